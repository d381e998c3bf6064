"""One job per checkpoint root: a second Checkpointer on a root another live job owns is refused
with the holder's name, a take-over is explicit and stops the old owner from deleting anything,
and a retention cut short never leaves a ``step-N`` that is not a whole checkpoint."""
import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import weakref

import pytest
import torch

import statesnap as ss
from dist_utils import local_level
from statesnap.bench.faults import Faults
from statesnap.storage import backend_for
from statesnap.storage.local import LocalBackend
from statesnap.storage.lock import (LEASE_NAME, ClaimedBackend, FlockClaim, LeaseClaim, LeaseUnreachableError,
                                    RootBusyError)


def _state(value):
    return {"t": torch.full((1000,), float(value))}


def _holder(root, ready):
    """A child process that owns ``root`` with a Checkpointer in flight until killed."""
    code = textwrap.dedent(f"""
        import time, torch, statesnap as ss
        ckpt = ss.Checkpointer({str(root)!r}, keep_last=3, host_memory_gb=0.05)
        for step in range(1, 4):
            ckpt.save(step, {{"t": torch.full((1000,), float(step))}}).wait()
        open({str(ready)!r}, "w").close()
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 120
    while not os.path.exists(ready):
        assert proc.poll() is None and time.monotonic() < deadline, "holder did not start"
        time.sleep(0.05)
    return proc


def test_second_job_is_refused_and_touches_nothing(tmp_path):
    root = tmp_path / "ckpt"
    holder = _holder(root, tmp_path / "ready")
    try:
        os.makedirs(root / ".step-9.tmp-abcdef")  # looks like the holder's save in flight
        with pytest.raises(RootBusyError, match=rf"owned by another job: pid {holder.pid} on host"):
            ss.Checkpointer(root, keep_last=1, host_memory_gb=0.05)
        assert sorted(n for n in os.listdir(root) if "step" in n) == [".step-9.tmp-abcdef", "step-1", "step-2",
                                                                      "step-3"]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # kill -9 frees the lock: the next job needs no take-over, and cleans up the leftovers
    with ss.Checkpointer(root, keep_last=1, host_memory_gb=0.05) as ckpt:
        state = _state(0)
        assert ckpt.load_latest(state) == 3 and torch.equal(state["t"], _state(3)["t"])
    assert sorted(n for n in os.listdir(root) if "step" in n) == ["step-1", "step-2", "step-3"]


def test_a_root_inside_a_step_of_another_job_s_root_is_refused(tmp_path):
    """A root inside another live job's step-1 was claimed: that job's retention then deleted it,
    checkpoints and lock included. A root beside the steps (a sub-directory of its own) is not
    deleted by retention, and is still allowed."""
    root = tmp_path / "ckpt"
    holder = _holder(root, tmp_path / "ready")  # another process: its flock is found in /proc/locks
    try:
        for inner in (root / "step-2" / "nested", root / ".step-9.tmp-abcdef" / "x"):
            with pytest.raises(ss.CheckpointError, match=rf"lies inside {inner.parent.name} of {root}, the root of a "
                                                         "running Checkpointer"):
                ss.Checkpointer(inner, host_memory_gb=0.05)
        assert not (root / "step-2" / "nested").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with ss.Checkpointer(root, keep_last=1, host_memory_gb=0.05) as outer:  # this process: its registry
        outer.save(4, _state(4)).wait()
        with pytest.raises(ss.CheckpointError, match="lies inside step-4"):
            ss.Checkpointer(root / "step-4" / "inner", host_memory_gb=0.05)
        with ss.Checkpointer(root / "other-run", host_memory_gb=0.05) as beside:
            beside.save(1, _state(2)).wait()
        outer.save(5, _state(5)).wait()
    assert torch.equal(ss.open(root / "other-run" / "step-1").read("t"), _state(2)["t"])


def test_retention_keeps_a_step_that_holds_a_live_root_started_while_its_job_was_not_running(tmp_path):
    """A root claimed inside a step of a job that was not running was deleted with that step by the
    job's retention once it ran again: the inner job's checkpoints and lock gone."""
    with ss.Checkpointer(tmp_path / "run", keep_last=1, host_memory_gb=0.05) as first:
        first.save(5, _state(5)).wait()
    with ss.Checkpointer(tmp_path / "run" / "step-5" / "inner", host_memory_gb=0.05) as inner:
        inner.save(1, _state(1)).wait()
        with ss.Checkpointer(tmp_path / "run", keep_last=1, host_memory_gb=0.05) as again:
            with pytest.warns(RuntimeWarning, match="step 5 at .* is not deleted by retention: it holds .*inner"):
                again.save(6, _state(6)).wait()
        inner.save(2, _state(2)).wait()
    assert torch.equal(ss.open(tmp_path / "run" / "step-5" / "inner" / "step-2").read("t"), _state(2)["t"])
    with ss.Checkpointer(tmp_path / "run", keep_last=1, host_memory_gb=0.05) as last:  # no job holds it now
        last.save(7, _state(7)).wait()
    assert sorted(n for n in os.listdir(tmp_path / "run") if n.startswith("step-")) == ["step-7"]


def test_second_checkpointer_in_one_process_is_refused_until_the_first_closes(tmp_path):
    first = ss.Checkpointer(tmp_path, host_memory_gb=0.05)
    with pytest.raises(RootBusyError, match="another Checkpointer in this process"):
        ss.Checkpointer(tmp_path, host_memory_gb=0.05)
    first.close()
    ss.Checkpointer(tmp_path, host_memory_gb=0.05).close()


def test_a_checkpointer_dropped_without_close_can_be_taken_over_in_process(tmp_path):
    dropped = []

    def train():  # the loop dies without close() or `with`: its threads keep the Checkpointer alive
        ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.05)
        dropped.append(weakref.ref(ckpt))
        ckpt.save(1, _state(1)).wait()
        raise RuntimeError("NaN loss")
    with pytest.raises(RuntimeError):
        train()
    gc.collect()
    with pytest.raises(RootBusyError, match="close\\(\\) it first, or pass take_over=True"):
        ss.Checkpointer(tmp_path, host_memory_gb=0.05)
    with ss.Checkpointer(tmp_path, host_memory_gb=0.05, take_over=True) as ckpt:
        state = _state(0)
        assert ckpt.load_latest(state) == 1
        ckpt.save(2, _state(2)).wait()
        old = dropped[0]()
        if old is not None:  # still alive (its threads hold it): it no longer commits or deletes
            with pytest.raises(ss.CheckpointError, match="taken over"):
                old.save(3, _state(3)).wait()
            old.close()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-1", "step-2"]


def test_take_over_stops_the_old_owner_from_committing_or_deleting(tmp_path):
    old = ss.Checkpointer(tmp_path, keep_last=1, host_memory_gb=0.05)
    old.save(1, _state(1)).wait()
    new = ss.Checkpointer(tmp_path, keep_last=3, host_memory_gb=0.05, take_over=True)
    new.save(2, _state(2)).wait()
    with pytest.raises(ss.CheckpointError, match="taken over"):
        old.save(3, _state(3)).wait()  # would commit step-3 and, keeping 1, delete steps 1 and 2
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-1", "step-2"]
    old.close()
    new.save(4, _state(4)).wait()
    new.close()
    for step in (1, 2, 4):
        assert torch.equal(ss.open(tmp_path / f"step-{step}").read("t"), _state(step)["t"])


def test_a_write_that_fails_after_a_take_over_names_the_take_over(tmp_path):
    """The new owner's start-up cleanup deletes the old owner's staging directories: the old
    owner's next write there fails, and must say that the root was taken over, not just
    FileNotFoundError."""
    old_claim = FlockClaim(str(tmp_path), take_over=False)
    backend = ClaimedBackend(LocalBackend(), old_claim)
    manifest = str(tmp_path / ".step-5.tmp-gone" / "manifest.json")
    with pytest.raises(FileNotFoundError):  # still the owner: the failure stands as it is
        backend.write_bytes(manifest, b"{}", False)
    new_claim = FlockClaim(str(tmp_path), take_over=True)
    with pytest.raises(RootBusyError, match=f"{tmp_path} was taken over by pid {os.getpid()}") as caught:
        backend.open_write(str(tmp_path / ".step-5.tmp-gone" / "data.bin"))
    assert isinstance(caught.value.__cause__, FileNotFoundError)
    with pytest.raises(RootBusyError, match="taken over"):  # a manifest's write reads the claim first
        backend.write_bytes(manifest, b"{}", False)
    with pytest.raises(FileNotFoundError):  # a read's missing file is an answer, not a failure
        backend.read_bytes(manifest)
    assert backend.join("a", "b") == LocalBackend().join("a", "b")  # what succeeds passes through
    new_claim.release()
    old_claim.release()


def test_object_store_lease_names_the_holder_and_expires(tmp_path):
    root = f"memory://lease-test-{os.getpid()}/root"
    first = ss.Checkpointer(root, host_memory_gb=0.05, lease_s=6)
    with pytest.raises(RootBusyError, match=rf"pid {os.getpid()} on host .*lease runs for"):
        ss.Checkpointer(root, host_memory_gb=0.05)
    first.save(1, _state(1)).wait()
    time.sleep(7)  # past the first expiry; renewed every 2 s in the background: still held
    with pytest.raises(RootBusyError):
        ss.Checkpointer(root, host_memory_gb=0.05)
    first.close()  # releases the lease
    second = ss.Checkpointer(root, host_memory_gb=0.05, lease_s=3)
    state = _state(0)
    assert second.load_latest(state) == 1 and torch.equal(state["t"], _state(1)["t"])
    second.close()


def test_a_lease_that_is_not_renewed_goes_stale_and_its_holder_stops():
    """The holder's renewer is stopped and joined, not only told to stop: a renewal it had begun
    (this thread kept off the CPU for the renewer's second) would store an expiry after the
    sleep below, and the new claim would be refused."""
    root = f"memory://stale-lease-{os.getpid()}/root"
    backend = backend_for(root)
    # the holder's node froze: no more renewals
    old = _by_hand(LeaseClaim(root, backend, take_over=False, lease_s=3))
    with pytest.raises(RootBusyError):
        LeaseClaim(root, backend, take_over=False, lease_s=3)
    time.sleep(3.2)
    new = LeaseClaim(root, backend, take_over=False, lease_s=3)
    with pytest.raises(RootBusyError, match="lost its claim"):
        old.check()
    new.check()
    new.release()


@pytest.mark.parametrize("storage", ["object store", "file system without flock"])
def test_two_jobs_that_both_find_a_root_free_do_not_both_claim_it(tmp_path, monkeypatch, storage):
    """Both read 'no lease' before either wrote one: the second one's write is exclusive (a
    conditional PUT, a link), so it is refused naming the first, whose lease stays as it was."""
    root = f"memory://both-free-{uuid.uuid4().hex[:8]}/root" if storage == "object store" else str(tmp_path)
    backend = backend_for(root)
    first = _by_hand(LeaseClaim(root, backend, take_over=False, lease_s=60))
    held = _stored(backend, root)
    looked = LeaseClaim._look
    answers = iter([("free", None)])  # what the second job read before the first one's lease was there
    monkeypatch.setattr(LeaseClaim, "_look", lambda self: next(answers, None) or looked(self))
    with pytest.raises(RootBusyError, match=f"was not claimed: pid {held['pid']} on host .* claimed it at the same"):
        LeaseClaim(root, backend, take_over=False, lease_s=60)
    assert _stored(backend, root) == held
    first.check()
    first.release()
    assert not backend.exists(backend.join(root, LEASE_NAME))


def test_a_backend_written_before_exclusive_writes_still_claims_and_saves():
    """A StorageBackend subclass whose write_bytes takes (path, data, durable), as the ABC declared
    before exclusive writes: its root is claimed and its saves commit (a look first instead)."""
    from statesnap.storage.fsspec_backend import FsspecBackend

    class Counting(FsspecBackend):
        def write_bytes(self, path, data, durable):
            self.written = getattr(self, "written", 0) + len(data)
            super().write_bytes(path, data, durable)

    root = f"memory://before-exclusive-{uuid.uuid4().hex[:8]}/root"
    backend = Counting(root)
    with ss.Checkpointer(root, backend=backend) as ckpt:
        ckpt.save(1, _state(1)).wait()
    assert backend.written > 0
    with ss.Checkpointer(root, backend=Counting(root)) as ckpt:
        state = _state(0)
        assert ckpt.load_latest(state) == 1 and torch.equal(state["t"], _state(1)["t"])


def test_a_lease_file_system_without_hard_links_renames_it_into_place(tmp_path, monkeypatch):
    """A mount with neither flock nor hard links (FUSE mounts of object stores answer EPERM):
    the lease is renamed into place, as where it replaces one, instead of failing the claim."""
    import errno

    def no_link(*args):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    claim = _by_hand(LeaseClaim(str(tmp_path), LocalBackend(), take_over=False, lease_s=3))
    assert os.listdir(tmp_path) == [LEASE_NAME] and _stored(LocalBackend(), str(tmp_path))["token"] == claim.token
    claim.check()
    claim.release()


def _lease_root(name):
    faults = Faults()
    root = f"faulty://{name}-{os.getpid()}-{time.monotonic_ns()}/root"
    return root, backend_for(root, {"faults": faults}), faults


def _stored(backend, root):
    import json
    return json.loads(backend.read_bytes(backend.join(root, LEASE_NAME)))


def _stored_raw(backend, root):
    return backend.read_bytes(backend.join(root, LEASE_NAME))


def _by_hand(claim):
    """Stop the claim's renewer, so that the test drives each renewal itself."""
    claim._stop.set()
    claim._renewer.join()
    return claim


@pytest.mark.parametrize("fault", ["read", "write"])
def test_a_lease_the_storage_cannot_read_or_write_is_an_outage_not_another_job(tmp_path, fault):
    """An object store that is down at a restart: its lease cannot be read (or written) and
    that is an outage, not 'owned by another job', so a job with a node-local level starts
    without the store and restores from the node, as for any other outage."""
    root, backend, faults = _lease_root(f"outage-{fault}")
    settings = dict(local_root=tmp_path / "local", storage_options={"faults": faults}, host_memory_gb=0.05)
    with ss.Checkpointer(root, **settings) as ckpt:
        ckpt.save(1, _state(1)).wait()
    faults.sticky = True
    faults.reset(**{f"fail_{fault}": 1})
    with pytest.raises(LeaseUnreachableError, match="injected fault"):
        LeaseClaim(root, backend, take_over=False, lease_s=3)
    with pytest.raises(ss.CheckpointError, match="cannot keep checkpoints under"):
        ss.Checkpointer(root, storage_options={"faults": faults}, host_memory_gb=0.05)
    with pytest.warns(RuntimeWarning, match="starting without the persistent level"):
        ckpt = ss.Checkpointer(root, **settings)
    with ckpt:
        state = _state(0)
        assert ckpt.load_latest(state) == 1 and ckpt.loaded_from == "local"
        assert torch.equal(state["t"], _state(1)["t"])


@pytest.mark.parametrize("forget_fails", [False, True])
def test_a_lease_written_but_not_read_back_is_never_taken_for_another_job(tmp_path, monkeypatch, forget_fails):
    """The store fails the read-back of the lease this job just wrote: the job starts without the
    level; the lease left there (deleted if the store answers, else kept) is this job's own at
    the next claim, which persists the next step instead of failing it as 'owned by another job'."""
    root = f"memory://read-back-{forget_fails}-{uuid.uuid4().hex[:8]}/root"
    real_look = LeaseClaim._look
    looks = {"n": 0}

    def flaky(self):
        looks["n"] += 1
        failing = (2, 3) if forget_fails else (2,)  # the read-back, and the look before deleting
        return ("error", "reading it failed: ConnectionError: test") if looks["n"] in failing else real_look(self)

    monkeypatch.setattr(LeaseClaim, "_look", flaky)
    with pytest.warns(RuntimeWarning, match="starting without the persistent level"):
        ckpt = ss.Checkpointer(root, local_root=tmp_path / "local", host_memory_gb=0.05, lease_s=30)
    monkeypatch.setattr(LeaseClaim, "_look", real_look)
    with ckpt:
        assert ckpt.persistent.unreachable is not None
        ckpt.save(1, _state(1)).wait()
        assert ckpt.persistent.unreachable is None and ckpt.persistent.is_committed(1)
    second = ss.Checkpointer(root, host_memory_gb=0.05)  # closed: the lease was released
    state = _state(0)
    assert second.load_latest(state) == 1 and second.loaded_from == "persistent"
    second.close()


def test_a_failed_renewal_extends_nothing_and_the_next_one_renews():
    root, backend, faults = _lease_root("renew")
    claim = _by_hand(LeaseClaim(root, backend, take_over=False, lease_s=3))
    deadline, expires = claim._deadline, _stored(backend, root)["expires"]
    assert claim.expires == expires
    faults.reset(fail_write=1)  # the fsspec backend raises CheckpointError, not OSError
    with pytest.raises(ss.CheckpointError, match="injected fault"):
        claim._renew_once()
    assert (claim._deadline, claim.expires, _stored(backend, root)["expires"]) == (deadline, expires, expires)
    claim._renew_once()
    assert claim._deadline > deadline and claim.expires == _stored(backend, root)["expires"] > expires
    claim.release()


class _FailingWrites:
    """A backend whose lease writes number ``fail`` raise; ``renewed`` is set by the first
    successful write after them."""

    def __init__(self, backend, fail):
        self._backend, self.fail, self.writes = backend, set(fail), 0
        self.renewed = threading.Event()

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def write_bytes(self, path, data, durable, exclusive=False):
        self.writes += 1
        if self.writes in self.fail:
            raise ss.CheckpointError(f"writing {path} failed: injected")
        self._backend.write_bytes(path, data, durable, exclusive)
        if self.writes > max(self.fail):
            self.renewed.set()


def test_the_renewer_survives_a_failed_renewal():
    root = f"memory://renewer-{os.getpid()}/root"
    backend = _FailingWrites(backend_for(root), fail=[2, 3])  # write 1 claims; the next two renewals fail
    claim = LeaseClaim(root, backend, take_over=False, lease_s=3)
    try:
        assert backend.renewed.wait(20), "no renewal after the failed ones"
        assert claim._renewer.is_alive() and claim.renew_errors == 2
        claim.check()
    finally:
        claim.release()


def test_an_expired_lease_that_is_still_ours_recovers_and_a_taken_one_stays_lost():
    root, backend, faults = _lease_root("expired")
    claim = _by_hand(LeaseClaim(root, backend, take_over=False, lease_s=3))
    claim._deadline = time.monotonic() - 1  # renewals failed or came late: the lease expired
    faults.reset(fail_write=1)
    with pytest.raises(RootBusyError, match="lease expired and could not be renewed"):
        claim.check()  # the renewal it tries first fails: nothing commits
    faults.reset()
    before = time.monotonic()
    claim.check()  # still ours: renewed, and on it goes
    assert claim._deadline >= before + 3 and _stored(backend, root)["token"] == claim.token
    claim._deadline = time.monotonic() - 1
    new = _by_hand(LeaseClaim(root, backend, take_over=True, lease_s=3))
    for _ in range(2):  # lost for good: neither check nor a renewal writes the lease again
        with pytest.raises(RootBusyError, match="lost its claim \\(taken over by pid"):
            claim.check()
        with pytest.raises(RootBusyError, match="lost its claim"):
            claim._renew_once()
    assert _stored(backend, root)["token"] == new.token
    new.check()
    new.release()
    claim.release()


def test_every_commit_and_deletion_reads_the_lease():
    root, backend, faults = _lease_root("window")
    old = _by_hand(LeaseClaim(root, backend, take_over=False, lease_s=60))
    claimed = ClaimedBackend(backend, old)
    faults.reset()
    old.check()
    claimed.remove(backend.join(root, "nothing-there"))
    assert faults.reads == 2  # one GET each
    new = _by_hand(LeaseClaim(root, backend, take_over=True, lease_s=60))
    backend.write_bytes(backend.join(root, "step-1", "a"), b"x", True)
    for call in (lambda: claimed.commit(backend.join(root, "step-1"), backend.join(root, "step-1"), False, True),
                 lambda: claimed.remove(backend.join(root, "step-1")),
                 lambda: claimed.retire(backend.join(root, "step-1"), "manifest.json"),
                 lambda: claimed.recover(backend.join(root, "step-1"))):
        with pytest.raises(RootBusyError, match="taken over"):  # at once, not at the next renewal
            call()
    assert backend.exists(backend.join(root, "step-1", "a"))
    faults.reset(fail_read=1)
    with pytest.raises(ss.CheckpointError, match="cannot confirm .* claim"):
        new.check()  # a GET that fails fails that check only
    new.check()
    new.release()
    old.release()


@pytest.mark.parametrize("content", [b'{"expires": "tomorrow", "pid": 1}', b'{"expires": null}',
                                     b'{"token": "x", "expires": 1e400}', b'{"token": "x", "expires": [1]}',
                                     b'{"token": 7, "expires": 1}', b"[1]", b"\xff\xfe", b""])
def test_an_unreadable_lease_counts_as_held(content):
    root, backend, _ = _lease_root("garbled")
    backend.write_bytes(backend.join(root, LEASE_NAME), content, True)
    with pytest.raises(RootBusyError, match=rf"the lease at {root}/{LEASE_NAME} is unreadable .*take_over=True"):
        LeaseClaim(root, backend, take_over=False, lease_s=3)
    claim = _by_hand(LeaseClaim(root, backend, take_over=True, lease_s=3))
    claim.check()
    backend.write_bytes(backend.join(root, LEASE_NAME), content, True)  # the holder's lease garbled too
    with pytest.raises(RootBusyError, match="lost its claim .*replaced by an unreadable one"):
        claim.check()
    claim.release()
    assert _stored_raw(backend, root) == content  # not ours to delete


def test_a_checkpointer_refuses_a_garbled_lease_and_takes_a_missing_one():
    root, backend, faults = _lease_root("ckpt-garbled")
    # a long lease: close() deletes only a lease not yet expired, however late it runs here
    settings = dict(host_memory_gb=0.05, events=False, storage_options={"faults": faults}, lease_s=60)
    backend.write_bytes(backend.join(root, LEASE_NAME), b'{"expires": null}', True)
    with pytest.raises(RootBusyError, match="unreadable"):
        ss.Checkpointer(root, **settings)
    backend.remove(backend.join(root, LEASE_NAME))
    ss.Checkpointer(root, **settings).close()
    assert not backend.exists(backend.join(root, LEASE_NAME))  # released


def test_a_lease_file_on_a_file_system_without_flock_is_replaced_whole(tmp_path):
    claim = _by_hand(LeaseClaim(str(tmp_path), LocalBackend(), take_over=False, lease_s=3))
    first = _stored(LocalBackend(), str(tmp_path))
    claim._renew_once()  # renamed over the lease: a reader sees the old one or the new one, whole
    assert _stored(LocalBackend(), str(tmp_path))["expires"] >= first["expires"]
    assert os.listdir(tmp_path) == [LEASE_NAME]
    claim.check()
    claim.release()
    assert os.listdir(tmp_path) == []


def test_release_deletes_only_its_own_live_lease():
    root, backend, _ = _lease_root("release")
    old = _by_hand(LeaseClaim(root, backend, take_over=False, lease_s=60))
    new = _by_hand(LeaseClaim(root, backend, take_over=True, lease_s=60))
    old.release()  # never noticed the take-over: reads the lease, finds it is not its own
    assert _stored(backend, root)["token"] == new.token
    new.check()
    new._deadline = time.monotonic() - 1  # expired: may be another opener's already, so left in place
    new.release()
    assert _stored(backend, root)["token"] == new.token


def test_a_take_over_inside_the_release_round_trip_stops_the_taker():
    """fsspec has no conditional delete: the window between release's GET and its DELETE is
    documented, and a taker that loses its lease there finds out at its next check."""
    root, backend, _ = _lease_root("release-race")
    old = _by_hand(LeaseClaim(root, backend, take_over=False, lease_s=60))
    taker = []

    class TakeOverAfterRead:
        def __getattr__(self, name):
            return getattr(backend, name)

        def read_bytes(self, path):
            raw = backend.read_bytes(path)
            taker.append(_by_hand(LeaseClaim(root, backend, take_over=True, lease_s=60)))
            return raw
    old.backend = TakeOverAfterRead()
    old.release()
    with pytest.raises(RootBusyError, match="lost its claim .*was deleted"):
        taker[0].check()
    taker[0].release()


def _claim_fails_raw_on_rank_0(rank, world, root):
    import statesnap.checkpointer.levels as levels

    def broken(*args, **kwargs):
        raise ValueError("a storage library's own error")
    if rank == 0:
        levels.claim_root = broken
    try:
        ss.Checkpointer(root, host_memory_gb=0.05, commit_timeout_s=60)
    except ss.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return None


def test_a_raw_error_of_the_claim_on_rank_0_reaches_every_rank(tmp_path):
    from dist_utils import run_ranks
    results = run_ranks(2, _claim_fails_raw_on_rank_0, str(tmp_path))
    for rank in range(2):  # the other rank gets it in the broadcast, not a PeerLostError at the timeout
        assert results[rank] == ("CheckpointError", f"cannot claim {tmp_path} for this job: ValueError: a storage "
                                                    "library's own error"), results


def test_retention_cut_short_leaves_no_visible_partial_checkpoint(tmp_path, monkeypatch):
    with ss.Checkpointer(tmp_path, keep_last=2, host_memory_gb=0.05) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state(step)).wait()

    def killed(path, *args, **kwargs):  # the process dies while deleting the old checkpoint's bytes
        raise KeyboardInterrupt
    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        LocalBackend().retire(str(tmp_path / "step-1"), "manifest.json")
    monkeypatch.undo()
    names = os.listdir(tmp_path)
    assert "step-1" not in names  # out of the namespace at once, not half deleted under its name
    assert [n for n in names if n.startswith(".step-1.deleting-")]
    ss.Checkpointer(tmp_path, host_memory_gb=0.05).close()  # the next start removes the remains
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".step-")]
    assert torch.equal(ss.open(tmp_path / "step-2").read("t"), _state(2)["t"])


def test_the_old_owner_s_failed_commit_after_a_take_over_is_a_root_busy_error(tmp_path):
    old = ss.Checkpointer(tmp_path, host_memory_gb=0.05)
    old.save(1, _state(1)).wait()
    new = ss.Checkpointer(tmp_path, host_memory_gb=0.05, take_over=True)
    with pytest.raises(RootBusyError, match="taken over"):
        old.save(2, _state(2)).wait()
    new.close()
    old.close()


def test_a_refused_checkpointer_leaves_the_holder_s_node_local_save_in_flight(tmp_path, monkeypatch):
    """The node-local level's leftovers are cleared only once the roots are claimed: a job
    refused them used to delete the holder's staging directory of the step it was writing."""
    from statesnap.storage import local as local_storage

    root, local_root = tmp_path / "root", tmp_path / "local"
    real, entered, release = local_storage._LocalWriter.pwrite, threading.Event(), threading.Event()

    def held_local_write(self, offset, views):
        if self.path.startswith(str(local_root)):
            entered.set()
            release.wait(30)
        return real(self, offset, views)
    monkeypatch.setattr(local_storage._LocalWriter, "pwrite", held_local_write)
    holder = ss.Checkpointer(root, local_root=local_root, host_memory_gb=0.05)
    handle = holder.save(1, _state(1))
    assert entered.wait(30)
    level = local_level(local_root, root)
    staging = sorted(os.listdir(level))  # (with the holder's claim on the local level)
    assert [n for n in staging if n.startswith(".step-")][0].startswith(".step-1.tmp-")
    with pytest.raises(RootBusyError):
        ss.Checkpointer(root, local_root=local_root, host_memory_gb=0.05)
    assert sorted(os.listdir(level)) == staging
    release.set()
    handle.wait(timeout=60)
    holder.close()
    assert "step-1" in os.listdir(level)
    assert torch.equal(ss.open(os.path.join(level, "step-1")).read("t"), _state(1)["t"])


def test_on_an_object_store_the_old_owner_writes_no_manifest_after_a_take_over():
    """There the manifest's write is the commit: the claim is read before it, so the old owner
    neither replaces the new owner's step of the same number nor leaves a manifest without data
    that the new owner's retention would count as a checkpoint."""
    import uuid

    import fsspec

    root = f"memory://take-over-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    old = ss.Checkpointer(root, host_memory_gb=0.05, keep_last=3)
    old.save(1, _state(1)).wait()
    new = ss.Checkpointer(root, host_memory_gb=0.05, keep_last=3, take_over=True)
    new.save(2, _state(102)).wait()
    new.save(3, _state(103)).wait()
    for step in (3, 20):
        with pytest.raises(RootBusyError):
            old.save(step, _state(step)).wait()
    assert not fs.find(f"{root[len('memory://'):]}/step-20")  # (files: the memory store keeps empty folders)
    assert torch.equal(ss.open(f"{root}/step-3").read("t"), _state(103)["t"])
    new.close()
    old.close()
    fs.rm(root[len("memory://"):], recursive=True)


def test_a_start_that_fails_clearing_the_node_local_level_releases_the_root(tmp_path):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("x")
    with pytest.raises(ss.CheckpointError):
        ss.Checkpointer(tmp_path / "root", local_root=not_a_directory)
    ss.Checkpointer(tmp_path / "root").close()  # the failed start kept no claim


@pytest.mark.parametrize("first_running", [True, False])
def test_jobs_sharing_a_node_local_root_keep_apart(tmp_path, first_running):
    """Different roots, the same ``local_root`` (a node's fixed NVMe path in the launch script),
    the first job still running or done: the second used to clear the first's node-local
    leftovers, restore the first's newest step into its model as its own, and delete its own
    steps by retention as older than the first's. Each job now has a directory of its own there:
    the second finds nothing to restore, keeps its own steps, and the first's are untouched."""
    local_root = tmp_path / "local"
    first = ss.Checkpointer(tmp_path / "root-a", local_root=local_root, host_memory_gb=0.05)
    first.save(9, _state(9)).wait()
    first_level = local_level(local_root, tmp_path / "root-a")
    os.makedirs(os.path.join(first_level, ".step-10.tmp-abcdef"))  # as the first job's save in flight
    before = sorted(os.listdir(first_level))
    if not first_running:
        first.close()
    settings = dict(local_root=local_root, host_memory_gb=0.05, keep_last=1, local_keep_last=1)
    with ss.Checkpointer(tmp_path / "root-b", **settings) as second:
        target = _state(0)
        assert second.load_latest(target) is None and torch.equal(target["t"], _state(0)["t"])
        for step in (1, 2):
            second.save(step, _state(step)).wait()
    assert sorted(os.listdir(first_level)) == before
    second_level = local_level(local_root, tmp_path / "root-b")
    assert sorted(n for n in os.listdir(second_level) if n.startswith("step-")) == ["step-2"]
    shutil.rmtree(tmp_path / "root-b")  # the second job's storage is lost: its node-local step serves
    with ss.Checkpointer(tmp_path / "root-b", **settings) as second:
        target = _state(0)
        assert second.load_latest(target) == 2 and second.loaded_from == "local"
        assert torch.equal(target["t"], _state(2)["t"])
    if first_running:
        first.close()
