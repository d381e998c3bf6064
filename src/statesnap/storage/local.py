"""Local POSIX backend: positioned vectored I/O that releases the GIL, atomic directory rename.

Commit renames the staging directory with ``renameat2``: ``RENAME_NOREPLACE`` so two savers
cannot both win, ``RENAME_EXCHANGE`` for overwrite so the old checkpoint stays whole and loadable
until the very instant the new one replaces it. Where ``renameat2`` is missing (old kernels, other
file systems) a rename-aside fallback keeps the old checkpoint under a hidden name until the new
one is in place; a kill between its two renames leaves the old checkpoint under that name, and
:meth:`LocalBackend.recover` (called by loads, by the next commit to that name and by the
Checkpointer at start) puts it back.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import shutil
import stat
import threading
from typing import BinaryIO, Sequence

from ..errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from .aligned import BOUNCE, address
from .base import DIRECT_ALIGN, FileReader, FileWriter, StorageBackend

_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100
_IOV_MAX = 1024
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _renameat2 = _libc.renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
except (OSError, AttributeError):
    _renameat2 = None


try:
    _sync_file_range = _libc.sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except (NameError, AttributeError):
    _sync_file_range = None
_SYNC_FILE_RANGE_WRITE = 2
_WRITEBACK_MIN = 1 << 20
_ASIDE_SUFFIX = ".old"  # the old checkpoint during an overwrite without renameat2
_SET_ASIDE = re.compile(rf"\.(.+)\.tmp-[0-9a-f]+{re.escape(_ASIDE_SUFFIX)}")  # (the name it was committed under)
RETIRED_MARK = ".deleting-"  # a checkpoint renamed out of the namespace, being deleted
_RETIRED_HEX = 12  # hex digits after RETIRED_MARK
_FRESH_SUFFIX = ".new"  # a staging directory before it is locked (as long as _ASIDE_SUFFIX)
# staging directory -> the descriptor whose flock says "a live process writes here"
_writing: dict[str, int] = {}
_writing_lock = threading.Lock()
log = logging.getLogger("statesnap")
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIRECT_MIN = 1 << 20


def _rename2(src: str, dst: str, flags: int) -> bool:
    """renameat2; False when the kernel or file system does not support it."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), dst)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwritev_all(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    views, first = [v for v in views if len(v)], 0
    with _naming(path):
        while first < len(views):
            written = os.pwritev(fd, views[first:first + _IOV_MAX], offset)
            offset += written
            # Short writes happen (signals, quotas): drop what went out and retry the rest.
            first, rest = _past(views, first, written)
            if rest:
                views[first] = views[first][rest:]


@contextlib.contextmanager
def _naming(path: str):
    """An OSError of a system call on a descriptor names the file ``path``: a full disk said only
    "[Errno 28] No space left on device", not which checkpoint file it was writing."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, path) from None


def _past(views: list[memoryview], first: int, nbytes: int) -> tuple[int, int]:
    """(index of the view ``nbytes`` past ``views[first]`` ends in, bytes of it already done)."""
    while first < len(views) and nbytes >= len(views[first]):
        nbytes -= len(views[first])
        first += 1
    return first, nbytes


class _LocalWriter(FileWriter):
    def __init__(self, path: str, durable: bool = False, exclusive: bool = False):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC), 0o644)
        # Start writing back each range as soon as it is written, so the disk works while later
        # ranges are still being copied and the final fsync has little left to wait for.
        self.writeback = durable and _sync_file_range is not None
        self._direct_fd: int | None = None  # opened on the first bulk write; -1: not available
        self._direct_refused = False
        self._lock = threading.Lock()

    def pwrite(self, offset: int, views: Sequence[memoryview]) -> None:
        views = [v for v in views if len(v)]
        length = sum(len(v) for v in views)
        _pwritev_all(self.fd, views, offset, self.path)
        if self.writeback and length >= _WRITEBACK_MIN:
            _sync_file_range(self.fd, offset, length, _SYNC_FILE_RANGE_WRITE)

    def pwrite_bulk(self, offset: int, view: memoryview) -> None:
        """Whole blocks go through an ``O_DIRECT`` descriptor: the device reads them from memory
        with no copy into the page cache, no reclaim of it later, and in large requests. Direct
        I/O needs the memory and the file offset at the same distance from a block boundary: the
        staging arena lays snapshots out so, and a durable ``ss.save`` writes whole aligned
        windows (``engine/write.py``); other memory (a converter's tensors) is copied through an
        aligned bounce buffer first. The partial blocks at either end of a range go buffered.

        Saving into a new file on this VM's settled disk, this wrote 1.0-1.5 GB/s where buffered
        writes with early writeback gave 0.56-0.71 (see docs/benchmarks.md)."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if len(view) < _DIRECT_MIN or not self._direct():
            self.pwrite(offset, [view])
        elif (address(view) - offset) % DIRECT_ALIGN:
            self._pwrite_bounced(offset, view)
        else:
            self._pwrite_direct(offset, view)

    def _pwrite_bounced(self, offset: int, view: memoryview) -> None:
        bounce = BOUNCE.take()
        step = len(bounce) - DIRECT_ALIGN
        try:
            for pos in range(0, len(view), step):
                part = view[pos:pos + step]
                skew = (offset + pos) % DIRECT_ALIGN
                ctypes.memmove(address(bounce) + skew, address(part), len(part))  # releases the GIL
                self._pwrite_direct(offset + pos, bounce[skew:skew + len(part)])
        finally:
            BOUNCE.give(bounce)

    def _pwrite_direct(self, offset: int, view: memoryview) -> None:
        head = min(-offset % DIRECT_ALIGN, len(view))
        body = (len(view) - head) // DIRECT_ALIGN * DIRECT_ALIGN
        if body and not self._direct_refused:
            try:
                _pwritev_all(self._direct_fd, [view[head:head + body]], offset + head, self.path)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_refused = True  # the file system took O_DIRECT but not these writes
                body = 0
        if not body:
            self.pwrite(offset, [view])
            return
        self.pwrite(offset, [view[:head]])
        self.pwrite(offset + head + body, [view[head + body:]])

    def bypasses_cache(self) -> bool:
        return self._direct()

    def _direct(self) -> bool:
        with self._lock:
            if self._direct_fd is None:
                try:
                    self._direct_fd = os.open(self.path, os.O_WRONLY | _O_DIRECT) if _O_DIRECT else -1
                except OSError:  # tmpfs and many FUSE file systems refuse O_DIRECT
                    self._direct_fd = -1
            return self._direct_fd >= 0 and not self._direct_refused

    def close(self, durable: bool) -> None:
        try:
            if durable:
                with _naming(self.path):
                    os.fsync(self.fd)  # the inode's: it covers the O_DIRECT descriptor's writes too
        finally:
            os.close(self.fd)
            if self._direct_fd is not None and self._direct_fd >= 0:
                os.close(self._direct_fd)


def _open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at ``path``. Opened non-blocking, so that a
    FIFO put where a checkpoint's file was opens at once instead of waiting for a writer forever
    (reads of regular files ignore the flag); anything but a regular file is refused unread. A
    symbolic link is followed to the file it names (a download cache such as Hugging Face's
    links every file of a snapshot into its blob store): that file must be a regular file too,
    and its bytes pass a checkpoint's checksums like any others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise CorruptCheckpointError(f"{path} is a symbolic link that loops (or one of too long a chain), not the "
                                     "regular file a checkpoint holds there") from None
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        if kind == stat.S_IFDIR:  # as open() itself says it
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        what = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
                stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}.get(kind, "not a regular file")
        raise CorruptCheckpointError(f"{path} is {what}, not the regular file a checkpoint holds there")
    return fd


def _read_ahead(paths: list[str]) -> None:
    for path in paths:
        try:
            fd = _open_regular(path)  # (a FIFO or a device in a file's place is never read)
        except (OSError, CheckpointError):
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def open_source(path: str) -> BinaryIO:
    """The regular file at ``path`` opened for reading, for importing a foreign checkpoint, as a
    statesnap checkpoint's own files are opened: a symbolic link is followed, and anything that
    is not a regular file (a FIFO, which would block the open until a writer came) is a
    :class:`CorruptCheckpointError` naming it."""
    return open(_open_regular(path), "rb")


class _LocalReader(FileReader):
    def __init__(self, path: str):
        self.fd = _open_regular(path)
        self._mapping: mmap.mmap | None = None
        self._lock = threading.Lock()

    def stream(self) -> FileReader | None:
        """A new open file description (its own readahead state) of the very file this one read,
        even if another has taken its name since: ``/proc/self/fd`` reopens the inode. None
        (share this reader) where that cannot be done: no ``/proc``, or no descriptor left."""
        try:
            return type(self)(f"/proc/self/fd/{self.fd}")
        except OSError:
            return None

    def map(self, offset: int, nbytes: int) -> memoryview | None:
        if nbytes <= 0 or offset + nbytes > self.size():
            return None
        with self._lock:
            if self._mapping is None:
                # A private mapping is writable as far as Python knows (tensors can view it without
                # warnings) while it shares the page cache's pages as long as nobody writes.
                self._mapping = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY)
        if hasattr(mmap, "MADV_WILLNEED"):  # start reading the whole range ahead if it is cold
            start = offset // mmap.PAGESIZE * mmap.PAGESIZE
            self._mapping.madvise(mmap.MADV_WILLNEED, start, offset + nbytes - start)
        return memoryview(self._mapping)[offset:offset + nbytes]

    def readinto(self, offset: int, views: Sequence[memoryview]) -> int:
        views, first, total = [v for v in views if len(v)], 0, 0
        while first < len(views):
            got = os.preadv(self.fd, views[first:first + _IOV_MAX], offset)
            if got == 0:
                break
            total += got
            offset += got
            first, rest = _past(views, first, got)
            if rest:
                views[first] = views[first][rest:]
        return total

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        os.close(self.fd)
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a view is still alive (an error's traceback): unmapped with it
                pass


def _refuse_long_staging_name(parent: str, name: str, staging_name: str) -> None:
    """A name the file system takes may still be too long for the names a save works under:
    ``.<name>.tmp-<token>``, that with ``.old`` (an overwrite's aside) and ``.<name>.deleting-<hex>``
    (a replaced checkpoint being deleted). Refused naming the user's name and the longest that
    works, not with an OSError about a name the user never chose, perhaps only at an overwrite."""
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # (a file system or platform that does not say)
        return
    own = len(os.fsencode(name))
    longest = max(len(os.fsencode(staging_name)) + len(_ASIDE_SUFFIX), own + 1 + len(RETIRED_MARK) + _RETIRED_HEX)
    if longest > limit:
        raise CheckpointError(f"its name is {own} bytes, and a save works under names up to {longest - own} bytes "
                              f"longer, past this file system's limit of {limit}. Use a name of at most "
                              f"{limit - (longest - own)} bytes")


class LocalBackend(StorageBackend):
    """Plain directories on a POSIX file system (also /dev/shm for a shared-memory level)."""

    def join(self, base: str, *names: str) -> str:
        return os.path.join(base, *names)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def remove(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def open_write(self, path: str, durable: bool = False) -> FileWriter:
        return _LocalWriter(path, durable)

    def open_read(self, path: str) -> FileReader:
        return _LocalReader(path)

    def prefetch(self, paths: Sequence[str]) -> None:
        """``POSIX_FADV_WILLNEED`` on each file, from a thread of its own: the kernel starts
        reading them into the page cache, and the call itself may wait for the disk's queue."""
        if hasattr(os, "posix_fadvise"):  # (not on macOS)
            threading.Thread(target=_read_ahead, args=(list(paths),), name="statesnap-prefetch",
                             daemon=True).start()

    def write_bytes(self, path: str, data: bytes, durable: bool, exclusive: bool = False) -> None:
        writer = _LocalWriter(path, exclusive=exclusive)
        try:
            writer.pwrite(0, [memoryview(data)])
        finally:
            writer.close(durable)

    def read_bytes(self, path: str) -> bytes:
        with open(_open_regular(path), "rb") as f:
            return f.read()

    def begin(self, final: str, token: str) -> str:
        final = os.path.abspath(final)
        parent, name = os.path.split(final)
        os.makedirs(parent, exist_ok=True)
        staging = os.path.join(parent, f".{name}.tmp-{token}")
        _refuse_long_staging_name(parent, name, os.path.basename(staging))
        _remove_abandoned_staging(parent, name)
        # made under another name and locked before it takes its own, so that no other
        # process's ``_remove_abandoned_staging`` sees it unlocked
        os.makedirs(staging + _FRESH_SUFFIX)
        try:
            fd = os.open(staging + _FRESH_SUFFIX, os.O_RDONLY | os.O_DIRECTORY)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(staging + _FRESH_SUFFIX)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without flock: its leftovers stay for a Checkpointer's start
            pass
        try:
            os.rename(staging + _FRESH_SUFFIX, staging)
        except BaseException:  # (no sweep removes a directory of this name, and the descriptor was kept open)
            os.close(fd)
            shutil.rmtree(staging + _FRESH_SUFFIX, ignore_errors=True)
            raise
        with _writing_lock:
            _writing[staging] = fd
        return staging

    def commit(self, staging: str, final: str, overwrite: bool, durable: bool,
               keep: Sequence[str] = (), replaced: Sequence[str] = ()) -> None:
        final = os.path.abspath(final)
        parent = os.path.dirname(final)
        if durable:
            fsync_dir(staging)
        # An overwrite killed halfway left the checkpoint at ``final`` aside: it is still the one
        # there (loads put it back), so this save replaces it only as an overwrite.
        self.recover(final)
        if os.path.exists(final):
            if not overwrite:
                raise CheckpointExistsError(f"{final} already exists; pass overwrite=True to replace it")
            self._replace(staging, final)
        else:
            try:
                if not _rename2(staging, final, _RENAME_NOREPLACE):
                    os.rename(staging, final)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    raise CheckpointExistsError(f"{final} appeared while saving; not replacing it") from None
                raise
        try:
            # No aside outlives a commit: a later kill would leave two, and a load might take the
            # older; one left half deleted would come back if ``final`` went.
            for aside in self._asides(final):
                self._delete_hidden(aside, final)
            if durable:
                fsync_dir(parent)
        except OSError as exc:  # said as what it is: the checkpoint replaced is gone, the new one in place
            raise OSError(exc.errno, f"{final} holds the new checkpoint, but what follows its rename failed "
                                     f"({exc.strerror or exc}): it may not survive a crash of this machine") from exc
        _release(os.path.abspath(staging))

    def _replace(self, staging: str, final: str) -> None:
        if _rename2(staging, final, _RENAME_EXCHANGE):
            # ``staging`` now holds the old checkpoint (or the link the user had there): it is
            # deleted only after the swap
            self.remove(staging)
            return
        os.rename(final, staging + _ASIDE_SUFFIX)  # deleted by ``commit`` once the new one is in
        os.rename(staging, final)

    def retire(self, path: str, marker: str) -> None:
        """Rename the checkpoint to a hidden name (atomic), make the rename durable, then delete:
        a kill at any moment leaves either the whole checkpoint or nothing at its name."""
        path = os.path.abspath(path)
        self._delete_hidden(path, path, durable=True)

    def _delete_hidden(self, path: str, final: str, durable: bool = False) -> None:
        """Rename ``path`` to a hidden name of ``final``'s that nothing puts back (a leftover a
        Checkpointer's start removes), then delete it: a kill while deleting leaves no aside."""
        parent, name = os.path.split(final)
        hidden = os.path.join(parent, f".{name}{RETIRED_MARK}{os.urandom(_RETIRED_HEX // 2).hex()}")
        try:
            os.rename(path, hidden)
        except FileNotFoundError:
            return
        if durable:
            fsync_dir(parent)
        self.remove(hidden)  # (a link is unlinked: what it points to is not this checkpoint's)

    def _asides(self, final: str) -> list[str]:
        """The checkpoints interrupted overwrites of ``final`` left aside."""
        parent, name = os.path.split(final)
        # exactly a staging name of ``final`` (a hex token): ``ck.tmp-x``'s asides are not ``ck``'s
        return [os.path.join(parent, n) for n in self.listdir(parent) if self.set_aside_for(n) == name]

    def set_aside_for(self, name: str) -> str | None:
        match = _SET_ASIDE.fullmatch(name)
        return match.group(1) if match else None

    def recover(self, final: str) -> bool:
        final = os.path.abspath(final)
        if os.path.exists(final):
            return False
        asides = self._asides(final)
        if not asides:
            return False
        # it was committed at ``final`` before; of several (left by an older version), the one
        # put aside last (a rename changes the inode's ctime)
        try:
            os.rename(max(asides, key=lambda aside: os.stat(aside).st_ctime_ns), final)
        except FileNotFoundError:  # another thread or process put it back (or deleted it) first
            return os.path.exists(final)
        fsync_dir(os.path.dirname(final))
        return True

    def abort(self, staging: str, final: str, written: Sequence[str] = ()) -> None:
        if os.path.abspath(staging) == os.path.abspath(final):
            raise CheckpointError("refusing to remove a committed checkpoint while aborting a save")
        shutil.rmtree(staging, ignore_errors=True)
        _release(os.path.abspath(staging))


def _release(staging: str) -> None:
    """Drop the lock ``begin`` took on ``staging`` (committed or removed by now)."""
    with _writing_lock:
        fd = _writing.pop(staging, None)
    if fd is not None:
        os.close(fd)


def _remove_abandoned_staging(parent: str, name: str) -> None:
    """Remove the staging directories of ``name`` that no live process holds: what a save, an
    export or a conversion killed while writing left (as large as the checkpoint), which nothing
    else would ever delete. A writer holds an ``flock`` on its directory until it commits or
    aborts, and the kernel drops it when the writer dies, ``kill -9`` included; a directory still
    locked is another job's save in progress and is left alone."""
    own = re.compile(rf"\.{re.escape(name)}\.tmp-[0-9a-f]+")
    for entry in os.listdir(parent):
        if not own.fullmatch(entry):
            continue
        path = os.path.join(parent, entry)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile (committed, aborted), or not a directory of ours
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a save in progress (or no flock here, so no telling)
            continue
        else:
            # (by name: had its writer committed since the listing, the name is gone and this
            # removes nothing)
            log.info("statesnap: removing %s, left by a save that was interrupted", path)
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
