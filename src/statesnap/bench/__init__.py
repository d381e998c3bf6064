"""``statesnap bench``: measure statesnap against its peers and the machine's limits.

Suites (each a module with ``main(argv)`` that parses its own options):

* ``io``: save/load throughput against the raw disk, torch.save and DCP (:mod:`.io`);
* ``training``: stall, end-to-end overhead and peak RSS of checkpointing a training run (:mod:`.training`);
* ``reshard``: resharded load against same-layout load and DCP (:mod:`.reshard`);
* ``convert``: DeepSpeed ZeRO-3 import against ``ds_to_universal``, and a safetensors import
  without copying against reading the source once (:mod:`.convert`);
* ``planning``: save/load planning and manifest size at 1024 simulated ranks (:mod:`.planning`);
* ``chaos``: kills, full disks, I/O errors, damage, dying ranks and concurrent owners, with the
  outcome of every trial counted (:mod:`.chaos`, docs/reliability.md);
* ``recovery``: restart after a node loss from the peer replica against from ``root`` (:mod:`.recovery`);
* ``lightning``: stall and overhead of Lightning's checkpointing, statesnap's plugin against the
  default and ``AsyncCheckpointIO`` (:mod:`.lightning`);
* ``hf``: the same for the Hugging Face Trainer, ``StatesnapTrainer`` against the stock one (:mod:`.hf`);
* ``restore``: loads into a fresh model and optimizer against torch.load and DCP (:mod:`.restore`);
* ``s3``: save/load throughput to an S3 API server (moto on loopback) against local disk (:mod:`.s3`);
* ``gpu``: snapshot, restore and load of GPU tensors against plain pinned copies (:mod:`.gpu`;
  reports that it skipped where there is no CUDA device);
* ``all``: every suite in turn with its default options.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUITES = ("io", "training", "reshard", "convert", "planning", "chaos", "recovery", "lightning", "hf", "restore", "s3",
          "gpu")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="statesnap bench", description="benchmark statesnap against torch.save and DCP",
        epilog="Options after --suite go to that suite: 'statesnap bench --suite io --help' lists them.",
        add_help=False)
    parser.add_argument("--suite", choices=(*SUITES, "all"), default="io", help="which suite to run (default io)")
    asks_help = "-h" in argv or "--help" in argv
    args, rest = parser.parse_known_args(argv)
    if asks_help and (args.suite == "all" or not any(a.startswith("--suite") for a in argv)):
        parser.print_help()
        return 0
    if args.suite != "all":
        return _suite(args.suite).main(rest)
    if rest:
        parser.error("--suite all runs every suite with its defaults; run suites one by one to pass options")
    status = 0
    for name in SUITES:
        print(f"\n=== suite {name} ===\n", flush=True)
        status = max(status, int(_suite(name).main([]) or 0))
    return status


def _suite(name: str):
    return importlib.import_module(f"{__name__}.{name}")
