"""The ``statesnap`` command: each subcommand lives with the code it drives and parses its own args."""
from __future__ import annotations

import importlib
import json
import math
import os
import signal
import sys

# subcommand -> (module, function taking argv and returning an exit code, one-line help)
COMMANDS = {
    "inspect": ("statesnap.tools", "inspect_main", "list tensors, dtypes, shapes, bytes, pieces and totals"),
    "verify": ("statesnap.tools", "verify_main", "check every checksum; non-zero exit on damage"),
    "diff": ("statesnap.tools", "diff_main", "compare two checkpoints tensor by tensor"),
    "convert": ("statesnap.convert", "convert_main", "foreign checkpoint (torch.save, DCP, safetensors, ...) -> statesnap"),
    "export": ("statesnap.convert", "export_main", "statesnap -> consolidated foreign format"),
    "trace": ("statesnap.monitor.trace", "main", "write a Chrome/Perfetto trace and PNG timeline of checkpoint events"),
    "bench": ("statesnap.bench", "main", "benchmark statesnap against torch.save and DCP"),
    "demo": ("statesnap.demo", "main", "train a small GPT on the CPU with checkpoints, kill it, resume"),
}


def json_text(doc) -> str:
    """``doc`` as one RFC 8259 JSON document, for scripts: Python's json would write a non-finite
    float as NaN or Infinity, which other parsers refuse, so it is written as the string "nan",
    "inf" or "-inf" (``float()`` reads each back). Only bench figures have any: a manifest holds
    none (format/columns.py's parse_json)."""
    return json.dumps(_finite_floats(doc), indent=2, allow_nan=False, default=str)


def _finite_floats(value):
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {key: _finite_floats(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_floats(item) for item in value]
    return value


def _usage() -> str:
    lines = ["usage: statesnap COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run 'statesnap COMMAND --help' for a command's options.", "",
              "Exit status: 0 done (verify: every checkpoint good; diff: they match); 1 verify found a",
              "checkpoint damaged or unreadable, or diff found differences; 2 a usage error, or the command",
              "could not do its work (a checkpoint or events file it cannot read, a conversion refused)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(f"statesnap: no command given\n\n{_usage()}", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"statesnap: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:
        code = int(getattr(importlib.import_module(module), func)(rest) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`statesnap inspect --json | head`): stop quietly, as `cat` does,
        # and keep Python's own flush at exit from failing on the closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
