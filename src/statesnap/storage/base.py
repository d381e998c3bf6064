"""The storage seam: a backend moves bytes and knows nothing of tensors, ranks or manifests.

A save writes every file into a *staging* location returned by :meth:`begin`, then
:meth:`commit` makes it visible at the final path in one atomic step (a directory rename on
POSIX; the manifest written last on object stores). Readers only ever see committed checkpoints.
"""
from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from typing import Sequence

# Direct I/O wants file offsets, lengths and memory on device blocks (at most 4 KiB on the disks
# checkpoints go to): memory handed to pwrite_bulk at the same distance from such a boundary as
# its file offset can skip the page cache.
DIRECT_ALIGN = 4096


class FileWriter(ABC):
    """A file being written with positioned writes; safe to call from several threads."""

    @abstractmethod
    def pwrite(self, offset: int, views: Sequence[memoryview]) -> None: ...

    def pwrite_bulk(self, offset: int, view: memoryview) -> None:
        """Write one large range that must reach stable storage and that nobody will read back
        soon (a durable save; a checkpoint flushed from the staging arena). Backends that can
        bypass the page cache do so: it keeps the host's memory for training, and where ``view``
        lies at the same distance from a :data:`DIRECT_ALIGN` boundary as ``offset`` it saves a
        copy of every byte. The default is a plain :meth:`pwrite`."""
        self.pwrite(offset, [view])

    def bypasses_cache(self) -> bool:
        """Whether :meth:`pwrite_bulk` sends memory on a :data:`DIRECT_ALIGN` boundary, at an
        offset on one, straight to the device. A writer that must copy unaligned memory anyway
        then lays the file out in aligned buffers itself, in whole blocks (``engine/write.py``)."""
        return False

    @abstractmethod
    def close(self, durable: bool) -> None:
        """Close the file; with ``durable`` its bytes are on stable storage when this returns."""


class FileReader(ABC):
    """A file opened for ranged reads straight into caller-owned buffers; thread-safe."""

    @abstractmethod
    def readinto(self, offset: int, views: Sequence[memoryview]) -> int:
        """Fill ``views`` in order from ``offset``; return the bytes read (short only at EOF)."""

    def map(self, offset: int, nbytes: int) -> memoryview | None:
        """The bytes ``[offset, offset + nbytes)`` in place, without a copy (a local file's page
        cache), for reads that only pick parts out of a range; None where the backend cannot map
        them or the file is shorter (callers then read into a buffer)."""
        return None

    def stream(self) -> "FileReader | None":
        """Another reader of this same file for one thread that reads a stretch of it in order
        (the caller closes it), where a reader of its own reads faster: a local file's readahead
        follows each open file's access pattern, and threads sharing one see random reads. None:
        share this reader."""
        return None

    @abstractmethod
    def size(self) -> int: ...

    @abstractmethod
    def close(self) -> None: ...


class StorageBackend(ABC):
    """Where checkpoints live: a local file system, shared memory, or an fsspec URL."""

    @abstractmethod
    def join(self, base: str, *names: str) -> str: ...

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path`` (empty if it does not exist)."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Delete a file or a whole directory tree; a missing path is not an error."""

    @abstractmethod
    def open_write(self, path: str, durable: bool = False) -> FileWriter:
        """A new file; ``durable`` says it will be closed durably, so a backend may start
        writing it back to stable storage while later parts are still being written."""

    @abstractmethod
    def open_read(self, path: str) -> FileReader: ...

    def prefetch(self, paths: Sequence[str]) -> None:
        """A hint that the files at ``paths`` are about to be read whole: a backend may start
        reading them in the background, so that a load's disk reads overlap the work it does
        before it reads (parsing the manifest, planning). Nothing waits for it and nothing it
        meets is an error: the reads that follow check everything. The default does nothing."""

    @abstractmethod
    def write_bytes(self, path: str, data: bytes, durable: bool, exclusive: bool = False) -> None:
        """Write ``data`` as the whole file ``path``. ``exclusive``: a ``FileExistsError`` where
        a file is there already, decided atomically where the store can (an S3 conditional PUT),
        so that of two saves to one path without ``overwrite`` only one commits."""

    @abstractmethod
    def read_bytes(self, path: str) -> bytes: ...

    @abstractmethod
    def begin(self, final: str, token: str) -> str:
        """Prepare and return the staging location for a save that will commit to ``final``."""

    @abstractmethod
    def commit(self, staging: str, final: str, overwrite: bool, durable: bool,
               keep: Sequence[str] = (), replaced: Sequence[str] = ()) -> None:
        """Make ``staging`` visible at ``final`` atomically. ``keep`` names the committed files;
        backends that write in place delete, after the switch, the files of the checkpoint it
        replaced (``replaced``) that it does not keep, and files no save has written to for long."""

    def retire(self, path: str, marker: str) -> None:
        """Delete the committed checkpoint at ``path`` so that it leaves the namespace in one
        step: a deletion cut short must not leave a half-deleted checkpoint under its committed
        name, where listings and other tools would take it for one. The default removes the commit
        marker first (on object stores a checkpoint without it does not exist), then the rest."""
        self.remove(self.join(path, marker))
        self.remove(path)

    def recover(self, final: str) -> bool:
        """Put back a checkpoint that an interrupted :meth:`commit` left under another name, if
        any; True if one was restored. Backends whose commit is one atomic step have none."""
        return False

    def set_aside_for(self, name: str) -> str | None:
        """The name of the checkpoint that the entry ``name`` holds, set aside by an interrupted
        :meth:`commit` (:meth:`recover` puts it back), or None: so that a root of thousands of
        leftovers is not searched once for each."""
        return None

    @abstractmethod
    def abort(self, staging: str, final: str, written: Sequence[str] = ()) -> None:
        """Remove what a failed save left behind (``written`` names its files), never touching a
        committed checkpoint."""


def write_new(backend: StorageBackend, path: str, data: bytes, durable: bool) -> None:
    """``backend.write_bytes(..., exclusive=True)``: a ``FileExistsError`` where a file is at
    ``path`` already. A backend written before ``exclusive`` (its own ``write_bytes`` takes three
    arguments) gets a look first and a plain write, which two writers at once can both pass."""
    try:
        backend.write_bytes(path, data, durable, exclusive=True)
    except TypeError as exc:
        if "exclusive" not in str(exc):
            raise
        if backend.exists(path):
            raise FileExistsError(errno.EEXIST, f"{path} exists", path) from None
        backend.write_bytes(path, data, durable)
