"""A file system that fails on purpose: ``faulty://``, for the tests and the chaos suite.

A real disk or object store fails in the middle of a save or a load (EIO, ENOSPC, a dropped
connection), at whatever operation was under way. :class:`FaultyFileSystem` wraps fsspec's memory
file system (or the local one) and raises ``OSError`` on the Nth read or the Nth write, counted
across everything the test runs against it, so a test can first count the operations of a save
(no fault) and then fail each of them in turn: every failure must surface as a
``CheckpointError`` and leave no partial checkpoint visible.

Counted operations: a *write* is opening a file for writing, each ``write`` call on it, and
each whole-file ``pipe_file`` (the manifest's PUT); a *read* is opening a file for reading, each
``read`` call on it, and each ``cat_file`` (ranged or whole). Listings, ``info``, directory
creation and deletion are not counted: they move no file bytes.

    faults = Faults(fail_write=3, errno=errno.ENOSPC)
    ss.save(state, "faulty://bucket/step-1", storage_options={"faults": faults})

Importing this module registers the ``faulty`` protocol with fsspec.
"""
from __future__ import annotations

import errno as errnos
import os
import threading
from dataclasses import dataclass, field

import fsspec
from fsspec.spec import AbstractFileSystem

PROTOCOL = "faulty"


@dataclass
class Faults:
    """Which operation fails, and what happened so far. ``fail_read``/``fail_write``: the
    1-based number of the read or write that raises (None: none). ``sticky``: every operation of
    that kind from the Nth on fails too (a disk that stays full), until the test clears it.
    ``reads``/``writes`` count the operations; ``injected`` says which failed and where."""

    fail_read: int | None = None
    fail_write: int | None = None
    errno: int = errnos.EIO
    sticky: bool = False
    reads: int = 0
    writes: int = 0
    injected: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reset(self, fail_read: int | None = None, fail_write: int | None = None) -> "Faults":
        """Clear the counts and arm the next faults (the test's loop over N)."""
        with self._lock:
            self.fail_read, self.fail_write = fail_read, fail_write
            self.reads = self.writes = 0
            self.injected.clear()
        return self

    def tick(self, kind: str, path: str) -> None:
        """Count one ``kind`` ("read" or "write") operation on ``path``; raise if it is the one."""
        with self._lock:
            if kind == "read":
                self.reads += 1
                count, armed = self.reads, self.fail_read
            else:
                self.writes += 1
                count, armed = self.writes, self.fail_write
            if armed is None or count < armed or (count > armed and not self.sticky):
                return
            self.injected.append(f"{kind} #{count} of {path}")
        raise OSError(self.errno, f"injected fault: {os.strerror(self.errno)} on {kind} #{count}", path)


class _FaultyFile:
    """A file of the wrapped file system whose reads or writes count (and may fail)."""

    def __init__(self, inner, faults: Faults, path: str):
        self._inner, self._faults, self._path = inner, faults, path

    def write(self, data) -> int:
        self._faults.tick("write", self._path)
        return self._inner.write(data)

    def read(self, size: int = -1) -> bytes:
        self._faults.tick("read", self._path)
        return self._inner.read(size)

    def seek(self, loc: int, whence: int = 0) -> int:
        return self._inner.seek(loc, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def close(self) -> None:
        self._inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FaultyFileSystem(AbstractFileSystem):
    """``faulty://PATH``: ``PATH`` on the ``target_protocol`` file system ("memory" by default,
    or "file"), with the faults of the ``faults`` storage option."""

    protocol = PROTOCOL
    cachable = False  # each instance carries its test's Faults; fsspec must not hand out another's

    def __init__(self, faults: Faults | None = None, target_protocol: str = "memory", **kwargs):
        super().__init__(**kwargs)
        self.faults = faults if faults is not None else Faults()
        self.inner = fsspec.filesystem(target_protocol)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith(PROTOCOL + "://"):
            path = path[len(PROTOCOL) + 3:]
        return path.rstrip("/") or "/"

    def _open(self, path, mode="rb", **kwargs):
        self.faults.tick("write" if "r" not in mode else "read", path)
        return _FaultyFile(self.inner.open(path, mode), self.faults, path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        self.faults.tick("read", path)
        return self.inner.cat_file(path, start=start, end=end)

    def pipe_file(self, path, value, **kwargs):
        self.faults.tick("write", path)
        return self.inner.pipe_file(path, value)

    def ls(self, path, detail=True, **kwargs):
        return self.inner.ls(path, detail=detail)

    def info(self, path, **kwargs):
        return self.inner.info(path)

    def exists(self, path, **kwargs):
        return self.inner.exists(path)

    def makedirs(self, path, exist_ok=False):
        return self.inner.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path, create_parents=True, **kwargs):
        return self.inner.mkdir(path, create_parents=create_parents)

    def rm(self, path, recursive=False, maxdepth=None):
        return self.inner.rm(path, recursive=recursive, maxdepth=maxdepth)


fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)

__all__ = ["Faults", "FaultyFileSystem", "PROTOCOL"]
