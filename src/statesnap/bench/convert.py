"""Importing foreign checkpoints: DeepSpeed ZeRO-3 against ``ds_to_universal``, and a safetensors
model imported without copying against reading it once.

* ``deepspeed``: DeepSpeed writes a ZeRO-3 checkpoint of an MLP stack on 2 gloo ranks (fp32,
  AdamW, one step). Then, interleaved ``--repeat`` times, each in a fresh process: DeepSpeed's own
  ``ds_to_universal`` (the Universal Checkpointing converter: it writes one folder per parameter)
  and ``ss.convert(source="deepspeed")`` (which writes one reshardable checkpoint directly).
* ``safetensors``: a ``--gb`` safetensors file; the floor is reading it once and hashing it with
  xxh3 (what any import must do to checksum it); against it ``ss.convert(copy=False)`` (hard
  links) and a copying convert. Disk use is what the destination adds: bytes of its files that
  share no inode with the source.

Each job reports the seconds of its own work (timed inside the process, imports excluded), the
wall time of the whole process (interpreter start and imports included) and the peak resident
memory of its process tree (``ds_to_universal`` runs worker processes; their memory is summed).

The page cache is warm for every measurement (each source is read once first): the figures compare
the converters' work, not the disk. Scratch goes under ``--out`` and is removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from .common import (
    DEFAULT_OUT, format_table, fresh_dir, median, positive_float, positive_int, publish, remove_scratch, tree_bytes,
)

PARTS = ("deepspeed", "safetensors")
PAGE = os.sysconf("SC_PAGE_SIZE")


class TreeMemory:
    """Peak summed RSS of a process and all its descendants, sampled every ``interval_s``."""

    def __init__(self, pid: int, interval_s: float = 0.02):
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak

    def _sample(self) -> None:
        while not self._done.wait(self.interval_s):
            self.peak = max(self.peak, sum(_rss(pid) for pid in _descendants(self.pid)))


def _descendants(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, ()))
    return found


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def measured(command: list[str], env: dict | None = None) -> dict:
    """Wall seconds and peak tree RSS of ``command``, which must succeed and print, last, a JSON
    line with the seconds of the work itself (the wall time also holds interpreter start and imports)."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    memory = TreeMemory(proc.pid)
    out, err = proc.communicate()
    wall = time.perf_counter() - started
    peak = memory.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit {proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}")
    return {"wall_seconds": wall, "seconds": json.loads(out.strip().splitlines()[-1])["seconds"],
            "peak_rss_bytes": peak}


def _child(*args: str) -> list[str]:
    return [sys.executable, "-m", "statesnap.bench.convert", "--child", *args]


def run_child_job(kind: str, args: list[str]) -> None:
    """In a fresh process: one timed job, then its seconds as the last line of stdout. Each job's
    modules are imported before its clock starts: statesnap imports its converters only when a
    conversion asks for them, which put a second of imports into a 20 ms conversion."""
    if kind == "ds_to_universal":
        from deepspeed.checkpoint import ds_to_universal
    elif kind != "hash":
        from statesnap.convert.api import convert
    started = time.perf_counter()
    if kind == "hash":
        hash_file(args[0])
    elif kind == "ds_to_universal":
        sys.argv = ["ds_to_universal", "--input_folder", args[0], "--output_folder", args[1]]
        ds_to_universal.main(ds_to_universal.parse_arguments())
    else:
        convert(args[0], args[1], source=args[2], overwrite=True, copy=kind != "no_copy", progress=False)
    print(json.dumps({"seconds": time.perf_counter() - started}))


def read_everything(path: str) -> None:
    """Bring ``path``'s files into the page cache."""
    for top, _, names in os.walk(path) if os.path.isdir(path) else [("", [], [path])]:
        for name in names:
            with open(os.path.join(top, name), "rb") as f:
                while f.read(1 << 24):
                    pass


# --- DeepSpeed ZeRO-3 -------------------------------------------------------------------------

def deepspeed_part(scratch: str, dim: int, layers: int, repeat: int) -> dict:
    ckpt = os.path.join(fresh_dir(scratch), "ds")
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    made = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "statesnap.bench.ds_producer", ckpt, str(dim), str(layers)],
                          capture_output=True, text=True, env={**os.environ, **env})
    if made.returncode != 0:
        raise RuntimeError(f"DeepSpeed could not write the checkpoint (exit {made.returncode}):\n{made.stderr[-6000:]}")
    tag = os.path.join(ckpt, "global_step1")
    read_everything(ckpt)
    universal, ours = os.path.join(scratch, "universal", "global_step1_universal"), os.path.join(scratch, "ss")
    runs: dict[str, list[dict]] = {"ds_to_universal": [], "statesnap": []}
    for _ in range(repeat):
        shutil.rmtree(os.path.dirname(universal), ignore_errors=True)
        runs["ds_to_universal"].append(measured(_child("ds_to_universal", tag, universal), env))
        runs["statesnap"].append(measured(_child("copy", tag, ours, "deepspeed"), env))
    checked = same_as_universal(ours, universal)
    return {"tensors_checked": checked, "checkpoint_bytes": tree_bytes(tag), "universal_bytes": tree_bytes(os.path.dirname(universal)),
            "statesnap_bytes": tree_bytes(ours), "runs": runs, "summary": _summary(runs)}


def same_as_universal(ours: str, universal: str) -> int:
    """Check, bit for bit, that statesnap's import holds what ``ds_to_universal`` wrote (fp32
    master weights and every optimizer moment); return how many tensors were compared."""
    import torch

    import statesnap as ss

    reader, compared = ss.open(ours), 0
    zero = os.path.join(universal, "zero")
    for param in sorted(os.listdir(zero)):
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            file = os.path.join(zero, param, f"{state}.pt")
            if not os.path.isfile(file):
                continue
            theirs = torch.load(file, weights_only=True)
            theirs = theirs["param"] if isinstance(theirs, dict) else theirs
            mine = reader.read(f"fp32.{param}" if state == "fp32" else f"optim.state.{param}.{state}")
            if not torch.equal(mine.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8)):
                raise RuntimeError(f"{param} {state}: statesnap's import differs from ds_to_universal's")
            compared += 1
    if not compared:
        raise RuntimeError(f"nothing to compare in {zero}")
    return compared


# --- safetensors without copying --------------------------------------------------------------

def safetensors_part(scratch: str, gigabytes: float, repeat: int) -> dict:
    import torch
    from safetensors.torch import save_file

    src = os.path.join(fresh_dir(scratch), "model.safetensors")
    per_tensor = 64 << 20
    count = max(1, round(gigabytes * 1e9 / per_tensor))
    generator = torch.Generator().manual_seed(0)
    save_file({f"layers.{i}.weight": torch.randn(per_tensor // 4, generator=generator).view(4096, -1)
               for i in range(count)}, src)
    read_everything(src)
    runs: dict[str, list[dict]] = {"read_and_xxh3": [], "no_copy": [], "copy": []}
    added: dict[str, int] = {}
    for _ in range(repeat):
        runs["read_and_xxh3"].append(measured(_child("hash", src)))
        for mode in ("no_copy", "copy"):
            dst = os.path.join(scratch, mode)
            runs[mode].append(measured(_child(mode, src, dst, "safetensors")))
            added[mode] = _bytes_not_shared_with(dst, src)
            shutil.rmtree(dst)
    return {"source_bytes": os.path.getsize(src), "tensors": count, "disk_added_bytes": added,
            "runs": runs, "summary": _summary(runs)}


def _bytes_not_shared_with(path: str, src: str) -> int:
    """Bytes of ``path``'s files that are not the inode of ``src`` (what the import costs on disk)."""
    source_inode = os.stat(src).st_ino
    total = 0
    for top, _, names in os.walk(path):
        for name in names:
            st = os.stat(os.path.join(top, name))
            if st.st_ino != source_inode:
                total += st.st_blocks * 512
    return total


def hash_file(path: str) -> None:
    """The floor: one sequential read of ``path`` with an xxh3-64 over every byte."""
    import xxhash

    digest, buffer = xxhash.xxh3_64(), bytearray(1 << 24)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    digest.hexdigest()


# --- report -----------------------------------------------------------------------------------

def _summary(runs: dict[str, list[dict]]) -> dict:
    return {name: {"seconds": median(r["seconds"] for r in rs), "wall_seconds": median(r["wall_seconds"] for r in rs),
                   "peak_rss_mb": median(r["peak_rss_bytes"] for r in rs) / 1e6}
            for name, rs in runs.items()}


def report(result: dict) -> str:
    lines = []
    if "deepspeed" in result:
        part = result["deepspeed"]
        s = part["summary"]
        lines += [f"DeepSpeed ZeRO-3 checkpoint, {part['checkpoint_bytes'] / 1e6:.0f} MB on disk "
                  f"(2 ranks); medians of {result['repeat']} interleaved runs; {part['tensors_checked']} tensors "
                  "equal bit for bit in both outputs",
                  format_table(["converter", "seconds", "process wall s", "peak RSS MB", "output MB"], [
                      ["ds_to_universal", s["ds_to_universal"]["seconds"], s["ds_to_universal"]["wall_seconds"],
                       s["ds_to_universal"]["peak_rss_mb"], part["universal_bytes"] / 1e6],
                      ["statesnap convert", s["statesnap"]["seconds"], s["statesnap"]["wall_seconds"],
                       s["statesnap"]["peak_rss_mb"], part["statesnap_bytes"] / 1e6]]),
                  f"statesnap is {s['ds_to_universal']['seconds'] / s['statesnap']['seconds']:.2f}x faster "
                  f"({s['ds_to_universal']['wall_seconds'] / s['statesnap']['wall_seconds']:.2f}x by process wall time)", ""]
    if "safetensors" in result:
        part = result["safetensors"]
        s = part["summary"]
        floor = s["read_and_xxh3"]["seconds"]
        lines += [f"safetensors import, {part['source_bytes'] / 1e9:.2f} GB in {part['tensors']} tensors; "
                  f"medians of {result['repeat']} interleaved runs (warm page cache)",
                  format_table(["mode", "seconds", "x floor", "process wall s", "peak RSS MB", "disk added MB"], [
                      ["read once + xxh3 (floor)", floor, 1.0, s["read_and_xxh3"]["wall_seconds"],
                       s["read_and_xxh3"]["peak_rss_mb"], 0.0],
                      *([label, s[mode]["seconds"], s[mode]["seconds"] / floor, s[mode]["wall_seconds"],
                         s[mode]["peak_rss_mb"], part["disk_added_bytes"][mode] / 1e6]
                        for label, mode in (("convert copy=False", "no_copy"), ("convert (copy)", "copy")))])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap bench --suite convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--dim", type=positive_int, default=2048, help="width of the DeepSpeed model's square layers")
    parser.add_argument("--layers", type=positive_int, default=8, help="layers of the DeepSpeed model")
    parser.add_argument("--gb", type=positive_float, default=1.0, help="size of the safetensors model")
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--out", default=DEFAULT_OUT, help="scratch directory (removed at the end)")
    parser.add_argument("--json", help="also write the figures here ('-' for stdout)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # one timed job in a fresh process
    args = parser.parse_args(argv)
    if args.child:
        run_child_job(args.child[0], args.child[1:])
        return 0
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(set(parts) - set(PARTS))}; choose from {', '.join(PARTS)}")
    scratch = fresh_dir(os.path.join(args.out, "convert"))
    result: dict = {"repeat": args.repeat}
    try:
        if "deepspeed" in parts:
            result["deepspeed"] = deepspeed_part(os.path.join(scratch, "deepspeed"), args.dim, args.layers,
                                                 args.repeat)
        if "safetensors" in parts:
            result["safetensors"] = safetensors_part(os.path.join(scratch, "safetensors"), args.gb, args.repeat)
    finally:
        remove_scratch(scratch)
    publish(result, report(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
