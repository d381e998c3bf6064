"""One job per checkpoint root: an exclusive claim held for a Checkpointer's whole life.

Two Checkpointers on one root destroy each other's work: the second one's start-up cleanup takes
the first one's staging directories for leftovers of a crash, and its retention deletes the first
one's checkpoints. So a Checkpointer claims its root before it touches anything there:

* **POSIX file systems** (local disks, ``/dev/shm``, NFS, Lustre, GPFS): an exclusive ``flock``
  on ``<root>/.statesnap-lock``. The kernel drops it when the holder dies, however it dies
  (``kill -9`` included), so a crashed job leaves no stale lock on a local disk; on NFS the
  server frees a dead client's lock when that client's lease runs out.
* **Object stores** (no locks): a lease object ``<root>/.statesnap-lease.json`` naming the owner,
  host, pid and an expiry, renewed in the background. A lease not renewed by its expiry is stale
  and the next opener takes it.

Either way the file says who holds the root, so a second opener's error can name the holder.
``take_over=True`` claims a root that is held anyway (a job on a dead node whose lock or lease has
not expired yet): the old holder, if it still runs, notices at its next commit or deletion and
stops with a ``CheckpointError`` instead of deleting the new owner's checkpoints.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from abc import ABC, abstractmethod

from ..errors import CheckpointError
from .base import StorageBackend
from .local import LocalBackend

LOCK_NAME = ".statesnap-lock"
LEASE_NAME = ".statesnap-lease.json"
TAKE_OVER_HINT = ("If that job is gone (its node died) and the claim has not expired yet, pass "
                  "take_over=True to claim the root anyway")

_held_here: dict[str, str] = {}  # lock path -> token of the claim this process holds on it
_held_lock = threading.Lock()


class RootBusyError(CheckpointError):
    """Another live job (or another Checkpointer in this process) owns the checkpoint root."""


def _holder_record(token: str, expires: float | None = None) -> dict:
    record = {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
              "command": " ".join(sys.argv)[:200]}
    if expires is not None:
        record["expires"] = expires
    return record


def describe_holder(record: dict | None) -> str:
    if not record:
        return "an unknown holder"
    since = record.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"pid {record.get('pid', '?')} on host {record.get('host', '?')} (since {when}, {record.get('command', '')!r})"


def _parse_record(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


class RootClaim(ABC):
    """A held claim on a root. ``check`` raises once the claim was lost (taken over, expired)."""

    def __init__(self, root: str):
        self.root = root

    @abstractmethod
    def check(self) -> None: ...

    @abstractmethod
    def release(self) -> None: ...


class FlockClaim(RootClaim):
    """``flock`` on a file in the root. Locks are per open file, so a second Checkpointer in the
    same process conflicts too; a registry covers NFS, where Linux emulates ``flock`` with
    per-process POSIX locks that would not."""

    def __init__(self, root: str, take_over: bool):
        super().__init__(root)
        os.makedirs(root, exist_ok=True)
        self.path = os.path.join(os.path.realpath(root), LOCK_NAME)
        self.token = uuid.uuid4().hex
        with _held_lock:
            if self.path in _held_here and not take_over:
                raise RootBusyError(f"{root} is already used by another Checkpointer in this process; "
                                    "close it first")
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    os.close(fd)
                    if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise
                    holder = self._read_holder()
                    if not take_over:
                        raise RootBusyError(f"{root} is owned by another job: {describe_holder(holder)}. A root "
                                            f"holds one job's checkpoints at a time. {TAKE_OVER_HINT}.") from None
                    self._unlink()  # the old holder keeps a lock on a file no longer at this name
                    continue
                if self._same_file(fd):  # not unlinked by a take-over between our open and our lock
                    break
                os.close(fd)
            self.fd = fd
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_holder_record(self.token)).encode(), 0)
            os.fsync(fd)
            _held_here[self.path] = self.token

    def _read_holder(self) -> dict | None:
        try:
            with open(self.path, "rb") as f:
                return _parse_record(f.read(4096))
        except OSError:
            return None

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _same_file(self, fd: int) -> bool:
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (at_path.st_dev, at_path.st_ino) == (mine.st_dev, mine.st_ino)

    def check(self) -> None:
        with _held_lock:
            ours = _held_here.get(self.path) == self.token and self._same_file(self.fd)
        if not ours:
            raise RootBusyError(f"{self.root} was taken over by {describe_holder(self._read_holder())}; this "
                                "Checkpointer no longer commits or deletes checkpoints there")

    def release(self) -> None:
        with _held_lock:
            if _held_here.get(self.path) == self.token:
                del _held_here[self.path]
            os.close(self.fd)  # closing drops the flock; the file stays, so no opener races an unlink


class LeaseClaim(RootClaim):
    """A lease object on storage without locks, renewed every third of its length. Object stores
    offer no compare-and-swap through fsspec, so two openers that write within the same instant
    could both read back their own lease; the read-back after writing narrows that to a window
    of one round trip, and every commit and deletion checks the lease again."""

    def __init__(self, root: str, backend: StorageBackend, take_over: bool, lease_s: float):
        super().__init__(root)
        self.backend, self.lease_s = backend, lease_s
        self.path = backend.join(root, LEASE_NAME)
        self.token = uuid.uuid4().hex
        self._lost: str | None = None
        holder = self._read()
        if holder is not None and holder.get("token") != self.token and not take_over and \
                float(holder.get("expires", 0)) > time.time():
            raise RootBusyError(f"{root} is owned by another job: {describe_holder(holder)}, whose lease runs "
                                f"for {float(holder['expires']) - time.time():.0f} s more unless renewed. "
                                f"{TAKE_OVER_HINT}.")
        self._write()
        if (self._read() or {}).get("token") != self.token:
            raise RootBusyError(f"{root} was claimed by {describe_holder(self._read())} at the same moment")
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="statesnap-lease", daemon=True)
        self._renewer.start()

    def _read(self) -> dict | None:
        try:
            return _parse_record(self.backend.read_bytes(self.path))
        except (FileNotFoundError, OSError):
            return None

    def _write(self) -> None:
        self.expires = time.time() + self.lease_s
        self.backend.write_bytes(self.path, json.dumps(_holder_record(self.token, self.expires)).encode(), True)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            holder = self._read()
            if holder is not None and holder.get("token") != self.token:
                self._lost = f"taken over by {describe_holder(holder)}"
                return
            try:
                self._write()
            except OSError:
                pass  # try again next round; check() reports the lease lost once it expires

    def check(self) -> None:
        if self._lost is None and time.time() > self.expires:
            self._lost = "its lease expired before it could be renewed"
        if self._lost is not None:
            raise RootBusyError(f"{self.root}: this Checkpointer lost its claim ({self._lost}); it no longer "
                                "commits or deletes checkpoints there")

    def release(self) -> None:
        self._stop.set()
        self._renewer.join()
        if self._lost is None and (self._read() or {}).get("token") == self.token:
            self.backend.remove(self.path)


def claim_root(root: str, backend: StorageBackend, take_over: bool = False, lease_s: float = 60.0) -> RootClaim:
    """Claim ``root`` for this job: a ``flock`` where the backend is a POSIX file system, a lease
    elsewhere. Raises :class:`RootBusyError` naming the holder if another job holds it."""
    if isinstance(backend, LocalBackend):
        try:
            return FlockClaim(root, take_over)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # a file system without flock (some FUSE mounts): fall back to a lease file
    return LeaseClaim(root, backend, take_over, lease_s)


class ClaimedBackend:
    """A claimed root's backend: each commit and deletion first checks that the claim still
    holds, so a job whose root was taken over cannot delete or replace the new owner's work.
    Everything else passes through unchanged."""

    def __init__(self, backend: StorageBackend, claim: RootClaim):
        self._backend, self.claim = backend, claim

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def commit(self, *args, **kwargs) -> None:
        self.claim.check()
        self._backend.commit(*args, **kwargs)

    def remove(self, path: str) -> None:
        self.claim.check()
        self._backend.remove(path)

    def retire(self, path: str, marker: str) -> None:
        self.claim.check()
        self._backend.retire(path, marker)

    def recover(self, final: str) -> bool:
        self.claim.check()
        return self._backend.recover(final)
