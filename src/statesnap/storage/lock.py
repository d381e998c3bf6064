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
  and the next opener takes it; a missing lease is free, and one that cannot be read as a lease
  counts as held (``take_over=True`` claims it). The holder reads it again before every commit
  and deletion (see :class:`LeaseClaim` for what that covers and what it cannot).

Either way the file says who holds the root, so a second opener's error can name the holder.
``take_over=True`` claims a root that is held anyway (a job on a dead node whose lock or lease has
not expired yet): the old holder, if it still runs, notices at its next commit or deletion and
stops with a ``CheckpointError`` instead of deleting the new owner's checkpoints.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
from abc import ABC, abstractmethod

from ..errors import CheckpointError, described
from .base import StorageBackend, write_new
from .local import LocalBackend

LOCK_NAME = ".statesnap-lock"
LEASE_NAME = ".statesnap-lease.json"
TAKE_OVER_HINT = ("If that job is gone (its node died) and the claim has not expired yet, pass "
                  "take_over=True to claim the root anyway")

_held_here: dict[str, str] = {}  # lock path -> token of the claim this process holds on it
_held_lock = threading.Lock()


def _forget_claims_in_child() -> None:
    """A forked child holds none of its parent's claims: a Checkpointer it makes on the parent's
    root was told the root is used "in this process", and the lock may have been copied held."""
    global _held_lock
    _held_lock = threading.Lock()
    _held_here.clear()


os.register_at_fork(after_in_child=_forget_claims_in_child)
log = logging.getLogger("statesnap")


class RootBusyError(CheckpointError):
    """Another live job (or another Checkpointer in this process) owns the checkpoint root."""


class LeaseUnreachableError(OSError):
    """The storage failed to read or write a root's lease: it says nothing of another job, and
    the Checkpointer handles it as the outage it is (it may start without the level)."""


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
                raise RootBusyError(
                    f"{root} is already used by another Checkpointer in this process "
                    f"({describe_holder(self._read_holder())}): close() it first, or pass take_over=True to claim "
                    "the root from it (then it stops committing and deleting there). A Checkpointer dropped "
                    "without close() keeps its claim for the life of the process: its threads hold it")
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
            how = (f"lost its lock file {self.path} (the root was deleted or moved?)" if not os.path.lexists(self.path)
                   else f"was taken over by {describe_holder(self._read_holder())}")
            raise RootBusyError(f"{self.root} {how}; this Checkpointer no longer commits or deletes checkpoints "
                                "there (close it; a new one claims the root again)")

    def release(self) -> None:
        with _held_lock:
            if _held_here.get(self.path) == self.token:
                del _held_here[self.path]
            # Unlocked first: the lock belongs to the open file, which a child forked meanwhile (a
            # DataLoader's persistent worker) holds too, and closing this descriptor alone left the
            # root locked against the next Checkpointer until the child exited. The file stays, so
            # no opener races an unlink.
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)


class LeaseClaim(RootClaim):
    """A lease object on storage without locks, renewed every third of its length.

    A lease is read, then written, then read back. Where none was found the write is exclusive
    (``_store``), so two jobs starting at once cannot both claim the root. Object stores offer no
    compare-and-swap of an object that exists through fsspec, so two openers taking over one
    stale lease within one round trip of each other could both read back their own lease: that
    window is what remains. Everything else is checked:

    * :meth:`check` (before every commit and deletion, through :class:`ClaimedBackend`) reads the
      lease object (one GET). Another holder's lease, a deleted one or an unreadable one means
      the claim is lost, for good: this holder stops and never writes the lease again. A read
      that fails fails that check only.
    * Time: the stored ``expires`` is wall-clock time (``time.time()`` taken before the write,
      plus ``lease_s``), because other hosts compare it with their own clocks. The holder itself
      trusts its lease until ``time.monotonic()`` taken before its last successful write, plus
      ``lease_s``, so a changed wall clock on its host cannot stretch it. Hosts sharing a root
      must keep their clocks in step (NTP) to well under ``lease_s / 3``: a host whose clock runs
      ``d`` seconds ahead sees a lease go stale ``d`` seconds early, and only the renewals every
      ``lease_s / 3`` keep a live holder's lease ahead of it.
    * A renewal that fails (any exception: fsspec backends raise ``CheckpointError``) changes
      nothing; the renewer tries again after ``lease_s / 10``. Once the holder's own deadline has
      passed, ``check`` fails, unless the stored lease is still this holder's: then it renews
      it first (read, write, read back) and goes on. So a late renewal recovers; a lease that
      someone else took by then stays lost.
    """

    def __init__(self, root: str, backend: StorageBackend, take_over: bool, lease_s: float,
                 token: str | None = None):
        super().__init__(root)
        self.backend, self.lease_s = backend, lease_s
        self.path = backend.join(root, LEASE_NAME)
        self.token = token or uuid.uuid4().hex
        self.expires: float | None = None  # the wall-clock expiry last stored
        self._deadline = float("-inf")  # time.monotonic() until which this holder's lease stands
        self._since = time.time()
        self._lost: str | None = None  # why the claim is gone for good
        self._renewing = threading.Lock()  # one read-write-read of the lease at a time
        self.renew_errors = 0  # renewals that failed (and were retried)
        kind = None
        if not take_over:
            kind, found = self._look()
            if kind == "error":
                raise LeaseUnreachableError(f"the lease at {self.path} cannot be read ({found})")
            if kind == "garbled":
                raise RootBusyError(f"{root} may be owned by another job: the lease at {self.path} is unreadable "
                                    f"({found}). take_over=True claims the root anyway (only if no other job "
                                    f"uses it).")
            if kind == "held" and found["expires"] > time.time() and found["token"] != self.token:
                raise RootBusyError(f"{root} is owned by another job: {describe_holder(found)}, whose lease runs "
                                    f"for {found['expires'] - time.time():.0f} s more unless renewed. "
                                    f"{TAKE_OVER_HINT}.")
        try:
            self._store(exclusive=kind == "free")
        except Exception as exc:  # noqa: BLE001 (any storage library's error)
            self._forget()  # (a write reported failed may have landed)
            raise LeaseUnreachableError(f"the lease at {self.path} cannot be written: {described(exc)}") from exc
        kind, found = self._look()  # another opener that wrote at the same moment reads back too
        if kind == "error":
            self._forget()
            raise LeaseUnreachableError(f"reading back this job's lease at {self.path} failed ({found})")
        if kind != "held" or found["token"] != self.token:
            raise RootBusyError(f"{root} was not claimed: " + (
                f"{describe_holder(found)} claimed it at the same moment" if kind == "held" else
                f"this job's lease at {self.path} was replaced by an unreadable one ({found})" if kind == "garbled"
                else f"this job's lease at {self.path} was deleted right after it was written"))
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="statesnap-lease", daemon=True)
        self._renewer.start()

    # ----------------------------------------------------------------- the lease object

    def _forget(self) -> None:
        """After a claim that failed once its lease may have been written: delete the lease if it
        is this one's, where the storage answers (else the next claim with the same token, or
        its expiry, frees it). Read, then delete, as :meth:`release` does, with the same window:
        a take-over between the two loses its fresh lease, and its next check says so."""
        try:
            kind, found = self._look()
            if kind == "held" and found["token"] == self.token:
                self.backend.remove(self.path)
        except Exception:  # noqa: BLE001 (the storage is failing: nothing more to do)
            pass

    def _look(self) -> tuple[str, dict | str | None]:
        """What the lease object holds: ("free", None) if there is none, ("held", record) for a
        valid lease, ("garbled", why) for one that cannot be read as a lease, ("error", why) if
        reading it failed (storage error: it may be anything)."""
        try:
            raw = self.backend.read_bytes(self.path)
        except FileNotFoundError:
            return "free", None
        except Exception as exc:  # OSError, or the CheckpointError of an fsspec backend
            return "error", f"reading it failed: {type(exc).__name__}: {exc}"
        record = _parse_record(raw)
        if record is None:
            return "garbled", f"{len(raw)} bytes that are not a JSON object"
        token, expires = record.get("token"), record.get("expires")
        if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
            return "garbled", f"its expiry is {expires!r}, not a time"
        if not isinstance(token, str) or not token:
            return "garbled", "it names no owner token"
        return "held", record

    def _store(self, exclusive: bool = False) -> None:
        """Write this holder's lease; only once the write succeeded does the holder trust it,
        until ``lease_s`` after a moment taken before the write. ``exclusive`` (a root found
        free): the write fails where a lease appeared meanwhile, atomically where the storage
        can (an S3 conditional PUT, a link on a file system), so that of two jobs starting at
        once only one claims the root; the read-back after it tells another opener's lease from
        this one's that landed before a retried PUT."""
        started, now_wall = time.monotonic(), time.time()
        expires = now_wall + self.lease_s
        data = json.dumps({**_holder_record(self.token, expires), "since": self._since}).encode()
        try:
            if isinstance(self.backend, LocalBackend):
                # A file system without flock: write a new file and rename it over the lease (link
                # it, where it must not replace one), so that no reader ever sees a lease truncated
                # or half written (it would count as garbled).
                scratch = f"{self.path}.tmp-{self.token}"
                self.backend.write_bytes(scratch, data, True)
                try:
                    _put_in_place(scratch, self.path, exclusive)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(scratch)
            elif exclusive:
                write_new(self.backend, self.path, data, True)
            else:  # an object store's PUT replaces the object at once
                self.backend.write_bytes(self.path, data, True)
        except FileExistsError:
            if not exclusive:
                raise
        self.expires, self._deadline = expires, started + self.lease_s

    def _lose(self, kind: str, found) -> RootBusyError:
        if self._lost is None:
            self._lost = (
                f"taken over by {describe_holder(found)}" if kind == "held" else
                f"its lease at {self.path} was deleted (by a job that took the root over, or by hand)" if kind == "free"
                else f"its lease at {self.path} was replaced by an unreadable one ({found})")
        return self._lost_error()

    def _lost_error(self) -> RootBusyError:
        return RootBusyError(f"{self.root}: this Checkpointer lost its claim ({self._lost}); it no longer "
                             "commits or deletes checkpoints there")

    def _renew_once(self, only_if_expired: bool = False) -> None:
        """Read the lease; if it is still this holder's, write it again, then read it back.
        Raises the lost claim's ``RootBusyError`` if it is not, and any storage error as is."""
        with self._renewing:
            if self._lost is not None:
                raise self._lost_error()
            if only_if_expired and time.monotonic() < self._deadline:
                return  # renewed by the renewer meanwhile
            kind, found = self._look()
            if kind == "error":
                raise CheckpointError(f"{self.root}: the lease at {self.path} could not be renewed: {found}")
            if kind != "held" or found["token"] != self.token:
                raise self._lose(kind, found)
            self._store()
            kind, found = self._look()  # another opener that wrote meanwhile has its lease read back too
            if kind != "error" and (kind != "held" or found["token"] != self.token):
                raise self._lose(kind, found)

    def _renew(self) -> None:
        interval = self.lease_s / 3
        while not self._stop.wait(interval):
            try:
                self._renew_once()
                interval = self.lease_s / 3
            except Exception:  # noqa: BLE001 - a renewer that dies leaves the lease to expire
                if self._lost is not None:
                    return
                self.renew_errors += 1
                interval = self.lease_s / 10  # storage trouble: try again soon; check() fails once it expires

    # ----------------------------------------------------------------- RootClaim

    def check(self) -> None:
        """Read the lease (one GET): raise unless it is still this holder's and not expired
        (an expired one that is still ours is renewed first)."""
        if self._lost is not None:
            raise self._lost_error()
        kind, found = self._look()
        if kind == "error":
            raise CheckpointError(f"{self.root}: cannot confirm this Checkpointer's claim on the root, the lease "
                                  f"at {self.path} could not be read ({found}); nothing is committed or deleted")
        if kind != "held" or found["token"] != self.token:
            raise self._lose(kind, found)
        if time.monotonic() < self._deadline:
            return
        try:  # our lease, but expired: renewals failed or came late, and any opener may take it now
            self._renew_once(only_if_expired=True)
        except RootBusyError:
            raise
        except Exception as exc:
            raise RootBusyError(f"{self.root}: this Checkpointer's lease expired and could not be renewed ({exc}); "
                                "nothing is committed or deleted until a renewal succeeds") from exc

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this holder's. fsspec has no
        conditional delete, so the lease is read and then deleted: a job that takes the root
        over (``take_over=True``) in the round trip between the two loses its fresh lease, and
        its next check stops it. Outside that, only a lease that has not expired is deleted:
        an expired one may already be another opener's, and is free for the next one anyway."""
        self._stop.set()
        self._renewer.join()
        with self._renewing:
            ours = self._lost is None and time.monotonic() < self._deadline
            self._lost = self._lost or "released"
            if not ours:
                return
            kind, found = self._look()
            if kind == "held" and found["token"] == self.token:
                try:
                    self.backend.remove(self.path)
                except Exception as exc:  # noqa: BLE001 - the lease then expires on its own
                    log.warning("statesnap: could not delete the lease %s (%s); it expires in %.0f s", self.path,
                                exc, self._deadline - time.monotonic())


def claim_root(root: str, backend: StorageBackend, take_over: bool = False, lease_s: float = 60.0,
               token: str | None = None) -> RootClaim:
    """Claim ``root`` for this job: a ``flock`` where the backend is a POSIX file system, a lease
    elsewhere. Raises :class:`RootBusyError` naming the holder if another job holds it. ``token``:
    the lease's owner token, the same at every claim of one level, so that a lease an earlier
    claim wrote and could not confirm is taken for this job's own."""
    if isinstance(backend, LocalBackend):
        try:
            return FlockClaim(root, take_over)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # a file system without flock (some FUSE mounts): fall back to a lease file
    return LeaseClaim(root, backend, take_over, lease_s, token)


def held_root_above(path: str) -> tuple[str, str] | None:
    """(the nearest directory above ``path`` on a local file system that a live Checkpointer holds,
    the name of its entry that ``path`` lies in), or None. A lock held in this process is known
    from the registry; one held by another is looked for among the kernel's ``flock``s
    (``/proc/locks``; where that cannot be read, only this process's are found), never by
    taking it, which would make that job's own claim fail meanwhile."""
    child = os.path.realpath(path)
    parent = os.path.dirname(child)
    while parent != child:
        lock = os.path.join(parent, LOCK_NAME)
        if os.path.isfile(lock) and _flock_held(lock):
            return parent, os.path.relpath(os.path.realpath(path), parent).split(os.sep)[0]
        child, parent = parent, os.path.dirname(parent)
    return None


def held_root_within(path: str) -> str | None:
    """A directory under ``path`` (a local directory) that a live Checkpointer holds as its root,
    or None: found as :func:`held_root_above` finds one."""
    for top, _, names in os.walk(path):
        if LOCK_NAME in names and _flock_held(os.path.join(os.path.realpath(top), LOCK_NAME)):
            return top
    return None


def _flock_held(lock: str) -> bool:
    with _held_lock:
        if lock in _held_here:
            return True
    try:
        st = os.stat(lock)
        device_inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            return any("FLOCK" in line and device_inode in line.split() for line in f)
    except OSError:
        return False


# what link() answers on a file system without hard links (FUSE mounts of object stores, some)
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV}


def _put_in_place(scratch: str, path: str, exclusive: bool) -> None:
    """Move the lease written at ``scratch`` to ``path``: exclusive, by a hard link, which fails
    where a lease is there already; else, or where the file system has no hard links, by a
    rename over it."""
    if exclusive:
        try:
            os.link(scratch, path)
            return
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
    os.replace(scratch, path)


class ClaimedBackend:
    """A claimed root's backend: each commit and deletion first checks that the claim still
    holds, so a job whose root was taken over cannot delete or replace the new owner's work.

    A write, a staging step, a commit or a deletion that fails asks whether the claim was lost
    meanwhile: the new owner's start-up cleanup deletes the old one's staging directories, so
    the old owner's next write there fails with a bare ``FileNotFoundError`` whose real cause is
    the take-over, and that is what it reports. Reads pass through untouched: a missing file is
    an answer there, not a failure."""

    # write_bytes: on an object store a save writes its manifest in place, and that write is the
    # commit; checked after it, a lost claim would leave the old owner's manifest over the new one's
    _CHECKED_FIRST = frozenset({"commit", "remove", "retire", "recover", "write_bytes"})
    _EXPLAINED = _CHECKED_FIRST | {"open_write", "begin", "abort"}

    def __init__(self, backend: StorageBackend, claim: RootClaim):
        self._backend, self.claim = backend, claim

    def __getattr__(self, name: str):
        if name.startswith("_"):  # copy/pickle look for these before __init__ ran
            raise AttributeError(name)
        found = getattr(self._backend, name)
        if name not in self._EXPLAINED:
            return found
        check_first = name in self._CHECKED_FIRST

        def call(*args, **kwargs):
            if check_first:
                self.claim.check()
            try:
                return found(*args, **kwargs)
            except Exception as exc:
                self._explain(exc)
                raise
        return call

    def _explain(self, exc: Exception) -> None:
        """Raise the lost claim's error (caused by ``exc``) if the claim is gone; else return."""
        try:
            self.claim.check()
        except RootBusyError as lost:
            raise lost from exc
        except Exception:  # noqa: BLE001 - the claim could not be checked: the failure stands as is
            pass
