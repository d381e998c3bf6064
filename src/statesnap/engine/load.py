"""Blocking load: match the target state against the manifest, plan reads, fill tensors in place.

Loading is resharding: every target item says which part of which logical tensor it wants, and
the planner finds the stored bytes for exactly that part, whatever layout wrote them.
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Container

import numpy as np
import torch

from ..collector import collector_paused
from ..errors import (CheckpointError, CorruptCheckpointError, ManifestError, MissingFileError, NotACheckpointError,
                      ReadFailedError, StateMismatchError, refuse_bad_settings, refuse_non_switches)
from ..format.checksum import checksum_whole
from ..format.manifest import MANIFEST_NAME, Manifest, ObjectEntry, TensorEntry
from ..plan.load_plan import TargetPlan, piece_offsets, plan_target
from ..progress import bar, wanted as wanted_bar
from ..state.flatten import StoredNames, flatten_for_load
from ..state.items import Flattened
from ..state.optim_state import restore_emptied
from ..storage import LocalBackend, backend_for, normalize, path_text
from ..storage.base import StorageBackend
from .buffers import borrowed_byte_view, host_contiguous, memory_in_order
from .device_load import fill_device_targets, wave_parts
from .dist import DEFAULT_TIMEOUT_S, Comm
from .objects import Mismatch, castable, decode_value, fitted_to_held
from .overlaps import aliases_filled, overlapping_pairs, overwritten, same_view, tie_error
from .read import ReadExecutor, open_data_file
from .shared import plan_shared_reads, should_share

MAX_LISTED = 20


@dataclass
class LoadInfo:
    path: str
    bytes: int
    seconds: float
    # What a load with strict=False left as it was (a strict load raises instead): the names the
    # checkpoint lacks, and those it holds with another shape or dtype (also warned of).
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


def read_manifest(backend: StorageBackend, path: str) -> Manifest:
    where = backend.join(path, MANIFEST_NAME)
    try:
        raw = backend.read_bytes(where)
    except MemoryError:  # (a manifest of gigabytes: damaged, or not statesnap's)
        raise ManifestError(f"the manifest {where} is too large to read into this process's memory") from None
    except IsADirectoryError:  # a directory where the manifest was: damage, as a FIFO there is
        raise CorruptCheckpointError(f"{where} is a directory, not the regular file a checkpoint holds there") from None
    except (FileNotFoundError, NotADirectoryError):
        if backend.recover(path):  # an overwrite killed halfway had left the checkpoint aside
            return read_manifest(backend, path)
        if not backend.exists(path):
            raise CheckpointError(f"no checkpoint at {path}") from None
        if os.path.basename(path) == MANIFEST_NAME:
            raise NotACheckpointError(f"{path} is a checkpoint's manifest, not the checkpoint: name its directory, "
                                      f"{os.path.dirname(path) or '.'}, instead") from None
        raise NotACheckpointError(f"{path} has no {MANIFEST_NAME}: it is not a committed statesnap checkpoint "
                                  f"({_what_else(backend, path)})") from None
    except OSError as exc:  # no permission, an I/O error: the file may be intact
        raise ReadFailedError(f"the manifest {where} cannot be read: {exc}") from None
    return Manifest.from_bytes(raw, where=where, fetch=section_fetcher(backend, path))


def section_fetcher(backend: StorageBackend, path: str):
    """``fetch(name, offset, nbytes)``: a byte range of a split manifest's section file (a load
    reads only the parts of the tensors it needs, format/split.py)."""
    def fetch(name: str, offset: int, nbytes: int) -> bytes:
        try:
            reader = backend.open_read(backend.join(path, name))
        except FileNotFoundError:
            raise MissingFileError(f"manifest section {name} of {path} is missing") from None
        try:
            return read_at_most(reader, offset, nbytes)
        finally:
            reader.close()
    return fetch


def read_at_most(reader, offset: int, nbytes: int) -> bytes:
    """Up to ``nbytes`` from ``offset``: fewer where the file ends first. The buffer is sized by
    what the file holds, never by the manifest's word alone: a damaged or hostile size of 2**50
    would otherwise be allocated before the first byte is read."""
    buf = bytearray(max(0, min(nbytes, reader.size() - offset)))
    got = reader.readinto(offset, [memoryview(buf)]) if buf else 0
    return bytes(buf[:got])


def _what_else(backend: StorageBackend, path: str) -> str:
    """What a path without a manifest probably is, and what to do about it."""
    try:
        names = backend.listdir(path)
    except OSError:  # a file: statesnap checkpoints are directories
        names = None
    convert = f"convert it with ss.convert({path!r}, DST) or `statesnap convert`"
    from ..integrations.pointers import POINTER_NAME  # (light: no trainer is imported)
    pointer = path if names is None else backend.join(path, POINTER_NAME) if POINTER_NAME in names else None
    pointed = _pointed_checkpoint(backend, pointer) if pointer is not None else None
    if pointed is not None:  # (named from the directory above ``path``: beside a .ckpt file, or a checkpoint-N)
        return (f"{'it' if pointer == path else pointer} is a pointer a trainer's statesnap integration wrote; "
                f"the checkpoint it names is {backend.join(path.rstrip('/').rpartition('/')[0] or '.', pointed)}")
    if names is None:
        return f"it is a file, perhaps a torch.save or safetensors one: {convert}"
    from ..checkpointer.levels import STEP_PREFIX, parse_step  # (here: the checkpointer package imports this module)
    steps = sorted(step for step in map(parse_step, names) if step is not None)
    if steps:  # (only names the Checkpointer writes, as load_latest reads them)
        newest = backend.join(path, f"{STEP_PREFIX}{steps[-1]}")
        return (f"it holds {len(steps)} step-N checkpoint(s), as a Checkpointer's root does: name one, "
                f"{newest} the newest, or restore the newest with Checkpointer({path!r}).load_latest(state)")
    if ".metadata" in names:
        return f"it looks like a PyTorch DCP checkpoint: {convert}"
    if any(name.endswith(".safetensors") for name in names):
        return f"it holds safetensors files: {convert}"
    return "an interrupted save leaves none; load an earlier checkpoint"


def _pointed_checkpoint(backend: StorageBackend, pointer: str) -> str | None:
    """The relative path that the file ``pointer`` names, if it is a statesnap pointer (one that
    Lightning's or the Hugging Face Trainer's integration wrote), else None."""
    from ..integrations.pointers import POINTER_MAX_BYTES, pointed_checkpoint

    try:
        reader = backend.open_read(pointer)
        try:
            relative = pointed_checkpoint(read_at_most(reader, 0, POINTER_MAX_BYTES))
        finally:
            reader.close()
    except (OSError, CheckpointError):
        return None
    return relative


def blob_reader(backend: StorageBackend, path: str, manifest: Manifest):
    """A function that reads and verifies a pickled object's bytes."""
    def read(fqn: str, ref: list) -> bytes:
        file, offset, nbytes, checksum = ref
        reader = open_data_file(backend, path, manifest.files[file], f"object {fqn!r}")
        try:
            try:
                data = read_at_most(reader, offset, nbytes)
            except MemoryError:  # (its size is the manifest's word: damage or a forgery may make it any)
                raise CheckpointError(f"object {fqn!r} in {manifest.files[file]} of {path} is {nbytes:,} bytes "
                                      "according to the manifest, too many to read into this process's memory") from None
            if len(data) != nbytes or checksum_whole(memoryview(data)) != checksum:
                raise CorruptCheckpointError(f"object {fqn!r} in {manifest.files[file]} of {path} is damaged" +
                                             (f" (the file ends before its byte {offset + nbytes})"
                                              if len(data) != nbytes else ""))
            return data
        finally:
            reader.close()
    return read


def zero_unfilled(created: list[torch.Tensor], only: list[torch.Tensor] | None = None) -> None:
    """Zero the tensors of ``created`` (fresh optimizer state made with ``torch.empty``) that the
    load does not fill: those sharing memory with ``only``, or all of them."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's local shard
    pointers = None if only is None else {t.data_ptr() for t in only if t.numel()}
    with torch.no_grad():
        for tensor in created:
            if pointers is None or local(tensor).data_ptr() in pointers:
                local(tensor).zero_()


def _format_list(title: str, names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return f"{title} ({len(names)}): {shown}{more}"


CAST_HINT = " Pass cast=True to convert between floating dtypes."


def in_part(name: str, part: str) -> bool:
    """Whether the stored ``name`` is the state's top-level ``part`` or lies under it."""
    return name == part or name.startswith(part + ".")


def parts_lacking(stored: list[str], parts: list[str]) -> list[str]:
    """The top-level ``parts`` of a state that a checkpoint of the names ``stored`` holds nothing of
    (saved without them: an optimizer, a model-only export)."""
    return [part for part in parts if not any(in_part(name, part) for name in stored)]


def _match(flat: Flattened, manifest: Manifest, comm: Comm, strict: bool, path: str, cast: bool,
           top: list[str], partial: bool) -> tuple[list[str], list[str], list[str]]:
    """Check the target against the checkpoint; return the names to skip: those it lacks
    (non-strict), those it holds with another shape or dtype, which are warned of (PyTorch's and
    DCP's own non-strict loads refuse them; skipped without a word, a model cast to bf16 loaded
    nothing of an fp32 checkpoint and trained on from its random values). ``top``: the state's
    top-level names. ``partial``: what the checkpoint holds outside them is not unexpected, but
    what it holds under them is (a model of fewer layers loads no part of a deeper one). Third,
    the names the checkpoint lacks that are filled all the same: the tensor is the very one of
    another name it holds (a tied weight stored once, as Hugging Face's save_pretrained stores
    ``lm_head.weight``), so neither missing nor read."""
    missing, mismatched, precision_only = mismatches(flat, manifest.header, manifest.objects, cast)
    aliases = aliases_filled(flat.tensors, missing, {*missing, *(m.name for m in mismatched)})
    missing = [name for name in missing if name not in aliases]
    unexpected = []
    if strict:
        # what no rank loads: one flag per stored name from each rank, never every rank's names
        keys, mine = list(manifest.keys()), {i.fqn for i in flat.tensors} | {o.fqn for o in flat.objects}
        loaded = [k in mine or (partial and not any(in_part(k, p) for p in top)) for k in keys]
        unexpected = [k for k, wanted in zip(keys, comm.any_of(loaded)) if not wanted]
    return missing, settle_mismatches(path, strict, missing, unexpected, mismatched, precision_only, top, partial,
                                      stacklevel=7), sorted(aliases)  # (at ss.load's caller)


def settle_mismatches(path: str, strict: bool, missing: list[str], unexpected: list[str], mismatched: list[str],
                      precision_only: bool, top: list[str], partial: bool, stacklevel: int) -> list[str]:
    """Raise a strict load's mismatches; warn of a non-strict one's ``mismatched`` (each name with
    what it holds and what is stored), whose names are returned: they are left as they were."""
    if strict and (missing or mismatched or unexpected):
        raise mismatch_error(f"checkpoint {path}", missing, unexpected, mismatched, precision_only, top, partial)
    if mismatched:
        warnings.warn(f"strict=False left what checkpoint {path} holds with another shape or dtype as it was: "
                      + _format_list("shape/dtype mismatch", sorted(mismatched)) + "."
                      + (CAST_HINT if precision_only else ""), stacklevel=stacklevel)
    return [m.name for m in mismatched]


def mismatches(flat: Flattened, header: Callable[[str], Any], stored_objects: Container[str],
               cast: bool) -> tuple[list[str], list[str], bool]:
    """(missing, mismatched, precision_only): the target's names the checkpoint lacks, those
    stored with another shape or dtype (or as a plain value where the target holds a tensor, or
    the other way round), each with both, and whether some differ in floating precision alone
    (which ``cast`` would convert). ``header(fqn)``: the stored tensor's entry (its ``shape``
    and ``dtype``), or None; ``stored_objects``: the names of the stored plain values."""
    missing, mismatched, precision_only = [], [], False
    for item in flat.tensors:
        entry = header(item.fqn)
        if entry is None:
            if item.fqn in stored_objects:
                mismatched.append(Mismatch(item.fqn, "checkpoint a plain value, target a tensor "
                                           f"{str(item.dtype)[6:]}{list(item.global_shape)}"))
            else:
                missing.append(item.fqn)
            continue
        same_shape, same_dtype = entry.shape == item.global_shape, entry.dtype == item.dtype
        convertible = not same_dtype and castable(entry.dtype, item.dtype)
        precision_only = precision_only or (same_shape and convertible and not cast)
        if not same_shape or not (same_dtype or (cast and convertible)):
            why = (" (cast=True converts between floating dtypes only)"
                   if cast and same_shape and not same_dtype else "")
            mismatched.append(Mismatch(item.fqn, f"checkpoint {str(entry.dtype)[6:]}{list(entry.shape)}, "
                                       f"target {str(item.dtype)[6:]}{list(item.global_shape)}", why))
    for obj in flat.objects:
        if obj.fqn in stored_objects:
            continue
        entry = header(obj.fqn)
        if entry is None:
            missing.append(obj.fqn)
        else:
            mismatched.append(Mismatch(obj.fqn, f"checkpoint a tensor {str(entry.dtype)[6:]}{list(entry.shape)}, "
                                       f"target a {type(obj.value).__name__}"))
    return missing, mismatched, precision_only


def mismatch_error(where: str, missing: list[str], unexpected: list[str], mismatched: list[str],
                   precision_only: bool, top: list[str], partial: bool) -> StateMismatchError:
    """The error of a strict load whose target does not match ``where`` (what ``mismatches``
    found, and the stored names no part of the target takes)."""
    listed = [_format_list(t, sorted(n)) for t, n in
              (("missing in checkpoint", missing), ("unexpected in checkpoint", unexpected),
               ("shape/dtype mismatch", mismatched)) if n]
    hint = CAST_HINT if precision_only else ""
    only_outside = not partial and top and not missing and not mismatched and \
        not any(in_part(name, key) for name in unexpected for key in top)
    return StateMismatchError(f"state does not match {where}: " + "; ".join(listed) + ".",
                              missing, unexpected, mismatched, advice=_match_advice(top, only_outside) + hint)


def _match_advice(top: list[str], only_outside: bool) -> str:
    """``only_outside``: all the checkpoint has beyond the state lies outside the state's keys, so
    the state is a part of it (the model of a model + optimizer checkpoint)."""
    if only_outside:
        return (f"Pass partial=True to load only what lies under the state's keys ({', '.join(top)}), "
                "or strict=False to load only what matches.")
    return "Pass strict=False to load only what matches."


def fill_tensors(flat: Flattened, manifest: Manifest, backend: StorageBackend, path: str, skip: set[str],
                 verify: bool, threads: int | None, strict: bool, received: set[int] = frozenset(),
                 progress: bool | None = False) -> int:
    """Read every item not in ``skip`` (by name) or ``received`` (by index: another rank sends it),
    with a progress bar as ``progress`` asks (see statesnap/progress.py)."""
    wanted = [item for index, item in enumerate(flat.tensors) if item.fqn not in skip and index not in received]
    total = sum(item.local.numel() * manifest.header(item.fqn).dtype.itemsize for item in wanted) if wanted_bar(
        progress) else 0  # (a bar's total only: asked for each tensor, it cost a load of many a millisecond)
    with bar(total, f"load <- {os.path.basename(path.rstrip('/'))}", progress) as advance:
        return _fill_wanted(wanted, manifest, backend, path, verify, threads, strict, advance)


def _fill_wanted(wanted: list, manifest: Manifest, backend: StorageBackend, path: str, verify: bool,
                 threads: int | None, strict: bool, advance: Callable[[int], None]) -> int:
    # The bytes go in behind autograd's back: counted as the in-place change they are, so that a
    # backward through values saved before the load fails loudly and caches keyed on tensor
    # versions (integrations/lightning.py's) see the change. Before the first byte too: a
    # Checkpointer's snapshot of these tensors still being copied checks their counters after
    # each copy and before it commits, and one that looked while the load was writing committed
    # a mix of both states.
    targets = [item.local for item in wanted]
    torch.autograd.graph.increment_version(targets)
    try:
        return _read_into(wanted, manifest, backend, path, verify, threads, strict, advance)
    finally:
        torch.autograd.graph.increment_version(targets)


def _read_into(wanted: list, manifest: Manifest, backend: StorageBackend, path: str, verify: bool,
               threads: int | None, strict: bool, advance: Callable[[int], None]) -> int:
    executor = ReadExecutor(backend, path, manifest, verify, threads, advance)
    # (a split manifest's sections are fetched here, outside the pause below)
    entries = [manifest.tensor_part(item.fqn, item.layout, item.start, item.size) for item in wanted]
    with collector_paused():  # planning the reads of many tensors makes no garbage (statesnap/collector.py)
        on_device, indirect, casts = _plan_reads(wanted, entries, executor, path, strict)
    copy_back = []
    for fqn, entry, local, plan in indirect:  # strided (or other devices') targets: through a host copy
        buffer = host_contiguous(local)
        copy_back.append((local, buffer))
        executor.add(fqn, entry, buffer, plan)
    executor.run()
    with torch.no_grad():
        for local, buffer in copy_back:
            local.copy_(buffer)
    nbytes = executor.bytes_read + fill_device_targets(
        on_device, lambda: ReadExecutor(backend, path, manifest, verify, threads, advance))
    return nbytes + sum(_fill_cast(backend, path, manifest, verify, threads, advance, *cast) for cast in casts)


def _plan_reads(wanted: list, entries: list, executor: ReadExecutor, path: str, strict: bool) -> tuple:
    """Give ``executor`` the reads of the contiguous CPU targets; return, as (fqn, entry, target,
    plan), the GPU targets (filled in waves, device_load.py), the targets to fill through a host
    copy, and those of another dtype."""
    on_device, indirect, casts = [], [], []
    for item, entry in zip(wanted, entries):
        local = item.local
        if local.dtype == entry.dtype and _plain_host(local):
            offsets = piece_offsets(entry, item.layout, item.start, item.size)
            if offsets is not None:  # (the commonest, planned at once)
                executor.add_pieces(item.fqn, entry, local, borrowed_byte_view(local), offsets)
                continue
        plan = plan_target(entry, item.layout, item.start, item.size)
        if plan.covered != item.local.numel() and strict:
            raise CorruptCheckpointError(f"{item.fqn}: the checkpoint {path} stores only {plan.covered} of the "
                                         f"{item.local.numel()} elements this rank needs; it is incomplete")
        if local.dtype != entry.dtype:  # cast=True (checked by _match): filled after the others
            casts.append((item.fqn, entry, local, plan))
        elif local.is_cuda and plan.covered == local.numel():
            on_device += wave_parts(item, entry, plan, executor.manifest.block_bytes)
        elif _plain_host(local):
            target = _writable(local)
            executor.add(item.fqn, entry, target, plan, borrowed_byte_view(target))
        else:
            indirect.append((item.fqn, entry, local, plan))
    return on_device, indirect, casts


def _plain_host(local: torch.Tensor) -> bool:
    """Whether the bytes of ``local`` are read straight into its memory: a contiguous CPU tensor
    whose memory holds its values (no conjugate or negative bit)."""
    return local.is_cpu and memory_in_order(local)


def _writable(local: torch.Tensor) -> torch.Tensor:
    """A plain tensor as it is; any other through a detached alias (numpy refuses a subclass that
    dispatches: '.numpy() is not supported for tensor subclasses')."""
    return local if type(local) is torch.Tensor and not local.requires_grad else local.detach()


def _fill_cast(backend: StorageBackend, path: str, manifest: Manifest, verify: bool, threads: int | None,
               advance: Callable[[int], None], fqn: str, entry: TensorEntry, local: torch.Tensor,
               plan: TargetPlan) -> int:
    """Read one tensor's stored bytes into a buffer of the stored dtype (so checksums verify what
    was written), then convert them into the target with ``copy_``. One tensor at a time: the
    extra memory a cast costs is this rank's part of one tensor, not a copy of the whole state."""
    buffer, nbytes = _read_stored(backend, path, manifest, verify, threads, advance, fqn, entry, local.shape, plan)
    with torch.no_grad():
        local.copy_(buffer)
    return nbytes


def _read_stored(backend: StorageBackend, path: str, manifest: Manifest, verify: bool, threads: int | None,
                 advance: Callable[[int], None], fqn: str, entry: TensorEntry, shape: torch.Size,
                 plan: TargetPlan) -> tuple[torch.Tensor, int]:
    """The stored values ``plan`` reads, in a new tensor of ``shape`` and the stored dtype, and
    the bytes read."""
    buffer = torch.empty(shape, dtype=entry.dtype)
    executor = ReadExecutor(backend, path, manifest, verify, threads, advance)
    executor.add(fqn, entry, buffer, plan)
    executor.run()
    return buffer, executor.bytes_read


class PlainValues:
    """This rank's plain values of a load, in two steps. Made before any tensor is written, it
    decodes, chooses (a per-rank value) and checks each value the manifest holds inline, and
    refuses a pickled one without ``allow_pickle``: a value the load cannot read, map (saved by
    another number of ranks) or put back (another value where the state holds a tuple) then
    fails it with the state as it was. A pickled value's bytes lie in a data file, which a
    node-local restore may still be fetching (checkpointer/recovery.py): :meth:`put` reads those,
    after the tensors, then puts every value in place."""

    def __init__(self, flat: Flattened, manifest: Manifest, backend: StorageBackend, path: str, skip: set[str],
                 allow_pickle: bool, comm: Comm, cast: bool = False):
        self.manifest, self.allow_pickle, self.comm, self.cast = manifest, allow_pickle, comm, cast
        # the tensors held among the values whose stored values do not fit them (``fitted_to_held``)
        self.mismatched: list[str] = []
        self.precision_only = False
        self.where = backend.join(path, MANIFEST_NAME)
        self._values = []  # (item, its entry, (found, value) or None where its bytes are read by put)
        for item in flat.objects:
            if item.fqn in skip:
                continue
            entry = manifest.objects[item.fqn]
            if item.per_rank is None and entry.kind == "per_rank":
                raise CheckpointError(f"{item.fqn} was saved per rank; wrap it in ss.PerRank(...) to load it")
            in_file = allow_pickle and any(e.kind == "pickle" for e in (entry.per_rank or [entry]))
            self._values.append((item, entry, None if in_file else self._decoded(item, entry, None)))

    def _decoded(self, item, entry: ObjectEntry, read_blob) -> tuple[bool, Any]:
        """(whether this rank takes a value, the value), checked where the state must keep its own."""
        value = decode_value(item.fqn, entry, self.allow_pickle, read_blob, self.where)
        if item.per_rank is not None:
            return item.per_rank.choose(value if entry.kind == "per_rank" else [value], self.comm.rank,
                                        self.comm.world_size, item.fqn)
        if not item.owned:
            value, mismatched, precision_only = fitted_to_held(item.fqn, item.value, value, self.cast)
            self.mismatched += mismatched
            self.precision_only = self.precision_only or precision_only
        if item.check is not None:
            item.check(value)
        return True, value

    def put(self, backend: StorageBackend, path: str, settle: Callable[[int], None] = lambda first: None) -> None:
        """Decode the pickled values, hand ``settle`` the index of the first mismatch they add to
        ``mismatched`` (a strict load raises them there, before any value is put in place), then
        put every value in place."""
        read_blob = blob_reader(backend, path, self.manifest)
        first = len(self.mismatched)
        values = [(item, self._decoded(item, entry, read_blob) if decoded is None else decoded)
                  for item, entry, decoded in self._values]
        settle(first)
        for item, (found, value) in values:
            if found:
                (item.assign if item.per_rank is None else item.per_rank.restore)(value)


def load(state: dict, path, *, strict: bool = True, verify: bool = True, allow_pickle: bool = False,
         storage_options: dict | None = None, process_group=None, threads: int | None = None,
         shared_reads: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, cast: bool = False,
         progress: bool | None = None, partial: bool = False) -> LoadInfo:
    """Load the checkpoint at ``path`` into ``state`` in place, resharding into its current layout.

    ``strict`` (the default): every name of ``state`` must be in the checkpoint with its shape
    and dtype, and every name of the checkpoint in ``state``; ``partial=True`` loads a part of a
    checkpoint (the model alone, say): both rules hold for the names under the top-level keys of
    ``state`` (``model.*``), the checkpoint's other names are left unread. ``strict=False`` loads
    only what matches and leaves the rest as it was: the returned ``LoadInfo`` lists the state's
    names the checkpoint lacks (``missing``) and those it holds with another shape or dtype
    (``mismatched``, also warned of: PyTorch's own non-strict load refuses them).

    ``progress``: a bar on stderr for the bytes this rank reads; by default only on a terminal and
    once the load has taken a few seconds (True: at once, False: never).

    ``cast=True`` lets a target tensor of another floating dtype than the stored one take its
    values converted (fp32 master weights into a bf16 model, as UCP's precision-agnostic resume
    does); the stored bytes are still verified against their checksums before the conversion.
    Without it a dtype mismatch is a ``StateMismatchError``, because a silently changed precision
    is a silently changed model. Floating <-> integer/bool is refused either way: those tensors
    hold counts, indices and masks, which a conversion would round or truncate.

    ``shared_reads``: bytes several ranks need are read by one and sent to the others (True),
    read by each (False), or shared only when storage is not local (None; see engine/shared.py).
    Every collective waits at most ``timeout_s`` for the other ranks; a rank that vanishes or
    hangs makes the load raise a ``CheckpointError`` on the others."""
    return load_step(state, path, None, strict=strict, verify=verify, allow_pickle=allow_pickle,
                     storage_options=storage_options, process_group=process_group, threads=threads,
                     shared_reads=shared_reads, timeout_s=timeout_s, cast=cast, progress=progress, partial=partial)


def load_step(state: dict, path, step: int | None, **options) -> LoadInfo:
    """:func:`load` of the ``step-N`` of a Checkpointer's root (``step``: N, or None for any
    checkpoint): one whose manifest records another step (a step directory renamed, or copied in
    from another run) is a ``CorruptCheckpointError``, not step N."""
    with collector_paused():  # until the load's own objects are freed (statesnap/collector.py)
        loading = Loading(state, path, step=step, **options)
        loading.fill()
        info = loading.finish()
        del loading
    return info


def _tied_apart(pairs: list, manifest: Manifest, path: str) -> StateMismatchError | None:
    """Weights tied in the state (one tensor under two names, or two views alike: FSDP2 gives a
    view of its own for each name) that the checkpoint holds different values for (saved
    untied): each would get its stored bytes, the second over the first, which a load must not
    pass off as loaded. Checked before reading, among the targets sharing memory."""
    for a, b in pairs:
        if same_view(a, b) and not _stored_alike(manifest, a.fqn, b.fqn):
            return tie_error([a.fqn, b.fqn], path)
    return None


def _stored_alike(manifest: Manifest, a: str, b: str) -> bool:
    """Whether tensors ``a`` and ``b`` are stored with the same values: same dtype, shape and
    pieces, and the same checksums of every block."""
    ea, eb = manifest.tensors[a], manifest.tensors[b]
    return (ea.dtype == eb.dtype and ea.shape == eb.shape and ea.layout == eb.layout
            and all(np.array_equal(x, y) for x, y in ((ea.start, eb.start), (ea.size, eb.size),
                                                       (ea.checksum, eb.checksum))))


# A checkpoint of at most this many data bytes is read ahead whole as soon as its manifest is read:
# loading a small state is mostly planning, which the disk reads then overlap (1,000 tensors of
# 9 MB, cold: 19 -> 16 ms). A large one is not: its own parallel reads outrun one read-ahead of
# everything, which competed with them (3 x 400 MB, cold: 0.36 -> 0.49 s).
PREFETCH_MAX_BYTES = 64 << 20


def _prefetch_small(backend: StorageBackend, path: str, manifest: Manifest) -> None:
    if manifest.total_bytes <= PREFETCH_MAX_BYTES:
        sections = set(manifest.sections)
        backend.prefetch([backend.join(path, name) for i, name in enumerate(manifest.files) if i not in sections])


class Loading:
    """One load (``load``'s arguments) in its three steps, for a caller with other work to run
    between checking the target and reading its bytes: a restore from the node-local level
    fetches the files a node lacks meanwhile, and the ranks that lack none read theirs at the
    same time instead of after the slowest transfer.

    Making it is collective: the manifest (read, or ``manifest`` as given), the target matched
    against it. ``fill`` reads this rank's bytes and involves no other rank; ``finish`` is
    collective again: every rank's outcome, shared reads, plain values. A failure anywhere
    leaves a fresh optimizer without state, and is raised on every rank together."""

    def __init__(self, state: dict, path, *, manifest: Manifest | None = None, strict: bool = True,
                 verify: bool = True, allow_pickle: bool = False, storage_options: dict | None = None,
                 process_group=None, threads: int | None = None, shared_reads: bool | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cast: bool = False, progress: bool | None = None,
                 partial: bool = False, step: int | None = None):
        refuse_non_switches("ss.load", strict=strict, verify=verify, allow_pickle=allow_pickle, cast=cast,
                            partial=partial)
        refuse_bad_settings("ss.load", threads=threads, timeout_s=timeout_s, progress=progress,
                            shared_reads=shared_reads)
        self.started = time.perf_counter()
        self.step = step  # the Checkpointer's step-N: a checkpoint that records another is no step N
        self.path = path_text(path)
        self.comm = Comm(process_group, f"loading {self.path}", timeout_s)
        self.strict, self.verify, self.allow_pickle, self.threads, self.progress = (
            strict, verify, allow_pickle, threads, progress)
        self.created: list[torch.Tensor] = []  # a fresh optimizer's state, created unfilled (state/flatten.py)
        self.fresh: list[tuple] = []  # (optimizer, its state before) of those the load gives state
        self.nbytes, self._error = 0, None
        self.missing: list[str] = []  # what strict=False leaves as it was (LoadInfo)
        self.mismatched: list[str] = []
        with self._reset_on_failure():
            self._begin(state, manifest, cast, shared_reads, partial, storage_options)

    def _begin(self, state: dict, manifest: Manifest | None, cast: bool, shared_reads: bool | None,
               partial: bool, storage_options: dict | None) -> None:
        error = None
        try:  # (a path or storage one rank cannot use fails every rank at once, not after timeout_s)
            self.path = normalize(self.path)
            self.backend = backend_for(self.path, storage_options)
            self.manifest = manifest if manifest is not None else read_manifest(self.backend, self.path)
            _prefetch_small(self.backend, self.path, self.manifest)
            recorded = self.manifest.meta.get("step")  # (none in checkpoints no Checkpointer wrote)
            if self.step is not None and recorded not in (None, self.step):  # renamed, or copied in from another run
                raise CorruptCheckpointError(f"{self.path} holds step {recorded!r}, not step {self.step}")
            stored = StoredNames.of_manifest(self.manifest, self.backend.join(self.path, MANIFEST_NAME))
            self.flat = flatten_for_load(state, stored, self.created, self.fresh, self.strict and not partial)
        except Exception as exc:
            error = exc
        self.comm.agree(error, f"loading {self.path}")
        try:
            self.top, self.partial = [str(key) for key in state], partial
            self.missing, self.mismatched, aliases = _match(self.flat, self.manifest, self.comm, self.strict,
                                                            self.path, cast, self.top, partial)
            self.skip = {*self.missing, *self.mismatched, *aliases}
            self.sharing = overlapping_pairs(item for item in self.flat.tensors if item.fqn not in self.skip)
            tied_apart = _tied_apart(self.sharing, self.manifest, self.path)
            if tied_apart is not None:
                raise tied_apart
            self.plain = PlainValues(self.flat, self.manifest, self.backend, self.path, self.skip, self.allow_pickle,
                                     self.comm, cast)
            self.mismatched += self._settle_plain(0, stacklevel=7)
            zero_unfilled(self.created, [item.local for item in self.flat.tensors if item.fqn in self.skip])
        except Exception as exc:
            error = exc
        self.comm.agree(error, f"loading {self.path}")
        local = isinstance(self.backend, LocalBackend)
        self.exchange = plan_shared_reads(self.comm, self.flat, self.skip,
                                          should_share(shared_reads, self.comm, local))

    def fill(self, backend: StorageBackend | None = None) -> None:
        """Read this rank's tensors (through ``backend`` if given: a restore reads files as they
        arrive). A failure is kept for ``finish`` to raise on every rank: the others are on
        their way there."""
        with self._reset_on_failure():
            try:
                self.nbytes = fill_tensors(self.flat, self.manifest, backend or self.backend, self.path, self.skip,
                                           self.verify, self.threads, self.strict, self.exchange.received,
                                           self.progress)
            except CorruptCheckpointError as exc:
                self._error = self._overlap_behind(exc) or exc
            except Exception as exc:
                self._error = exc

    def finish(self) -> LoadInfo:
        with self._reset_on_failure():
            self.comm.agree(self._error, f"loading {self.path}")
            error = None
            try:
                self.exchange.run(self.flat)
                clash = self._overwritten()
                if clash is not None:
                    raise clash
                self.plain.put(self.backend, self.path,  # (pickled values are decoded here)
                               lambda first: self.mismatched.extend(self._settle_plain(first, stacklevel=8)))
                for finalize in self.flat.finalizers:
                    finalize()
            except Exception as exc:
                error = exc
            self.comm.agree(error, f"loading {self.path}")
        return LoadInfo(self.path, self.nbytes, time.perf_counter() - self.started, self.missing, self.mismatched)

    def _settle_plain(self, first: int, stacklevel: int) -> list[str]:
        """``settle_mismatches`` of the tensors held among plain values that the values stored do
        not fit, from the ``first`` found on (``PlainValues.mismatched``)."""
        return settle_mismatches(self.path, self.strict, [], [], self.plain.mismatched[first:],
                                 self.plain.precision_only, self.top, self.partial, stacklevel)

    def _overwritten(self) -> StateMismatchError | None:
        """Targets sharing memory whose writes overwrote one another (engine/overlaps.py): each
        is read again into memory of its own and compared. One view twice (tied weights) that
        the checkpoint stores alike needs no second look, nor do targets of other memory."""
        pairs = [(a, b) for a, b in self.sharing
                 if not (same_view(a, b) and _stored_alike(self.manifest, a.fqn, b.fqn))]
        names = overwritten(pairs, self._stored) if pairs else None
        return tie_error(names, self.path) if names is not None else None

    def _overlap_behind(self, exc: CorruptCheckpointError) -> StateMismatchError | None:
        """The targets sharing memory that made ``exc``'s checksum fail, so that an intact
        checkpoint is not called damaged (and given up for an older one) because one view's
        write changed another's bytes before they were checked: its tensor, read again into
        memory of its own, passes its checksums. None where it fails them there too (damage),
        or shares no memory."""
        pairs = [(a, b) for a, b in self.sharing if exc.tensor in (a.fqn, b.fqn)]
        if not pairs:
            return None
        failed = pairs[0][0] if pairs[0][0].fqn == exc.tensor else pairs[0][1]
        try:
            if self._stored(failed) is None:
                return None
        except CorruptCheckpointError:
            return None
        return tie_error([exc.tensor, *dict.fromkeys(b.fqn if a is failed else a.fqn for a, b in pairs)], self.path)

    def _stored(self, item) -> torch.Tensor | None:
        """The stored values of ``item``'s part, read again (None where the checkpoint holds
        only some of them: a load with strict=False)."""
        entry = self.manifest.tensor_part(item.fqn, item.layout, item.start, item.size)
        plan = plan_target(entry, item.layout, item.start, item.size)
        if plan.covered != item.local.numel():
            return None
        return _read_stored(self.backend, self.path, self.manifest, self.verify, self.threads, lambda nbytes: None,
                            item.fqn, entry, item.local.shape, plan)[0]

    def abandon(self) -> None:
        """Leave a fresh optimizer fresh again: without state, so that a load of a checkpoint
        saved before its first step (a restart falling back to it) finds it so, and a restart
        that loads nothing does not train on state the load made. For a failure of the load
        itself, and of a caller's work between its steps (a node-local restore whose file
        transfers failed once the load had made the state, recovery.py)."""
        zero_unfilled(self.created)  # (also for tensors a caller still holds: zero, not garbage)
        restore_emptied(self.fresh)

    @contextlib.contextmanager
    def _reset_on_failure(self):
        try:
            yield
        except BaseException:
            self.abandon()
            raise
