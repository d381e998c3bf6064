"""``torch.save`` files in and out, unpickled only with ``torch.load(weights_only=True)``.

A ``.pt`` file is a pickle, and unpickling runs whatever code it names. PyTorch's weights-only
unpickler admits tensors, containers and a short allow-list of types; anything else (a class from
the training code, ``os.system``) is refused, and we report that as an error naming the file
rather than fall back to full unpickling. Types the caller trusts can be admitted with
``torch.serialization.add_safe_globals``. Zip-format files are memory-mapped, so converting a
large file does not first copy it into memory.
"""
from __future__ import annotations

import errno
import io
import os
import pickle
from typing import Any

import torch

from ..errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ..storage.local import open_source
from .transform import materialize
from .tree import flatten_tree
from .unpickler import nesting_problem_of
from .zip_members import check_member_crcs, looks_like_zip, refuse_compressed_members

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def read(src: str) -> dict[str, Any]:
    """``{name: tensor or plain value}`` of one file, or of every torch.save file under a directory.

    From a directory (one file per rank, as Megatron writes ``mp_rank_00/model_optim_rng.pt``),
    each name starts with the file's path relative to it, without suffix, so that a transform spec
    can fuse the per-rank slices: ``mp_rank_00/model_optim_rng.<key>``."""
    if not os.path.isdir(src):
        return flatten_tree(load_file(src), src)
    files = sorted(os.path.relpath(os.path.join(top, name), src)
                   for top, _, names in os.walk(src) for name in names if name.endswith(SUFFIXES))
    if not files:
        raise CheckpointError(f"{src} holds no torch.save files ({', '.join(SUFFIXES)})")
    out: dict[str, Any] = {}
    came_from: dict[str, str] = {}
    for rel in files:
        path = os.path.join(src, rel)
        prefix = os.path.splitext(rel)[0].replace(os.sep, "/")
        for name, value in flatten_tree(load_file(path), path, prefix).items():
            if name in out:  # (model.bin and model.pt; a.pt's b.c and a.b.pt's c): one would be lost
                raise CheckpointError(f"{came_from[name]} and {rel} under {src} both give a value named {name!r}; "
                                      "convert them apart, or rename one with a transform spec")
            out[name], came_from[name] = value, rel
    return out


def load_file(path: str) -> Any:
    """The object in a torch.save file, loaded with the weights-only unpickler."""
    if not os.path.exists(path):
        raise CheckpointError(f"no torch.save file at {path}")
    try:
        with open_source(path) as f:  # a FIFO or device in its place is refused, not waited on
            archive = looks_like_zip(f)
            f.seek(0)
            legacy = _pickle_head(f.read(2))
    except OSError as exc:
        raise CheckpointError(f"cannot read the torch.save file {path}: {exc}") from None
    if not archive and not legacy:
        raise CorruptCheckpointError(f"{path} is not a torch.save file (neither a zip archive nor a pickle of "
                                     "protocol 2 or later): it is damaged or of another format")
    refuse_compressed_members(path, path)
    problem = nesting_problem_of(path, path)
    if problem is not None:
        raise UnsafeCheckpointError(f"{path}: refused to unpickle: {problem}")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=archive)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        reason = next((line for line in lines if "unsupported" in line.lower()), lines[0])
        raise UnsafeCheckpointError(
            f"{path}: refused to unpickle, because it needs more than tensors and plain data ({reason}). "
            "statesnap never runs code from a checkpoint; if you trust the file and the type is harmless, "
            "admit it with torch.serialization.add_safe_globals([...]) and convert again") from None
    except Exception as exc:
        check_member_crcs(path, path, None)  # (damage, where that is why)
        raise CheckpointError(f"{path} is not a readable torch.save file: {type(exc).__name__}: {exc}") from None
    check_member_crcs(path, path, loaded)
    return loaded


def _pickle_head(head: bytes) -> bool:
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= pickle.HIGHEST_PROTOCOL


def is_torch_save_bytes(raw: bytes) -> bool:
    """Whether ``raw`` (a whole file) is what torch.save writes: a zip archive, or a legacy pickle."""
    return looks_like_zip(io.BytesIO(raw)) or _pickle_head(raw[:2])


def write(values: dict[str, Any], target: str) -> list[str]:
    """One torch.save file of the flat ``{name: value}`` map (it holds every tensor in memory at once)."""
    state = {name: materialize(value) for name, value in values.items()}
    try:
        # through a file of ours: torch's zip writer turns a failed write into a RuntimeError that
        # says nothing of why, while our file's OSError (a full disk) stays behind it as its context
        with open(target, "wb") as file:
            torch.save(state, file)
    except RuntimeError as exc:
        raise write_failed("torch.save", exc, target) from None
    return [target]


def write_failed(writer: str, exc: BaseException, target: str) -> OSError:
    """The ``OSError`` an export reports for ``exc``, which torch's zip writer raised as a
    ``RuntimeError`` when a write failed, so that the export names its destination in one error
    as it does for any other failed write. Where the writer wrote through a Python file, that
    file's ``OSError`` (a full disk: ``ENOSPC``, with its remedy) is the ``RuntimeError``'s
    context and gives its errno; otherwise the cause is unknown (``EIO``)."""
    cause = exc.__context__
    if isinstance(cause, OSError) and cause.errno is not None:
        return OSError(cause.errno, cause.strerror, target)
    first = str(exc).splitlines()[0] if str(exc) else ""
    return OSError(errno.EIO, f"{writer} could not write it ({type(exc).__name__}: {first})", target)
