"""One job per checkpoint root: a second Checkpointer on a root another live job owns is refused
with the holder's name, a take-over is explicit and stops the old owner from deleting anything,
and a retention cut short never leaves a ``step-N`` that is not a whole checkpoint."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import statesnap as ss
from statesnap.storage import backend_for
from statesnap.storage.local import LocalBackend
from statesnap.storage.lock import LeaseClaim, RootBusyError


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


def test_second_checkpointer_in_one_process_is_refused_until_the_first_closes(tmp_path):
    first = ss.Checkpointer(tmp_path, host_memory_gb=0.05)
    with pytest.raises(RootBusyError, match="another Checkpointer in this process"):
        ss.Checkpointer(tmp_path, host_memory_gb=0.05)
    first.close()
    ss.Checkpointer(tmp_path, host_memory_gb=0.05).close()


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


def test_object_store_lease_names_the_holder_and_expires(tmp_path):
    root = f"memory://lease-test-{os.getpid()}/root"
    first = ss.Checkpointer(root, host_memory_gb=0.05, lease_s=3)
    with pytest.raises(RootBusyError, match=rf"pid {os.getpid()} on host .*lease runs for"):
        ss.Checkpointer(root, host_memory_gb=0.05)
    first.save(1, _state(1)).wait()
    time.sleep(3.5)  # renewed in the background: still held
    with pytest.raises(RootBusyError):
        ss.Checkpointer(root, host_memory_gb=0.05)
    first.close()  # releases the lease
    second = ss.Checkpointer(root, host_memory_gb=0.05, lease_s=3)
    state = _state(0)
    assert second.load_latest(state) == 1 and torch.equal(state["t"], _state(1)["t"])
    second.close()


def test_a_lease_that_is_not_renewed_goes_stale_and_its_holder_stops():
    root = f"memory://stale-lease-{os.getpid()}/root"
    backend = backend_for(root)
    old = LeaseClaim(root, backend, take_over=False, lease_s=3)
    old._stop.set()  # the holder's node froze: no more renewals
    with pytest.raises(RootBusyError):
        LeaseClaim(root, backend, take_over=False, lease_s=3)
    time.sleep(3.2)
    new = LeaseClaim(root, backend, take_over=False, lease_s=3)
    with pytest.raises(RootBusyError, match="lost its claim"):
        old.check()
    new.check()
    new.release()


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
