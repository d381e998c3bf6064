"""What a DCP checkpoint pickles, read without running code from it.

DCP pickles its ``.metadata`` file and every non-tensor value, and its own reader unpickles them
with ``pickle.load`` and ``torch.load(weights_only=False)``: a hostile directory runs whatever it
names in ``dcp.load``. Here the metadata goes through :class:`_MetadataUnpickler`, which admits
only DCP's own metadata and plan records and gives state (pickle's BUILD) only to fresh instances
of its dataclasses, never to a class, a function or an enum member that the rest of the process
shares, after ``unpickler.nesting_problem`` found no tuples nested too deep; the values go through the
allow-listed weights-only unpickler of ``unpickler.py`` (tensors, plain data, numpy arrays:
Megatron's RNG state is one). The files the metadata names must lie inside the checkpoint
(symbolic links are followed, as for every source) and be regular files (a FIFO would block
the read for ever), and each tensor's chunks must cover it exactly once.
"""
from __future__ import annotations

import enum
import os
import pathlib
import pickle

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from ..errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ..format.boxes import first_outside, tiling_problem
from ..storage.local import open_source
from .tree import Refused
from .unpickler import load_from, nesting_problem

METADATA_NAME = ".metadata"


def read_metadata(src: str, load_id: str | None) -> Metadata:
    """The metadata of the DCP checkpoint directory ``src``, checked (see the module's docstring)."""
    path = os.path.join(src, METADATA_NAME)
    try:
        with open(path, "rb") as f:
            problem = nesting_problem(f)
            if problem is not None:
                raise _Refused(problem)
            f.seek(0)
            metadata = _MetadataUnpickler(f).load()
    except _Refused as exc:
        raise UnsafeCheckpointError(f"{path}: refused to unpickle: {exc}. statesnap admits only DCP's metadata "
                                    "records there, and never runs code from a checkpoint") from None
    except Exception as exc:  # noqa: BLE001 (a damaged file: what it is, in one line)
        raise CheckpointError(f"{path} is not readable DCP metadata (truncated or damaged?): "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not DCP metadata: it holds a {type(metadata).__name__}")
    _check_files(src, path, metadata)
    _check_chunks(path, metadata)
    if metadata.storage_meta is None:  # as DCP's own reader completes it
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


def _check_files(src: str, path: str, metadata: Metadata) -> None:
    """Every data file the metadata names is a relative path inside ``src`` and, if there, a
    regular file (a missing one is reported by the read that needs it, naming what it holds)."""
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for name in sorted({getattr(info, "relative_path", None) for info in storage.values()}, key=str):
        if not isinstance(name, str) or os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == "..":
            raise CheckpointError(f"{path} names the data file {name!r}, which is not a path inside {src}")
        try:
            open_source(os.path.join(src, name)).close()  # a FIFO there: CorruptCheckpointError
        except FileNotFoundError:
            continue
        except IsADirectoryError:
            raise CorruptCheckpointError(f"{os.path.join(src, name)}, a data file of DCP checkpoint {src}, is a "
                                         "directory") from None


def _check_chunks(path: str, metadata: Metadata) -> None:
    """Each tensor's chunks lie inside it and cover it exactly once: a tensor they leave a hole
    in would be converted with whatever memory held there."""
    tensors = metadata.state_dict_metadata if isinstance(metadata.state_dict_metadata, dict) else {}
    for key, md in tensors.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        shape, rows = list(md.size), (len(md.chunks), len(md.size))
        try:
            start = np.array([list(chunk.offsets) for chunk in md.chunks], dtype=np.int64).reshape(rows)
            size = np.array([list(chunk.sizes) for chunk in md.chunks], dtype=np.int64).reshape(rows)
        except (TypeError, ValueError, OverflowError, AttributeError):
            raise CheckpointError(f"{path}: tensor {key!r}: its chunks are not boxes of its {len(shape)} "
                                  "dimensions") from None
        outside = first_outside(start, size, shape)
        if outside >= 0:
            raise CheckpointError(f"{path}: tensor {key!r} of shape {shape}: chunk {outside} lies outside it")
        problem = tiling_problem(shape, start, size, lambda i: f"chunk {i}")
        if problem is not None:
            raise CheckpointError(f"{path}: tensor {key!r} of shape {shape}: {problem}")


def _admitted() -> dict:
    records = {(dcp_metadata.__name__, name): getattr(dcp_metadata, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING") if hasattr(dcp_metadata, name)}
    # Megatron's torch_dist saves keep the ranks' save plans in the metadata too
    records.update({(dcp_planner.__name__, name): getattr(dcp_planner, name) for name in (
        "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType", "TensorWriteData",
        "BytesIOWriteData") if hasattr(dcp_planner, name)})
    # DCP of torch 2.0-2.2 took these two from the sharded tensor's module
    old = "torch.distributed._shard.sharded_tensor.metadata"
    try:
        from torch.distributed._shard.sharded_tensor import metadata as sharded
        records.update({(old, name): getattr(sharded, name) for name in ("TensorProperties", "MEM_FORMAT_ENCODING")
                        if hasattr(sharded, name)})
    except ImportError:
        pass
    records[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    records[("torch", "Size")] = torch.Size
    records[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    # a checkpoint_id: as a pure path, which touches no file system
    records[("pathlib", "PosixPath")] = pathlib.PurePosixPath
    records[("pathlib", "WindowsPath")] = pathlib.PureWindowsPath
    records[("collections", "OrderedDict")] = dict
    return records


class _MetadataUnpickler(pickle._Unpickler):
    """Admits the globals a DCP ``.metadata`` names and nothing else. Python's own unpickler,
    not the C one, for its BUILD: admitted, the class ``torch.Size`` or the function
    ``_get_layout`` would take state like any object, and change for the whole process."""

    _RECORDS = _admitted()
    # the records whose instances take state: fresh dataclasses (an enum member is shared)
    _BUILDABLE = frozenset(cls for cls in _RECORDS.values()
                           if isinstance(cls, type) and hasattr(cls, "__dataclass_fields__")
                           and not issubclass(cls, enum.Enum))

    def find_class(self, module: str, name: str):
        if (module, name) in self._RECORDS:
            return self._RECORDS[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"global {module}.{name}")

    def load_build(self):
        target = self.stack[-2]
        if type(target) not in self._BUILDABLE:
            raise _Refused(f"state given to a {type(target).__name__}")  # (its repr may be exponential)
        super().load_build()

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


class _Refused(pickle.UnpicklingError):
    """What the metadata may not do (damage is another UnpicklingError)."""


class PlainValuesPlanner(DefaultLoadPlanner):
    """DCP's planner for a flat state dict, with each non-tensor value read by the allow-listed
    weights-only unpickler. ``failed``: the error of a value, which ``dcp.load`` raises wrapped
    in its own exception."""

    def __init__(self, src: str, storage_data: dict):
        super().__init__(flatten_state_dict=False)
        self._src, self._storage_data = src, storage_data
        self.failed: CheckpointError | None = None

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        stored = self._storage_data.get(read_item.storage_index)
        where = os.path.join(self._src, stored.relative_path) if stored is not None else self._src
        try:
            self.original_state_dict[fqn] = load_from(value, f"{where}: value {fqn!r}")
        except UnsafeCheckpointError as exc:  # raised only if the conversion keeps it
            self.original_state_dict[fqn] = Refused(exc)
        except CheckpointError as exc:
            self.failed = exc
            raise
