"""statesnap: fast, safe, reshardable checkpoints for PyTorch training.

Public API (see DESIGN.md)::

    ss.save(state, path)            ss.load(state, path)
    ss.Checkpointer(root, ...)      ss.open(path)
    ss.convert(src, dst, ...)       ss.export(path, dst, to=...)
"""
from .convert import ExportInfo, convert, export
from .checkpointer import Checkpointer, CommitRecord
from .engine.load import LoadInfo, load
from .engine.save import SaveInfo, save
from .errors import (
    CheckpointError, CheckpointExistsError, ConsistencyError, CorruptCheckpointError, ManifestError,
    MissingFileError, ReshardError, StateMismatchError, UnsafeCheckpointError,
)
from .reader import Reader, open  # noqa: A004
from .state.wrappers import PerRank, Replicated, Sharded, flat_partition

__version__ = "0.1.0"

__all__ = [
    "save", "load", "open", "Reader", "SaveInfo", "LoadInfo", "convert", "export", "ExportInfo",
    "Checkpointer", "CommitRecord",
    "Sharded", "PerRank", "Replicated", "flat_partition",
    "CheckpointError", "CorruptCheckpointError", "MissingFileError", "ManifestError", "StateMismatchError",
    "CheckpointExistsError", "UnsafeCheckpointError", "ConsistencyError", "ReshardError",
]
