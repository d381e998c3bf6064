"""S3 suite: save and load throughput to an S3 API server (moto's, on loopback) against local disk.

The same state (the GPT-like model and AdamW moments of the io suite) is saved and loaded with
``ss.save``/``ss.load``, interleaving in every repeat:

* ``local``: a local directory (durable save: fsync'd; warm load: the files in the page cache);
* ``s3``: ``s3://`` with statesnap's defaults (16 MiB parts, 8 in flight per file; ranged GETs
  from the load's reader threads);
* ``s3_serial``: one part in flight per file and one reader thread: one request at a time, the
  pace of s3fs's own buffered file, to show what sending parts and ranges in parallel buys;
* ``s3fs_raw``: the same bytes as one object with s3fs's ``pipe_file`` (16 MiB parts, 10 in
  flight) and ``cat_file``: the ceiling of this client and server, with no checkpoint around it.

moto keeps objects in its process's memory and answers on loopback, so this measures the client
path (request building, checksums, HTTP on loopback, the server's own parsing), not a network or
a real store's disks: real S3 adds per-request latency and per-connection bandwidth limits, which
make parallel requests matter more, not less. ``--link-mb-s`` puts a :class:`.s3_server.ShapedLink`
between client and server that caps each connection (a connection slower than the store, as on a
real one) to show what requests in flight together buy. The first round's loads are checked bit
for bit.
"""
from __future__ import annotations

import argparse
import os

from .. import load as ss_load
from .. import save as ss_save
from .common import (
    add_output_arguments, format_table, fresh_dir, gbps, machine_description, median, non_negative_float,
    positive_float, positive_int, publish, remove_scratch, timed,
)
from .io import build_state, same_values, tensors_of, zeros_like_state
from .s3_server import MotoServer, ShapedLink

SYSTEMS = ("local", "s3", "s3_serial", "s3fs_raw")
RAW_PART = 16 << 20
OPS = ("save", "load")
BUCKET = "statesnap-bench"


def _targets(options: dict, scratch: str) -> dict:
    """Per system: (path, storage_options, reader threads)."""
    return {"local": (os.path.join(scratch, "local.ckpt"), None, None),
            "s3": (f"s3://{BUCKET}/bench", options, None),
            "s3_serial": (f"s3://{BUCKET}/bench-serial", {**options, "max_concurrency": 1}, 1)}


def _measure_raw(options: dict, blob: bytes, check: bool) -> dict[str, float]:
    """Seconds to write ``blob`` as one object and read it back through s3fs alone."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    path, got = f"{BUCKET}/raw.bin", []
    seconds = {"save": timed(lambda: fs.pipe_file(path, blob, chunksize=RAW_PART)),
               "load": timed(lambda: got.append(fs.cat_file(path)))}
    if check and got[0] != blob:
        raise RuntimeError("s3fs_raw: the object read back differs from the one written")
    return seconds


def run(size_gb: float, repeat: int, out: str, link_mb_s: float = 0.0) -> dict:
    state = build_state(size_gb)
    target = zeros_like_state(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    scratch = fresh_dir(os.path.join(out, "s3"))
    samples = {s: {op: [] for op in OPS} for s in SYSTEMS}
    with MotoServer() as server:
        server.create_bucket(BUCKET)
        link = ShapedLink(server.port, link_mb_s) if link_mb_s else None
        options = {**server.storage_options(), **({"endpoint_url": link.endpoint} if link else {})}
        blob = b"".join(t.numpy().tobytes() for t in tensors_of(state))
        for rep in range(repeat):
            for op, sec in _measure_raw(options, blob, rep == 0).items():
                samples["s3fs_raw"][op].append(sec)
            for system, (path, options_of, threads) in _targets(options, scratch).items():
                samples[system]["save"].append(
                    timed(lambda: ss_save(state, path, overwrite=True, storage_options=options_of, progress=False)))
                for t in tensors_of(target):
                    t.zero_()
                samples[system]["load"].append(
                    timed(lambda: ss_load(target, path, storage_options=options_of, threads=threads, progress=False)))
                if rep == 0 and not same_values(state, target):
                    raise RuntimeError(f"{system}: the loaded state differs from the saved one")
        if link:
            link.close()
    remove_scratch(scratch)
    throughput = {s: {op: gbps(nbytes, median(samples[s][op])) for op in OPS} for s in SYSTEMS}
    return {"suite": "s3", "bytes": nbytes, "link_mb_s": link_mb_s, "tensors": len(tensors_of(state)), "repeat": repeat,
            "machine": machine_description(out), "seconds": samples, "gb_per_s": throughput}


def report(result: dict) -> str:
    tp = result["gb_per_s"]
    lines = [f"S3 suite: {result['bytes'] / 1e9:.2f} GB in {result['tensors']} tensors, median of "
             f"{result['repeat']} interleaved repeats (GB/s); S3 is moto on loopback (the client path, not a network)"
             + (f", each connection capped at {result['link_mb_s']:g} MB/s" if result["link_mb_s"] else ""),
             "", format_table(["op", *SYSTEMS], [[op, *(tp[s][op] for s in SYSTEMS)] for op in OPS]), "",
             format_table(["op", "s3 / local", "s3 / s3_serial", "s3 / s3fs_raw"],
                          [[op, tp["s3"][op] / tp["local"][op], tp["s3"][op] / tp["s3_serial"][op],
                            tp["s3"][op] / tp["s3fs_raw"][op]] for op in OPS])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap bench --suite s3", description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=positive_float, default=0.5, help="state size in GB (default 0.5)")
    parser.add_argument("--repeat", type=positive_int, default=3, help="interleaved repeats; medians are reported")
    parser.add_argument("--link-mb-s", type=non_negative_float, default=0.0,
                        help="cap every connection to the S3 server at this many MB/s (default 0: no cap)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    result = run(args.size_gb, args.repeat, args.out, args.link_mb_s)
    publish(result, report(result), args.json)
    return 0
