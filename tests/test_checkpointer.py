"""The Checkpointer: consistent lazy snapshots, levels, retention, errors, monitoring."""
import errno
import gc
import json
import logging
import os
import random
import threading
import time

import pytest
import torch
import torch.nn as nn

import statesnap as ss
from statesnap.checkpointer import hooks, pipeline
from statesnap.monitor import trace
from statesnap.state.flatten import flatten_for_save
from statesnap.storage.local import LocalBackend, _LocalWriter
from statesnap.storage.lock import RootBusyError


# ----------------------------------------------------------------------------- helpers (also used by
# test_checkpointer_kill.py and test_checkpointer_dist.py)

def make_training(seed=0, width=32, depth=3):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train_step(model, optim, seed):
    g = torch.Generator().manual_seed(seed)
    optim.zero_grad()
    model(torch.randn(4, model[0].in_features, generator=g)).pow(2).sum().backward()
    optim.step()


def reference(state) -> dict:
    """A deep copy of every tensor of ``state`` by name, taken the moment it is called."""
    return {item.fqn: item.local.detach().clone() for item in flatten_for_save(state).tensors}


def assert_checkpoint_equals(path, ref):
    reader = ss.open(path)
    assert set(reader.manifest.tensors) == set(ref)
    for fqn, value in ref.items():
        assert torch.equal(reader.read(fqn), value), f"{fqn} differs in {path}"


def assert_state_equals(state, ref):
    now = reference(state)
    assert set(now) == set(ref)
    for fqn, value in ref.items():
        assert torch.equal(now[fqn], value), fqn


class SlowBackend(LocalBackend):
    """Local storage whose writes sleep a random while: persistence slower than training."""

    def __init__(self, seed=0, max_sleep=0.01):
        self.random = random.Random(seed)
        self.max_sleep = max_sleep

    def open_write(self, path, durable=False):
        writer = _LocalWriter(path, durable)
        backend = self

        class Slow(_LocalWriter):
            def __init__(self):
                self.__dict__.update(writer.__dict__)

            def pwrite(self, offset, views):
                time.sleep(backend.random.uniform(0, backend.max_sleep))
                super().pwrite(offset, views)
        return Slow()


class DiskFullBackend(LocalBackend):
    """Local storage that runs out of space in the middle of the data of the chosen checkpoints:
    the first write of such a file lands, the next ones fail with ENOSPC."""

    def __init__(self, failing_steps):
        self.failing_steps = set(failing_steps)

    def open_write(self, path, durable=False):
        writer = _LocalWriter(path, durable)
        step = int(os.path.basename(os.path.dirname(path)).split(".tmp-")[0].split("-")[1])
        if step in self.failing_steps:
            real, writes = writer.pwrite, []

            def pwrite(offset, views):
                writes.append(offset)
                if len(writes) > 1:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                real(offset, views)
            writer.pwrite = pwrite
        return writer


class Gate:
    """Holds every staging copy until opened: makes "the copy has not finished yet" deterministic."""

    def __init__(self, monkeypatch):
        self.opened = threading.Event()
        real = pipeline.copy_into

        def gated(*args, **kwargs):
            self.opened.wait()
            real(*args, **kwargs)
        monkeypatch.setattr(pipeline, "copy_into", gated)

    def open(self):
        self.opened.set()


def hold_writes(monkeypatch) -> threading.Event:
    """Hold every persistent flush's writing (after the copies) until the returned event is set."""
    writing = threading.Event()
    real_write = pipeline.Flusher._write

    def held_write(self, *args, **kwargs):
        writing.wait(60)
        return real_write(self, *args, **kwargs)
    monkeypatch.setattr(pipeline.Flusher, "_write", held_write)
    return writing


# ----------------------------------------------------------------------------- consistency

@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_each_checkpoint_equals_a_deep_copy_taken_at_save(tmp_path, seed):
    """Training continues at once after save(); storage is slow and timings random."""
    rng = random.Random(seed)
    model, optim = make_training(seed)
    state = {"model": model, "optim": optim, "extra": {"epoch": 0}}
    ckpt = ss.Checkpointer(tmp_path, keep_last=100, persist_every=rng.choice([1, 2]),
                           max_in_flight=rng.choice([1, 2, 3]), copy_threads=rng.choice([1, 2]),
                           backend=SlowBackend(seed, max_sleep=0.01), host_memory_gb=0.01)
    refs, handles = {}, []
    for step in range(1, 13):
        train_step(model, optim, seed * 100 + step)
        state["extra"]["epoch"] = step
        refs[step] = reference(state)
        handles.append(ckpt.save(step, state))
        time.sleep(rng.uniform(0, 0.004))
    ckpt.close()
    for h in handles:
        path = h.wait()
        if h.step % ckpt.config.persist_every == 0:
            assert path == os.path.join(str(tmp_path), f"step-{h.step}")
            assert_checkpoint_equals(path, refs[h.step])
            assert ss.open(path).read("extra.epoch") == h.step
        else:
            assert path is None


def test_optimizer_step_waits_for_the_copy(tmp_path, monkeypatch):
    """The copy is let go only once the step is seen waiting for it in its hook: a stepping
    thread kept off the CPU for 0.3 s (a loaded machine) would otherwise reach its hook after the
    copy, find nothing to wait for, and record no wait (``hook_wait_s`` 0)."""
    model, optim = make_training()
    train_step(model, optim, 1)
    state = {"model": model, "optim": optim}
    ref = reference(state)
    gate = Gate(monkeypatch)
    waiting, real_wait = threading.Event(), hooks.Countdown.wait

    def noted_wait(countdown, timeout=None):
        if threading.current_thread() is stepper:
            waiting.set()
        return real_wait(countdown, timeout)
    monkeypatch.setattr(hooks.Countdown, "wait", noted_wait)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01)
    handle = ckpt.save(1, state)
    assert not handle.staged.done()  # save returned before copying anything
    model(torch.randn(4, 32)).sum().backward()  # forward/backward only read: no wait
    stepper = threading.Thread(target=optim.step)
    stepper.start()
    stepper.join(0.3)
    assert stepper.is_alive(), "optimizer.step() ran before the snapshot copy finished"
    assert waiting.wait(60), "optimizer.step() does not wait for the snapshot copy"
    gate.open()
    stepper.join()
    assert handle.staged.result() == 1
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)
    assert not torch.equal(model[0].weight, ref["model.0.weight"])  # the step did run afterwards
    assert ckpt.stats()["hook_wait_s"] > 0


def test_in_place_change_outside_the_optimizer_fails_the_checkpoint(tmp_path, monkeypatch):
    model, optim = make_training()
    train_step(model, optim, 1)
    state = {"model": model, "optim": optim}
    gate = Gate(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01)
    handle = ckpt.save(1, state)
    with torch.no_grad():
        model[1].bias.add_(1.0)  # not the optimizer: no hook holds it back
    gate.open()
    with pytest.raises(ss.ConsistencyError, match=r"step 1.*'model\.1\.bias'"):
        handle.staged.result()
    with pytest.raises(ss.ConsistencyError):
        ckpt.save(2, state)  # the failure surfaces at the next call
    ckpt.close()
    assert not os.path.exists(tmp_path / "step-1")
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == [".statesnap-lock"]  # no staging left


@pytest.mark.parametrize("how", ["changed", "after wait_staged", "by the optimizer's step"])
def test_a_change_after_the_copy_is_looked_for_again_before_the_commit(tmp_path, monkeypatch, how):
    """On the CPU the check right after a copy misses an in-place change still under way, so
    the version counters are looked at once more when the checkpoint is about to commit (or
    the optimizer about to step). A change outside the optimizer found then fails the
    checkpoint, even one made after the copy; one made after ``wait_staged()``, or by the
    optimizer's own step, is the writer's own, and the checkpoint commits with the values of
    ``save()``."""
    model, optim = make_training()
    train_step(model, optim, 1)
    state = {"model": model, "optim": optim}
    ref = reference(state)
    writing = hold_writes(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01)
    handle = ckpt.save(1, state)
    assert handle.staged.result() == 1  # every copy is done and checked
    if how == "changed":
        with torch.no_grad():
            model[1].bias.add_(1.0)
    elif how == "after wait_staged":
        ckpt.wait_staged()
        with torch.no_grad():
            model[1].bias.add_(1.0)
    else:
        train_step(model, optim, 2)
    writing.set()
    if how == "changed":
        with pytest.raises(ss.ConsistencyError, match=r"step 1.*'model\.1\.bias'.*wait_staged"):
            handle.wait()
        assert not os.path.exists(tmp_path / "step-1")
    else:
        assert_checkpoint_equals(handle.wait(), ref)
    ckpt.close()  # (a failure the handle reported is not raised again)


def test_tensors_no_optimizer_writes_are_copied_inside_save(tmp_path, monkeypatch):
    """A BatchNorm's running statistics change in the very next forward, before any optimizer
    step: save() copies such tensors itself, so the checkpoint holds their values at save()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(16, 8)).sum().backward()
    optim.step()
    state = {"model": model, "optim": optim, "extra": {"ema": torch.randn(100)}}
    ref = reference(state)
    gate = Gate(monkeypatch)  # the background copies have not run when the forward changes the buffers
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01)
    handle = ckpt.save(1, state)
    model(torch.randn(16, 8)).sum().backward()
    state["extra"]["ema"].mul_(0.5)
    assert not torch.equal(model[1].running_mean, ref["model.1.running_mean"])
    gate.open()
    optim.step()
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)


def test_unguarded_tensors_over_the_eager_limit_are_checked(tmp_path, monkeypatch):
    """Past ``eager_copy_mb`` those that did not change since the last save (frozen weights) are
    copied in the background, and a change before the copy is caught by the version check (the
    checkpoint fails instead of mixing two steps)."""
    state = {"frozen": torch.randn(1000)}
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0)
    ckpt.save(1, state).wait()
    gate = Gate(monkeypatch)
    handle = ckpt.save(2, state)
    state["frozen"].add_(1.0)
    gate.open()
    with pytest.raises(ss.ConsistencyError, match="'frozen'"):
        handle.wait()
    ckpt.close()
    assert not os.path.exists(tmp_path / "step-2")


@pytest.mark.parametrize("then", ["save", "close"])
def test_a_failure_raised_by_the_durable_future_is_not_raised_again(tmp_path, monkeypatch, then):
    """``h.durable.result()`` is a public way to learn of a failure, as ``h.wait()`` is: a loop that
    handled it there must not get it again from the next save or from close."""
    state = {"frozen": torch.randn(1000)}
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0)
    ckpt.save(1, state).wait()
    gate = Gate(monkeypatch)
    handle = ckpt.save(2, state)
    with pytest.raises(TimeoutError):  # (a wait that timed out saw no failure)
        handle.durable.result(0.01)
    state["frozen"].add_(1.0)
    gate.open()
    with pytest.raises(ss.ConsistencyError, match="'frozen'"):
        handle.durable.result()
    if then == "save":
        assert ckpt.save(3, state).wait().endswith("step-3")
    ckpt.close()


def test_conjugated_and_negated_views_copied_in_the_background_keep_their_values(tmp_path):
    """A lazily conjugated or negated view's memory holds the values before that: a raw copy of it
    committed them instead, without a word. Each is larger than the arena, so it is copied in
    parts (streamed to storage), as a plain tensor is."""
    base, real = torch.randn(1_500_000, dtype=torch.cfloat), torch.randn(3_000_000)
    state = {"c": base.conj(), "n": real._neg_view()}
    with ss.Checkpointer(tmp_path, host_memory_gb=0.008, eager_copy_mb=0) as ckpt:
        path = ckpt.save(1, state).wait()
    reader = ss.open(path)
    assert torch.equal(reader.read("c"), base.conj().resolve_conj())
    assert torch.equal(reader.read("n"), -real)


def test_two_optimizers_over_the_same_parameters_each_wait_for_the_copies(tmp_path, monkeypatch):
    """The parameters' owner was the first optimizer alone: the second's step changed them
    without waiting for their copy, and every checkpoint failed its version check."""
    real = pipeline.copy_into

    def slow(*args, **kwargs):
        time.sleep(0.02)
        real(*args, **kwargs)
    monkeypatch.setattr(pipeline, "copy_into", slow)
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    first = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    second = torch.optim.SGD(model.parameters(), lr=0.01)
    state, expected = {"model": model, "first": first, "second": second}, {}
    with ss.Checkpointer(tmp_path, host_memory_gb=0.01, keep_last=5) as ckpt:
        for step in range(1, 4):
            for optim in (first, second):
                optim.zero_grad()
                model(torch.randn(4, 64)).sum().backward()
                optim.step()
            handle = ckpt.save(step, state)
            expected[step] = (handle, model.weight.detach().clone())
        for handle, weight in expected.values():
            assert torch.equal(ss.open(handle.wait()).read("model.weight"), weight)


def test_finished_snapshots_are_freed_without_the_cyclic_collector(tmp_path):
    """A snapshot held itself through its countdown's callback and its arena region's eviction
    callback: each finished one, with the copies ``save`` made of the tensors no optimizer
    writes, waited for a full collection, which a large program runs rarely (memory grew by a
    copy per save). With the collector off, only the snapshots still kept are alive."""
    from statesnap.checkpointer.pipeline import Snapshot

    model, optim = make_training(width=8)
    model.register_buffer("ema", torch.ones(1 << 12))
    state = {"model": model, "optim": optim}
    gc.collect()
    gc.disable()
    try:
        with ss.Checkpointer(tmp_path, keep_last=1, persist_every=10, host_memory_gb=0.05) as ckpt:
            for step in range(1, 41):
                train_step(model, optim, step)
                handle = ckpt.save(step, state)
            handle.wait()  # (the last, persisted: every one before it is done too)
            alive = sum(type(o) is Snapshot for o in gc.get_objects())
            assert alive <= len(ckpt.memory.snapshots()) + 1
    finally:
        gc.enable()


def test_save_waits_for_the_copies_of_unguarded_tensors_that_change_between_saves(tmp_path, monkeypatch):
    """Past ``eager_copy_mb``, tensors no optimizer writes that changed since the last save (an
    EMA updated in place by the loop; at the first save, every one of them) are copied before
    ``save`` returns: on the CPU a version check misses an in-place change still running when
    it looks, so a change right after ``save`` could otherwise tear the copy. With every copy
    slowed down, the change right after ``save`` never reaches the checkpoint."""
    real = pipeline.copy_into

    def slow(*args, **kwargs):
        time.sleep(0.02)
        real(*args, **kwargs)
    monkeypatch.setattr(pipeline, "copy_into", slow)
    state = {"ema": torch.zeros(1000), "frozen": torch.ones(3000)}
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, eager_copy_mb=0, keep_last=5)
    for step in range(1, 4):
        handle = ckpt.save(step, state)
        expected = state["ema"].clone()
        state["ema"].add_(1.0)  # the loop's EMA update, at once
        assert torch.equal(ss.open(handle.wait()).read("ema"), expected)
        assert torch.equal(ss.open(handle.wait()).read("frozen"), torch.ones(3000))
    # an EMA that changed between saves is waited for from then on, also at a save after which
    # it did not change (one updated every few steps); the frozen tensor only at the first save
    waited = [ckpt.save(step, state) for step in (4, 5)]
    assert [{item.fqn for i, item in enumerate(h._snap.flat.tensors) if i in h._snap.hot} for h in waited] == [
        {"ema"}, {"ema"}]
    ckpt.close()
    assert ckpt.stats()["phases"]["wait-unguarded"]["count"] == 5


def test_in_a_state_larger_than_the_arena_save_waits_for_those_copies_alone(tmp_path, monkeypatch):
    """A state larger than the host budget streams through the arena: its later batches are
    copied only as the flush frees space. ``save`` waits for the changed unguarded tensors'
    copies, which go first, not for the rest: here the flush is held back, and ``save`` still
    returns, with the EMA's copy done."""
    writing = hold_writes(monkeypatch)
    model = nn.Linear(256, 256)
    optim = torch.optim.AdamW(model.parameters())
    train_step(nn.Sequential(model), optim, 1)
    state = {"model": model, "optim": optim, "ema": torch.zeros(2000)}
    ref = reference(state)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=(128 << 10) / 1e9, eager_copy_mb=0)  # state: 0.8 MB
    saved: list = []
    saving = threading.Thread(target=lambda: saved.append(ckpt.save(1, state)), daemon=True)
    saving.start()
    saving.join(30)
    assert not saving.is_alive(), "save() waited for the whole streaming snapshot"
    state["ema"].add_(1.0)
    writing.set()
    assert_checkpoint_equals(saved[0].wait(), ref)
    ckpt.close()


def test_a_restore_from_memory_into_targets_sharing_memory_is_checked(tmp_path):
    """A restore from host memory copied each snapshot value into its target and checked
    nothing: tied weights the snapshot held untied, or views of one tensor, came back holding
    the last copy's values. Now they are named as a load from storage names them."""
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    ckpt = ss.Checkpointer(tmp_path, persist_every=1)
    try:
        ckpt.save(1, {"a": a, "b": b})
        ckpt.wait_staged()
        tied = torch.zeros(8, 8)
        with pytest.raises(ss.StateMismatchError, match=r"'a' and 'b' share memory.*host memory"):
            ckpt.load_latest({"a": tied, "b": tied})
        assert not tied.any()  # refused before any copy, as a load from storage refuses it
        base = torch.zeros(8, 8)
        with pytest.raises(ss.StateMismatchError, match=r"'a' and 'b' share memory.*host memory"):
            ckpt.load_latest({"a": base, "b": base.t()})
        ckpt.save(2, {"a": a, "b": a.t()})
        ckpt.wait_staged()
        assert ckpt.load_latest({"a": base, "b": base.t()}) == 2 and ckpt.loaded_from == "memory"
        assert torch.equal(base, a)
    finally:
        ckpt.close()


def test_pickled_values_larger_than_a_checksum_block(tmp_path):
    """A pickled value is checked by one hash of all its bytes, whatever its size."""
    big = set(range(20_000))  # about 100 KB pickled, far over the small arena's blocks
    with ss.Checkpointer(tmp_path, host_memory_gb=0.001, allow_pickle=True) as ckpt:
        ckpt.save(1, {"t": torch.ones(10), "obj": big}).wait()
    target = {"t": torch.zeros(10), "obj": None}
    ss.load(target, tmp_path / "step-1", allow_pickle=True)
    assert target["obj"] == big
    ss.open(tmp_path / "step-1").verify()


def test_a_root_that_is_a_file_is_a_checkpoint_error(tmp_path):
    (tmp_path / "file").write_text("x")
    for events in (True, False):
        with pytest.raises(ss.CheckpointError, match="file"):
            ss.Checkpointer(tmp_path / "file", events=events)


def test_checkpointer_start_puts_back_a_checkpoint_an_overwrite_left_aside(tmp_path):
    with ss.Checkpointer(tmp_path, events=False) as ckpt:
        ckpt.save(1, {"t": torch.ones(3)}).wait()
    os.rename(tmp_path / "step-1", tmp_path / ".step-1.tmp-0123456789ab.old")  # killed mid-overwrite
    os.mkdir(tmp_path / ".step-1.tmp-0123456789ab")  # the new one, never committed
    with ss.Checkpointer(tmp_path, events=False) as ckpt:
        target = {"t": torch.zeros(3)}
        assert ckpt.load_latest(target) == 1
    assert torch.equal(target["t"], torch.ones(3))
    assert sorted(os.listdir(tmp_path)) == [".statesnap-lock", "step-1"]


def test_a_step_directory_renamed_or_copied_in_is_not_restored_as_that_step(tmp_path):
    """step-5 holding what step 2 saved (renamed by hand, copied from another run) is no step 5:
    load_latest goes back to the step before it, saying why, instead of returning 5 with step
    2's values."""
    with ss.Checkpointer(tmp_path, events=False, keep_last=5) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"t": torch.full((3,), float(step))}).wait()
    os.rename(tmp_path / "step-2", tmp_path / "step-5")
    with ss.Checkpointer(tmp_path, events=False) as ckpt:
        target = {"t": torch.zeros(3)}
        with pytest.warns(RuntimeWarning, match="step-5 holds step 2, not step 5"):
            assert ckpt.load_latest(target) == 1
    assert torch.equal(target["t"], torch.ones(3))
    ss.load(target, tmp_path / "step-5")  # as a plain checkpoint it still loads
    assert torch.equal(target["t"], torch.full((3,), 2.0))


def test_first_saves_from_several_threads_share_one_arena_and_are_exact(tmp_path, monkeypatch):
    """Two threads' first saves at once each made an arena, and a step copied into one was
    written from the other, zeroed: saves are taken one at a time."""
    from statesnap.checkpointer import manager

    made = []

    class SlowArena(manager.Arena):
        def __init__(self, *args, **kwargs):
            made.append(self)
            time.sleep(0.2)  # the other thread's save arrives meanwhile
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(manager, "Arena", SlowArena)
    state = {"w": {f"t{i}": torch.randn(64, 64, generator=torch.Generator().manual_seed(i)) for i in range(8)}}
    expected = {k: v.clone() for k, v in state["w"].items()}
    errors = []
    with ss.Checkpointer(tmp_path, host_memory_gb=0.01, keep_last=10, events=False) as ckpt:
        start = threading.Barrier(2)

        def saves(first):
            try:
                start.wait()
                for step in (first, first + 1):
                    ckpt.save(step, state)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=saves, args=(first,)) for first in (10, 20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors and len(made) == 1
    for step in (10, 11, 20, 21):
        reader = ss.open(tmp_path / f"step-{step}")
        for name, value in expected.items():
            assert torch.equal(reader.read(f"w.{name}"), value), (step, name)


def test_a_forked_child_is_told_the_checkpointer_is_the_parents(tmp_path, monkeypatch):
    """Its save used to wait forever for threads that do not survive a fork; close() there
    leaves the parent's work and roots alone."""
    with ss.Checkpointer(tmp_path, host_memory_gb=0.01, events=False) as ckpt:
        ckpt.save(1, {"t": torch.ones(3)}).wait()
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery past this point
            import signal
            signal.alarm(30)  # a child that hangs dies (and fails the test) instead of outliving it
            code = 3
            try:
                ckpt.save(2, {"t": torch.ones(3)})
            except ss.CheckpointError as exc:
                code = 0 if "forked child" in str(exc) else 4
            except BaseException:  # noqa: BLE001
                code = 5
            ckpt.close()
            try:  # a Checkpointer of its own on the root: the parent's, not one "in this process"
                ss.Checkpointer(tmp_path, events=False)
                code = code or 6
            except RootBusyError as exc:
                code = code or (0 if f"pid {os.getppid()}" in str(exc) and "in this process" not in str(exc) else 7)
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # a child forked while a copy is in flight: its optimizer steps do not wait for it (its
        # memory is its own), and waiting for the parent's step is refused, not endless
        model = nn.Linear(4, 4)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(1, 4)).sum().backward()
        gate = Gate(monkeypatch)  # the copy of step 3 stays in flight
        handle = ckpt.save(3, {"model": model, "optim": optim})
        pid = os.fork()
        if pid != 0:
            backstop = threading.Timer(40, gate.open)  # the parent's close() never waits forever
            backstop.daemon = True
            backstop.start()
        if pid == 0:
            import signal
            signal.alarm(30)
            code = 3
            try:
                optim.step()
                try:
                    handle.wait()
                except ss.CheckpointError as exc:
                    code = 0 if "forked child" in str(exc) else 4
            except BaseException:  # noqa: BLE001
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        gate.open()
        backstop.cancel()
        handle.wait()
        ckpt.save(2, {"t": torch.full((3,), 2.0)}).wait()  # the parent's Checkpointer is untouched
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-1", "step-2", "step-3"]


def test_on_commit_may_not_wait_for_its_own_commit(tmp_path, caplog):
    """It runs on the thread committing a checkpoint: a save there would wait for that commit
    (with a training thread growing the arena meanwhile, forever), as would a restore, close(),
    removing that step, or wait_staged() (the next snapshot's copy may wait for the memory of the
    one committing). They are refused, and logged; removing another step works."""
    ckpt = None
    refused = []

    def on_commit(record):
        for call in (lambda: ckpt.load_latest({"t": torch.zeros(2)}), lambda: ckpt.remove(record.step),
                     ckpt.close, ckpt.wait_staged):
            with pytest.raises(ss.CheckpointError, match="was called from on_commit"):
                call()
        if record.step == 2:
            ckpt.remove(1)  # another step: fine there
        try:
            ckpt.save(1000, {"t": torch.ones(2)})
        except ss.CheckpointError as exc:
            refused.append(str(exc))
            raise

    with caplog.at_level(logging.ERROR, logger="statesnap"):
        with ss.Checkpointer(tmp_path, host_memory_gb=0.01, events=False, on_commit=on_commit) as ckpt:
            ckpt.save(1, {"t": torch.ones(2)}).wait()
            ckpt.save(2, {"t": torch.ones(1 << 20)}).wait()  # a larger arena: waits for step 1's commit
    assert len(refused) == 2 and "save() was called from on_commit" in refused[0]
    assert "on_commit raised for step 1" in caplog.text and "on_commit raised for step 2" in caplog.text
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-2"]


def test_wait_staged_covers_custom_loops(tmp_path, monkeypatch):
    model, optim = make_training()
    state = {"model": model}
    ref = reference(state)
    gate = Gate(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01)
    handle = ckpt.save(1, state)
    threading.Timer(0.05, gate.open).start()
    ckpt.wait_staged()
    assert handle.staged.done()
    with torch.no_grad():
        model[0].weight.zero_()  # safe now: the snapshot is in host memory
    ckpt.close()
    assert_checkpoint_equals(handle.wait(), ref)


def test_checkpoints_in_flight_are_bounded(tmp_path, monkeypatch):
    """Checkpoint 1 is let go only once save(2) is seen waiting for it: a saving thread kept off
    the CPU for 0.3 s (a loaded machine) would otherwise find checkpoint 1 finished, not wait,
    and record no back-pressure."""
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    gate = Gate(monkeypatch)
    ckpt = ss.Checkpointer(tmp_path, max_in_flight=1, host_memory_gb=0.01)
    first = ckpt.save(1, state)
    second, waiting, real_wait = [], threading.Event(), first._snap.finished.wait

    def noted_wait(timeout=None):
        if threading.current_thread() is saver:
            waiting.set()
        return real_wait(timeout)
    monkeypatch.setattr(first._snap.finished, "wait", noted_wait)
    saver = threading.Thread(target=lambda: second.append(ckpt.save(2, state)))
    saver.start()
    saver.join(0.3)
    assert saver.is_alive() and not first.staged.done()  # save(2) waits for checkpoint 1
    assert waiting.wait(60), "save(2) does not wait for checkpoint 1"
    gate.open()
    saver.join()
    ckpt.close()
    assert first.wait() and second[0].wait()
    assert ckpt.stats()["backpressure_s"] > 0


# ----------------------------------------------------------------------------- memory budget

def test_state_larger_than_the_budget_streams_through_the_arena(tmp_path):
    model, optim = make_training(width=128, depth=4)  # ~800 KB of model + AdamW state
    state = {"model": model, "optim": optim}
    budget_gb = 128 * 1024 / 1e9
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=budget_gb, persist_every=1, keep_last=10)
    refs = {}
    for step in (1, 2, 3):
        train_step(model, optim, step)
        refs[step] = reference(state)
        ckpt.save(step, state)
    assert ckpt._arena.capacity <= 128 * 1024
    ckpt.close()
    stats = ckpt.stats()
    assert stats["bytes_written"] >= 3 * sum(v.numel() * v.element_size() for v in refs[1].values())
    assert stats["memory_step"] is None  # nothing fits: no memory level
    for step, ref in refs.items():
        assert_checkpoint_equals(tmp_path / f"step-{step}", ref)


def test_steps_that_fit_nowhere_are_skipped_with_a_warning(tmp_path):
    model, optim = make_training(width=128, depth=4)
    state = {"model": model, "optim": optim}
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=128 * 1024 / 1e9, persist_every=2)
    with pytest.warns(RuntimeWarning, match="does not fit host_memory_gb"):
        skipped = ckpt.save(1, state)
    assert skipped.wait() is None
    ckpt.save(2, state)
    ckpt.close()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-2"]


# ----------------------------------------------------------------------------- levels and retention

def test_retention_keeps_the_newest_committed(tmp_path):
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    ckpt = ss.Checkpointer(tmp_path, keep_last=2, host_memory_gb=0.01)
    for step in range(1, 6):
        train_step(model, optim, step)
        ckpt.save(step, state).wait()
        steps = sorted(int(n[5:]) for n in os.listdir(tmp_path) if n.startswith("step-"))
        assert steps == list(range(max(1, step - 1), step + 1))
    ckpt.close()


def test_load_latest_uses_the_fastest_level_holding_the_newest_step(tmp_path):
    root, further = tmp_path / "local", tmp_path / "shared"
    model, optim = make_training()
    state = {"model": model, "optim": optim, "extra": {"step": 0}}
    settings = dict(persist_every=2, further_root=str(further), further_every=4, keep_last=1,
                    further_keep_last=1, host_memory_gb=0.01)
    ckpt = ss.Checkpointer(root, **settings)
    refs = {}
    for step in range(1, 8):
        train_step(model, optim, step)
        state["extra"]["step"] = step
        refs[step] = reference(state)
        ckpt.save(step, state)
    ckpt.wait_staged()
    train_step(model, optim, 99)  # diverge, then roll back within the process
    assert ckpt.load_latest(state) == 7 and ckpt.loaded_from == "memory"
    assert_state_equals(state, refs[7])
    assert state["extra"]["step"] == 7
    ckpt.close()

    fresh_model, fresh_optim = make_training(seed=5)
    fresh = {"model": fresh_model, "optim": fresh_optim, "extra": {"step": 0}}
    restarted = ss.Checkpointer(root, **settings)  # a new process: host memory is empty
    assert restarted.load_latest(fresh) == 6 and restarted.loaded_from == "persistent"
    assert_state_equals(fresh, refs[6])
    restarted.close()

    os.rename(root / "step-6", tmp_path / "lost")  # the node-local disk is gone
    fresh_model, fresh_optim = make_training(seed=6)
    fresh = {"model": fresh_model, "optim": fresh_optim, "extra": {"step": 0}}
    restarted = ss.Checkpointer(root, **settings)
    assert restarted.load_latest(fresh) == 4 and restarted.loaded_from == "further"
    assert_state_equals(fresh, refs[4])
    assert sorted(os.listdir(further)) == [".statesnap-lock", "step-4"]
    restarted.close()


@pytest.mark.parametrize("target", [{"w": torch.zeros(5)}, {"w": torch.zeros(4), "x": torch.ones(1)},
                                    {"w": torch.zeros(4, dtype=torch.float64)}, {"v": torch.zeros(4)}],
                         ids=["shape", "extra name", "dtype", "renamed"])
def test_a_step_in_memory_alone_refuses_a_state_that_does_not_match_it(tmp_path, target):
    """Not None ("no checkpoint": the loop would start from scratch): the mismatch, by name, as a
    stored copy of the step would say it; the state untouched, and nothing said to be loaded."""
    with ss.Checkpointer(tmp_path, persist_every=100, host_memory_gb=0.01) as ckpt:
        ckpt.save(1, {"w": torch.arange(4.0)})
        ckpt.save(2, {"w": torch.arange(4.0) * 7})
        matching = {"w": torch.zeros(4)}
        assert ckpt.load_latest(matching) == 2 and ckpt.loaded_from == "memory"
        before = {name: value.clone() for name, value in target.items()}
        with pytest.raises(ss.StateMismatchError, match="does not match the snapshot of step 2 in host memory"):
            ckpt.load_latest(target)
        assert ckpt.loaded_from is None
        assert all(torch.equal(target[name], value) for name, value in before.items())
        assert ckpt.load_latest(matching) == 2 and torch.equal(matching["w"], torch.arange(4.0) * 7)


def test_a_step_in_memory_in_another_layout_loads_from_a_stored_copy_or_is_refused(tmp_path, caplog):
    """A snapshot in memory restores only into the layout it was taken from. Another layout of
    the same names, shapes and dtypes (a part of the tensor here, as another rank count gives)
    loads a stored copy of the step, or an older stored step with a warning, and with none
    stored is refused, not answered with None."""
    whole = torch.arange(6.0)
    part = lambda: {"w": ss.Sharded(torch.zeros(3), (6,), (3,))}  # noqa: E731
    with ss.Checkpointer(tmp_path / "same", persist_every=1, host_memory_gb=0.01) as ckpt:
        ckpt.save(1, {"w": whole})
        target = part()
        assert ckpt.load_latest(target) == 1 and ckpt.loaded_from == "persistent"
        assert torch.equal(target["w"].local, whole[3:])
        cast = {"w": torch.zeros(6, dtype=torch.float64)}
        assert ckpt.load_latest(cast, cast=True) == 1 and ckpt.loaded_from == "persistent"
        assert torch.equal(cast["w"], whole.double())
    with ss.Checkpointer(tmp_path / "older", persist_every=2, host_memory_gb=0.01) as ckpt:
        ckpt.save(2, {"w": whole}).wait()
        ckpt.save(3, {"w": whole * 2})
        target = part()
        with caplog.at_level(logging.WARNING, logger="statesnap"), pytest.warns(RuntimeWarning, match="step 3 is held"):
            assert ckpt.load_latest(target) == 2 and ckpt.loaded_from == "persistent"
        assert "step 3 is held in host memory only in the layout it was saved from" in caplog.text
        assert "restoring step 2 from the persistent level instead" in caplog.text
        assert torch.equal(target["w"].local, whole[3:])
    with ss.Checkpointer(tmp_path / "none", persist_every=100, host_memory_gb=0.01) as ckpt:
        ckpt.save(1, {"w": whole})
        target = part()
        with pytest.raises(ss.CheckpointError, match="step 1 is held in host memory only in the layout .* no level "
                                                     "holds a stored copy"):
            ckpt.load_latest(target)
        assert torch.equal(target["w"].local, torch.zeros(3)) and ckpt.loaded_from is None


def test_load_latest_without_checkpoints_returns_none(tmp_path):
    model, _ = make_training()
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01)
    assert ckpt.load_latest({"model": model}) is None
    ckpt.close()


def test_leftovers_of_an_interrupted_save_are_removed(tmp_path):
    (tmp_path / ".step-5.tmp-abc").mkdir()
    (tmp_path / "step-6").mkdir()  # no manifest: never committed
    (tmp_path / "step-7").mkdir()  # a save staged in place (an object store's) and cut short
    (tmp_path / "step-7" / "data-0123456789ab-r00000.bin").write_bytes(b"x" * 100)
    ss.Checkpointer(tmp_path, host_memory_gb=0.01).close()
    assert [n for n in os.listdir(tmp_path) if "step" in n] == []


def test_what_no_save_wrote_under_a_step_name_is_left_alone(tmp_path, caplog):
    """A step directory without a manifest holding a file of the user's, or a file named like a
    step, is no leftover of a save: the Checkpointer's start once deleted them with the rest."""
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / "notes.txt").write_text("mine")
    (tmp_path / "step-2" / "data-0123456789ab-r00000.bin").write_bytes(b"x")
    (tmp_path / "step-3").write_text("a file")
    with caplog.at_level(logging.WARNING, logger="statesnap"):
        with ss.Checkpointer(tmp_path, host_memory_gb=0.01, keep_last=1) as ckpt:
            assert ckpt.load_latest({"t": torch.zeros(3)}) is None
            ckpt.save(4, {"t": torch.ones(3)}).wait()
            ckpt.save(5, {"t": torch.ones(3)}).wait()
    assert (tmp_path / "step-2" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "step-3").read_text() == "a file"
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step")) == ["step-2", "step-3", "step-5"]
    assert "step-2 has no manifest and holds what a save does not write (notes.txt)" in caplog.text


@pytest.mark.parametrize("name", ["step-0100", "step-\u0665", "step-07"])
def test_directories_named_unlike_a_step_are_left_alone(tmp_path, name):
    """Only ``step-N`` as a Checkpointer writes it is a step: a committed checkpoint a user put
    under another spelling was once taken for an interrupted save of step N and deleted."""
    ss.save({"t": torch.ones(3)}, tmp_path / name)
    with ss.Checkpointer(tmp_path, keep_last=1) as ckpt:
        assert ckpt.load_latest({"t": torch.zeros(3)}) is None
        ckpt.save(1, {"t": torch.zeros(3)}).wait()
        ckpt.save(2, {"t": torch.zeros(3)}).wait()
    assert sorted(n for n in os.listdir(tmp_path) if "step" in n) == sorted(["step-2", name])
    assert ss.open(tmp_path / name).read("t").tolist() == [1.0, 1.0, 1.0]


# ----------------------------------------------------------------------------- monitoring

def test_stats_and_trace(tmp_path, monkeypatch, capsys):
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01, persist_every=2)
    for step in range(1, 5):
        train_step(model, optim, step)
        ckpt.save(step, state)
    ckpt.close()
    stats = ckpt.stats()
    assert stats["checkpoints"] == 4 and len(stats["stall_s_per_checkpoint"]) == 4
    assert len(stats["hook_wait_s_per_checkpoint"]) == 4
    for phase in ("plan", "save", "copy", "checksum", "write", "fsync", "commit"):
        assert stats["phases"][phase]["count"] >= 1, phase
    nbytes = sum(v.numel() * v.element_size() for v in reference(state).values())
    assert stats["bytes_staged"] == 4 * nbytes and stats["bytes_written"] == 2 * nbytes
    assert stats["stall_s"] >= stats["hook_wait_s"]

    with open(tmp_path / "events" / "rank-00000.jsonl", "a") as f:
        f.write('{"phase": "wri')  # a line cut short by a kill
    out = tmp_path / "trace.json"
    assert trace.main([str(tmp_path), "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"save", "copy", "write", "commit"}
    assert (tmp_path / "trace.png").stat().st_size > 0

    # without the optional matplotlib: the JSON trace still, and a word on how to get the PNG
    (tmp_path / "trace.png").unlink()
    monkeypatch.setattr(trace.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else True)
    assert trace.main([str(tmp_path), "-o", str(out)]) == 0
    assert "statesnap[plot]" in capsys.readouterr().err
    assert out.stat().st_size > 0 and not (tmp_path / "trace.png").exists()


def test_each_commit_logs_one_info_line_and_calls_on_commit_whose_failure_costs_nothing(tmp_path, caplog):
    records = []

    def on_commit(record):
        records.append(record)
        if record.step == 2:
            raise RuntimeError("metrics backend down")

    model = torch.nn.Linear(64, 32)
    caplog.set_level(logging.INFO, logger="statesnap")
    with ss.Checkpointer(tmp_path / "run", host_memory_gb=0.05, on_commit=on_commit, persist_every=2) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, {"model": model}).wait()
    assert [r.step for r in records] == [2, 4]  # step 1 and 3 stayed in memory: no commit
    for record in records:
        assert isinstance(record, ss.CommitRecord) and record.rank == 0
        assert record.path.endswith(f"step-{record.step}")
        assert record.bytes >= (64 * 32 + 32) * 4 and record.write_s > 0 and record.stall_s >= 0
        assert record.throughput_gbps == record.bytes / record.write_s / 1e9
    lines = [r.getMessage() for r in caplog.records if r.name == "statesnap" and r.levelno == logging.INFO
             and "committed step" in r.getMessage()]
    assert len(lines) == 2 and "committed step 2" in lines[0] and "bytes" in lines[0] and "stall" in lines[0]
    assert any("on_commit raised for step 2" in r.getMessage() for r in caplog.records)
    assert ss.open(tmp_path / "run" / "step-2").verify() > 0  # the failing hook cost nothing
    with pytest.raises(ss.CheckpointError, match="on_commit must be a callable"):
        ss.Checkpointer(tmp_path / "other", on_commit="print")


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_close_gives_the_host_memory_back_while_the_checkpointer_is_still_referenced(tmp_path):
    """A training script closes its Checkpointer and goes on (an evaluation, an export) with
    ``ckpt`` still in scope: the arena, up to ``host_memory_gb``, used to stay mapped until the
    object itself was collected."""
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.5)
    ckpt.save(1, {"w": torch.randn(16, 1 << 20)}).wait()  # 64 MiB, copied into the arena
    for thread in threading.enumerate():  # (the thread faulting the arena in holds it until done)
        if thread.name == "statesnap-arena-populate":
            thread.join()
    before = _resident_mib()
    ckpt.close()
    assert before - _resident_mib() >= 48, "the arena's pages are still resident after close()"
    assert os.path.isdir(tmp_path / "step-1")


def test_a_restore_from_memory_fits_small_tensors_held_in_lists_as_a_load_does(tmp_path):
    """A small tensor held in a list (an optimizer's parameter) whose stored value has another
    dtype is a mismatch from host memory too, not replaced behind the optimizer's back; cast=True
    converts it in place, and one that fits is filled in place."""
    params = [torch.full((4,), 1.5, requires_grad=True)]
    with ss.Checkpointer(tmp_path, persist_every=1000) as ckpt:
        ckpt.save(1, {"params": params}).wait()
        held = [torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)]
        with pytest.raises(ss.StateMismatchError, match=r"host memory.*params.0 \(checkpoint float32\[4\], "
                                                        r"target bfloat16\[4\]\)"):
            ckpt.load_latest({"params": held})
        assert float(held[0].detach().abs().sum()) == 0
        for dtype in (torch.bfloat16, torch.float32):
            target = [torch.zeros(4, dtype=dtype, requires_grad=True)]
            first = target[0]
            assert ckpt.load_latest({"params": target}, cast=True) == 1 and ckpt.loaded_from == "memory"
            assert target[0] is first and torch.equal(first.detach(), torch.full((4,), 1.5, dtype=dtype))


def test_the_per_checkpoint_figures_keep_a_window_of_recent_saves(monkeypatch):
    """One entry per save, by step, was kept for ever: a run checkpointing every step for days grew
    in memory, and ``stats()`` slowed with it. The lists keep the recent saves; the counts and
    sums keep everything."""
    from statesnap.monitor import events

    monkeypatch.setattr(events, "RECENT_SAVES", 5)
    log = events.EventLog(0, None)
    for step in range(1, 21):
        log.add("save", step, 0.0, 0.001 * step)
        log.add("wait-in-hook", step, 0.0, 0.5)
        log.add("write", step, 0.0, 0.1, nbytes=10)  # (never committed: a failed step)
    summary = log.summary()
    assert summary["checkpoints"] == 20 and summary["stall_s"] == pytest.approx(sum(range(1, 21)) / 1000 + 10)
    assert summary["stall_s_per_checkpoint"] == pytest.approx([0.001 * s + 0.5 for s in range(16, 21)])
    assert summary["hook_wait_s_per_checkpoint"] == [0.5] * 5
    assert len(log._stall_by_step) == len(log._hook_by_step) == len(log._writes_by_step) == 5


def test_a_child_forked_while_the_root_was_claimed_does_not_keep_it_claimed(tmp_path):
    """The root's lock belongs to the open file, which a child forked meanwhile (a DataLoader's
    persistent worker) holds too: closing the parent's descriptor left the root locked, and the
    next Checkpointer on it (a second ``fit``) was refused as owned by this very process."""
    ckpt = ss.Checkpointer(tmp_path, events=False)
    ckpt.save(1, {"t": torch.ones(3)}).wait()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child lives on past the parent's close(), as a persistent worker does
        import signal
        signal.alarm(30)
        os.close(writer)
        os.read(reader, 1)
        os._exit(0)
    os.close(reader)
    try:
        ckpt.close()
        with ss.Checkpointer(tmp_path, events=False) as again:
            assert again.load_latest({"t": torch.zeros(3)}) == 1
    finally:
        os.write(writer, b"x")
        os.close(writer)
        os.waitpid(pid, 0)


def test_a_checkpointer_sent_to_another_process_is_refused_by_name(tmp_path):
    import pickle

    with ss.Checkpointer(tmp_path, events=False) as ckpt:
        handle = ckpt.save(1, {"t": torch.ones(3)})
        for obj, name in ((ckpt, "Checkpointer"), (handle, "SaveHandle")):
            with pytest.raises(ss.CheckpointError, match=f"a {name} cannot be sent to another process"):
                pickle.dumps(obj)
        handle.wait()
