"""fsspec backend for object stores and remote file systems (s3://, gs://, memory://, ...).

Object stores cannot rename a directory atomically, so the manifest is the commit marker: data
files are written in place under names unique to this save, and the manifest is written last in
one PUT (without overwrite a conditional one, so that of two saves to one path only the first
commits). A reader that finds no manifest sees no checkpoint. On overwrite the old data files stay
until the new manifest is in place and are deleted only then.

Object stores also cannot write at an offset: a file is one stream (fsspec's buffered files on
s3/gcs upload a multipart part each time their block fills). :class:`_FsspecWriter` turns the
positioned writes of several threads into that stream without holding the file in memory. On
S3 the stream goes out as a multipart upload with its parts sent in parallel
(:mod:`.s3_upload`); loads read byte ranges, several at once (the load's reader threads).

Requests are retried with backoff on throttling, 5xx answers and dropped connections
(:mod:`.retry`); on S3 this replaces s3fs's and botocore's own retries, so that the bound is one.
``storage_options`` for ``s3://`` take, besides s3fs's own: ``retries`` (tries per request, 5),
``retry_backoff_s`` (first wait, 0.2 s; it doubles), ``retry_max_backoff_s`` (10 s),
``default_block_size`` (the upload's part size, 16 MiB here) and ``max_concurrency`` (parts in
flight per file, 8 by default with 16 MiB parts).
"""
from __future__ import annotations

import datetime
import errno
import heapq
import logging
import os
import tempfile
import threading
import time
import weakref
from typing import NamedTuple, Sequence

import fsspec
from fsspec.spec import AbstractBufferedFile

from ..errors import CheckpointError
from .base import FileReader, FileWriter, StorageBackend
from .retry import NOT_IMPLEMENTED, RetryPolicy, answered, describe
from .s3_upload import ParallelUpload

# Out-of-order bytes one file may hold in host memory. It is outside the Checkpointer's
# ``host_memory_gb`` budget, so it is small and fixed: about one write of a blocking save.
ABANDONED_AFTER_S = 24 * 3600  # a file at a checkpoint's path unwritten this long: no save's in progress
REORDER_BYTES = 64 << 20
# The most one call hands to the fsspec file: its buffer grows by at most this before it
# uploads a block, whatever size the caller's write has.
WRITE_SLICE = 8 << 20
# Writers leave gaps only to start a piece on a multiple of this (the save plan's ALIGN), and
# cut pieces into parts at multiples of it (blocking saves' chunks; the Checkpointer's segments,
# whole blocks, when its ``block_bytes`` is a multiple of it). So a stream that ends off such a
# multiple ends a piece: the gap up to the next multiple is padding, not bytes still to come. A
# part that breaks this arrives behind the stream and fails the file rather than being lost.
PAD_ALIGN = 64
S3_PROTOCOLS = ("s3", "s3a")
# Parts of an S3 upload, and the bytes of one file on the wire at once (parts in flight): a file
# holds at most these plus REORDER_BYTES in host memory, outside the staging budget.
S3_PART_BYTES = 16 << 20
S3_UPLOAD_WINDOW = 128 << 20
log = logging.getLogger("statesnap")
# file systems whose store refused a conditional write (FsspecBackend.write_bytes): not asked again
_NO_CONDITIONAL_WRITES: "weakref.WeakSet" = weakref.WeakSet()


def _error(what: str, exc: BaseException) -> CheckpointError:
    error = CheckpointError(f"{what}: {describe(exc)}")
    error.__cause__ = exc
    return error


_HOLD = object()  # ``_admit``'s answer for a part copied into memory


class _Spilled(NamedTuple):
    """A part kept in the spill file: ``nbytes`` at ``at``."""

    at: int
    nbytes: int


def _size(part) -> int:
    if isinstance(part, _Spilled):
        return part.nbytes
    return len(part) if isinstance(part, bytes) else sum(len(v) for v in part)


class _FsspecWriter(FileWriter):
    """Positioned writes in, one sequential stream out, in bounded memory.

    The file is opened at once and written front to back. A part that continues the stream is
    written straight from the caller's memory by the thread that brings it, which then writes the
    held parts that follow on. One thread writes to the file at a time (the *writing role*). A
    part that arrives early is copied (the caller may reuse its memory once ``pwrite`` returns)
    while at most ``reorder_bytes`` are held. Beyond that its thread waits (back-pressure), but
    only while progress is certain: a thread is writing, or a thread inside ``pwrite`` brings
    the part the stream needs next; either will move the stream on and wake it. Otherwise the
    next part is still with a caller that may itself be waiting for this one to return (the
    Checkpointer's flusher writes in copy order, not file order, from a finite pool and arena),
    so waiting could deadlock: the part goes to a spill file on local disk (``TMPDIR``) instead,
    and host memory stays bounded. Callers that write in file order from FIFO pools (blocking
    saves, level copies) keep the next part in flight, so they wait: they spill only if the
    stream catches up in the instant between a thread taking the next part and handing it over.

    A failed write fails the writer: every later ``pwrite`` and ``close`` raises, and ``close``
    deletes what was uploaded, so no complete-looking object is left (the manifest is the commit
    marker in any case)."""

    def __init__(self, fs, path: str, name: str, reorder_bytes: int = REORDER_BYTES, open_file=None):
        self.fs, self.path, self.name = fs, path, name
        self.reorder_bytes = reorder_bytes
        self.held = 0  # bytes of early parts held in memory
        self._pos = 0  # bytes written to the stream; changed only by the thread in the writing role
        self._pending: dict[int, object] = {}  # offset -> bytes or _Spilled
        self._offsets: list[int] = []  # heap of the offsets in ``_pending``
        self._arriving: list[int] = []  # offsets of parts inside pwrite, neither written nor pending
        self._writing = False
        self._failure: CheckpointError | None = None
        self._spill = None
        self._spill_end = 0
        self._cond = threading.Condition()
        try:
            self._file = open_file() if open_file is not None else fs.open(path, "wb")
        except Exception as exc:
            raise _error(f"cannot create {name}", exc) from exc

    def pwrite(self, offset: int, views: Sequence[memoryview]) -> None:
        views = [memoryview(v).cast("B") for v in views]
        nbytes = sum(len(v) for v in views)
        if not nbytes:
            return
        with self._cond:
            how = self._admit(offset, nbytes)
        if how is None:
            self._write_out(offset, views)
            return
        try:
            part = b"".join(views) if how is _HOLD else self._spill_out(how, views)
        except Exception as exc:
            what = f"cannot keep bytes [{offset}, {offset + nbytes}) of {self.name} until their turn"
            raise self._fail(what, exc) from exc
        with self._cond:
            if offset in self._pending:
                raise self._fail(f"bytes at {offset} of {self.name} were written twice", None)
            self._pending[offset] = part
            heapq.heappush(self._offsets, offset)
            self._arriving.remove(offset)
            if self._writing or not self._ready(self._offsets[0]):
                return
            self._writing = True  # the stream reached this part while it was being copied
        self._write_out()

    def _admit(self, offset: int, nbytes: int):
        """Under the lock: None to write the part now (the writing role is taken), ``_HOLD`` to
        copy it into memory (room reserved), or where in the spill file to put it; or wait."""
        self._arriving.append(offset)
        while True:
            self._raise_if_failed()
            if offset < self._pos:
                raise self._fail(f"bytes [{offset}, {offset + nbytes}) of {self.name} arrived after the "
                                 f"upload had passed byte {self._pos}", None)
            if not self._writing and self._ready(offset):
                self._writing = True
                self._arriving.remove(offset)
                return None
            if self.held + nbytes <= self.reorder_bytes:
                self.held += nbytes
                return _HOLD
            if not self._writing and not any(map(self._ready, self._arriving)):
                if self._spill is None:
                    try:
                        self._spill = tempfile.TemporaryFile(prefix="statesnap-spill-")
                    except OSError as exc:
                        raise self._fail(f"cannot spill early bytes of {self.name} to {tempfile.gettempdir()}",
                                         exc) from exc
                at, self._spill_end = self._spill_end, self._spill_end + nbytes
                return _Spilled(at, nbytes)
            self._cond.wait()  # the thread writing, or the one bringing the next part, makes progress

    def _ready(self, offset: int) -> bool:
        return offset == self._pos or (self._pos % PAD_ALIGN != 0 and offset == -(-self._pos // PAD_ALIGN) * PAD_ALIGN)

    def _spill_out(self, spilled: _Spilled, views: list[memoryview]) -> _Spilled:
        at, fd = spilled.at, self._spill.fileno()
        for view in views:
            while len(view):
                done = os.pwrite(fd, view, at)
                view, at = view[done:], at + done
        return spilled

    def _write_out(self, offset: int | None = None, part=None, final: bool = False) -> None:
        """In the writing role: write ``part`` at ``offset`` (if given), then the held parts that
        follow on (with ``final``, all of them, gaps filled with zeros); then give up the role."""
        try:
            while True:
                if part is not None:
                    self._write_at(offset, part)
                with self._cond:
                    if part is not None:
                        self._pos = offset + _size(part)
                        self.held -= len(part) if isinstance(part, bytes) else 0
                        self._cond.notify_all()
                    if not self._offsets or not (final or self._ready(self._offsets[0])):
                        self._writing = False
                        self._cond.notify_all()
                        return
                    offset = heapq.heappop(self._offsets)
                    part = self._pending.pop(offset)
                    if offset < self._pos:
                        raise self._fail(f"bytes at {offset} of {self.name} overlap bytes written before", None)
        except BaseException as exc:
            error = self._fail(f"writing {self.name} failed at byte {offset}", exc)  # keeps a first failure
            if isinstance(exc, Exception):
                raise error from exc
            raise

    def _write_at(self, offset: int, part) -> None:
        for start in range(self._pos, offset, WRITE_SLICE):  # padding (or, at close, a gap)
            self._file.write(bytes(min(WRITE_SLICE, offset - start)))
        if isinstance(part, _Spilled):
            for start in range(0, part.nbytes, WRITE_SLICE):
                self._file.write(os.pread(self._spill.fileno(), min(WRITE_SLICE, part.nbytes - start), part.at + start))
            return
        for view in [memoryview(part)] if isinstance(part, bytes) else part:
            for start in range(0, len(view), WRITE_SLICE):
                self._file.write(view[start:start + WRITE_SLICE])

    def _fail(self, what: str, exc: BaseException | None) -> CheckpointError:
        """Fail the writer (the first failure is the one reported) and wake every waiting thread."""
        with self._cond:
            if self._failure is None:
                self._failure = _error(what, exc) if exc is not None else CheckpointError(what)
            self._writing = False
            self._cond.notify_all()
            return self._copy_of_failure()

    def _copy_of_failure(self) -> CheckpointError:
        error = CheckpointError(str(self._failure))
        error.__cause__ = self._failure.__cause__
        return error

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._copy_of_failure()

    def close(self, durable: bool) -> None:
        """Write what is still held, gaps zero-filled, and complete the upload (an object store
        makes the object durable as it completes it). A failed writer deletes its object."""
        try:
            with self._cond:
                while self._writing:  # a pwrite still under way: callers close after theirs return
                    self._cond.wait()
                self._raise_if_failed()
                self._writing = True
            self._write_out(final=True)
            try:
                self._file.close()
            except Exception as exc:
                raise self._fail(f"completing {self.name} failed", exc) from exc
        except BaseException:
            self._discard()
            raise
        finally:
            if self._spill is not None:
                self._spill.close()

    def _discard(self) -> None:
        """Best effort, on the way to raising the failure that matters: abort the upload (closing
        a buffered file would complete it with what it has) and delete whatever was stored."""
        try:
            if isinstance(self._file, ParallelUpload):
                self._file.abort()
            elif isinstance(self._file, AbstractBufferedFile):
                self._file.discard()
                self._file.closed = True
            else:
                self._file.close()
        except Exception:  # noqa: BLE001 (the write's failure is raised instead)
            pass
        try:
            self.fs.rm(self.path)
        except Exception:  # noqa: BLE001 (nothing stored, or a store failing as well)
            pass


class _FsspecReader(FileReader):
    """Ranged reads: each ``readinto`` is one request for its bytes (a ranged GET on S3), retried
    on its own; the load's reader threads keep several in flight."""

    def __init__(self, fs, path: str, name: str, retry: RetryPolicy):
        self.fs, self.path, self.name, self.retry = fs, path, name, retry
        try:
            self._size = retry.call(f"size of {name}", fs.size, path)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise _error(f"cannot open {name}", exc) from exc

    def readinto(self, offset: int, views: Sequence[memoryview]) -> int:
        total = sum(len(v) for v in views)
        end = min(offset + total, self._size)
        try:
            data = self.retry.call(f"reading bytes [{offset}, {end}) of {self.name}", self._ranged, offset,
                                   end) if end > offset else b""
        except Exception as exc:
            raise _error(f"reading bytes [{offset}, {end}) of {self.name} failed", exc) from exc
        pos = 0
        for view in views:
            chunk = data[pos:pos + len(view)]
            view[:len(chunk)] = chunk
            pos += len(chunk)
        return len(data)

    def _ranged(self, offset: int, end: int) -> bytes:
        """Bytes ``[offset, end)``, all of them: a store's short answer inside the object (a cut
        connection, a proxy) is sent again, as a failed request is, rather than taken for the
        end of a truncated file; a longer one (a store that ignores the range) is an error."""
        data = self.fs.cat_file(self.path, start=offset, end=end)
        if len(data) < end - offset:
            raise _ShortAnswer(f"the store answered {len(data)} bytes for bytes [{offset}, {end}) of {self.name}, "
                               f"which holds {self._size}")
        if len(data) > end - offset:
            raise OSError(errno.EIO, f"the store answered {len(data)} bytes for the {end - offset} bytes [{offset}, "
                                     f"{end}) of {self.name}: it may not take ranged reads")
        return data

    def size(self) -> int:
        return self._size

    def close(self) -> None:
        pass


class _ShortAnswer(ConnectionError):
    """A ranged read answered short: a ``ConnectionError``, so that it is retried (storage/retry.py)."""


class FsspecBackend(StorageBackend):
    def __init__(self, url: str, storage_options: dict | None = None):
        self.protocol = url.split("://", 1)[0]
        options = dict(storage_options or {})
        self.s3 = self.protocol in S3_PROTOCOLS
        try:
            self.retry = RetryPolicy(options.pop("retries", 5), options.pop("retry_backoff_s", 0.2),
                                     options.pop("retry_max_backoff_s", 10.0))
            if self.s3:
                options = _s3_options(options)
            self.fs, _ = fsspec.core.url_to_fs(url, **options)
        # ImportError: fsspec knows the protocol but its package (gcsfs, adlfs, ...) is not
        # installed; ValueError: a protocol fsspec does not know, or an option it refuses
        except (ImportError, ValueError, TypeError) as exc:
            raise _error(f"cannot open {url}", exc) from exc
        if self.s3:
            # s3fs's own retries (a class attribute, not an option): one try. This instance is
            # statesnap's (fsspec caches instances by options, and botocore's retries are off in these).
            self.fs.retries = 1
            self.part_bytes = self.fs.default_block_size
            self.parts_in_flight = options.get("max_concurrency") or max(1, S3_UPLOAD_WINDOW // self.part_bytes)

    def _strip(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def _call(self, what: str, fn, *args, **kwargs):
        return self.retry.call(what, fn, *args, **kwargs)

    def join(self, base: str, *names: str) -> str:
        return "/".join([base.rstrip("/"), *names])

    def exists(self, path: str) -> bool:
        return self._call(f"looking for {path}", self.fs.exists, self._strip(path))

    def listdir(self, path: str) -> list[str]:
        try:
            names = self._call(f"listing {path}", self.fs.ls, self._strip(path), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in names)

    def remove(self, path: str) -> None:
        try:
            self._call(f"deleting {path}", self.fs.rm, self._strip(path), recursive=True)
        except FileNotFoundError:
            pass

    def open_write(self, path: str, durable: bool = False) -> FileWriter:
        stripped, open_file = self._strip(path), None
        if self.s3:
            open_file = lambda: ParallelUpload(self.fs, stripped, self.part_bytes, self.parts_in_flight,  # noqa: E731
                                               self.retry)
        return _FsspecWriter(self.fs, stripped, path, REORDER_BYTES, open_file)

    def open_read(self, path: str) -> FileReader:
        return _FsspecReader(self.fs, self._strip(path), path, self.retry)

    def write_bytes(self, path: str, data: bytes, durable: bool, exclusive: bool = False) -> None:
        # One PUT (up to 100 MiB on S3): the object appears whole or not at all, which is what
        # makes the manifest, written last, the commit marker. Exclusive: fsspec's mode "create",
        # a conditional PUT on S3 (If-None-Match); on a store that refuses those (some speaking
        # S3's API answer 501), a look first, once said in the log.
        if exclusive and self.fs not in _NO_CONDITIONAL_WRITES:
            try:
                self._call(f"writing {path}", self.fs.pipe_file, self._strip(path), data, mode="create")
                return
            except FileExistsError:
                raise
            except Exception as exc:
                if answered(exc, {"PreconditionFailed"}, 412):  # (s3fs says FileExistsError only for some 412s)
                    raise FileExistsError(errno.EEXIST, f"{path} exists", path) from exc
                # (a TypeError naming the mode: an fsspec store from before pipe_file took one)
                if not (answered(exc, {"NotImplemented"}, NOT_IMPLEMENTED)
                        or isinstance(exc, TypeError) and "mode" in str(exc)):
                    raise _error(f"writing {path} failed", exc) from exc
                _NO_CONDITIONAL_WRITES.add(self.fs)
                log.warning("statesnap: %s refuses conditional writes (%s): where a file must not exist yet (a save "
                            "without overwrite, a root's lease) statesnap looks first instead, which two writers at "
                            "once can both pass", path, describe(exc))
        if exclusive and self.exists(path):
            raise FileExistsError(errno.EEXIST, f"{path} exists", path)
        try:
            self._call(f"writing {path}", self.fs.pipe_file, self._strip(path), data)
        except Exception as exc:
            raise _error(f"writing {path} failed", exc) from exc

    def read_bytes(self, path: str) -> bytes:
        try:
            return self._call(f"reading {path}", self.fs.cat_file, self._strip(path))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise  # callers tell a missing file from a failing one
        except Exception as exc:
            raise _error(f"reading {path} failed", exc) from exc

    def begin(self, final: str, token: str) -> str:
        self._call(f"creating {final}", self.fs.makedirs, self._strip(final), exist_ok=True)
        return final

    def commit(self, staging: str, final: str, overwrite: bool, durable: bool,
               keep: Sequence[str] = (), replaced: Sequence[str] = ()) -> None:
        # The caller wrote the manifest last into ``staging`` (== ``final``): that was the commit.
        # Another save to this path may be writing its files here now, and nothing tells them
        # from a killed save's: deleting every file the new manifest does not name deleted that
        # save's, and its manifest, committed next, named files that were gone. So only the
        # replaced checkpoint's files go, and files untouched for a day (a killed save's).
        keep, replaced = set(keep), set(replaced)
        abandoned = time.time() - ABANDONED_AFTER_S
        for name, modified in self._listing(final):
            if name not in keep and (name in replaced or (modified is not None and modified < abandoned)):
                self.remove(self.join(final, name))

    def _listing(self, path: str) -> list[tuple[str, float | None]]:
        """(name, last modified as a POSIX time, or None where the store does not say) under ``path``."""
        try:
            found = self._call(f"listing {path}", self.fs.ls, self._strip(path), detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return [(info["name"].rstrip("/").rsplit("/", 1)[-1], _modified(info)) for info in found]

    def abort(self, staging: str, final: str, written: Sequence[str] = ()) -> None:
        # Only this save's files go; their names are unique to it, so no manifest refers to them.
        # Best effort, as a local abort is: a store failing here too must not replace the save's
        # own error (with an OSError, not a CheckpointError). What stays is unreferenced: a commit at
        # this path a day later or the next Checkpointer's start deletes it.
        for name in written:
            try:
                self.remove(self.join(staging, name))
            except Exception as exc:  # noqa: BLE001
                log.warning("statesnap: could not delete %s of a save that failed (%s)", self.join(staging, name),
                            describe(exc))


def _modified(info: dict) -> float | None:
    """When an object was last written, from an fsspec listing's details: each store names it
    its own way (S3 ``LastModified``, GCS ``updated``, local ``mtime``, memory ``created``)."""
    for key in ("LastModified", "last_modified", "mtime", "updated", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                return None
    return None


def _s3_options(options: dict) -> dict:
    """s3fs's options with statesnap's defaults: botocore's retries off, since :class:`RetryPolicy`
    retries every request; the part size of uploads; and no listings cache, whose entries other
    ranks' and jobs' writes make stale (a cached listing without a manifest says "not committed")."""
    options.setdefault("use_listings_cache", False)
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    options["config_kwargs"] = config
    options.setdefault("default_block_size", S3_PART_BYTES)
    return options
