"""``statesnap convert`` and ``statesnap export``: the command-line faces of ss.convert / ss.export."""
from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Callable

from ..errors import CheckpointError, printable
from ..tools import OK, TROUBLE, progress_flags
from .api import SOURCES, TARGETS, convert, export

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes of a size such as ``500MB``, ``5GB`` (powers of 1000) or ``2GiB`` (powers of 1024)."""
    m = _SIZE.match(text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 500MB, 5GB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _parser(name: str, description: str, src_help: str, dst_help: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"statesnap {name}", description=description)
    parser.add_argument("src", help=src_help)
    parser.add_argument("dst", help=dst_help)
    parser.add_argument("--spec", help='transform spec: a JSON file {"ops": [...]} (rename, drop, keep, fuse, '
                                       "split; see docs/convert.md)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="convert: store non-plain values with pickle; export: include pickled values")
    progress_flags(parser)
    return parser


# The errors name the Python call's arguments; on the command line the flags that set them.
_FLAGS_FOR_ARGUMENTS = (("pass overwrite=True", "pass --overwrite"), ("use copy=True", "leave out --no-copy"),
                        ("copy=False", "--no-copy"), ("leave max_shard_bytes out", "leave out --max-shard-size"),
                        ("max_shard_bytes=", "--max-shard-size "), ("allow_pickle=True", "--allow-pickle"))


def cli_wording(message: str) -> str:
    """``message`` with the Python call's arguments named as this command's flags."""
    for argument, flag in _FLAGS_FOR_ARGUMENTS:
        message = message.replace(argument, flag)
    return message


def _run(name: str, call: Callable[[], Any]) -> Any:
    """The call's result, or None after printing the CheckpointError it raised."""
    try:
        return call()
    except CheckpointError as exc:
        print(printable(f"statesnap {name}: {cli_wording(str(exc))}"), file=sys.stderr)
        return None


def convert_main(argv: list[str]) -> int:
    parser = _parser("convert", "Convert a foreign checkpoint into a statesnap checkpoint.",
                     "torch.save file or directory of them, DCP directory, safetensors file/index/directory, "
                     "DeepSpeed run or global_stepN directory, ds_to_universal folder, Megatron "
                     "dist_checkpointing or Megatron-LM run/iter_N directory (docs/convert.md)",
                     "statesnap checkpoint to create (a path or fsspec URL)")
    parser.add_argument("--from", dest="source", choices=sorted(SOURCES), help="source format (default: detect)")
    parser.add_argument("--no-copy", dest="copy", action="store_false",
                        help="safetensors: link the source's files into the checkpoint instead of copying "
                             "them (one read to checksum, no added disk use; same file system only)")
    args = parser.parse_args(argv)
    info = _run("convert", lambda: convert(args.src, args.dst, source=args.source, spec=args.spec,
                                           overwrite=args.overwrite, allow_pickle=args.allow_pickle,
                                           copy=args.copy, progress=args.progress))
    if info is None:
        return TROUBLE
    print(printable(f"converted {args.src} -> {info.path}: {info.bytes} bytes in {info.seconds:.2f} s"))
    for line in info.notes:
        print(printable(f"  note: {line}"))
    return OK


def export_main(argv: list[str]) -> int:
    parser = _parser("export", "Export a statesnap checkpoint as one consolidated foreign checkpoint.",
                     "statesnap checkpoint (a path or fsspec URL)",
                     "file (.safetensors, torch) or directory (safetensors, dcp) to create")
    parser.add_argument("--to", choices=TARGETS, default="safetensors", help="format (default: safetensors)")
    parser.add_argument("--max-shard-size", type=parse_size, help="safetensors shard size, e.g. 5GB or 2GiB")
    args = parser.parse_args(argv)
    info = _run("export", lambda: export(args.src, args.dst, to=args.to, spec=args.spec,
                                         max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
                                         allow_pickle=args.allow_pickle, progress=args.progress))
    if info is None:
        return TROUBLE
    print(printable(f"exported {args.src} -> {info.path} ({info.to}): {info.tensors} tensors, {info.bytes} bytes "
                    f"in {len(info.files)} file(s), {info.seconds:.2f} s"))
    for line in info.skipped:
        print(printable(f"  skipped {cli_wording(line)}"))
    return OK
