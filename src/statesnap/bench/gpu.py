"""GPU suite: statesnap's device copies beside plain pinned copies of the same bytes on the same GPU.

Three measurements, each with its ceiling in the same run:

* **snapshot (device to host)**: ``Checkpointer.save`` of a GPU state kept in host memory only
  (nothing persisted), from the call until ``handle.staged`` (every byte in the pinned arena),
  against one plain ``copy_`` of the same number of bytes into pinned memory.
* **restore from memory (host to device)**: ``load_latest`` from that snapshot against a plain
  pinned ``copy_`` the other way.
* **load from a file**: ``ss.load`` of the same state, saved once, into the GPU tensors (reads,
  checksums and host-to-device copies overlapped; ``engine/device_load.py``) against the same
  load into CPU tensors of the same shapes (the host side alone) and ``torch.load`` with
  ``map_location`` on the GPU. Files are warm in the page cache: the host side is what is timed.

The state mixes the sizes a model's shard has: many 1 MiB tensors, many 64 MiB ones and one
larger than a load wave. Every restore and load is compared bit for bit with the original.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .common import (
    DEFAULT_OUT, add_output_arguments, format_table, fresh_dir, gbps, median, non_negative_int, positive_int, publish,
    remove_scratch,
)

MIB = 1 << 20


def make_state(small: int, medium: int, large_mib: int, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    sizes = [MIB] * small + [64 * MIB] * medium + ([large_mib * MIB] if large_mib else [])
    return {f"t{i:04d}": torch.randint(-2**31, 2**31 - 1, (n // 4,), dtype=torch.int32, generator=gen, device=device)
            .view(torch.float32) for i, n in enumerate(sizes)}


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sync_timed(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def plain_copies(nbytes: int, rounds: int) -> dict[str, float]:
    """Seconds of one pinned ``copy_`` of ``nbytes`` each way (median of ``rounds``, after a warm-up)."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, device), ("h2d", device, host)):
        dst.copy_(src, non_blocking=True)
        out[name] = median(sync_timed(lambda: dst.copy_(src, non_blocking=True)) for _ in range(rounds))
    return out


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].cpu().view(torch.int32), b[k].cpu().view(torch.int32)) for k in a)


def snapshot_and_restore(state: dict, scratch: str, rounds: int) -> dict[str, list[float]]:
    """Seconds from ``save`` to ``staged`` and of ``load_latest`` from memory, per round."""
    import statesnap as ss

    expected = {k: v.cpu() for k, v in state.items()}
    budget_gb = 2.5 * state_bytes(state) / 1e9 + 0.5
    times = {"snapshot": [], "restore": []}
    with ss.Checkpointer(os.path.join(scratch, "ckpt"), persist_every=10**9, host_memory_gb=budget_gb) as ckpt:
        for step in range(1, rounds + 2):  # the first save allocates and pins the arena: untimed
            torch.cuda.synchronize()
            started = time.perf_counter()
            ckpt.save(step, state).staged.result()
            if step > 1:
                times["snapshot"].append(time.perf_counter() - started)
            for t in state.values():
                t.zero_()
            seconds = sync_timed(lambda: ckpt.load_latest(state))
            if step > 1:
                times["restore"].append(seconds)
            if ckpt.loaded_from != "memory" or not same(state, expected):
                raise AssertionError(f"restore from memory was not bit exact (loaded from {ckpt.loaded_from})")
    return times


def loads(state: dict, scratch: str, rounds: int) -> dict[str, list[float]]:
    """Seconds of loading the saved state into GPU tensors, CPU tensors and with torch.load, interleaved."""
    import statesnap as ss

    expected = {k: v.cpu() for k, v in state.items()}
    path, torch_path = os.path.join(scratch, "saved"), os.path.join(scratch, "saved.pt")
    ss.save(state, path)
    torch.save(state, torch_path)
    on_cpu = {k: torch.empty_like(v, device="cpu") for k, v in state.items()}
    systems = {
        "statesnap -> GPU": (lambda: ss.load(state, path), state),
        "statesnap -> CPU": (lambda: ss.load(on_cpu, path), on_cpu),
        "torch.load -> GPU": (lambda: state.update(torch.load(torch_path, map_location="cuda", weights_only=True)),
                              state),
    }
    times = {name: [] for name in systems}
    for round_ in range(rounds + 1):  # the first round warms the page cache: untimed
        for name, (load, target) in systems.items():
            for t in target.values():
                t.zero_()
            seconds = sync_timed(load)
            if not same(target, expected):
                raise AssertionError(f"{name} was not bit exact")
            if round_:
                times[name].append(seconds)
    return times


def run(small: int = 256, medium: int = 48, large_mib: int = 512, rounds: int = 5, out: str = DEFAULT_OUT) -> dict:
    if not torch.cuda.is_available():
        return {"suite": "gpu", "skipped": "no CUDA device"}
    scratch = fresh_dir(os.path.join(out, "gpu-scratch"))
    try:
        state = make_state(small, medium, large_mib, "cuda")
        nbytes = state_bytes(state)
        plain = plain_copies(nbytes, rounds)
        checkpointer = snapshot_and_restore(state, scratch, rounds)
        load_times = loads(state, scratch, rounds)
    finally:
        remove_scratch(scratch)
    rows = {"plain pinned copy, device to host": plain["d2h"], "plain pinned copy, host to device": plain["h2d"],
            "snapshot (save -> staged)": median(checkpointer["snapshot"]),
            "restore from memory (load_latest)": median(checkpointer["restore"]),
            **{f"load from file, {name}": median(v) for name, v in load_times.items()}}
    aims = [
        {"what": "snapshot D2H bandwidth / plain pinned copy's", "value": plain["d2h"] / rows["snapshot (save -> staged)"],
         "aim": ">= 0.8"},
        {"what": "restore-from-memory H2D bandwidth / plain pinned copy's",
         "value": plain["h2d"] / rows["restore from memory (load_latest)"], "aim": ">= 0.8"},
        {"what": "load into GPU / the same load into CPU tensors (copies hidden behind reads)",
         "value": rows["load from file, statesnap -> GPU"] / rows["load from file, statesnap -> CPU"], "aim": "<= 1.1"},
    ]
    for aim in aims:
        bound = float(aim["aim"].split()[1])
        aim["met"] = aim["value"] >= bound if aim["aim"].startswith(">=") else aim["value"] <= bound
    return {"suite": "gpu", "device": torch.cuda.get_device_name(), "state_bytes": nbytes, "tensors": len(state),
            "rounds": rounds, "seconds": rows, "gbps": {k: gbps(nbytes, v) for k, v in rows.items()},
            "raw": {**checkpointer, **load_times}, "aims": aims}


def report(result: dict) -> str:
    if "skipped" in result:
        return f"GPU suite skipped: {result['skipped']}"
    lines = [f"GPU suite on {result['device']}: {result['tensors']} tensors, {result['state_bytes'] / 1e9:.2f} GB, "
             f"medians of {result['rounds']} rounds, every restore and load bit exact", "",
             format_table(["what", "seconds", "GB/s"],
                          [[k, v, result["gbps"][k]] for k, v in result["seconds"].items()]), "",
             format_table(["aim", "value", "target", "met"],
                          [[a["what"], a["value"], a["aim"], "yes" if a["met"] else "NO"] for a in result["aims"]])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap bench --suite gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--small", type=non_negative_int, default=256, help="1 MiB tensors (default 256)")
    parser.add_argument("--medium", type=non_negative_int, default=48, help="64 MiB tensors (default 48)")
    parser.add_argument("--large-mib", type=non_negative_int, default=512,
                        help="size of the one large tensor (default 512; 0: none)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="timed rounds; medians are reported (default 5)")
    add_output_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args.small, args.medium, args.large_mib, args.rounds, args.out)
    publish(result, report(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
