"""``statesnap inspect``, ``verify`` and ``diff``: look at checkpoints without a training script.

All three go through :class:`statesnap.Reader`, so they apply exactly the validation and
checksums a load applies, and work on any path or fsspec URL a load accepts. Exit codes are for
scripts: 0 means good (or identical), 1 damaged (or different), 2 could not compare.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from .cli import json_text
from .errors import CheckpointError, NotACheckpointError, printable
from .format.columns import parse_json
from .format.dtypes import dtype_name
from .format.manifest import MANIFEST_NAME, ObjectEntry
from .engine.load import blob_reader
from .reader import Reader, TensorInfo

# exit codes, as diff(1) has them: all good, damage or differences found, could not compare
OK, FOUND, TROUBLE = 0, 1, 2
# diff reads large tensors a slab of rows at a time, so comparing 70B checkpoints fits in memory
DIFF_SLAB_BYTES = 64 << 20


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``1.5 KiB``, ``3.2 GiB``."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def json_object(text: str) -> dict:
    """``--storage-options``: fsspec takes keyword arguments, so only a JSON object will do, and
    only RFC 8259 JSON (NaN, a key given twice: the same rules as a manifest's)."""
    try:
        value = parse_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object like '{{\"anon\": true}}'")
    return value


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"statesnap {prog}", description=description)
    parser.add_argument("--storage-options", type=json_object, default=None, metavar="JSON",
                        help="fsspec storage options as a JSON object (for URLs such as s3://...)")
    return parser


def json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document (RFC 8259) on stdout instead of text (same exit status)")


def progress_flags(parser: argparse.ArgumentParser) -> None:
    """``--progress``/``--no-progress``: force the bar on or off (default: only on a terminal)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="show a progress bar on stderr (default: only when stderr is a terminal)")


def _open(path: str, args) -> Reader:
    return Reader(path, storage_options=args.storage_options)


# -- inspect ------------------------------------------------------------------------------------
def describe(reader: Reader) -> dict:
    """Everything ``inspect`` shows, as JSON-ready data."""
    manifest = reader.manifest
    tensors, objects = [], []
    for fqn in reader.keys():
        info = reader.info(fqn)
        if isinstance(info, TensorInfo):
            tensors.append({"name": fqn, "dtype": dtype_name(info.dtype), "shape": list(info.shape),
                            "bytes": info.nbytes, "pieces": info.pieces, "layout": info.layout,
                            "files": info.files})
        else:
            objects.append({"name": fqn, "kind": info.kind})
    manifest_path = reader.backend.join(reader.path, MANIFEST_NAME)
    manifest_file = reader.backend.open_read(manifest_path)
    try:
        manifest_bytes = manifest_file.size()
    finally:
        manifest_file.close()
    sections = set(manifest.sections)  # (a split manifest's sections are in its file table, but hold no tensors)
    files = [{"name": n, "bytes": s, "kind": "manifest section" if i in sections else "data"}
             for i, (n, s) in enumerate(zip(manifest.files, manifest.file_sizes))]
    return {
        "path": reader.path, "format_version": manifest.version, "world_size": manifest.world_size,
        "block_bytes": manifest.block_bytes, "meta": manifest.meta, "files": files,
        "tensors": tensors, "objects": objects,
        "totals": {"tensors": len(tensors), "objects": len(objects), "pieces": sum(t["pieces"] for t in tensors),
                   "tensor_bytes": sum(t["bytes"] for t in tensors), "files": len(files) - len(sections),
                   "file_bytes": manifest.total_bytes, "manifest_bytes": manifest_bytes,
                   "manifest_sections": len(sections),
                   "section_bytes": sum(f["bytes"] for f in files if f["kind"] != "data")},
    }


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]


def print_description(doc: dict, show_files: bool) -> None:
    totals = doc["totals"]
    print(printable(f"{doc['path']}: statesnap format v{doc['format_version']}, saved by {doc['world_size']} rank(s)"))
    if doc["tensors"]:
        rows = [["tensor", "dtype", "shape", "bytes", "pieces"]]
        rows += [[printable(t["name"]), t["dtype"], str(t["shape"]), human_bytes(t["bytes"]),
                  str(t["pieces"]) + ("" if t["layout"] == "box" else " flat")] for t in doc["tensors"]]
        print("\n".join(_columns(rows)))
    if doc["objects"]:
        print("\n".join(_columns([["object", "kind"]] + [[printable(o["name"]), o["kind"]] for o in doc["objects"]])))
    if show_files:
        rows = [[printable(f["name"]), human_bytes(f["bytes"]), f["kind"]] for f in doc["files"]]
        print("\n".join(_columns([["file", "bytes", "holds"]] + rows)))
    sections = totals["manifest_sections"]
    print(f"total: {totals['tensors']} tensors in {totals['pieces']} pieces, {human_bytes(totals['tensor_bytes'])}; "
          f"{totals['objects']} objects; {totals['files']} data files, {human_bytes(totals['file_bytes'])}; "
          f"manifest {human_bytes(totals['manifest_bytes'])}"
          + (f" and {sections} section files, {human_bytes(totals['section_bytes'])}" if sections else ""))


def inspect_main(argv: list[str]) -> int:
    parser = _parser("inspect", "list a checkpoint's tensors, dtypes, shapes, bytes, pieces and totals")
    parser.add_argument("path", help="checkpoint directory or URL")
    json_flag(parser)
    parser.add_argument("--files", action="store_true", help="also list the data files")
    args = parser.parse_args(argv)
    try:
        doc = describe(_open(args.path, args))
    except CheckpointError as exc:
        if args.json:  # (a script reads stdout: the error in the document, as diff and verify do)
            print(json_text({"path": args.path, "error": str(exc)}))
        else:
            print(printable(f"statesnap inspect: {exc}"), file=sys.stderr)
        return TROUBLE
    if args.json:
        print(json_text(doc))
    else:
        print_description(doc, args.files)
    return OK


# -- verify -------------------------------------------------------------------------------------
def verify_main(argv: list[str]) -> int:
    parser = _parser("verify", "read every stored byte of each checkpoint and check its checksums")
    parser.add_argument("paths", nargs="+", metavar="path", help="checkpoint directories or URLs")
    json_flag(parser)
    progress_flags(parser)
    args = parser.parse_args(argv)
    results = []
    for path in args.paths:
        try:
            reader = _open(path, args)
            checked = reader.verify(progress=args.progress)
        except CheckpointError as exc:
            results.append({"path": path, "ok": False, "error": str(exc)})
            if not args.json:  # (a path with nothing there, or a URL no file system serves, is no damage)
                label = ("UNREADABLE" if type(exc) is CheckpointError else
                         "NOT A CHECKPOINT" if isinstance(exc, NotACheckpointError) else "DAMAGED")
                print(printable(f"{label} {path}: {exc}"), file=sys.stderr)
            continue
        results.append({"path": path, "ok": True, "tensors": len(reader.manifest.tensors), "bytes_verified": checked})
        if not args.json:
            print(printable(f"ok {path}: {len(reader.manifest.tensors)} tensors, {human_bytes(checked)} verified"))
    if args.json:
        print(json_text({"checkpoints": results}))
    return OK if all(r["ok"] for r in results) else FOUND


# -- diff ---------------------------------------------------------------------------------------
def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool]:
    """(Largest |a - b| over the elements whose bits differ, NaN where either side is NaN;
    whether any bits differ). Bits can differ where values do not (0.0 and -0.0, NaN payloads),
    and integers are compared exactly: through float64, 2**62 and 2**62 + 1 would be equal."""
    if a.numel() == 0:
        return 0.0, False
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8).reshape(t.numel(), -1)  # noqa: E731
    differs = (as_bytes(a) != as_bytes(b)).any(dim=1)
    if not differs.any():
        return 0.0, False
    x, y = a.reshape(-1)[differs], b.reshape(-1)[differs]
    if not (x.is_floating_point() or x.is_complex()):  # (Python integers: no 64-bit overflow)
        return float(max(abs(int(p) - int(q)) for p, q in zip(x.tolist(), y.tolist()))), True
    wide = torch.complex128 if x.is_complex() else torch.float64
    delta = (x.to(wide) - y.to(wide)).abs()
    return (math.nan if delta.isnan().any() else float(delta.max())), True


def compare_tensor(left: Reader, right: Reader, fqn: str) -> tuple[float, bool]:
    """``max_abs_diff`` of ``fqn`` in two checkpoints, read a slab at a time."""
    entry = left.manifest.tensors[fqn]
    if not entry.shape or entry.numel == 0:
        return max_abs_diff(left.read(fqn).contiguous(), right.read(fqn).contiguous())
    row_bytes = max(1, entry.numel // entry.shape[0] * entry.dtype.itemsize)
    rows = max(1, DIFF_SLAB_BYTES // row_bytes)
    worst, differs = 0.0, False
    for start in range(0, entry.shape[0], rows):
        region = slice(start, min(start + rows, entry.shape[0]))
        found, bits = max_abs_diff(left.read(fqn, region), right.read(fqn, region))
        if math.isnan(found):
            return found, True
        worst, differs = max(worst, found), differs or bits
    return worst, differs


def diff(left: Reader, right: Reader, atol: float = 0.0) -> list[str]:
    """One line per difference between two checkpoints, key by key (empty: they match)."""
    lines = []
    left_keys, right_keys = set(left.keys()), set(right.keys())
    lines += [f"only in {left.path}: {k}" for k in sorted(left_keys - right_keys)]
    lines += [f"only in {right.path}: {k}" for k in sorted(right_keys - left_keys)]
    for fqn in sorted(left_keys & right_keys):
        a, b = left.manifest.tensors.get(fqn), right.manifest.tensors.get(fqn)
        if a is None or b is None:
            if (a is None) != (b is None):
                lines.append(f"{fqn}: a tensor in one checkpoint, an object in the other")
            else:
                ours, theirs = _fingerprint(left, fqn, left.manifest.objects[fqn]), \
                    _fingerprint(right, fqn, right.manifest.objects[fqn])
                if ours != theirs:
                    shown = f"{ours} vs {theirs}" if len(f"{ours}{theirs}") <= 80 else "values differ"
                    lines.append(f"{fqn}: {shown}")
            continue
        if a.dtype != b.dtype or a.shape != b.shape:
            lines.append(f"{fqn}: {dtype_name(a.dtype)}{list(a.shape)} vs {dtype_name(b.dtype)}{list(b.shape)}")
            continue
        worst, differs = compare_tensor(left, right, fqn)
        if differs and (atol == 0 or math.isnan(worst) or worst > atol):  # atol 0: bit for bit
            lines.append(f"{fqn}: max abs diff {worst:.6g}" + (" (the values' bits differ)" if worst == 0 else ""))
    return lines


def _fingerprint(reader: Reader, fqn: str, entry: ObjectEntry):
    """What identifies an object's value: its encoded JSON, or for pickled bytes their length and
    checksum, once the bytes are read and found to have them (diff never unpickles; a damaged
    value, which no load can read, matched its good copy)."""
    if entry.kind == "json":
        return json.dumps(entry.value, sort_keys=True)
    if entry.kind == "pickle":
        blob_reader(reader.backend, reader.path, reader.manifest)(fqn, entry.value)
        return entry.value[2:]
    return [_fingerprint(reader, fqn, e) for e in entry.per_rank]


def tolerance(text: str) -> float:
    """``--atol``: no difference exceeds a NaN or infinite tolerance, so with one every pair of
    checkpoints would "match"."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return value


def diff_main(argv: list[str]) -> int:
    parser = _parser("diff", "compare two checkpoints key by key; exit 1 if they differ")
    parser.add_argument("left")
    parser.add_argument("right")
    parser.add_argument("--atol", type=tolerance, default=0.0,
                        help="ignore tensors whose max abs difference is at most this, a finite number >= 0 "
                             "(default 0: bit-exact)")
    json_flag(parser)
    args = parser.parse_args(argv)
    try:
        lines = diff(_open(args.left, args), _open(args.right, args), args.atol)
    except CheckpointError as exc:
        if args.json:
            print(json_text({"left": args.left, "right": args.right, "error": str(exc)}))
        else:
            print(printable(f"statesnap diff: {exc}"), file=sys.stderr)
        return TROUBLE
    if args.json:
        print(json_text({"left": args.left, "right": args.right, "match": not lines, "differences": lines}))
        return FOUND if lines else OK
    for line in lines:
        print(printable(line))
    if lines:
        print(f"{len(lines)} difference(s)")
        return FOUND
    print("checkpoints match")
    return OK
