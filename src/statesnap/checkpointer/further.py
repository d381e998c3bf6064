"""The further level's copy: every rank copies its own files, rank 0 commits.

A copy that funnels through one rank reads every other rank's files, so the persistent root
would have to be one file system that rank 0 sees whole, and the copy would move the whole
checkpoint through one node's network link. Here each rank reads only the data files it wrote
(``data-<token>-r<rank>.bin``) and writes them into a staging location that rank 0 opened, and
rank 0 writes the manifest and commits only once every rank says its files are in place, with
the same atomic commit as a save. The collectives run on a group made for this copy alone, one
step after another, so they never interleave with the commit's or the trainer's.
"""
from __future__ import annotations

import logging
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ..engine.dist import Comm
from ..engine.save import commit_unknown, committed_in_place, files_replaced, write_manifest
from ..errors import CheckpointError, described
from ..format.manifest import MANIFEST_NAME, Manifest
from ..monitor.events import EventLog, now
from .levels import StorageLevel

COPY_CHUNK = 64 << 20
log = logging.getLogger("statesnap")
_RANK_OF_FILE = re.compile(r"-r([0-9]{5,})\.(bin|sec)$")  # data files and split-manifest sections


def files_of_rank(files: list[str], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` copies: the data file and manifest section it wrote; rank 0 also takes
    any file no rank of this world wrote (none in a checkpoint the Checkpointer made, but a copy
    must be whole)."""
    def owner(name: str) -> int:
        match = _RANK_OF_FILE.search(name)
        return int(match.group(1)) if match and int(match.group(1)) < world_size else 0
    return [name for name in files if owner(name) == rank]


def copy_file(src: StorageLevel, source: str, dst: StorageLevel, target: str, durable: bool, buffer,
              size: int) -> int:
    """Stream the ``size`` bytes the manifest records of one file from ``src`` to ``dst`` through
    ``buffer``; return ``size``. A read that ends before them fails the copy: taken for the end of
    the file (a store's short or empty answer), it committed a copy that no load could read, and
    the level kept for the loss of the persistent one was damaged without a word."""
    reader = src.backend.open_read(source)
    writer = dst.backend.open_write(target, durable)
    offset = 0
    try:
        while offset < size:
            got = reader.readinto(offset, [memoryview(buffer)[:size - offset]])
            if not got:
                raise CheckpointError(f"{source} ended at byte {offset}, before the {size} bytes its manifest "
                                      "records")
            writer.pwrite(offset, [memoryview(buffer)[:got]])
            offset += got
        return size
    finally:
        reader.close()
        writer.close(durable)


class FurtherCopier:
    """Copies committed persistent checkpoints to the further level in the background, on every
    rank; ``done(step, error)`` runs on every rank after each copy, with the same outcome."""

    def __init__(self, src: StorageLevel, dst: StorageLevel, comm: Comm, durable: bool, events: EventLog,
                 done: Callable[[int, CheckpointError | None], None],
                 claim_again: Callable[[StorageLevel], CheckpointError | None]):
        self._src, self._dst, self._comm, self._durable = src, dst, comm, durable
        self._events, self._done, self._claim_again = events, done, claim_again
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="statesnap-further")
        self._broken: BaseException | None = None

    def submit(self, step: int) -> None:
        self._pool.submit(self._run, step)

    def drain(self) -> None:
        """Wait for every copy submitted so far (one thread runs them in order)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _run(self, step: int) -> None:
        start, error = now(), None
        try:
            nbytes = self._copy(step)
            self._events.add("further", step, start, now(), nbytes)
        except BaseException as exc:  # noqa: BLE001 (reported through done)
            error = exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"copying step {step} to {self._dst.path(step)} failed: {described(exc)}")
            error.__cause__ = exc
        self._done(step, error)

    def _copy(self, step: int) -> int:
        if self._broken is not None:
            raise CheckpointError(f"step {step} was not copied to {self._dst.root}: an earlier copy could not "
                                  f"reach the other ranks ({self._broken})")
        comm = self._comm
        try:
            staging, raw, problem, outage = comm.broadcast(self._open(step) if comm.rank == 0 else None)
        except BaseException as exc:
            self._broken = exc
            raise
        self._dst.unreachable = outage  # every rank keeps the same view of the level
        if outage is not None and problem is None:
            log.warning("statesnap: step %d was not copied to the further level: %s is unreachable (%s)",
                        step, self._dst.root, outage)
            return 0
        copied, error = 0, problem
        if problem is None:
            try:
                copied = self._copy_own_files(step, staging, Manifest.from_bytes(raw))
            except Exception as exc:  # noqa: BLE001 (every rank must reach the gather below)
                error = described(exc)
        try:
            outcomes = comm.gather(error)
            result = self._commit_or_abort(step, staging, raw, outcomes) if comm.rank == 0 else None
            result = comm.broadcast(result)
        except BaseException as exc:
            self._broken = exc
            raise
        if not isinstance(result, int):
            raise CheckpointError(result)
        return copied

    def _open(self, step: int) -> tuple[str | None, bytes | None, str | None, str | None]:
        """Rank 0: (staging location, the source manifest's bytes, problem, outage). An outage
        (the level could not be claimed when the job started, and still cannot) skips the copy.
        Never raises: the other ranks wait in the broadcast of this outcome."""
        try:
            if self._dst.unreachable is not None:
                outage = self._claim_again(self._dst)
                if outage is not None:
                    return None, None, None, str(outage)
            raw = self._src.backend.read_bytes(self._src.backend.join(self._src.path(step), MANIFEST_NAME))
            return self._dst.backend.begin(self._dst.path(step), uuid.uuid4().hex[:12]), raw, None, None
        except Exception as exc:  # noqa: BLE001 (reported on every rank)
            return None, None, f"could not start the copy of step {step}: {described(exc)}", \
                self._dst.unreachable

    def _commit_or_abort(self, step: int, staging: str | None, raw: bytes | None, outcomes: list) -> int | str:
        """Rank 0: commit the copy if every rank copied its files; else remove what was written.
        Returns the checkpoint's bytes or the error text every rank reports."""
        target = self._dst.path(step)
        failures = "; ".join(f"rank {r}: {e}" for r, e in enumerate(outcomes) if e is not None)
        if staging is None:
            return f"step {step} was not copied to {target}: {failures}"
        manifest = Manifest.from_bytes(raw)
        backend = self._dst.backend
        in_place = False
        try:
            if failures:
                raise CheckpointError(failures)
            replaced = files_replaced(backend, staging, target)
            write_manifest(backend, staging, target, raw, self._durable)
            in_place = staging == target
            backend.commit(staging, target, True, self._durable, keep=[*manifest.files, MANIFEST_NAME],
                           replaced=replaced)
        except Exception as exc:  # noqa: BLE001 (reported on every rank)
            if not in_place:  # else the manifest's write was the commit (engine/save.py: committed_in_place)
                if not commit_unknown(exc):
                    backend.abort(staging, target, manifest.files)
                return f"step {step} was not copied to {target}: {described(exc)}"
            committed_in_place(target, exc, 0)
        try:
            self._dst.retain({step}, step)  # (spared when not the highest: a run that went back)
        except Exception as exc:  # noqa: BLE001 (the copy is committed; retention is retried next time)
            return f"retention in {self._dst.root} after copying step {step} failed: {exc}"
        return manifest.total_bytes

    def _copy_own_files(self, step: int, staging: str, manifest: Manifest) -> int:
        source = self._src.path(step)
        buffer = torch.empty(COPY_CHUNK, dtype=torch.uint8).numpy()
        sizes = dict(zip(manifest.files, manifest.file_sizes))
        return sum(copy_file(self._src, self._src.backend.join(source, name), self._dst,
                             self._dst.backend.join(staging, name), self._durable, buffer, sizes[name])
                   for name in files_of_rank(manifest.files, self._comm.rank, self._comm.world_size))
