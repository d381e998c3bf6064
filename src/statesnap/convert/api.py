"""``ss.convert`` (foreign checkpoint -> statesnap) and ``ss.export`` (statesnap -> foreign format).

Both are thin pipelines over the same three steps: a source gives a flat map ``{name: tensor,
Lazy tensor or plain value}``, an optional transform spec reshapes it, a sink writes it one
tensor at a time. The statesnap side is written with the save engine's own plan, encoding,
checksums and commit (``convert/writer.py``) and read through ``ss.open``, so a converted
checkpoint is exactly what a save would have produced, with its provenance in the manifest's
``meta``. Exports are written into a staging name and renamed into place, so an interrupted
export leaves nothing that looks complete.
"""
from __future__ import annotations

import os
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

from ..engine.save import SaveInfo
from ..errors import CheckpointError, CheckpointExistsError, explained, printable, remedy
from ..format.manifest import MANIFEST_NAME
from ..progress import bar
from ..reader import Reader, TensorInfo
from ..storage import is_url, normalize, place_of
from ..storage.local import LocalBackend, fsync_dir
from . import dcp, deepspeed, megatron, safetensors_io, torch_save, ucp
from .transform import Lazy, apply_spec, is_tensor, load_spec, materialize
from .tree import refuse_unread
from .writer import write_checkpoint

SOURCES = {"torch": torch_save.read, "dcp": dcp.read, "safetensors": safetensors_io.read, "ucp": ucp.read,
           "deepspeed": deepspeed.read, "megatron": megatron.read}
TARGETS = ("safetensors", "torch", "dcp")
IN_PLACE_SOURCES = ("safetensors",)  # sources whose tensors convert(copy=False) can link (writer.InFile)
NOTING_SOURCES = ("deepspeed", "megatron")  # sources whose read(src, notes) merges replicas by a derived spec


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
    """The source kind of ``src`` by what it contains: DeepSpeed (universal, then native) and
    Megatron layouts first, as they are built from DCP and torch.save files; then DCP metadata,
    safetensors, else torch.save."""
    if os.path.isdir(src):
        names = os.listdir(src)
        if ucp.is_universal(src):
            return "ucp"
        if deepspeed.is_deepspeed(src):
            return "deepspeed"
        if megatron.is_megatron(src):  # before DCP: a dist_checkpointing directory is a DCP one plus common.pt
            return "megatron"
        if dcp.METADATA_NAME in names:
            return "dcp"
        if any(n.endswith(safetensors_io.SUFFIX) or n == safetensors_io.INDEX_NAME for n in names):
            return "safetensors"
        if MANIFEST_NAME in names:  # (read as torch.save files, its data files were "not a torch.save file")
            raise CheckpointError(f"{src} is a statesnap checkpoint already (it holds {MANIFEST_NAME}): load it with "
                                  "ss.load, or ss.export it to another format")
        return "torch"
    return "safetensors" if src.endswith((safetensors_io.SUFFIX, ".json")) else "torch"


def convert(src, dst, source: str | None = None, spec: Any = None, *, overwrite: bool = False,
            allow_pickle: bool = False, storage_options: dict | None = None, copy: bool = True,
            progress: bool | None = None) -> SaveInfo:
    """Convert the foreign checkpoint ``src`` into a statesnap checkpoint at ``dst``.

    ``source`` is one of :data:`SOURCES` (``"torch"``: a torch.save file, or a directory of
    them, one per rank; ``"dcp"``; ``"safetensors"``: a file, an index json or a directory; ...);
    by default it is detected from ``src``. ``spec`` is a transform spec (a dict or a JSON file;
    see :mod:`statesnap.convert.transform`) applied before saving. The checkpoint is written one
    tensor at a time (see :mod:`statesnap.convert.writer`), so a source larger than memory
    converts. ``copy=False`` (safetensors) makes the checkpoint's data files links to the
    source's files instead of copies. ``progress``: a bar on stderr (default: on a terminal).
    What the conversion noticed without refusing (replicas that drifted) is in ``.notes``."""
    src = os.fspath(src)
    _refuse_overlap(src, os.fspath(dst), "convert")
    source = source or detect_source(src)
    if source not in SOURCES:
        raise CheckpointError(f"unknown source {source!r} for {src}; choose one of {', '.join(SOURCES)}")
    if not copy and source not in IN_PLACE_SOURCES:
        raise CheckpointError(f"copy=False links the source's files into the checkpoint, which needs tensors stored "
                              f"raw in them ({', '.join(IN_PLACE_SOURCES)}); a {source!r} source is decoded, "
                              "so it is copied: use copy=True")
    ops = load_spec(spec)  # a bad spec fails before a large source is read
    notes: list[str] = []
    read = SOURCES[source]
    values = apply_spec(ops, read(src, notes) if source in NOTING_SOURCES else read(src), notes=notes)
    refuse_unread(values)
    meta = {"converted_from": {"source": source, "path": os.path.abspath(src), "ops": ops}}
    try:
        info = write_checkpoint(values, dst, meta=meta, overwrite=overwrite, allow_pickle=allow_pickle,
                                storage_options=storage_options, copy=copy, progress=progress)
    except CheckpointError as exc:  # (a value that fails as it is written names itself, not its source)
        if exc.args and isinstance(exc.args[0], str) and src not in exc.args[0]:
            exc.args = (printable(f"converting {src}: {exc.args[0]}"), *exc.args[1:])
        raise
    info.notes = notes  # filled while the values were read
    return info


def export(path, dst, to: str = "safetensors", *, spec: Any = None, max_shard_bytes: int | None = None,
           overwrite: bool = False, allow_pickle: bool = False, storage_options: dict | None = None,
           progress: bool | None = None) -> ExportInfo:
    """Write the statesnap checkpoint ``path`` as one consolidated foreign checkpoint at local ``dst``.

    ``to="safetensors"``: tensors only (``dst`` a ``.safetensors`` file or a directory, sharded
    by ``max_shard_bytes``), read and written one tensor at a time. ``to="torch"``: one
    torch.save file of ``{name: value}``. ``to="dcp"``: a DCP directory. Values a format cannot
    hold (plain data in safetensors, per-rank values anywhere) are listed in ``skipped``.
    ``dst`` may be an existing empty directory (as ``save_pretrained`` allows); anything else
    already there needs ``overwrite=True``. ``progress``: a bar on stderr (default: on a terminal)."""
    started = time.perf_counter()
    dst = normalize(os.fspath(dst))  # (a file:// URL is the local path it names)
    if is_url(dst):
        raise CheckpointError(f"exports go to local paths, not {dst}: export to a local path and copy it there "
                              "(the checkpoint exported may itself be at a URL)")
    if to not in TARGETS:
        raise CheckpointError(f"unknown export format {to!r}; choose one of {', '.join(TARGETS)}")
    _refuse_overlap(os.fspath(path), dst, "export")
    if max_shard_bytes is not None and (to != "safetensors" or max_shard_bytes <= 0):
        raise CheckpointError("max_shard_bytes must be positive and applies to safetensors exports only")
    ops = load_spec(spec)
    reader = Reader(path, storage_options=storage_options, allow_pickle=allow_pickle)
    values, skipped = checkpoint_values(reader)
    values = apply_spec(ops, values)
    if to == "safetensors":
        skipped += [f"{name} (safetensors holds tensors only)" for name, v in values.items() if not is_tensor(v)]
        unnamed = [name for name, v in values.items() if is_tensor(v) and not _utf8(name)]
        skipped += [f"{name} (safetensors names are UTF-8; this one holds a lone surrogate)" for name in unnamed]
        untyped = [name for name, v in values.items() if is_tensor(v) and v.dtype not in safetensors_io.DTYPE_NAMES]
        skipped += [f"{name} (safetensors has no dtype {str(values[name].dtype)[6:]}; export to torch or dcp)"
                    for name in untyped]
        unnamed += untyped
        if is_tensor(values.get(safetensors_io.METADATA)):
            unnamed.append(safetensors_io.METADATA)
            skipped.append(f"{safetensors_io.METADATA} (the name safetensors keeps for its header's metadata; "
                           "rename the tensor with a transform spec to export it)")
        values = {name: v for name, v in values.items() if name not in unnamed}
    for loses, why in _LOST.get(to, ()):
        lost = [name for name, v in values.items() if loses(v)]
        skipped += [f"{name} ({why})" for name in lost]
        values = {name: v for name, v in values.items() if name not in lost}
    single_file = to == "torch" or dst.endswith(safetensors_io.SUFFIX)
    tensors = [v for v in values.values() if is_tensor(v)]
    nbytes = sum(safetensors_io.tensor_bytes(v) for v in tensors)
    if single_file and max_shard_bytes is not None and nbytes > max_shard_bytes and len(tensors) > 1:
        raise CheckpointError(f"{dst} is one file, and max_shard_bytes={max_shard_bytes} splits these {nbytes} "
                              "bytes into shards: export to a directory (a name without .safetensors) to shard, "
                              "or leave max_shard_bytes out")
    with _staged(dst, overwrite, single_file) as target, bar(nbytes, f"export -> {os.path.basename(dst)}",
                                                             progress) as advance:
        values = {name: _counted(v, advance) if is_tensor(v) else v for name, v in values.items()}
        if to == "safetensors":
            files = safetensors_io.write(values, target, max_shard_bytes)
        else:
            files = (torch_save.write if to == "torch" else dcp.write)(values, target)
    return ExportInfo(dst, to, [dst] if single_file else files, len(tensors), nbytes,
                      time.perf_counter() - started, skipped)


def _refuse_overlap(src: str, dst: str, verb: str) -> None:
    """Refuse a ``dst`` that is ``src``, lies inside it or holds it: the write would change what
    is being read, and with overwrite=True replace it (an export onto its own checkpoint, or
    onto the directory holding it, deleted the checkpoint)."""
    if is_url(src) or is_url(dst):
        return
    read, written = place_of(src), place_of(dst)
    if read == written or written.startswith(read + os.sep) or read.startswith(written + os.sep):
        raise CheckpointError(f"cannot {verb} {src} to {dst}: the destination is the source, lies inside it or "
                              "holds it, so writing it would change or replace what is being read; choose a "
                              "destination apart from the source")


def _utf8(name: str) -> bool:
    """Whether ``name`` is text UTF-8 can write (a name from ``os.fsdecode`` may hold a lone
    surrogate, which statesnap's manifest keeps and a safetensors header cannot)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _holds(value: Any, lost: Callable[[Any], bool]) -> bool:
    """Whether ``value`` is, or holds at any depth (dict keys included), a value ``lost`` names."""
    if lost(value):
        return True
    if isinstance(value, dict):
        return any(_holds(v, lost) for v in (*value.keys(), *value.values()))
    return isinstance(value, (list, tuple)) and any(_holds(v, lost) for v in value)


def _keys_made_strings(value: Any) -> bool:
    """Whether DCP's flattening reaches a dict with a key that is not a string in ``value``: it
    goes down through dicts and lists only."""
    if isinstance(value, dict):
        return any(type(key) is not str for key in value) or any(map(_keys_made_strings, value.values()))
    return isinstance(value, list) and any(map(_keys_made_strings, value))


# Plain values an export format cannot give back, by format: DCP's flattening drops empty dicts
# ({} is lost, [{}, t] comes back as [None, t], or fails), and names the items of every dict it
# walks (through dicts and lists) by ``str(key)`` (``[{1: "a"}]`` came back ``[{"1": "a"}]``; it keeps
# a tuple whole, and what is in it). torch.save pickles b"" as a call of ``bytes``, which
# torch.load(weights_only=True) refuses: one such value anywhere in the file and the whole file no
# longer loads as the export promises.
_LOST = {"dcp": ((lambda v: _holds(v, lambda x: isinstance(x, dict) and not x), "DCP drops empty dicts"),
                 (_keys_made_strings, "DCP turns its dict keys that are not strings into strings; "
                                      "export to torch to keep them")),
         "torch": ((lambda v: _holds(v, lambda x: isinstance(x, bytes) and not x),
                    "holds b'', which torch.load(weights_only=True) refuses"),)}


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


def _counted(value: Any, advance: Callable[[int], None]) -> Lazy:
    """``value`` as a Lazy tensor that moves the progress bar by its bytes once it is read."""
    def read():
        tensor = materialize(value)
        advance(safetensors_io.tensor_bytes(value))
        return tensor

    return Lazy(value.dtype, tuple(value.shape), read)


@contextmanager
def _staged(dst: str, overwrite: bool, single_file: bool) -> Iterator[str]:
    """Yield where to write (a file or a directory in a staging directory next to ``dst``), then
    make every byte durable and move it to ``dst`` in one rename.

    An existing empty directory is where a user meant the export to go (``mkdir out`` first, as
    with ``save_pretrained``): it is removed just before the rename, which fails if anything has
    appeared in it meanwhile, so nothing the user put there is ever replaced without ``overwrite``."""
    if single_file and os.path.isdir(dst):  # overwrite=True replaces a file, never a whole directory with one
        raise CheckpointExistsError(f"{dst} is a directory, and this export writes one file; overwrite=True does "
                                    "not replace a directory with a file: export to a file name (inside it, or "
                                    "elsewhere), or remove it")
    into_empty = not single_file and not overwrite and os.path.isdir(dst) and not os.listdir(dst)
    if os.path.exists(dst) and not overwrite and not into_empty:
        raise CheckpointExistsError(f"{dst} already exists and is not an empty directory; "
                                    "pass overwrite=True to replace it")
    backend = LocalBackend()
    try:
        staging = backend.begin(dst, uuid.uuid4().hex[:12])
    except OSError as exc:
        raise CheckpointError(f"cannot export to {dst}: {explained(exc)}") from None
    target = os.path.join(staging, os.path.basename(dst)) if single_file else staging
    try:
        yield target
        _fsync_tree(staging)
        _put_in_place(backend, staging, target, dst, single_file, into_empty, overwrite)
    except OSError as exc:  # the disk is full (ENOSPC, or EFBIG past a file size limit), an I/O error, ...
        raise CheckpointError(f"exporting to {dst} failed, and nothing was put there: {exc.strerror or exc}"
                              f"{remedy(exc)}") from None
    finally:
        if os.path.exists(staging):
            backend.abort(staging, dst)


def _put_in_place(backend: LocalBackend, staging: str, target: str, dst: str, single_file: bool, into_empty: bool,
                  overwrite: bool) -> None:
    """Rename the durable export at ``target`` (in ``staging``) to ``dst``."""
    if single_file:
        os.replace(target, dst)
        fsync_dir(os.path.dirname(os.path.abspath(dst)))
        return
    if into_empty:
        try:
            os.rmdir(dst)
        except FileNotFoundError:
            pass
        except OSError:
            raise CheckpointExistsError(f"{dst} was filled while exporting; not replacing it") from None
    backend.commit(staging, dst, overwrite, durable=True)


def _fsync_tree(root: str) -> None:
    for top, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(top, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(top)
