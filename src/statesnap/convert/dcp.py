"""PyTorch Distributed Checkpoint (DCP) directories in and out, through DCP's public API only.

Reading builds a target from the checkpoint's own metadata (every tensor at its full global
shape), one large tensor at a time (``read`` returns them as :class:`Lazy` values); its chunks are
read straight into place by :mod:`.dcp_chunks`, or, for what that does not read, assembled by
``torch.distributed.checkpoint.load`` in one process with no process group. The
nesting DCP flattened away is rebuilt from ``planner_data``, so an optimizer's ``param_groups``
comes back as one list, as ``ss.save`` would have stored it.

Trust: DCP pickles its ``.metadata`` file and every non-tensor value; they are read without
running code from them (``dcp_pickles.py``), and anything else they name is refused with
:class:`UnsafeCheckpointError` naming the file and the global. The statesnap checkpoint written
from it holds no pickle.
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import CheckpointError
from ..format.dtypes import itemsize
from ..format.plaindata import MAX_INLINE_TENSOR_BYTES
from .dcp_chunks import check_chunks, read_tensor
from .transform import Lazy, materialize
from .dcp_pickles import METADATA_NAME, PlainValuesPlanner, read_metadata
from .torch_save import write_failed
from .tree import flatten_tree, nest_paths

# Tensors up to this size are read together, at once: they may be plain data inside a list (an
# RNG state), which the statesnap checkpoint keeps as one value, and one call per tiny tensor
# would cost more than it saves.
EAGER_BYTES = MAX_INLINE_TENSOR_BYTES
# What dcp.load raises: its CheckpointException derives from BaseException, not Exception.
DCP_FAILURES = (Exception, dcp.CheckpointException)
SHOWN = 5  # names shown in an error


def read(src: str) -> dict[str, Any]:
    """``{name: Lazy tensor, small tensor or plain value}`` of the DCP checkpoint directory ``src``.

    Large tensors are :class:`Lazy`: each is read on its own, when the writer gets to it, through
    ``dcp.load`` of a one-tensor state dict, so a conversion never holds the whole checkpoint.
    Plain values and tensors small enough to be plain data are read at once, in one call."""
    if not os.path.isfile(os.path.join(src, METADATA_NAME)):
        raise CheckpointError(f"{src} is not a DCP checkpoint: it has no {METADATA_NAME} file")
    try:
        reader = _MetadataOnce(src)
        metadata = reader.read_metadata()  # UnsafeCheckpointError is a CheckpointError: raised as it is
        flat: dict[str, Any] = {}
        now: dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                flat[key] = now[key] = None  # DCP puts the stored object in its place
            elif md.size.numel() * itemsize(md.properties.dtype) <= EAGER_BYTES:
                flat[key] = now[key] = torch.empty(md.size, dtype=md.properties.dtype)
            else:
                flat[key] = Lazy(md.properties.dtype, tuple(md.size), partial(_load_one, reader, src, key, md))
        if now:
            small_tensors = {key: md for key in now
                             if isinstance(md := metadata.state_dict_metadata[key], TensorStorageMetadata)}
            try:
                _load(reader, now)
            except CheckpointError:
                raise
            except DCP_FAILURES as exc:
                # damage in a chunk (its pickle, say) fails DCP's load with an error of its own
                # that names no file: the archives' CRC-32s name the file, the member and the tensor
                check_chunks(src, small_tensors, metadata.storage_data)
                raise CheckpointError(_small_values_failure(metadata, now, src, exc)) from None
            check_chunks(src, small_tensors, metadata.storage_data)
            flat.update(now)
        nested = nest_paths(flat, metadata.planner_data or {})
    except CheckpointError:
        raise
    except DCP_FAILURES as exc:
        raise CheckpointError(f"reading DCP checkpoint {src} failed: {_cause(exc)}") from None
    return flatten_tree(nested, src)


def _cause(exc: BaseException) -> str:
    """What went wrong, in one line: DCP's CheckpointException carries each rank's whole traceback."""
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[-1] if isinstance(exc, dcp.CheckpointException) else lines[0]}"


class _MetadataOnce(FileSystemReader):
    """DCP's reader of a directory, with its ``.metadata`` unpickled once, safely
    (``dcp_pickles.py``): ``dcp.load`` asks for it on every call, and the streaming read makes
    one call per tensor."""

    def __init__(self, src: str):
        super().__init__(src)
        self.src = src

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if not hasattr(self, "_metadata"):
            self._metadata = read_metadata(self.src, self.load_id)
        return self._metadata


def _small_values_failure(metadata, now: dict[str, Any], src: str, exc: BaseException) -> str:
    """What failed when the small values were read together, naming the files that hold them,
    or those of them cut short (or missing) if any are: the bytes a value needs lie past the end."""
    held = [info for index, info in metadata.storage_data.items() if index.fqn in now]
    short = sorted({info.relative_path for info in held if info.offset + info.length > _size(src, info.relative_path)})
    files = short or sorted({info.relative_path for info in held})
    shown = f"{', '.join(list(now)[:SHOWN])}{', ...' if len(now) > SHOWN else ''}"
    cut = " (cut short or missing)" if short else ""
    return f"reading {', '.join(files)}{cut} of DCP checkpoint {src} (small values {shown}) failed: {_cause(exc)}"


def _size(src: str, name: str) -> int:
    try:
        return os.path.getsize(os.path.join(src, name))
    except OSError:
        return -1


def _load(reader: _MetadataOnce, state: dict[str, Any]) -> None:
    planner = PlainValuesPlanner(reader.src, reader.read_metadata().storage_data)
    try:
        with _single_process():
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except DCP_FAILURES:
        if planner.failed is not None:
            raise planner.failed from None
        raise


def _load_one(reader: FileSystemReader, src: str, key: str, md: TensorStorageMetadata) -> torch.Tensor:
    in_place = read_tensor(src, key, md, reader.read_metadata().storage_data)
    if in_place is not None:
        return in_place
    state = {key: torch.empty(md.size, dtype=md.properties.dtype)}
    try:
        _load(reader, state)
    except CheckpointError:
        raise
    except DCP_FAILURES as exc:
        files = sorted({info.relative_path for index, info in reader.read_metadata().storage_data.items()
                        if index.fqn == key})
        raise CheckpointError(f"reading {key!r} from {', '.join(files)} of DCP checkpoint {src} failed: "
                              f"{_cause(exc)}") from None
    check_chunks(src, {key: md}, reader.read_metadata().storage_data)
    return state[key]


def write(values: dict[str, Any], target: str) -> list[str]:
    """A DCP checkpoint of the flat ``{name: value}`` map in directory ``target`` (one process)."""
    state = {name: materialize(value) for name, value in values.items()}
    try:
        with _single_process():
            dcp.save(state, storage_writer=FileSystemWriter(target), no_dist=True)
    except CheckpointException as exc:  # a BaseException: what failed, per rank (the disk was full, ...)
        cause = next(iter(exc.failures.values()), None)
        cause = cause[0] if isinstance(cause, tuple) and cause else cause
        raise (cause if isinstance(cause, OSError) else write_failed("dcp.save", cause, target)) from None
    return sorted(os.listdir(target))


@contextmanager
def _single_process():
    """DCP warns that it assumes a single process when no group exists; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
