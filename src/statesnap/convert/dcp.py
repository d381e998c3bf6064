"""PyTorch Distributed Checkpoint (DCP) directories in and out, through DCP's public API only.

Reading builds a target state dict from the checkpoint's own metadata (every tensor at its full
global shape) and lets ``torch.distributed.checkpoint.load`` assemble the shards, in one process
with no process group. The nesting DCP flattened away is rebuilt from ``planner_data``, so an
optimizer's ``param_groups`` comes back as one list, as ``ss.save`` would have stored it.

Trust: DCP pickles its ``.metadata`` file and every non-tensor value (``torch.load`` with
``weights_only=False``). Converting a DCP checkpoint therefore trusts it exactly as much as
``dcp.load`` would: convert only checkpoints you would load with DCP itself. The statesnap
checkpoint written from it holds no pickle.
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointError
from .transform import materialize
from .tree import flatten_tree, nest_paths

METADATA_NAME = ".metadata"


def read(src: str) -> dict[str, Any]:
    """``{name: tensor or plain value}`` of the DCP checkpoint directory ``src``, fully assembled."""
    if not os.path.isfile(os.path.join(src, METADATA_NAME)):
        raise CheckpointError(f"{src} is not a DCP checkpoint: it has no {METADATA_NAME} file")
    reader = FileSystemReader(src)
    try:
        metadata = reader.read_metadata()
        flat = {key: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
                for key, md in metadata.state_dict_metadata.items()}
        with _single_process():
            dcp.load(flat, storage_reader=reader, no_dist=True)
        nested = nest_paths(flat, metadata.planner_data or {})
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"reading DCP checkpoint {src} failed: {type(exc).__name__}: {exc}") from None
    return flatten_tree(nested, src)


def write(values: dict[str, Any], target: str) -> list[str]:
    """A DCP checkpoint of the flat ``{name: value}`` map in directory ``target`` (one process)."""
    state = {name: materialize(value) for name, value in values.items()}
    with _single_process():
        dcp.save(state, storage_writer=FileSystemWriter(target), no_dist=True)
    return sorted(os.listdir(target))


@contextmanager
def _single_process():
    """DCP warns that it assumes a single process when no group exists; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
