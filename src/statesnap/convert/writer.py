"""Write a converted ``{name: value}`` map as a statesnap checkpoint, one tensor at a time.

``ss.save`` wants every tensor in memory at once; a 70B-parameter DCP or DeepSpeed checkpoint does
not fit. This writer takes the converter's map, whose tensors are mostly :class:`Lazy` (known by
dtype and shape, read on demand), and produces exactly what ``ss.save`` of the materialized map
would: the same save plan (``plan_save``), the same plain-data encoding, block checksums computed
on the way (``write_file``), the same manifest and the same atomic commit through the storage
backend (``commit_or_abort``). Only one tensor is materialized at a time, so the peak memory is
the largest tensor plus what the source needs to read it.

Import without copying (``copy=False``): tensors that a source knows to lie raw and whole in a
file (:class:`InFile`: safetensors) and that the spec left untouched are not written at all. The
source file is hard-linked into the checkpoint directory under a data file name (a reflink where
a hard link is refused), each tensor's piece points at its byte offset in it, and the checksums
are computed from one read of it. A hard link shares the source's inode: writing into the source
file in place changes the checkpoint too, which its checksums then report. Where neither link
works (another file system), the tensors are written like any other, still reading the source
once.
"""
from __future__ import annotations

import errno
import fcntl
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..engine.buffers import byte_view, host_contiguous
from ..engine.save import (RankOutput, SaveInfo, commit_or_abort, committed_bytes, data_file_name, encode_objects,
                           open_staging, own_objects, per_rank_names, shared_names)
from ..engine.write import default_threads, write_file
from ..errors import CheckpointError, CheckpointExistsError, remedy
from ..format.checksum import DEFAULT_BLOCK_BYTES, checksum_blocks, checksum_whole
from ..format.dtypes import dtype_name, itemsize
from ..format.manifest import BOX, ObjectEntry
from ..plan.save_plan import align_up, plan_save
from ..progress import bar
from ..state.flatten import flatten_for_save
from ..state.items import ItemMeta
from ..storage import backend_for, normalize
from ..storage.base import FileWriter
from ..storage.local import LocalBackend
from .transform import Lazy, is_tensor, materialize

FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), a reflink of a whole file
# errors of os.link that mean "not here, but a copy would do", not "something is wrong"
_CANNOT_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EACCES)


@dataclass(frozen=True)
class InFile(Lazy):
    """A tensor stored raw (row-major, little-endian, no gaps) at byte ``offset`` of ``path``."""

    path: str
    offset: int
    # (st_dev, st_ino, st_size, st_mtime_ns) of the file the offsets were read from: the file
    # linked must be that one, not another renamed over its path in between
    identity: tuple = ()


def write_checkpoint(values: dict[str, Any], dst, *, meta: dict, overwrite: bool = False,
                     allow_pickle: bool = False, storage_options: dict | None = None, copy: bool = True,
                     progress: bool | None = None, durable: bool = True,
                     block_bytes: int = DEFAULT_BLOCK_BYTES) -> SaveInfo:
    """Write ``values`` (tensors, :class:`Lazy` tensors and plain values) as a checkpoint at ``dst``."""
    started = time.perf_counter()
    path = normalize(dst)
    backend = backend_for(path, storage_options)
    if not copy and not isinstance(backend, LocalBackend):
        raise CheckpointError(f"copy=False links files on a local file system; {path} is not local")
    plain = flatten_for_save({name: v for name, v in values.items() if not is_tensor(v)})
    tensors = {name: v for name, v in values.items() if is_tensor(v)}
    tensors.update((item.fqn, item.local) for item in plain.tensors)  # large tensors inside plain lists
    entries, blobs = encode_objects(plain, allow_pickle)
    staging, token, problem = open_staging(backend, path, overwrite)
    if problem is not None:
        raise CheckpointError(f"cannot save to {path}: {problem}")
    if staging is None:
        raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it")
    try:
        linked = {} if copy else _link_sources(tensors, staging, token, durable)
        in_link = {name for names in linked.values() for name in names}
        own = [name for name in tensors if name not in in_link]
        files = list(linked)
        # each linked file is planned as if another rank held its tensors (its offsets are then set
        # to where they lie in it), so the manifest comes from the engine's own build_manifest
        plan = plan_save([[_meta(n, tensors[n]) for n in own], *([_meta(n, tensors[n]) for n in linked[f]]
                                                                   for f in files)],
                         [shared_names(plain)] + [[] for _ in files])
        mine, my_blobs = own_objects(entries, blobs, per_rank_names(plain), 0, plan.object_writers)
        total = sum(int(pieces.nbytes.sum()) for pieces in plan.tensors.values())
        with bar(total, f"convert -> {os.path.basename(path.rstrip('/'))}", progress) as advance:
            outputs = [_write_own(backend, staging, token, plan, own, tensors, mine, my_blobs, durable,
                                  block_bytes, advance)]
            for rank, file in enumerate(files, start=1):
                outputs.append(_checksum_linked(plan, staging, rank, file, linked[file], tensors, block_bytes, advance))
    except OSError as exc:  # the disk is full (ENOSPC, EFBIG past a file size limit), an I/O error, ...
        backend.abort(staging, path)
        raise CheckpointError(f"writing the converted checkpoint {path} failed, nothing was committed: "
                              f"{exc.strerror or exc}{remedy(exc)}") from None
    except BaseException:
        backend.abort(staging, path)
        raise
    result = commit_or_abort(backend, path, staging, plan, [(out, None) for out in outputs], 1, overwrite,
                             durable, block_bytes, meta)
    return SaveInfo(path, committed_bytes(result, path), time.perf_counter() - started)


def _meta(name: str, value: Any) -> ItemMeta:
    """The save plan's description of a whole tensor held by one rank, from dtype and shape."""
    shape = tuple(int(s) for s in value.shape)
    try:
        dtype = dtype_name(value.dtype)
    except CheckpointError as exc:
        # (a transform spec's cast converts between the floating dtypes the format stores: not from these)
        raise CheckpointError(f"{name}: {exc}; convert it in the source before converting the checkpoint (a "
                              "quantized tensor: t.dequantize(), or t.int_repr() with its scales)") from None
    nbytes = torch.Size(shape).numel() * itemsize(value.dtype)
    return ItemMeta(name, dtype, shape, BOX, (0,) * len(shape), shape, nbytes)


class _Kept(FileWriter):
    """The one data file, passed to ``write_file`` once per tensor: its closes are ignored, and
    the stream closes the file after its last write."""

    def __init__(self, inner: FileWriter):
        self.inner = inner

    def open_write(self, path: str, durable: bool = False) -> FileWriter:  # what write_file opens
        return self

    def pwrite(self, offset, views) -> None:
        self.inner.pwrite(offset, views)

    def pwrite_bulk(self, offset, view) -> None:
        self.inner.pwrite_bulk(offset, view)

    def close(self, durable: bool) -> None:
        pass


def _write_own(backend, staging, token, plan, own, tensors, objects, blobs, durable, block_bytes,
               advance) -> RankOutput:
    """Rank 0's data file: the planned tensors materialized and written one at a time, then the
    pickled values (as ``write_rank`` places them: each aligned, after the tensors)."""
    name = data_file_name(token, 0)
    end = plan.file_bytes[0]
    if not plan.writes[0] and not blobs:
        return RankOutput(None, 0, {}, objects, set())
    writer = backend.open_write(backend.join(staging, name), durable)
    kept, checksums = _Kept(writer), {}
    try:
        for index, offset in plan.writes[0]:
            fqn = own[index]
            tensor = _materialized(fqn, tensors[fqn])
            checksums[index] = write_file(kept, name, [(offset, byte_view(tensor))], block_bytes, durable)[0]
            advance(tensor.numel() * tensor.element_size())
            del tensor  # before the next one is read
        for fqn, blob in blobs:
            start = align_up(end)
            kept.pwrite(start, [memoryview(blob)])
            objects[fqn] = ObjectEntry("pickle", [None, start, len(blob), checksum_whole(memoryview(blob))])
            end = start + len(blob)
    except BaseException:
        writer.close(durable=False)
        raise
    writer.close(durable)
    return RankOutput(name, end, checksums, objects, set())


def _materialized(fqn: str, value: Any) -> torch.Tensor:
    """The tensor a value promised, in contiguous host memory, or an error naming it."""
    try:
        tensor = host_contiguous(materialize(value))
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{fqn}: reading it from the source failed: {type(exc).__name__}: {exc}") from None
    if tensor.dtype != value.dtype or tuple(tensor.shape) != tuple(value.shape):
        raise CheckpointError(f"{fqn}: the source gave {tensor.dtype}{list(tensor.shape)}, "
                              f"announced {value.dtype}{list(value.shape)}")
    return tensor


def _link_sources(tensors: dict[str, Any], staging: str, token: str, durable: bool) -> dict[str, list[str]]:
    """Link every source file that holds an untouched tensor into ``staging``; return
    ``{linked data file name: [tensor names]}``. Files that cannot be linked are left out (their
    tensors are then written)."""
    by_path: dict[str, list[str]] = {}
    for name, value in tensors.items():
        if isinstance(value, InFile):
            by_path.setdefault(value.path, []).append(name)
    if not by_path:
        raise CheckpointError("copy=False: no tensor is left as the source stores it (the transform spec "
                              "computes every one), so there is nothing to link; use copy=True")
    linked = {}
    for rank, (source, names) in enumerate(by_path.items(), start=1):
        name = data_file_name(token, rank)
        linked_stat = _link(source, os.path.join(staging, name))
        if linked_stat is not None:
            _require_same_file(source, linked_stat, tensors[names[0]].identity)
            if durable:  # the source may never have been flushed; the checkpoint must be durable
                fd = os.open(os.path.join(staging, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            linked[name] = sorted(names, key=lambda n: tensors[n].offset)
    return linked


def _require_same_file(source: str, linked: os.stat_result, identity: tuple) -> None:
    if identity and (linked.st_dev, linked.st_ino, linked.st_size, linked.st_mtime_ns) != identity:
        raise CheckpointError(f"{source} changed while it was being converted (another file was put at its path, "
                              "or it was written to): its tensors' offsets were read from the file as it was "
                              "before; convert again")


def _link(source: str, target: str) -> os.stat_result | None:
    """Hard-link ``source`` at ``target``, else reflink it; return the status of the file that
    was linked (None if the file system allows neither).

    A symlink is resolved first: Linux's link() links the symlink itself (whatever
    ``follow_symlinks`` says), which would leave the checkpoint a pointer to a path, dangling
    when relative, and no protection against the source being replaced or deleted."""
    source = os.path.realpath(source)
    try:
        os.link(source, target)
        return os.stat(target)  # the same inode as what was linked, whatever is at source now
    except OSError as exc:
        if exc.errno not in _CANNOT_LINK:
            raise CheckpointError(f"linking {source} into the checkpoint failed: {exc}") from None
    src_fd = os.open(source, os.O_RDONLY)
    try:
        dst_fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.ioctl(dst_fd, FICLONE, src_fd)
            return os.fstat(src_fd)
        except OSError:
            os.unlink(target)
            return None
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def _checksum_linked(plan, staging: str, rank: int, file: str, names: list[str], tensors: dict[str, Any],
                     block_bytes: int, advance) -> RankOutput:
    """A linked file as if rank ``rank`` had written it: each tensor's piece at its offset in the
    file, its block checksums from one read of those bytes."""
    where, source = os.path.join(staging, file), tensors[names[0]].path
    size = os.path.getsize(where)
    for fqn in names:
        plan.tensors[fqn].offset = np.array([tensors[fqn].offset], dtype=np.int64)
    plan.file_bytes[rank] = size
    reader = LocalBackend().open_read(where)

    def checksums(fqn: str) -> list[int]:
        """One block at a time through one buffer: a mapping of the whole file would make every
        page of it count as this process's memory."""
        base, nbytes = tensors[fqn].offset, int(plan.tensors[fqn].nbytes[0])
        buf = memoryview(bytearray(min(block_bytes, nbytes)))
        sums = [] if nbytes else checksum_blocks([buf], block_bytes)
        for pos in range(0, nbytes, block_bytes):
            view = buf[:min(block_bytes, nbytes - pos)]
            if reader.readinto(base + pos, [view]) != len(view):
                raise CheckpointError(f"{source}: tensor {fqn!r} was cut short while it was imported")
            sums += checksum_blocks([view], block_bytes)
            advance(len(view))
        return sums

    try:
        with ThreadPoolExecutor(default_threads(), thread_name_prefix="statesnap-checksum") as pool:
            sums = list(pool.map(checksums, names))
    finally:
        reader.close()
    items = [int(plan.tensors[fqn].item[0]) for fqn in names]  # each tensor's place in this rank's list
    return RankOutput(file, size, dict(zip(items, sums)), {}, set())
