"""``ss.convert`` (foreign checkpoint -> statesnap) and ``ss.export`` (statesnap -> foreign format).

Both are thin pipelines over the same three steps: a source gives a flat map ``{name: tensor or
plain value}``, an optional transform spec reshapes it, a sink writes it. The statesnap side
always goes through the public ``ss.save`` and ``ss.open``, so a converted checkpoint is exactly
what a save would have produced, with its provenance in the manifest's ``meta``. Exports are
written into a staging name and renamed into place, so an interrupted export leaves nothing
that looks complete.
"""
from __future__ import annotations

import os
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator

from ..engine.save import SaveInfo, save
from ..errors import CheckpointError, CheckpointExistsError
from ..reader import Reader, TensorInfo
from ..storage.local import LocalBackend, fsync_dir
from . import dcp, deepspeed, safetensors_io, torch_save, ucp
from .transform import Lazy, apply_spec, is_tensor, load_spec, materialize

SOURCES = {"torch": torch_save.read, "dcp": dcp.read, "safetensors": safetensors_io.read, "ucp": ucp.read,
           "deepspeed": deepspeed.read}
TARGETS = ("safetensors", "torch", "dcp")


@dataclass
class ExportInfo:
    path: str
    to: str
    files: list[str]  # relative to ``path`` for directory exports
    tensors: int
    bytes: int
    seconds: float
    skipped: list[str] = field(default_factory=list)  # "name (why)" of values the format cannot hold


def detect_source(src: str) -> str:
    """The source kind of ``src`` by what it contains: DCP metadata, safetensors, else torch.save."""
    if os.path.isdir(src):
        names = os.listdir(src)
        if ucp.is_universal(src):
            return "ucp"
        if deepspeed.is_deepspeed(src):
            return "deepspeed"
        if dcp.METADATA_NAME in names:
            return "dcp"
        if any(n.endswith(safetensors_io.SUFFIX) or n == safetensors_io.INDEX_NAME for n in names):
            return "safetensors"
        return "torch"
    return "safetensors" if src.endswith((safetensors_io.SUFFIX, ".json")) else "torch"


def convert(src, dst, source: str | None = None, spec: Any = None, *, overwrite: bool = False,
            allow_pickle: bool = False, storage_options: dict | None = None) -> SaveInfo:
    """Convert the foreign checkpoint ``src`` into a statesnap checkpoint at ``dst``.

    ``source`` is ``"torch"`` (a torch.save file, or a directory of them, one per rank),
    ``"dcp"`` or ``"safetensors"`` (a file, an index json or a directory); by default it is
    detected from ``src``. ``spec`` is a transform spec (a dict or a JSON file; see
    :mod:`statesnap.convert.transform`) applied before saving."""
    src = os.fspath(src)
    source = source or detect_source(src)
    if source not in SOURCES:
        raise CheckpointError(f"unknown source {source!r} for {src}; choose one of {', '.join(SOURCES)}")
    ops = load_spec(spec)  # a bad spec fails before a large source is read
    values = apply_spec(ops, SOURCES[source](src))
    state = {name: materialize(value) for name, value in values.items()}
    meta = {"converted_from": {"source": source, "path": os.path.abspath(src), "ops": ops}}
    return save(state, dst, overwrite=overwrite, allow_pickle=allow_pickle, storage_options=storage_options,
                meta=meta)


def export(path, dst, to: str = "safetensors", *, spec: Any = None, max_shard_bytes: int | None = None,
           overwrite: bool = False, allow_pickle: bool = False, storage_options: dict | None = None) -> ExportInfo:
    """Write the statesnap checkpoint ``path`` as one consolidated foreign checkpoint at local ``dst``.

    ``to="safetensors"``: tensors only (``dst`` a ``.safetensors`` file or a directory, sharded
    by ``max_shard_bytes``), read and written one tensor at a time. ``to="torch"``: one
    torch.save file of ``{name: value}``. ``to="dcp"``: a DCP directory. Values a format cannot
    hold (plain data in safetensors, per-rank values anywhere) are listed in ``skipped``."""
    started = time.perf_counter()
    dst = os.fspath(dst)
    if to not in TARGETS:
        raise CheckpointError(f"unknown export format {to!r}; choose one of {', '.join(TARGETS)}")
    if max_shard_bytes is not None and (to != "safetensors" or max_shard_bytes <= 0):
        raise CheckpointError("max_shard_bytes must be positive and applies to safetensors exports only")
    ops = load_spec(spec)
    reader = Reader(path, storage_options=storage_options, allow_pickle=allow_pickle)
    values, skipped = checkpoint_values(reader)
    values = apply_spec(ops, values)
    if to == "safetensors":
        skipped += [f"{name} (safetensors holds tensors only)" for name, v in values.items() if not is_tensor(v)]
    single_file = to == "torch" or dst.endswith(safetensors_io.SUFFIX)
    with _staged(dst, overwrite, single_file) as target:
        if to == "safetensors":
            files = safetensors_io.write(values, target, max_shard_bytes)
        else:
            files = (torch_save.write if to == "torch" else dcp.write)(values, target)
    tensors = [v for v in values.values() if is_tensor(v)]
    nbytes = sum(safetensors_io.tensor_bytes(v) for v in tensors)
    return ExportInfo(dst, to, [dst] if single_file else files, len(tensors), nbytes,
                      time.perf_counter() - started, skipped)


def checkpoint_values(reader: Reader) -> tuple[dict[str, Any], list[str]]:
    """``{name: Lazy tensor or plain value}`` of a statesnap checkpoint, and the names left out."""
    values: dict[str, Any] = {}
    skipped = []
    for name in reader.keys():
        info = reader.info(name)
        if isinstance(info, TensorInfo):
            values[name] = Lazy(info.dtype, tuple(info.shape), partial(reader.read, name))
        elif info.kind == "per_rank":
            skipped.append(f"{name} (per-rank value: one per saving rank, no consolidated form)")
        elif info.kind == "pickle" and not reader.allow_pickle:
            skipped.append(f"{name} (pickled; pass allow_pickle=True if you trust the checkpoint)")
        else:
            values[name] = reader.read(name)
    return values, skipped


@contextmanager
def _staged(dst: str, overwrite: bool, single_file: bool) -> Iterator[str]:
    """Yield where to write (a file or a directory in a staging directory next to ``dst``), then
    make every byte durable and move it to ``dst`` in one rename."""
    if os.path.exists(dst) and not overwrite:
        raise CheckpointExistsError(f"{dst} already exists; pass overwrite=True to replace it")
    backend = LocalBackend()
    staging = backend.begin(dst, uuid.uuid4().hex[:12])
    target = os.path.join(staging, os.path.basename(dst)) if single_file else staging
    try:
        yield target
        _fsync_tree(staging)
        if single_file:
            os.replace(target, dst)
            fsync_dir(os.path.dirname(os.path.abspath(dst)))
        else:
            backend.commit(staging, dst, overwrite, durable=True)
    finally:
        if os.path.exists(staging):
            backend.abort(staging, dst)


def _fsync_tree(root: str) -> None:
    for top, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(top, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(top)
