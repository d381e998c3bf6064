"""``statesnap bench --suite chaos``: attack the library as a bad day would, and count what held.

Five families of scenarios, each in its own module, each trial in its own process (forked from
one server that imported torch once, :mod:`.processes`) with a deadline, so that a hang is
counted rather than suffered:

* :mod:`.kills`: kill -9 of a trainer during the async Checkpointer's copy, flush, commit,
  retention and further-level copy, and during blocking ``ss.save(..., overwrite=True)``;
* :mod:`.storage`: a full disk (tmpfs, or a backend that runs out of bytes where mounting is
  not allowed) and an I/O error on the Nth read or write (``faulty://``);
* :mod:`.damage`: random damage to a checkpoint's bytes and manifest, and hostile manifests;
* :mod:`.ranks`: a gloo rank killed or stopped during ``ss.save``, ``ss.load``, a flush, a commit;
* :mod:`.owners`: two jobs on one root, ``save`` racing ``close``, ``load_latest`` during a flush.

Each trial is ``expected``, ``wrong`` or ``hang`` (:mod:`.report`); the suite exits 1 if any
trial of any scenario was not expected. ``--profile quick`` (under a minute on two cores) runs
in the test suite; ``--profile full`` is the run of record (docs/reliability.md).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

from ..common import (
    DEFAULT_OUT, add_output_arguments, format_table, fresh_dir, machine_description, parse_choices, publish,
    remove_scratch,
)
from . import damage, kills, owners, ranks, storage
from .processes import ForkServer

MODULES = {"kills": kills, "storage": storage, "damage": damage, "ranks": ranks, "owners": owners}
FAMILIES = tuple(MODULES)
RANK_TIMEOUT_S = 8.0

# family -> profile -> its module's run() arguments (after server, workdir, rng)
PROFILES = {
    "quick": {
        "kills": {"kills": {kills.ASYNC: 3, kills.BLOCKING: 2}, "per_run": 5, "max_delay": 0.8},
        "storage": {"disk_full_trials": 2, "fault_trials": 1},
        "damage": {"trials": 60},
        "ranks": {"trials": [(2, op, "kill") for op in ranks.OPS], "timeout": RANK_TIMEOUT_S},
        "owners": {"owners": 1, "races": 2},
    },
    "full": {
        "kills": {"kills": {kills.ASYNC: 160, kills.BLOCKING: 60}, "per_run": 10, "max_delay": 1.5},
        "storage": {"disk_full_trials": 12, "fault_trials": None},
        "damage": {"trials": 1200},
        "ranks": {"trials": [(world, op, how) for op in ranks.OPS for world in (2, 3, 4)
                             for how in ("kill", "kill", "stop")], "timeout": RANK_TIMEOUT_S},
        "owners": {"owners": 5, "races": 40},
    },
}


def run(profile: str = "quick", seed: int = 0, out: str = DEFAULT_OUT, families=FAMILIES) -> dict:
    """Run the chosen families; return the report (what ``--json`` writes)."""
    workdir = fresh_dir(os.path.join(out, "chaos"))
    started = time.monotonic()
    server = ForkServer(workdir)
    tallies = []
    try:
        for family in families:
            print(f"chaos: {family} ...", flush=True)
            rng = random.Random(f"{seed}:{family}")  # the same trials whichever families run
            tallies += MODULES[family].run(server, workdir, rng, **PROFILES[profile][family])
    finally:
        server.close()
        remove_scratch(workdir)
    return {"profile": profile, "seed": seed, "seconds": round(time.monotonic() - started, 1),
            "machine": machine_description(out), "scenarios": [t.to_json() for t in tallies],
            "unexpected": sum(t.unexpected for t in tallies)}


def report_text(result: dict) -> str:
    rows = [(s["scenario"], s["trials"], s["expected"], s["wrong"], s["hang"],
             ", ".join(f"{k} {v}" for k, v in s["details"].items())) for s in result["scenarios"]]
    lines = [format_table(("scenario", "trials", "expected", "wrong", "hang", "details"), rows)]
    for s in result["scenarios"]:
        lines += [f"\n{s['scenario']}: {message}" for message in s["messages"]]
    machine = result["machine"]
    lines.append(f"\n{result['profile']} profile, seed {result['seed']}: {result['seconds']:.0f} s on "
                 f"{machine['cores']} cores ({machine['cpu']}), torch {machine['torch']}; "
                 f"{result['unexpected']} unexpected outcome(s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap bench --suite chaos",
                                     description="fault injection: kills, full disks, I/O errors, damage, "
                                                 "dying ranks, concurrent owners; exits 1 on any unexpected outcome")
    parser.add_argument("--profile", choices=tuple(PROFILES), default="quick",
                        help="quick: a few trials per scenario (CI); full: the run of record")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    parser.add_argument("--only", default=",".join(FAMILIES),
                        help=f"families to run, comma-separated (default all: {','.join(FAMILIES)})")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    families = parse_choices(parser, args.only, FAMILIES, "family")
    result = run(args.profile, args.seed, args.out, families)
    publish(result, report_text(result), args.json)
    return 1 if result["unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())
