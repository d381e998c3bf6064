"""Blocking save: plan across ranks, write each rank's file, commit the manifest atomically.

The sequence is what makes a checkpoint trustworthy after a crash: data files are written into a
staging location and fsync'd, the manifest is written last, then one rename (or, on object
stores, the manifest itself) makes the whole checkpoint visible at once.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import numpy as np

from ..errors import (CheckpointError, CheckpointExistsError, described, explained, refuse_bad_settings,
                      refuse_non_switches)
from ..format.checksum import DEFAULT_BLOCK_BYTES, checksum_whole
from ..format.dtypes import dtype_from_name, dtype_name
from ..format.manifest import MANIFEST_NAME, Manifest, ObjectEntry, TensorEntry, meta_problem
from ..format.split import TensorRow, encode_section, section_name
from ..plan.owners import Decision, OwnedTensors, owner_of, place_writes, plan_owned, route
from ..plan.save_plan import SavePlan, align_up
from ..progress import bar
from ..state.flatten import flatten_for_save
from ..state.items import Flattened
from ..storage import backend_for, normalize, path_text
from ..storage.base import StorageBackend, write_new
from ..storage.lock import RootBusyError
from ..storage.retry import describe
from .buffers import byte_view, host_contiguous
from .dist import DEFAULT_TIMEOUT_S, Comm, PeerLostError
from .load import read_manifest
from .exchange import all_to_all
from .objects import encode_value
from .replicas import (REPLICA_CHECK_MB, differing_pieces, hash_tensors, heads_of, limit_bytes, mismatches,
                       object_digests, replicas_to_check, sampled_items)
from .write import write_file

log = logging.getLogger("statesnap")


@dataclass
class SaveInfo:
    path: str
    bytes: int
    seconds: float
    # What a conversion noticed but did not refuse (how far averaged replicas drifted, ...)
    notes: list[str] = field(default_factory=list)


# Jobs of this many ranks or more write a split manifest (format/split.py): every loading rank then
# reads only its tensors' parts. Smaller jobs write the one-document manifest, small anyway, that
# every statesnap tool and older reader reads.
SPLIT_MIN_RANKS = 64


def data_file_name(token: str, rank: int) -> str:
    return f"data-{token}-r{rank:05d}.bin"


_DATA_FILE = re.compile(r"^(data-[0-9a-f]{12}-r[0-9]{5,}\.bin|manifest-[0-9a-f]{12}-r[0-9]{5,}\.sec)$")


def foreign_entries(backend: StorageBackend, path: str) -> list[str]:
    """What ``path`` holds that no statesnap checkpoint holds: a save must not replace it (a
    user's directory, a Checkpointer's root with its steps and lock, another tool's files)."""
    return [name for name in backend.listdir(path) if name != MANIFEST_NAME and not _DATA_FILE.match(name)]


@dataclass
class RankOutput:
    """What one rank reports to the coordinator after writing its file."""

    file: str | None
    file_bytes: int
    checksums: dict[int, list[int]]  # item index -> block checksums
    objects: dict[str, ObjectEntry]  # this rank's object entries (shared ones only from rank 0)
    per_rank: set[str]  # which of ``objects`` are per-rank values
    replicas: list = field(default_factory=list)  # hashes of replicas other ranks write (engine.replicas)
    heads: dict[int, list[int]] = field(default_factory=dict)  # item index -> block_heads, of large written items
    object_digests: dict = field(default_factory=dict)  # fqn -> hash of each compared shared value
    # a split manifest's section this rank wrote for the tensors it owns: (file name, size, index rows)
    section: tuple[str, int, dict[str, TensorRow]] | None = None


def encode_objects(flat: Flattened, allow_pickle: bool) -> tuple[dict[str, ObjectEntry], dict[str, bytes]]:
    """Every object's entry and the pickled blobs. Every rank encodes every value, also the shared
    ones only rank 0 writes: the commit compares them (``engine/replicas.py``)."""
    entries, blobs = {}, {}
    for item in flat.objects:
        entry, blob = encode_value(item.fqn, item.value, allow_pickle)
        entries[item.fqn] = entry
        if blob is not None:
            blobs[item.fqn] = blob
    return entries, blobs


def shared_names(flat: Flattened) -> list[str]:
    """The shared (not per-rank) plain values this rank holds, for the plan to pick writers."""
    return [item.fqn for item in flat.objects if item.per_rank is None]


def own_objects(entries: dict[str, ObjectEntry], blobs: dict[str, bytes], per_rank: set[str], rank: int,
                writers: dict[str, int]) -> tuple[dict[str, ObjectEntry], list[tuple[str, bytes]]]:
    """What this rank writes of the objects: its per-rank values and the shared ones the plan
    gives it (``writers``: those it is the lowest rank to hold)."""
    mine = [fqn for fqn in entries if fqn in per_rank or writers.get(fqn) == rank]
    return {fqn: entries[fqn] for fqn in mine}, [(fqn, blobs[fqn]) for fqn in mine if fqn in blobs]


def per_rank_names(flat: Flattened) -> set[str]:
    return {item.fqn for item in flat.objects if item.per_rank is not None}


def write_rank(backend: StorageBackend, staging: str, token: str, rank: int, plan: SavePlan,
               tensors: list, entries: dict[str, ObjectEntry], blobs: list[tuple[str, bytes]],
               per_rank: set[str], durable: bool, threads: int | None, block_bytes: int,
               advance: Callable[[int], None] = lambda nbytes: None) -> RankOutput:
    """Write this rank's planned pieces (``tensors[i]`` are contiguous host tensors) and blobs;
    ``advance(nbytes)`` is told of every chunk written."""
    jobs = [(offset, byte_view(tensors[index])) for index, offset in plan.writes[rank]]
    end = plan.file_bytes[rank]
    for fqn, blob in blobs:
        start = align_up(end)
        jobs.append((start, memoryview(blob)))
        entries[fqn] = ObjectEntry("pickle", [None, start, len(blob), checksum_whole(memoryview(blob))])
        end = start + len(blob)
    if not jobs:
        return RankOutput(None, 0, {}, entries, per_rank)
    name = data_file_name(token, rank)
    sums = write_file(backend, backend.join(staging, name), jobs, block_bytes, durable, threads, advance,
                      whole_file=True)
    checksums = {index: s for (index, _), s in zip(plan.writes[rank], sums)}
    return RankOutput(name, end, checksums, entries, per_rank)


def build_manifest(plan: SavePlan, outputs: list[RankOutput], world_size: int, block_bytes: int,
                   meta: dict | None) -> Manifest:
    files, sizes, index_of = _file_table(outputs)
    file_of = np.full(len(outputs), -1, np.int64)
    file_of[list(index_of)] = list(index_of.values())
    tensors = {}
    for fqn, pieces in plan.tensors.items():
        checksum, bounds = TensorEntry.pack_checksums(
            [outputs[r].checksums[i] for r, i in zip(pieces.rank.tolist(), pieces.item.tolist())])
        tensors[fqn] = TensorEntry(
            dtype=dtype_from_name(pieces.dtype), shape=tuple(pieces.shape), layout=pieces.layout,
            file=file_of[pieces.rank], offset=pieces.offset, nbytes=pieces.nbytes,
            start=pieces.start, size=pieces.size, checksum=checksum, checksum_bounds=bounds,
        )
    objects = _merge_objects(outputs, index_of)
    return Manifest(files=files, file_sizes=sizes, tensors=tensors, objects=objects,
                    world_size=world_size, block_bytes=block_bytes, meta=dict(meta or {}))


def whole_manifest(tensors: dict[str, TensorEntry], outputs: list[RankOutput], world_size: int, block_bytes: int,
                   meta: dict | None) -> tuple[Manifest, bytes]:
    """The one-document manifest (version 1, or 3 or 4 with tables) of a save planned by tensor
    owners, from their entries gathered on rank 0: for jobs under ``SPLIT_MIN_RANKS`` ranks,
    whose manifest is small."""
    files, sizes, index_of = _file_table(outputs)
    manifest = Manifest(files=files, file_sizes=sizes, tensors=dict(sorted(tensors.items())),
                        objects=_merge_objects(outputs, index_of), world_size=world_size, block_bytes=block_bytes,
                        meta=dict(meta or {}))
    return manifest, manifest.to_bytes()


def split_index(outputs: list[RankOutput], world_size: int, block_bytes: int, meta: dict | None
                ) -> tuple[Manifest, bytes]:
    """The index of a split manifest (format/split.py) of a save planned by tensor owners
    (plan/owners.py): their sections, already written, plus the file table and objects from
    every rank's output. O(ranks + tensors), never the pieces."""
    files, sizes, index_of = _file_table(outputs)
    manifest = Manifest(files=files, file_sizes=sizes, tensors={}, objects=_merge_objects(outputs, index_of),
                        world_size=world_size, block_bytes=block_bytes, meta=dict(meta or {}), version=2)
    rows = {}
    for name, size, section_rows in (out.section for out in outputs if out.section is not None):
        for row in section_rows.values():
            row.section = len(manifest.sections)
        manifest.sections.append(len(manifest.files))  # sections join the file table
        manifest.files.append(name)
        manifest.file_sizes.append(size)
        rows.update(section_rows)
    return manifest, manifest.index_bytes(dict(sorted(rows.items())))


def _file_table(outputs: list[RankOutput]) -> tuple[list[str], list[int], dict[int, int]]:
    """(file names, sizes, rank -> file index) of the ranks that wrote a file, in rank order."""
    files, sizes, index_of = [], [], {}
    for rank, out in enumerate(outputs):
        if out.file is not None:
            index_of[rank] = len(files)
            files.append(out.file)
            sizes.append(out.file_bytes)
    return files, sizes, index_of


def _merge_objects(outputs: list[RankOutput], index_of: dict[int, int]) -> dict[str, ObjectEntry]:
    for rank, out in enumerate(outputs):
        for entry in out.objects.values():
            if entry.kind == "pickle":
                entry.value[0] = index_of[rank]
    objects = {fqn: e for out in outputs for fqn, e in out.objects.items() if fqn not in out.per_rank}
    for fqn in sorted(set().union(*(out.per_rank for out in outputs))):
        objects[fqn] = ObjectEntry("per_rank", per_rank=[out.objects.get(fqn, ObjectEntry("json", None))
                                                         for out in outputs])
    return objects


def save(state: dict, path, *, overwrite: bool = False, durable: bool = True, allow_pickle: bool = False,
         storage_options: dict | None = None, process_group=None, threads: int | None = None,
         meta: dict | None = None, block_bytes: int = DEFAULT_BLOCK_BYTES,
         replica_check_mb: float = REPLICA_CHECK_MB, timeout_s: float = DEFAULT_TIMEOUT_S,
         progress: bool | None = None) -> SaveInfo:
    """Save ``state`` to ``path`` and return once it is committed (durable unless ``durable=False``).

    ``progress``: a bar on stderr for the bytes this rank writes; by default only on a terminal
    and once the save has taken a few seconds (True: at once, False: never).

    ``threads``: the workers that checksum and write this rank's file; for a durable save to a
    local file system, those that copy it into aligned windows and checksum it, while four more
    wait on the direct writes (``engine/write.py``). By default from the number of cores.

    Every collective waits at most ``timeout_s`` for the other ranks; a rank that vanishes or
    hangs makes the save raise a ``CheckpointError`` on the others, and nothing is committed.
    Replicated pieces of at most ``replica_check_mb`` MiB, and shared plain values, are compared
    across the ranks holding them, larger pieces by a sample of each checksum block (0: nothing
    is compared); if they differ nothing is committed (see ``engine/replicas.py``)."""
    refuse_non_switches("ss.save", overwrite=overwrite, durable=durable, allow_pickle=allow_pickle)
    refuse_bad_settings("ss.save", threads=threads, block_bytes=block_bytes, replica_check_mb=replica_check_mb,
                        timeout_s=timeout_s, progress=progress)
    block_bytes = int(block_bytes)  # (a numpy integer is no JSON number)
    started = time.perf_counter()
    comm = Comm(process_group, f"saving {path_text(path)}", timeout_s)
    error = None
    try:  # (a path or storage one rank cannot use fails every rank at once, not after timeout_s)
        path = normalize(path)
        backend = backend_for(path, storage_options)
        problem = meta_problem({} if meta is None else meta)
        if problem:
            raise CheckpointError(f"cannot save to {path}: {problem}. meta is plain JSON (dicts with string keys, "
                                  "lists or tuples, strings, integers, finite floats, booleans, None); put other "
                                  "values in the state")
        flat = flatten_for_save(state)
        metas = [item.meta(dtype_name(item.dtype)) for item in flat.tensors]
        all_entries, all_blobs = encode_objects(flat, allow_pickle)
        compare = comm.world_size > 1 and replica_check_mb > 0
        digests = object_digests(flat, all_entries) if compare else {}
        names = shared_names(flat)
    except Exception as exc:
        error, metas, names = exc, [], []
    comm.agree(error, "preparing the save")
    plan, elsewhere, owned = plan_by_owners(comm, metas, names)
    entries, blobs = own_objects(all_entries, all_blobs, per_rank_names(flat), comm.rank, plan.object_writers)
    opened = open_staging(backend, path, overwrite) if comm.rank == 0 else None
    try:
        staging, token, problem, first_path = comm.broadcast(None if opened is None else (*opened, path))
    except PeerLostError:
        if opened is not None and opened[0] is not None:  # no rank wrote into it yet
            backend.abort(opened[0], path)
        raise
    if problem is not None:
        raise CheckpointError(f"cannot save to {path}: {problem}")
    if staging is None:
        raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it")
    output, error = None, None
    if path != first_path:  # (rank 0's path is the one written: this rank's SaveInfo named another)
        error = CheckpointError(f"rank {comm.rank} saves to {path} and rank 0 to {first_path}: the ranks of one "
                                "save write one checkpoint, so give every rank the same path")
    try:
        if error is not None:
            raise error
        tensors = {index: host_contiguous(flat.tensors[index].local) for index, _ in plan.writes[comm.rank]}
        total = sum(t.numel() * t.element_size() for t in tensors.values()) + sum(len(b) for _, b in blobs)
        with bar(total, f"save -> {os.path.basename(path.rstrip('/'))}", progress) as advance:
            output = write_rank(backend, staging, token, comm.rank, plan, tensors, entries, blobs,
                                per_rank_names(flat), durable, threads, block_bytes, advance)
        declared, limit = [item.replicated for item in flat.tensors], limit_bytes(replica_check_mb)
        output.replicas = hash_tensors(replicas_to_check(elsewhere, metas, declared, limit),
                                       [item.local for item in flat.tensors], block_bytes)
        output.heads = {index: heads_of(tensors[index], block_bytes)
                        for index in sampled_items(metas, declared, limit if comm.world_size > 1 else 0)
                        if index in tensors}
        output.object_digests = digests
    except Exception as exc:
        error = exc
    except BaseException:  # Ctrl-C, SystemExit: leave no hidden staging directory behind
        if comm.rank == 0:  # other ranks' interruptions reach rank 0 as a lost peer, which aborts
            backend.abort(staging, path)
        raise
    try:
        result, error = commit_by_owners(comm, backend, path, staging, token, metas, plan, owned, output, error,
                                         overwrite=overwrite, durable=durable, block_bytes=block_bytes, meta=meta)
    except BaseException as exc:
        # Ctrl-C or SystemExit on rank 0 before the commit: as during the writes. After the commit
        # this removes nothing: a local staging directory was renamed into place, and an object
        # store's abort removes only the files it is given.
        if comm.rank == 0 and not isinstance(exc, Exception):
            backend.abort(staging, path)
        raise
    if error is not None:
        raise error if isinstance(error, CheckpointError) else CheckpointError(
            f"save to {path} failed: {explained(error)}") from error
    return SaveInfo(path, committed_bytes(result, path), time.perf_counter() - started)


def write_section(backend: StorageBackend, staging: str, token: str, rank: int, entries: dict[str, TensorEntry],
                  durable: bool) -> tuple[str, int, dict[str, TensorRow]]:
    """Write the split manifest's section of the tensors this rank owns; (name, size, index rows)."""
    raw, rows = encode_section(entries)
    name = section_name(token, rank)
    backend.write_bytes(backend.join(staging, name), raw, durable)
    return name, len(raw), rows


def plan_by_owners(comm: Comm, metas: list, names: list[str]) -> tuple[SavePlan, dict, OwnedTensors | None]:
    """Phases 1-3 of plan/owners.py, a collective of every rank: (this rank's part of the plan,
    item index -> (writer rank, writer's item index) of the items another rank writes, the plan
    of the tensors this rank owns). Nothing in it grows with the number of ranks but the
    all-to-all's empty slots."""
    routed = route(metas, names, comm.world_size)
    inbox = all_to_all(comm, [routed.get(r) for r in range(comm.world_size)])
    owned, error = None, None
    try:
        owned = plan_owned({rank: sent for rank, sent in enumerate(inbox) if sent is not None})
    except Exception as exc:
        error = exc
    comm.agree(error, "planning the save")
    answers = all_to_all(comm, [owned.decisions.get(r, Decision()) for r in range(comm.world_size)])
    writes, pieces_end, elsewhere = place_writes(metas, answers, comm.rank)
    writers = {fqn: comm.rank for answer in answers for fqn in answer.objects}
    # this rank's view of the plan: what write_rank and own_objects read of it
    plan = SavePlan(comm.world_size, {comm.rank: writes}, {comm.rank: pieces_end}, {}, writers)
    return plan, elsewhere, owned


def commit_by_owners(comm: Comm, backend: StorageBackend, path: str, staging: str | None, token: str, metas: list,
                     plan: SavePlan, owned: OwnedTensors | None, output: RankOutput | None,
                     error: BaseException | None, *, overwrite: bool, durable: bool, block_bytes: int,
                     meta: dict | None, timed: Callable[[], ContextManager] = nullcontext
                     ) -> tuple[Any, BaseException | None]:
    """Phase 4 and the commit, on every rank together, once each has written its file (or
    failed: ``error``). The owners build their tensors' entries and compare their replicas; in a
    job of ``SPLIT_MIN_RANKS`` ranks or more each writes its entries as its manifest section,
    else they go to rank 0 with the outputs. Rank 0 writes the manifest and commits (inside
    ``timed()``), or aborts. Returns (total bytes or the reason nothing was committed, the same
    on every rank; this rank's first error). A rank lost on the way raises ``PeerLostError``
    everywhere, and rank 0 removes the staging."""
    split = comm.world_size >= SPLIT_MIN_RANKS

    def write_own_section(entries: dict[str, TensorEntry]) -> None:
        output.section = write_section(backend, staging, token, comm.rank, entries, durable)
    try:
        gathered, error = gather_reports(comm, metas, plan, owned, output, error,
                                         write_own_section if split else None)
    except PeerLostError:
        if comm.rank == 0 and staging is not None:  # the other ranks' files are in its staging
            backend.abort(staging, path, [name(token, r) for r in range(comm.world_size)
                                          for name in (data_file_name, section_name)])
        raise
    result = None
    if comm.rank == 0 and staging is not None:
        outputs = list(zip((report.output for report in gathered), report_errors(gathered)))
        tables = {fqn: entry for report in gathered for fqn, entry in (report.entries or {}).items()}
        differ = {fqn: parts for report in gathered for fqn, parts in report.differing.items()}
        def build(outs: list[RankOutput]) -> tuple[Manifest, bytes]:
            if split:
                return split_index(outs, comm.world_size, block_bytes, meta)
            return whole_manifest(tables, outs, comm.world_size, block_bytes, meta)
        with timed():
            result = commit_manifest(backend, path, staging, outputs, overwrite, durable, build, differ)
    return comm.broadcast(result), error


@dataclass
class OwnerReport:
    """What a rank sends rank 0 at the end of a save planned by owners."""

    output: RankOutput | None  # without checksums and replica hashes: the owners had them
    error: str | None
    entries: dict[str, TensorEntry] | None  # of the tensors it owns (None: written as a section)
    differing: dict[str, list[str]]  # of its tensors, replicas whose holders differ (replicas.py)
    unreported: str | None = None  # an item written for its tensors that no report gave


def report_errors(gathered: list[OwnerReport]) -> list[str | None]:
    """Each rank's failure, if any. An owner missing a report counts only where no rank failed:
    a writer that failed explains it, and says so itself."""
    any_failed = any(report.error is not None for report in gathered)
    return [report.error or (None if any_failed else report.unreported) for report in gathered]


def gather_reports(comm: Comm, metas: list, plan: SavePlan, owned: OwnedTensors | None, output: RankOutput | None,
                   error: BaseException | None, write_own_section: Callable[[dict], None] | None = None
                   ) -> tuple[list[OwnerReport] | None, BaseException | None]:
    """Phase 4: the offsets and checksums of the written pieces, and every holder's hashes of the
    replicas it does not write, go to their tensors' owners, which build the entries and compare
    the replicas; then rank 0 gathers one :class:`OwnerReport` per rank (the entries unless
    ``write_own_section`` wrote them). Returns (that list on rank 0, else None; this rank's first
    error). Nothing a rank sends or receives grows with the job but its own items and owned
    tensors, and one small output per rank on rank 0."""
    has_file = comm.all_gather(output is not None and output.file is not None)
    file_of_rank = (np.cumsum(has_file) - 1).tolist()  # owners name the writers' files by index
    outgoing = [({}, []) for _ in range(comm.world_size)]
    if output is not None:
        for index, offset in plan.writes[comm.rank]:
            outgoing[owner_of(metas[index].fqn, comm.world_size)][0][index] = (
                offset, output.checksums[index], output.heads.get(index))
        for hashed in output.replicas:
            outgoing[owner_of(hashed[0], comm.world_size)][1].append(hashed)
    received = all_to_all(comm, outgoing)
    written = dict(enumerate(placed for placed, _ in received))
    entries, differing, unreported = None, {}, None
    try:
        entries = owned.entries(written, file_of_rank)
        differing = differing_pieces(lambda writer, item, sampled: written[writer][item][2 if sampled else 1],
                                     ((rank, hashed) for rank, (_, hashes) in enumerate(received) for hashed in hashes))
    except KeyError as exc:  # a writer failed (and says so), or the commit must not go through
        unreported = f"a tensor owner got no report of an item written by another rank ({exc})"
    if write_own_section is not None and entries and error is None:
        try:
            write_own_section(entries)
        except Exception as exc:
            error = exc
    text = described(error)
    sent = None if output is None else dataclasses.replace(output, checksums={}, replicas=[], heads={})
    gathered = comm.gather(OwnerReport(sent, text, None if write_own_section is not None else entries, differing,
                                       unreported))
    return gathered, error


def open_staging(backend: StorageBackend, path: str, overwrite: bool) -> tuple[str | None, str, str | None]:
    """(staging location, token, problem): no location if ``path`` holds a checkpoint and
    ``overwrite`` is off; a problem if the location could not be created. Never raises: rank 0
    broadcasts the outcome, so a failure there cannot leave the other ranks waiting."""
    token = uuid.uuid4().hex[:12]
    try:
        if backend.exists(backend.join(path, MANIFEST_NAME)) and not overwrite:
            return None, token, None
        foreign = foreign_entries(backend, path)
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            return None, token, (f"{path} holds what is not part of a statesnap checkpoint ({shown}); a save "
                                 "replaces only a checkpoint, so choose another path")
        return backend.begin(path, token), token, None
    except Exception as exc:  # noqa: BLE001 (reported on every rank by the caller)
        return None, token, described(exc)


def commit_or_abort(backend, path, staging, plan, outputs, world_size, overwrite, durable, block_bytes, meta) -> Any:
    """On rank 0: write the manifest of a whole-job ``plan`` and commit, or abort; return what
    ``commit_manifest`` does."""
    def whole(outs: list[RankOutput]) -> tuple[Manifest, bytes]:
        manifest = build_manifest(plan, outs, world_size, block_bytes, meta)
        return manifest, manifest.to_bytes()
    return commit_manifest(backend, path, staging, outputs, overwrite, durable, whole)


def commit_manifest(backend, path, staging, outputs, overwrite, durable,
                    build: Callable[[list[RankOutput]], tuple[Manifest, bytes]],
                    differing: dict[str, list[str]] | None = None) -> Any:
    """On rank 0: write the manifest ``build`` makes of the ranks' outputs (and its bytes) and
    commit, or abort. Returns, for rank 0 to broadcast, the total bytes, an error text, or the
    RootBusyError of a lost claim (see ``committed_bytes``). ``differing``: replicas whose
    holders differ, as the tensors' owners found them (none where no replicas were hashed)."""
    failures = [f"rank {r}: {err}" for r, (_, err) in enumerate(outputs) if err is not None]
    written = [name for out, _ in outputs if out is not None
               for name in (out.file, out.section and out.section[0]) if name]
    if failures:
        backend.abort(staging, path, written)
        return f"save to {path} failed and was not committed: " + "; ".join(failures)
    differ = mismatches([out for out, _ in outputs], differing or {})
    if differ is not None:
        backend.abort(staging, path, written)
        return f"{path} was not committed: {differ}"
    in_place = False
    try:
        manifest, raw = build([out for out, _ in outputs])
        replaced = files_replaced(backend, staging, path)
        # (in place only: elsewhere the staging directory is new, and the commit's rename refuses to replace)
        write_manifest(backend, staging, path, raw, durable, exclusive=not overwrite and staging == path)
        in_place = staging == path
        backend.commit(staging, path, overwrite, durable, keep=[*manifest.files, MANIFEST_NAME], replaced=replaced)
    except Exception as exc:
        if in_place:  # see committed_in_place
            return committed_in_place(path, exc, manifest.total_bytes)
        if not commit_unknown(exc):
            backend.abort(staging, path, written)
        if isinstance(exc, (RootBusyError, CheckpointExistsError)):  # callers catch these types
            return exc
        return f"committing {path} failed: {described(exc)}"
    return manifest.total_bytes


_COMMIT_UNKNOWN = "statesnap_commit_unknown"  # the attribute write_manifest marks its failure with


def files_replaced(backend: StorageBackend, staging: str, path: str) -> list[str]:
    """Saving in place (an object store): the files of the checkpoint at ``path`` that the
    manifest about to be written replaces, for the commit to delete. Read just before, so
    that what another save to the path writes meanwhile is never among them. None where there
    is no checkpoint, or it cannot be read (its files are then left)."""
    if staging != path or not backend.exists(backend.join(path, MANIFEST_NAME)):
        return []
    try:
        return list(read_manifest(backend, path).files)
    except CheckpointError as exc:
        log.warning("statesnap: the checkpoint %s replaces cannot be read (%s); its files are left there", path, exc)
        return []


def write_manifest(backend: StorageBackend, staging: str, path: str, raw: bytes, durable: bool,
                   exclusive: bool = False) -> None:
    """Write the manifest ``raw`` into ``staging``. In place (an object store), a PUT that landed
    but whose answer was lost, its retries then failing, raises although it committed, so the
    manifest is read back: this one is the commit (the abort must not delete the files it
    names); another or none lets the write's failure stand. When the read fails too, nobody
    knows which: the write's failure is raised marked (``commit_unknown``), and its abort leaves
    the files, since deleting them could leave a committed manifest naming files that are gone.
    ``exclusive`` (a save without ``overwrite``): another save's manifest that got there first,
    while this one wrote its files, is a ``CheckpointExistsError``; without it, both saves
    succeeded and the first one's checkpoint was silently replaced."""
    where = backend.join(staging, MANIFEST_NAME)
    try:
        write_new(backend, where, raw, durable) if exclusive else backend.write_bytes(where, raw, durable)
    except Exception as exc:
        if staging != path:
            raise
        try:
            if backend.read_bytes(where) == raw:
                return
        except FileNotFoundError:
            pass
        except Exception as unread:  # noqa: BLE001 (any storage library's error)
            log.warning("statesnap: whether %s is committed is unknown: writing its manifest failed, and so did "
                        "reading it back (%s); its files are left there", path, describe(unread))
            setattr(exc, _COMMIT_UNKNOWN, True)
        if isinstance(exc, FileExistsError) and not commit_unknown(exc):
            raise CheckpointExistsError(f"{path} already exists: another save committed it while this one wrote "
                                        "its files; pass overwrite=True to replace it") from None
        raise


def commit_unknown(exc: BaseException) -> bool:
    """Whether ``exc`` is a manifest write whose commit is unknown (``write_manifest``): the
    abort must not delete the save's files then."""
    return getattr(exc, _COMMIT_UNKNOWN, False)


def committed_in_place(path: str, exc: Exception, nbytes: int) -> int:
    """A manifest written in place (an object store: staging is the final path) was the commit;
    what failed after it (the claim's check, deleting the files of the checkpoint it replaced)
    must not abort it. The abort deleted the data files that manifest names, and neither the new
    checkpoint nor the one it replaced loaded. Files left over go at the next commit there."""
    log.warning("statesnap: %s is committed, but what follows its commit failed (%s: %s); files of the "
                "checkpoint it replaced may be left there", path, type(exc).__name__, exc)
    return nbytes


def committed_bytes(result: Any, path: str) -> int:
    """The bytes a commit wrote, from what ``commit_manifest`` returned; its failure raised: a
    lost claim or a checkpoint there as the ``RootBusyError`` or ``CheckpointExistsError`` it is
    (callers catch those types), any other as text."""
    if isinstance(result, CheckpointError):
        raise result
    if not isinstance(result, int):
        raise CheckpointError(result or f"checkpoint {path} was not committed")
    return result
