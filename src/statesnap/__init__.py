"""statesnap: fast, safe, reshardable checkpoints for PyTorch training.

Public API (see DESIGN.md)::

    ss.save(state, path)            ss.load(state, path)
    ss.Checkpointer(root, ...)      ss.open(path)
    ss.convert(src, dst, ...)       ss.export(path, dst, to=...)

The names are imported on first use (PEP 562): ``import statesnap`` and ``statesnap --help`` stay
quick, and the heavy modules (torch, DCP, DTensor, safetensors, the converters) load only when a
name that needs them is touched.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_WHERE = {
    "save": "engine.save", "SaveInfo": "engine.save", "load": "engine.load", "LoadInfo": "engine.load",
    "open": "reader", "Reader": "reader",
    "convert": "convert", "export": "convert", "ExportInfo": "convert",
    "Checkpointer": "checkpointer", "CommitRecord": "checkpointer",
    "Sharded": "state.wrappers", "PerRank": "state.wrappers", "Replicated": "state.wrappers",
    "flat_partition": "state.wrappers",
    **{name: "errors" for name in (
        "CheckpointError", "CorruptCheckpointError", "MissingFileError", "ManifestError", "StateMismatchError",
        "CheckpointExistsError", "UnsafeCheckpointError", "ConsistencyError", "ReshardError",
        "NotInCheckpointError", "ReadFailedError", "NotACheckpointError", "RegionOutOfRangeError",
        "NotDurableYetError")},
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'statesnap' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


class _Package(types.ModuleType):
    """``ss.convert`` is the function although ``statesnap.convert`` is also a subpackage: importing
    a submodule sets it as an attribute of its parent, which would replace the function whenever
    the subpackage is imported (``from statesnap.convert import ...``) before ``ss.convert`` is
    first used. The subpackage stays reachable where imports look, in ``sys.modules``."""

    def __setattr__(self, name: str, value) -> None:
        if name == "convert" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .checkpointer import Checkpointer, CommitRecord
    from .convert import ExportInfo, convert, export
    from .engine.load import LoadInfo, load
    from .engine.save import SaveInfo, save
    from .errors import (
        CheckpointError, CheckpointExistsError, ConsistencyError, CorruptCheckpointError, ManifestError,
        MissingFileError, NotACheckpointError, NotDurableYetError, NotInCheckpointError, ReadFailedError,
        RegionOutOfRangeError, ReshardError, StateMismatchError, UnsafeCheckpointError,
    )
    from .reader import Reader, open  # noqa: A004
    from .state.wrappers import PerRank, Replicated, Sharded, flat_partition
