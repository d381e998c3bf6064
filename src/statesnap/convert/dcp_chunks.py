"""DCP tensor chunks read straight into their place in the destination tensor.

``dcp.load`` deserializes each stored chunk into a tensor of its own (``torch.load`` of the
chunk's bytes) and then copies it into the target, so reading one tensor holds it twice. A
conversion must hold at most the largest tensor plus a fixed buffer, so :func:`read_tensor`
reads each chunk's raw bytes into the target itself (through a bounded bounce buffer where the
chunk is not one contiguous run of the target).

Each chunk DCP writes with its default format is a ``torch.save`` archive at an offset of a
``.distcp`` file: an uncompressed zip whose ``data.pkl`` names one storage and the view of it.
That pickle is read by a tiny unpickler that knows only the three globals a tensor needs (no
other code can run); the view must be dense, row-major and the whole storage (DCP clones a
tensor whose storage is larger than itself). Anything else (safetensors-format files, stream
transforms, a big-endian archive, an unusual pickle) returns ``None`` and the caller takes the
``dcp.load`` path, which reads every format DCP writes.
"""
from __future__ import annotations

import io
import os
import pickle
import zipfile
import zlib
from typing import Any

import torch

from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.local import open_source
from .zip_members import MemberDamaged, check_member_crcs, crcs_recorded, member_data_start, read_member

# Bytes a non-contiguous chunk is moved through at a time (whole leading-dimension rows).
BOUNCE_BYTES = 8 << 20
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


class _NotDirect(Exception):
    """The chunk is not in the one shape this module reads; the caller falls back to dcp.load."""


class _Damaged(Exception):
    """The chunk's bytes differ from the CRC-32 its archive records (its member's name)."""


def read_tensor(src: str, key: str, md: Any, storage: dict) -> torch.Tensor | None:
    """The tensor ``key`` (DCP ``TensorStorageMetadata`` ``md``) of the checkpoint ``src``, its
    chunks read in place using ``storage`` (``Metadata.storage_data``); ``None`` when a chunk is
    not a plain ``torch.save`` archive (read it with ``dcp.load`` then)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    target = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    infos = []
    for chunk in md.chunks:
        info = storage.get(MetadataIndex(key, chunk.offsets))
        if info is None or getattr(info, "transform_descriptors", None):
            return None
        infos.append((chunk, info))
    for chunk, info in infos:
        path = os.path.join(src, info.relative_path)
        view = target
        for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
            view = view.narrow(dim, start, length)
        try:
            with open_source(path) as f:
                _read_chunk(f, info.offset, info.length, view)
        except _NotDirect:
            return None
        except _Damaged as exc:
            raise CorruptCheckpointError(
                f"{path}: the chunk of {key!r} at offsets {list(chunk.offsets)} is damaged: the bytes of its archive "
                f"member {str(exc)!r} differ from the CRC-32 the archive records for them; restore the file from "
                "another copy") from None
        except MemberDamaged as exc:  # (its pickle or byte order record)
            raise CorruptCheckpointError(f"{path}: the chunk of {key!r} at offsets {list(chunk.offsets)} is damaged: "
                                         f"{exc}; restore the file from another copy") from None
        except (OSError, zipfile.BadZipFile, EOFError) as exc:
            raise CheckpointError(f"{path}: reading the chunk of {key!r} at offsets {list(chunk.offsets)} failed: "
                                  f"{type(exc).__name__}: {exc}") from None
    return target


def check_chunks(src: str, tensors: dict[str, Any], storage: dict) -> None:
    """Raise :class:`CorruptCheckpointError` where a chunk of a tensor of ``tensors`` (name ->
    DCP ``TensorStorageMetadata``; read by ``dcp.load``, which checks no CRC-32) differs from the
    CRC-32 its archive records. Each file is opened once. Chunks of another format than a
    ``torch.save`` archive are not checked."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    by_file: dict[str, list] = {}
    for key, md in tensors.items():
        for chunk in md.chunks:
            info = storage.get(MetadataIndex(key, chunk.offsets))
            if info is not None and not getattr(info, "transform_descriptors", None):
                by_file.setdefault(info.relative_path, []).append((key, chunk, info))
    for name, chunks in by_file.items():
        path = os.path.join(src, name)
        with open_source(path) as f:
            for key, chunk, info in chunks:
                if info.length <= BOUNCE_BYTES:  # (read at once: zipfile's many small reads of it cost more)
                    f.seek(info.offset)
                    archive = io.BytesIO(f.read(info.length))
                else:
                    archive = _Window(f, info.offset, info.length)
                check_member_crcs(archive, f"{path}: the chunk of {key!r} at offsets {list(chunk.offsets)}", None)


def _read_chunk(f, offset: int, length: int, view: torch.Tensor) -> None:
    archive = zipfile.ZipFile(_Window(f, offset, length))
    names, members = archive.namelist(), archive.infolist()
    pickled = [n for n in names if n.endswith("/data.pkl")]
    if len(pickled) != 1 or any(info.compress_type != zipfile.ZIP_STORED for info in members):
        raise _NotDirect
    prefix, check = pickled[0][: -len("data.pkl")], crcs_recorded(members)
    read = lambda name: read_member(f, offset, archive.getinfo(name), check)  # noqa: E731
    if f"{prefix}byteorder" in names and read(f"{prefix}byteorder") != b"little":
        raise _NotDirect
    dtype, record, numel, storage_offset, size, stride = _TensorLayout(io.BytesIO(read(pickled[0]))).load()
    if (dtype != view.dtype or tuple(size) != tuple(view.shape) or storage_offset != 0 or numel != view.numel()
            or tuple(stride) != _row_major(size)):
        raise _NotDirect
    entry = archive.getinfo(f"{prefix}data/{record}")
    nbytes = view.numel() * view.element_size()
    if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != nbytes:
        raise _NotDirect
    start = member_data_start(f, offset, entry)
    if start + nbytes > offset + length:
        raise zipfile.BadZipFile(f"{entry.filename} runs past the end of its chunk")
    f.seek(start)
    if _read_rows(f, view, nbytes) != entry.CRC and check:
        raise _Damaged(entry.filename)


def _read_rows(f, view: torch.Tensor, nbytes: int) -> int:
    """Fill ``view`` from the next ``nbytes`` row-major bytes of ``f``: straight into it when it
    is contiguous, else a bounded number of leading-dimension rows at a time. Returns the
    bytes' CRC-32, computed as they come."""
    if view.is_contiguous():
        return _read_exact(f, view.reshape(-1).view(torch.uint8), 0)
    row_bytes = nbytes // view.shape[0]
    rows, crc = max(1, BOUNCE_BYTES // max(row_bytes, 1)), 0
    for first in range(0, view.shape[0], rows):
        part = view[first:first + rows]
        bounce = torch.empty(part.shape, dtype=view.dtype)
        crc = _read_exact(f, bounce.reshape(-1).view(torch.uint8), crc)
        part.copy_(bounce)
    return crc


def _read_exact(f, out: torch.Tensor, crc: int) -> int:
    """Fill ``out`` from ``f``; return ``crc`` continued over its bytes."""
    buffer, done = memoryview(out.numpy()), 0
    while done < len(buffer):
        got = f.readinto(buffer[done:])
        if not got:
            raise EOFError(f"file ends {len(buffer) - done} bytes early")
        crc = zlib.crc32(buffer[done:done + got], crc)
        done += got
    return crc


def _row_major(size) -> tuple:
    stride, step = [], 1
    for length in reversed(tuple(size)):
        stride.append(step)
        step *= max(length, 1)
    return tuple(reversed(stride))


class _TensorLayout(pickle.Unpickler):
    """Reads a one-tensor ``data.pkl`` as (dtype, storage record, numel, offset, size, stride)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (*storage, offset, size, stride)
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _NotDirect

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], torch.dtype)):
            raise _NotDirect
        return pid[1], pid[2], pid[4]

    def load(self):
        try:
            layout = super().load()
        except _NotDirect:
            raise
        except Exception:
            raise _NotDirect from None
        if not (isinstance(layout, tuple) and len(layout) == 6):
            raise _NotDirect
        return layout


class _Window(io.RawIOBase):
    """``length`` bytes of ``f`` from ``offset``, as a seekable file of their own (one chunk's
    archive inside a ``.distcp`` file, where zipfile looks for the archive's end)."""

    def __init__(self, f, offset: int, length: int):
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def readinto(self, buffer) -> int:
        want = min(len(buffer), self._length - self._pos)
        if want <= 0:
            return 0
        self._f.seek(self._offset + self._pos)
        got = self._f.readinto(memoryview(buffer)[:want])
        self._pos += got
        return got
