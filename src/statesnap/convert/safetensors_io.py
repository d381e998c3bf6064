"""Hugging Face safetensors in and out: one file, or shards listed by ``model.safetensors.index.json``.

Reading parses the header (an 8-byte length, then JSON naming each tensor's dtype, shape and byte
range) and reads each tensor's bytes only when asked, at its offset: a conversion holds one
tensor at a time, and an import without copying can point the checkpoint at the bytes where they
already are (``convert/writer.py``). Writing streams the format (an 8-byte header
length, a JSON header, then raw little-endian bytes) one tensor at a time, because the package's
``save_file`` wants every tensor of a file in memory at once, and a consolidated export of a
large model would not fit.
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter
from functools import partial
from typing import Any

import torch

from ..engine.buffers import byte_view, host_contiguous
from ..errors import CheckpointError
from ..format.dtypes import itemsize
from ..storage.local import open_source
from .transform import is_tensor, materialize
from .writer import InFile

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SUFFIX = ".safetensors"
METADATA = "__metadata__"  # the header's one key that names no tensor
HEADER_ALIGN = 8
# The dtype names of the safetensors specification.
DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e8m0fnu: "F8_E8M0", torch.complex64: "C64",
}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
MAX_HEADER_BYTES = 100 << 20  # the safetensors package's own limit
SHOWN = 8  # names shown in an error


def read(src: str) -> dict[str, Any]:
    """``{name: InFile}`` of a safetensors file, an index json, or a directory.

    Only the headers are read here; each tensor's bytes are read when it is materialized, so a
    conversion holds one tensor at a time, and each value knows its file and byte offset, so an
    import without copying can point at the bytes where they are."""
    out: dict[str, Any] = {}
    expected = None
    files = [src]
    if os.path.isdir(src) or src.endswith(".json"):
        files, expected = _shard_files(src)
    for path in files:
        for name, value in read_header(path).items():
            if name in out:
                raise CheckpointError(f"{path}: tensor {name!r} is also in another shard")
            if expected is not None and expected.get(name) != path:
                raise CheckpointError(f"{path}: tensor {name!r} is not listed for this file in the index")
            out[name] = value
    missing = sorted(set(expected or ()) - set(out))
    if missing:
        raise CheckpointError(f"{src}: the index lists tensors that no shard holds: {', '.join(missing[:20])}")
    return out


def read_header(path: str) -> dict[str, InFile]:
    """The tensors of one safetensors file as :class:`InFile` values, checked against the
    specification (known dtypes, byte ranges that match shape and dtype, lie in the file and do
    not overlap) so that a damaged or foreign file fails here, naming the file and tensor."""
    try:
        with open_source(path) as f:  # a FIFO in its place is refused, not waited on
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is not a safetensors file: {size} bytes are too few to hold the "
                                      "8-byte header length it starts with")
            length = struct.unpack("<Q", head)[0]
            if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(f"{path} is not a safetensors file: header length {length} does not fit "
                                      f"a file of {size} bytes")
            header = json.loads(f.read(length), object_pairs_hook=_unique_keys)
            st = os.fstat(f.fileno())
            identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
    except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError; RecursionError: nesting too deep
        raise CheckpointError(f"{path} is not a safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file: its header is not a JSON object")
    base = 8 + length
    out, ranges = {}, []
    for name, entry in header.items():
        if name == METADATA:
            if not (isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())):
                raise CheckpointError(f"{path} is not a safetensors file: its {METADATA} is not a map of strings "
                                      "to strings")
            continue
        dtype, shape, (begin, end) = _entry(path, name, entry)
        if base + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {base + end}, beyond the file's {size}")
        ranges.append((begin, end, name))
        out[name] = InFile(dtype, shape, partial(_read_range, path, name, dtype, shape, base + begin),
                           path, base + begin, identity)
    ranges.sort()
    for (_, end, first), (begin, _, second) in zip(ranges, ranges[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: tensors {first!r} and {second!r} overlap in the file")
    _refuse_holes(path, ranges, size - base)
    return out


def _refuse_holes(path: str, ranges: list[tuple[int, int, str]], data_bytes: int) -> None:
    """The specification leaves no byte of the data unindexed (so that no other content can hide
    in a file that loads as tensors; safetensors itself refuses such a file): the sorted
    ``ranges`` must follow one another from 0 to the end of the file."""
    at = 0
    for begin, end, name in ranges:
        if begin != at:
            raise CheckpointError(f"{path} is not a valid safetensors file: bytes [{at}, {begin}) of its data, before "
                                  f"tensor {name!r}, belong to no tensor (the format allows no holes)")
        at = end
    if at != data_bytes:
        raise CheckpointError(f"{path} is not a valid safetensors file: its last {data_bytes - at} bytes belong to no "
                              "tensor (the format allows no holes)")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice: ``json`` would keep the last silently, so a
    tensor named twice would be read from one of two byte ranges without a word."""
    out = dict(pairs)
    if len(out) != len(pairs):
        twice = sorted(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise ValueError(f"names given twice: {', '.join(map(repr, twice[:SHOWN]))}")
    return out


def _entry(path: str, name: str, entry: Any) -> tuple[torch.dtype, tuple, tuple[int, int]]:
    """(dtype, shape, data offsets) of one header entry, or an error naming file and tensor."""
    try:
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"unknown dtype {entry['dtype']!r}")
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        ints = [*shape, begin, end]
        if not all(type(n) is int and n >= 0 for n in ints) or begin > end:
            raise ValueError("shape and offsets must be non-negative integers")
        if math.prod(max(n, 1) for n in shape) * itemsize(dtype) >= 1 << 63:  # torch's sizes are int64
            raise ValueError(f"shape {list(shape)} is too large for any tensor")
        if end - begin != math.prod(shape) * itemsize(dtype):
            raise ValueError(f"{end - begin} bytes do not hold {dtype} {list(shape)}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({exc}): {entry!r:.200}") from None
    return dtype, shape, (begin, end)


def _read_range(path: str, name: str, dtype: torch.dtype, shape: tuple, offset: int) -> torch.Tensor:
    """The tensor stored at ``offset``: one positioned read into its own memory."""
    out = torch.empty(shape, dtype=dtype)
    view = byte_view(out)
    with open_source(path) as f:
        got = os.preadv(f.fileno(), [view], offset) if len(view) else 0
    if got != len(view):
        raise CheckpointError(f"{path}: tensor {name!r} was cut short (read {got} of {len(view)} bytes)")
    return out


def _shard_files(src: str) -> tuple[list[str], dict[str, str] | None]:
    """The shard files to read and, from an index, which file each tensor must come from."""
    index = src if src.endswith(".json") else os.path.join(src, INDEX_NAME)
    if not os.path.isfile(index):
        files = sorted(os.path.join(src, n) for n in os.listdir(src) if n.endswith(SUFFIX))
        if not files:
            raise CheckpointError(f"{src} holds neither {INDEX_NAME} nor any {SUFFIX} file")
        return files, None
    try:
        with open(index, encoding="utf-8") as f:  # (a tensor listed twice: for which file?)
            weight_map = json.load(f, object_pairs_hook=_unique_keys)["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"its weight_map is {str(weight_map)[:80]}, not an object naming tensors")
    except RecursionError:
        raise CheckpointError(f"{index} is not a safetensors index: its JSON is nested too deeply") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a safetensors index (needs a weight_map): {exc}") from None
    root = os.path.dirname(os.path.abspath(index))
    expected = {}
    for name, file in weight_map.items():
        path = os.path.normpath(os.path.join(root, str(file)))
        if os.path.dirname(path) != root:
            raise CheckpointError(f"{index}: shard {file!r} of {name!r} is outside {root}; refusing to read it")
        expected[name] = path
    return sorted(set(expected.values())), expected


def write(values: dict[str, Any], target: str, max_shard_bytes: int | None = None) -> list[str]:
    """Write the tensors of ``values`` as safetensors; return the files written.

    ``target`` ending in ``.safetensors`` is one file. Otherwise it is a directory in Hugging
    Face's layout: ``model.safetensors``, or with ``max_shard_bytes`` as many
    ``model-0000k-of-0000n.safetensors`` shards as needed plus ``model.safetensors.index.json``.
    A tensor larger than ``max_shard_bytes`` gets a shard of its own. Non-tensor values are left
    out: the caller reports them."""
    tensors = [(name, value) for name, value in values.items() if is_tensor(value)]
    shards = _plan_shards(tensors, max_shard_bytes)
    if target.endswith(SUFFIX):
        if len(shards) > 1:
            raise CheckpointError(f"{target}: {len(shards)} shards do not fit one file; export to a directory")
        _write_file(target, tensors)
        return [target]
    os.makedirs(target, exist_ok=True)
    if len(shards) == 1:
        _write_file(os.path.join(target, SINGLE_NAME), tensors)
        return [SINGLE_NAME]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}{SUFFIX}" for k in range(len(shards))]
    for name, shard in zip(names, shards):
        _write_file(os.path.join(target, name), shard)
    index = {"metadata": {"total_size": sum(tensor_bytes(v) for _, v in tensors)},
             "weight_map": {tensor: name for name, shard in zip(names, shards) for tensor, _ in shard}}
    with open(os.path.join(target, INDEX_NAME), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return [*names, INDEX_NAME]


def _plan_shards(tensors: list[tuple[str, Any]], max_shard_bytes: int | None) -> list[list[tuple[str, Any]]]:
    shards: list[list] = [[]]
    used = 0
    for name, value in tensors:
        size = tensor_bytes(value)
        if max_shard_bytes is not None and shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, value))
        used += size
    return shards


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor or Lazy, from dtype and shape alone."""
    return torch.Size(value.shape).numel() * itemsize(value.dtype)


def _write_file(path: str, tensors: list[tuple[str, Any]]) -> None:
    """Header first (shapes and dtypes are known without reading), then each tensor's bytes in turn."""
    header: dict[str, Any] = {METADATA: {"format": "pt"}}
    offset = 0
    for name, value in tensors:
        if value.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"{name}: dtype {value.dtype} has no safetensors name; export to torch or dcp")
        size = tensor_bytes(value)
        header[name] = {"dtype": DTYPE_NAMES[value.dtype], "shape": list(value.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % HEADER_ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, value in tensors:
            tensor = host_contiguous(materialize(value))
            if tensor.dtype != value.dtype or tuple(tensor.shape) != tuple(value.shape):
                raise CheckpointError(f"{name}: read {tensor.dtype}{list(tensor.shape)}, "
                                      f"expected {value.dtype}{list(value.shape)}")
            f.write(byte_view(tensor))
