"""IO suite: save and load throughput of statesnap against the raw disk, torch.save and DCP.

One run measures everything on the same state (the tensors of a GPT-like model plus its AdamW
moments, ~1 GB by default), interleaving the systems within each repeat so that drift in the
machine (other tenants, thermal limits) hits all of them alike:

* raw: the same bytes written with plain sequential ``write`` calls into one file (+ fsync), and
  read back with ``preadv`` straight into the target tensors: the disk's limit for one stream;
* raw_parallel: the same, with four 16 MiB requests in flight (loads: four streams, each reading
  its quarter of the file in order): the disk's limit when it is kept busy, which is what
  statesnap and DCP both try to reach;
* raw_direct: the same bytes, laid out beforehand (untimed) in page-aligned memory, written with
  four 16 MiB ``O_DIRECT`` requests in flight (+ fsync) into a file in a new directory: the
  ceiling for a durable save, which must also copy unaligned tensors and checksum them; loads as
  raw_parallel;
* ``torch.save`` (+ fsync) / ``torch.load``;
* DCP ``save`` / ``load`` (``torch.distributed.checkpoint``, no process group);
* statesnap ``save`` / ``load``.

Saves are timed durable (fsync'd) and buffered (page cache only, synced untimed afterwards),
each into a new file once the disk has settled after the previous one was deleted; loads cold
(page cache dropped, disk settled after the save) and warm (files cached).
"""
from __future__ import annotations

import argparse
import os
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import load as ss_load
from .. import save as ss_save
from ..demo.gpt import GPT, config_for_state_gb
from ..storage.aligned import huge_aligned_pages, unmap
from ..storage.base import DIRECT_ALIGN
from .common import (
    DEFAULT_OUT, add_output_arguments, drop_page_cache, format_table, fresh_dir, gbps, machine_description, median,
    non_negative_float, parse_choices, positive_float, positive_int, publish, remove_scratch, rotated, settle_disk,
    timed,
)

SYSTEMS = ("raw", "raw_parallel", "raw_direct", "torch", "dcp", "statesnap")
OPS = ("save_durable", "save_buffered", "load_cold", "load_warm")
RAW_CHUNK = 64 << 20
PARALLEL_CHUNK, PARALLEL_REQUESTS = 16 << 20, 4
DIRECT_FILE = "data"  # raw_direct's one file, in a directory of its own
# (statesnap op, peer, op of the peer, aim): the targets, checked in every report
AIMS = (("save_durable", "raw", "save_durable", 0.95), ("save_durable", "raw_direct", "save_durable", 0.9),
        ("load_cold", "raw", "load_cold", 0.95),
        ("load_cold", "dcp", "load_cold", 1.5), ("load_warm", "dcp", "load_warm", 2.0))


def build_state(size_gb: float, seed: int = 0) -> dict:
    """Random model + AdamW-moment tensors shaped like a GPT of about ``size_gb`` GB of state."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in GPT(config_for_state_gb(size_gb)).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    rand = lambda shape: torch.randn(shape, generator=gen)  # noqa: E731
    return {"model": {name: rand(shape) for name, shape in shapes.items()},
            "optim": {name: {"exp_avg": rand(shape), "exp_avg_sq": rand(shape).abs()}
                      for name, shape in shapes.items()}}


def tensors_of(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    return [t for key in sorted(state) for t in tensors_of(state[key])]


def zeros_like_state(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return {key: zeros_like_state(value) for key, value in state.items()}


def same_values(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tensors_of(a), tensors_of(b), strict=True))


# -- one save and one load function per system: save(state, path, durable); load(target, path) -> state
def raw_save(state: dict, path: str, durable: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _, chunk in _chunks(state, RAW_CHUNK):
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _chunks(state: dict, size: int) -> list[tuple[int, memoryview]]:
    """(file offset, bytes) of every ``size`` chunk of the state's tensors laid end to end."""
    out, offset = [], 0
    for tensor in tensors_of(state):
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        for pos in range(0, len(view), size):
            out.append((offset + pos, view[pos:pos + size]))
        offset += len(view)
    return out


def _read_chunk(fd: int, path: str, offset: int, chunk: memoryview) -> None:
    while chunk:
        got = os.preadv(fd, [chunk], offset)
        if got == 0:
            raise EOFError(f"{path} is shorter than the state")
        offset += got
        chunk = chunk[got:]


def raw_load(target: dict, path: str) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, chunk in _chunks(target, RAW_CHUNK):
            _read_chunk(fd, path, offset, chunk)
    finally:
        os.close(fd)
    return target


def raw_parallel_save(state: dict, path: str, durable: bool) -> None:
    def write(job):
        offset, chunk = job
        while chunk:
            written = os.pwrite(fd, chunk, offset)
            offset, chunk = offset + written, chunk[written:]

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with ThreadPoolExecutor(PARALLEL_REQUESTS) as pool:
            list(pool.map(write, _chunks(state, PARALLEL_CHUNK)))
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def raw_parallel_load(target: dict, path: str) -> dict:
    """Four streams, each reading its quarter of the file in order through a descriptor of its
    own: the kernel then reads ahead of each. (Handing the chunks out one by one to four threads
    sharing a descriptor looks random to readahead, and read 0.83 GB cold 1.4x slower here.)"""
    chunks = _chunks(target, PARALLEL_CHUNK)
    share = -(-len(chunks) // PARALLEL_REQUESTS)

    def stream(first: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, chunk in chunks[first:first + share]:
                _read_chunk(fd, path, offset, chunk)
        finally:
            os.close(fd)
    with ThreadPoolExecutor(PARALLEL_REQUESTS) as pool:
        list(pool.map(stream, range(0, len(chunks), share)))
    return target


_DIRECT_IMAGES: dict[int, tuple[memoryview, int]] = {}  # id(state) -> (its bytes, aligned; length)


def _direct_image(state: dict) -> tuple[memoryview, int]:
    """The state's bytes laid end to end in huge-page-aligned memory, and how many there are. Made once
    per state: ``run`` makes it before timing anything."""
    if id(state) not in _DIRECT_IMAGES:
        chunks = _chunks(state, RAW_CHUNK)
        nbytes = chunks[-1][0] + len(chunks[-1][1])
        image = huge_aligned_pages(-(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN)  # as the bounce buffers
        for offset, chunk in chunks:
            image[offset:offset + len(chunk)] = chunk
        _DIRECT_IMAGES[id(state)] = image, nbytes
    return _DIRECT_IMAGES[id(state)]


def raw_direct_save(state: dict, path: str, durable: bool) -> None:
    image, nbytes = _direct_image(state)
    view = memoryview(image)

    def write(offset):
        part = view[offset:offset + PARALLEL_CHUNK]
        while part:
            written = os.pwrite(fd, part, offset)
            offset, part = offset + written, part[written:]

    os.mkdir(path)  # a new directory, as a checkpoint gets: where the file system puts it matters
    name, flags = os.path.join(path, DIRECT_FILE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(name, flags | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:  # tmpfs and FUSE refuse O_DIRECT: the ceiling is then a parallel buffered write
        fd = os.open(name, flags, 0o644)
    try:
        with ThreadPoolExecutor(PARALLEL_REQUESTS) as pool:
            list(pool.map(write, range(0, len(image), PARALLEL_CHUNK)))
        os.ftruncate(fd, nbytes)  # the last block went out whole, padding included
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
        view.release()


def raw_direct_load(target: dict, path: str) -> dict:
    return raw_parallel_load(target, os.path.join(path, DIRECT_FILE))


def torch_save(state: dict, path: str, durable: bool) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        if durable:
            os.fsync(f.fileno())


def torch_load(target: dict, path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def dcp_save(state: dict, path: str, durable: bool) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=durable), no_dist=True)


def dcp_load(target: dict, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    dcp.load(target, checkpoint_id=path, no_dist=True)
    return target


def statesnap_save(state: dict, path: str, durable: bool) -> None:
    ss_save(state, path, durable=durable)


def statesnap_load(target: dict, path: str) -> dict:
    ss_load(target, path)
    return target


SAVE = {"raw": raw_save, "raw_parallel": raw_parallel_save, "raw_direct": raw_direct_save,
        "torch": torch_save, "dcp": dcp_save, "statesnap": statesnap_save}
LOAD = {"raw": raw_load, "raw_parallel": raw_parallel_load, "raw_direct": raw_direct_load,
        "torch": torch_load, "dcp": dcp_load, "statesnap": statesnap_load}


def remove(path: str, settle_s: float) -> None:
    """Delete ``path`` and give the disk ``settle_s`` (and until it is quiet) to finish what that
    started, so that every save lands on a disk in the same state (see ``settle_disk``)."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)
    os.sync()
    settle(path, settle_s)


def settle(path: str, settle_s: float) -> None:
    if settle_s > 0:
        settle_disk(os.path.dirname(path), settle_s)


def measure_system(system: str, state: dict, target: dict, path: str, check: bool,
                   settle_s: float) -> dict[str, float]:
    """Seconds of each op for one system; with ``check``, the loaded values are compared bit for bit."""
    save, load = SAVE[system], LOAD[system]
    seconds = {}
    remove(path, settle_s)
    seconds["save_buffered"] = timed(lambda: save(state, path, False))
    remove(path, settle_s)  # syncs, so the buffered save's dirty pages do not slow down the next op
    seconds["save_durable"] = timed(lambda: save(state, path, True))
    for op in ("load_cold", "load_warm"):
        if op == "load_cold":
            for t in tensors_of(target):
                t.zero_()
            drop_page_cache([path], globally=False)  # see drop_page_cache: it slows later saves
            # The virtual disk is still absorbing a fast writer's bytes for a while after its
            # fsync: cold reads right after the fastest save ran about 10% slower here.
            settle(path, settle_s)
        loaded: list = []
        seconds[op] = timed(lambda: loaded.append(load(target, path)))
        if check and not same_values(loaded[0], state):
            raise AssertionError(f"{system} loaded values that differ from the saved state ({path})")
        loaded.clear()  # torch.load returns a new state: free it before the next load
    remove(path, 0)
    return seconds


def run(size_gb: float = 1.0, repeat: int = 3, out: str = DEFAULT_OUT, systems=SYSTEMS,
        settle_s: float = 5.0) -> dict:
    """Measure every system and op ``repeat`` times; return per-op seconds, medians and ratios."""
    scratch = fresh_dir(os.path.join(out, "io-scratch"))
    state = build_state(size_gb)
    target = zeros_like_state(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    systems = tuple(systems)
    samples = {s: {op: [] for op in OPS} for s in systems}
    if "raw_direct" in systems:
        _direct_image(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group: intended
        for rep in range(repeat):
            # Each repeat starts one system further on: the disk's state depends on what ran
            # before (see ``remove``), so no system always follows the same one.
            for system in rotated(systems, rep):
                path = os.path.join(scratch, f"{system}.ckpt")
                for op, sec in measure_system(system, state, target, path, rep == 0, settle_s).items():
                    samples[system][op].append(sec)
    remove_scratch(scratch)
    if "raw_direct" in systems:
        unmap(_DIRECT_IMAGES.pop(id(state))[0])
    throughput = {s: {op: gbps(nbytes, median(samples[s][op])) for op in OPS} for s in systems}
    return {"suite": "io", "bytes": nbytes, "tensors": len(tensors_of(state)), "repeat": repeat,
            "machine": machine_description(out), "seconds": samples, "gb_per_s": throughput,
            "ratios": ratios(throughput), "aims": aims(throughput)}


def ratios(throughput: dict) -> dict:
    """statesnap's throughput over each other system's, per op (1.0 = as fast)."""
    mine = throughput.get("statesnap")
    if mine is None:
        return {}
    return {peer: {op: mine[op] / throughput[peer][op] for op in OPS}
            for peer in throughput if peer != "statesnap"}


def aims(throughput: dict) -> list[dict]:
    out = []
    for op, peer, peer_op, aim in AIMS:
        if "statesnap" in throughput and peer in throughput:
            ratio = throughput["statesnap"][op] / throughput[peer][peer_op]
            out.append({"what": f"statesnap {op} / {peer} {peer_op}", "ratio": ratio, "aim": aim, "met": ratio >= aim})
    return out


def report(result: dict) -> str:
    tp = result["gb_per_s"]
    systems = list(tp)
    lines = [f"IO suite: {result['bytes'] / 1e9:.2f} GB in {result['tensors']} tensors, "
             f"median of {result['repeat']} interleaved repeats (GB/s)", "",
             format_table(["op", *systems], [[op, *(tp[s][op] for s in systems)] for op in OPS])]
    if result["ratios"]:
        peers = list(result["ratios"])
        lines += ["", "statesnap / peer (x)", "",
                  format_table(["op", *peers], [[op, *(result["ratios"][p][op] for p in peers)] for op in OPS])]
    if result["aims"]:
        lines += ["", format_table(["aim", "ratio", "target", "met"],
                                   [[a["what"], a["ratio"], f">= {a['aim']}", "yes" if a["met"] else "NO"]
                                    for a in result["aims"]])]
    busy_disk = result["ratios"].get("raw_parallel", {}).get("load_cold")
    if busy_disk is not None:  # how much of the disk, kept busy, statesnap's cold load gets
        lines += ["", f"statesnap load_cold / raw_parallel load_cold (share of the busy disk): {busy_disk:.2f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap bench --suite io", description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=positive_float, default=1.0, help="state size in GB (default 1)")
    parser.add_argument("--repeat", type=positive_int, default=3, help="interleaved repeats; medians are reported")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    parser.add_argument("--settle-s", type=non_negative_float, default=5.0,
                        help="before each save, wait this long after deleting the previous file, and "
                             "until the disk is quiet (0: do not wait)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    systems = parse_choices(parser, args.systems, SYSTEMS, "systems")
    result = run(args.size_gb, args.repeat, args.out, systems, args.settle_s)
    publish(result, report(result), args.json)
    return 0
