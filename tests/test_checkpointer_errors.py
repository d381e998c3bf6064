"""The Checkpointer's failures and settings: a background failure reaches the training loop at its
next call and costs no later checkpoint; bad settings and steps fail at once, by name."""
import json
import logging
import os
import re
import threading
import warnings
from concurrent import futures

import numpy as np
import pytest
import torch

import statesnap as ss
from statesnap.checkpointer.config import CheckpointerConfig
from statesnap.monitor.events import EventLog
from test_checkpointer import DiskFullBackend, assert_checkpoint_equals, make_training, reference, train_step


def test_disk_full_mid_flush_surfaces_at_the_next_call(tmp_path):
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    ckpt = ss.Checkpointer(tmp_path, backend=DiskFullBackend({3}), keep_last=5, host_memory_gb=0.01)
    refs = {}
    for step in (1, 2, 3):
        train_step(model, optim, step)
        refs[step] = reference(state)
        handle = ckpt.save(step, state)
    futures.wait([handle.durable])  # (not result(): a failure that raised is not raised again)
    assert "step 3" in str(handle.durable.exception())
    with pytest.raises(ss.CheckpointError, match="No space left"):
        ckpt.save(4, state)  # (step 4 is taken before step 3's failure is raised)
    ckpt.close()
    names = os.listdir(tmp_path)
    assert sorted(n for n in names if n.startswith("step-")) == ["step-1", "step-2", "step-4"]
    assert [n for n in names if n.startswith(".")] == [".statesnap-lock"]  # the failed staging directory is gone
    refs[4] = refs[3]  # (no training step between the saves of steps 3 and 4)
    for step in (1, 2, 4):
        assert_checkpoint_equals(tmp_path / f"step-{step}", refs[step])


def test_errors_can_warn_instead_of_raise(tmp_path):
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    ckpt = ss.Checkpointer(tmp_path, backend=DiskFullBackend({1}), on_error="warn", host_memory_gb=0.01)
    ckpt.save(1, state).staged.result()
    ckpt._wait_all()
    with pytest.warns(RuntimeWarning, match="step 1"):
        ckpt.save(2, state)
    ckpt.close()
    assert ss.open(tmp_path / "step-2").keys()


def test_an_error_reported_by_wait_is_not_raised_again(tmp_path):
    model, optim = make_training()
    ckpt = ss.Checkpointer(tmp_path, backend=DiskFullBackend({1}), host_memory_gb=0.01)
    with pytest.raises(ss.CheckpointError):
        ckpt.save(1, {"model": model}).wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save(2, {"model": model})
        ckpt.close()


@pytest.mark.parametrize("bad", [dict(keep_last=0), dict(persist_every=0), dict(on_error="ignore"),
                                 dict(persist_every=3, further_root="x", further_every=4),
                                 dict(host_memory_gb=1e-9), dict(max_in_flight=0), dict(keep_last=None),
                                 dict(keep_last=2.5), dict(persist_every=True), dict(host_memory_gb="1"),
                                 dict(threads=1.0), dict(eager_copy_mb=None), dict(host_memory_gb=float("inf")),
                                 dict(eager_copy_mb=float("inf")), dict(replica_check_mb=float("inf")),
                                 dict(commit_timeout_s=float("inf")), dict(lease_s=float("nan")),
                                 dict(host_memory_gb=10**400)])
def test_invalid_settings_fail_at_construction(tmp_path, bad):
    with pytest.raises(ss.CheckpointError, match="invalid Checkpointer setting"):
        CheckpointerConfig(root=str(tmp_path), **bad)


@pytest.mark.parametrize("roots", [dict(local_root="{d}"), dict(further_root="{d}/"), dict(local_root="{d}/./",
                                   further_root="file://{d}"), dict(local_root="{d}/l", further_root="{d}/l")])
def test_two_levels_in_one_directory_are_refused_at_construction(tmp_path, roots):
    """Given one directory, the second level's claim met the first's and advised take_over=True,
    after which every save failed as taken over by the process itself."""
    with pytest.raises(ss.CheckpointError, match="must be different directories, each level claiming and retaining "
                                                 "its own: .* are both"):
        ss.Checkpointer(tmp_path, host_memory_gb=0.02, **{k: v.format(d=tmp_path) for k, v in roots.items()})
    assert os.listdir(tmp_path) == []  # nothing claimed


def test_a_construction_that_fails_once_the_roots_are_claimed_gives_them_back(tmp_path, monkeypatch):
    """A failure after the claim (an infinite replica_check_mb made one, in limit_bytes) left the
    root claimed: every later Checkpointer on it in the process was refused as busy."""
    from statesnap.checkpointer import manager

    def failing(*args, **kwargs):
        raise OSError("no room for the pipeline")
    monkeypatch.setattr(manager, "FlushTarget", failing)
    with pytest.raises(OSError, match="no room"):
        ss.Checkpointer(tmp_path, host_memory_gb=0.02)
    monkeypatch.undo()
    with ss.Checkpointer(tmp_path, host_memory_gb=0.02) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait()
    assert torch.equal(ss.open(tmp_path / "step-1").read("w"), torch.ones(3))


@pytest.mark.parametrize("cycle", ["dict", "dicts", "list", "state"])
def test_a_state_holding_itself_is_refused_by_name_not_a_hang(tmp_path, cycle):
    """Checkpointer.save spun forever in the search for optimizers over a dict that held itself;
    ss.save called it nesting too deep."""
    state = {"w": torch.ones(3)}
    if cycle == "dict":
        state["cfg"] = {"lr": 0.1}
        state["cfg"]["self"] = state["cfg"]
    elif cycle == "dicts":
        a, b = {}, {}
        a["b"], b["a"] = b, a
        state["cfg"] = a
    elif cycle == "list":
        state["cfg"] = [1]
        state["cfg"].append(state["cfg"])
    else:
        state["state"] = state
    says = r"the state holds itself: '(cfg\.self|cfg\.b\.a|cfg\.1|state)' is a dict, list or tuple that lies inside"
    with pytest.raises(ss.CheckpointError, match=says):
        ss.save(state, tmp_path / "c")
    outcome = []

    def save():
        try:
            with ss.Checkpointer(tmp_path / "root", host_memory_gb=0.02) as ckpt:
                ckpt.save(1, state)
        except ss.CheckpointError as exc:
            outcome.append(exc)
    saving = threading.Thread(target=save, daemon=True)
    saving.start()
    saving.join(60)
    assert not saving.is_alive() and len(outcome) == 1 and re.search(says, str(outcome[0]))


def test_a_misspelled_setting_is_a_checkpoint_error_naming_the_close_ones(tmp_path):
    with pytest.raises(ss.CheckpointError) as caught:
        ss.Checkpointer(tmp_path, keep_lats=2, wat=1)
    assert "no setting 'keep_lats' (did you mean 'keep_last'" in str(caught.value) and "'wat'" in str(caught.value)
    assert not list(tmp_path.iterdir())  # refused before the root is claimed


def test_settings_take_numpy_numbers(tmp_path):
    import numpy as np

    config = CheckpointerConfig(root=str(tmp_path), keep_last=np.int64(2), host_memory_gb=np.float32(0.5))
    assert config.keep_last == 2
    assert CheckpointerConfig(root=str(tmp_path), keep_last=10**400).keep_last == 10**400  # (no float's range)


@pytest.mark.parametrize("step", [-1, "7", 8.9, True, None])
def test_a_step_is_a_non_negative_integer(tmp_path, step):
    """``step-N`` is where a checkpoint lives: ``step--1`` or ``step-8`` for 8.9 would be saved
    where neither a restart nor retention looks."""
    with ss.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ss.CheckpointError, match="step must be a non-negative integer"):
            ckpt.save(step, {"t": torch.ones(2)})
        ckpt.save(0, {"t": torch.ones(2)}).wait()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step")) == ["step-0"]


def test_a_numpy_integer_step_is_saved_as_its_int(tmp_path):
    """A step from numpy (``np.int64``, as a data pipeline counts) is the step it holds: it once
    reached the events file as itself, whose writer then died, and every later wait hung."""
    import numpy as np

    state = {"t": torch.ones(2)}
    with ss.Checkpointer(tmp_path, keep_last=3) as ckpt:
        ckpt.save(np.int64(1), state).wait()
        state["t"].fill_(2)
        assert ckpt.save(np.uint8(2), state).wait() == str(tmp_path / "step-2")
    with ss.Checkpointer(tmp_path) as ckpt:
        target = {"t": torch.zeros(2)}
        assert type(ckpt.load_latest(target)) is int and torch.equal(target["t"], torch.full((2,), 2.0))
    lines = (tmp_path / "events" / "rank-00000.jsonl").read_text().splitlines()
    assert {json.loads(line)["step"] for line in lines} >= {1, 2}


def test_events_json_cannot_hold_are_dropped_with_a_warning(tmp_path, caplog):
    log = EventLog(0, str(tmp_path / "events.jsonl"))
    log.add("save", 1, 0.0, 1.0, 0, odd=object())
    with caplog.at_level(logging.WARNING, logger="statesnap"):
        log.flush()
    assert "cannot write events" in caplog.text and not (tmp_path / "events.jsonl").exists()
    log.add("save", 2, 0.0, 1.0, 0)
    log.flush()
    assert json.loads((tmp_path / "events.jsonl").read_text())["step"] == 2


def test_a_background_failure_past_the_stage_keeps_later_checkpoints_going(tmp_path, monkeypatch, caplog):
    """Whatever escapes a background stage's own handling fails that checkpoint alone: the thread
    lives on, so later saves, waits and close() return instead of waiting forever."""
    state = {"t": torch.ones(2)}
    real = ss.Checkpointer._report_commit
    failed = []

    def report_once(self, step):
        if not failed:
            failed.append(step)
            raise RuntimeError("injected")
        real(self, step)

    monkeypatch.setattr(ss.Checkpointer, "_report_commit", report_once)
    ckpt = ss.Checkpointer(tmp_path, keep_last=3)
    with caplog.at_level(logging.ERROR, logger="statesnap"):
        ckpt.save(1, state).wait()  # committed before the failure
        state["t"].fill_(2)
        done = threading.Event()
        threading.Thread(target=lambda: (ckpt.save(2, state).wait(), done.set()), daemon=True).start()
        assert done.wait(30), "the save after the failure never finished"
    ckpt.close()
    assert failed == [1] and "the background statesnap-write-stage failed at step 1" in caplog.text
    assert ss.open(tmp_path / "step-2").read("t").tolist() == [2.0, 2.0]


def test_a_background_failure_before_a_snapshot_is_finished_hangs_no_wait(tmp_path, monkeypatch):
    """A failure that escapes a stage before the snapshot is finished leaves nobody waiting for
    it: wait() raises it, and close() returns."""
    from statesnap.checkpointer import staging

    real, calls = staging.Arena.hold, []

    def hold_failing_once(self, region, *rest):
        calls.append(region)
        if len(calls) == 1:
            raise RuntimeError("injected in _finish")
        return real(self, region, *rest)

    monkeypatch.setattr(staging.Arena, "hold", hold_failing_once)
    ckpt = ss.Checkpointer(tmp_path, keep_last=3, host_memory_gb=0.01)
    handle = ckpt.save(1, {"t": torch.ones(2)})
    with pytest.raises(ss.CheckpointError, match="internal error in the background .*injected in _finish"):
        handle.wait(timeout=30)
    closing = threading.Thread(target=ckpt.close, daemon=True)
    closing.start()
    closing.join(30)
    assert not closing.is_alive(), "close() waited for an abandoned snapshot"


def test_a_wait_that_runs_out_of_time_says_the_step_is_still_being_written(tmp_path, monkeypatch):
    """wait(timeout) ending before the commit is no failure of the checkpoint: a TimeoutError that
    is a CheckpointError too, naming the step; the save goes on and a later wait() returns it."""
    from statesnap.storage.local import LocalBackend

    release, real = threading.Event(), LocalBackend.commit
    monkeypatch.setattr(LocalBackend, "commit", lambda self, *a, **k: (release.wait(30), real(self, *a, **k))[1])
    ckpt = ss.Checkpointer(tmp_path, keep_last=3)
    handle = ckpt.save(4, {"t": torch.arange(3.0)})
    with pytest.raises(ss.NotDurableYetError, match="step 4 is not durable after 0.05 s") as caught:
        handle.wait(0.05)
    assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, ss.CheckpointError)
    release.set()
    assert handle.wait(30) == str(tmp_path / "step-4")
    ckpt.close()
    assert ss.open(tmp_path / "step-4").read("t").tolist() == [0.0, 1.0, 2.0]


def test_a_save_failing_after_a_wait_ran_out_of_time_is_still_raised_at_close(tmp_path, monkeypatch):
    """The timed-out wait reported nothing: the commit's later failure is close()'s to raise."""
    from statesnap.storage.local import LocalBackend

    release = threading.Event()

    def failing_commit(self, *args, **kwargs):
        release.wait(30)
        raise OSError(5, "injected I/O error")

    monkeypatch.setattr(LocalBackend, "commit", failing_commit)
    ckpt = ss.Checkpointer(tmp_path, keep_last=3)
    handle = ckpt.save(4, {"t": torch.arange(3.0)})
    with pytest.raises(ss.NotDurableYetError):
        handle.wait(0.05)
    release.set()
    with pytest.raises(ss.CheckpointError, match="injected I/O error"):
        ckpt.close()


def test_a_step_committed_below_later_ones_warns_that_load_latest_prefers_them(tmp_path):
    """A run that went back (restored step 3 of a root holding 5) is told, once, that a restart
    before it passes step 5 would go on from the abandoned run's step 5, and how to remove it."""
    state = {"t": torch.zeros(2)}
    with ss.Checkpointer(tmp_path, keep_last=3) as ckpt:
        for step in range(1, 6):
            state["t"].fill_(step)
            ckpt.save(step, state).wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ss.Checkpointer(tmp_path, keep_last=3) as ckpt:
            for step in (3, 4, 5, 6):
                ckpt.save(step, state).wait()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages  # steps 4 and 5 again, then past them: nothing more to say
    assert re.search(r"step 3 was committed .* later steps 4, 5: .* go on from step 5.*Checkpointer.remove",
                     messages[0])


@pytest.mark.parametrize("step", ["3", 2.9, -1, None, [3]])
def test_remove_takes_a_step_as_save_does(tmp_path, step):
    """``remove("3")`` deleted step 3 from disk but, matching no step in memory, left its host
    copy there for load_latest to bring back; ``remove(2.9)`` did nothing without a word."""
    with ss.Checkpointer(tmp_path, keep_last=5) as ckpt:
        for n in (1, 2, 3):
            ckpt.save(n, {"t": torch.full((2,), float(n))}).wait()
        with pytest.raises(ss.CheckpointError, match="step must be a non-negative integer"):
            ckpt.remove(step)
        target = {"t": torch.zeros(2)}
        assert ckpt.load_latest(target) == 3 and target["t"].tolist() == [3.0, 3.0]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step")) == ["step-1", "step-2", "step-3"]


@pytest.mark.parametrize("path", [None, 5, 2.5, ["ckpt"]])
def test_a_path_that_is_no_path_is_refused(tmp_path, monkeypatch, path):
    """An unset environment variable (None) or a number as the root used to become a directory
    of that name in the working directory."""
    monkeypatch.chdir(tmp_path)
    state = {"t": torch.ones(2)}
    for attempt in (lambda: ss.Checkpointer(path), lambda: ss.save(state, path), lambda: ss.load(state, path)):
        with pytest.raises(ss.CheckpointError, match="a checkpoint path is a str, an os.PathLike or bytes"):
            attempt()
    assert os.listdir(tmp_path) == []


def test_a_save_that_reports_an_earlier_failure_takes_its_own_step(tmp_path, monkeypatch):
    """The failure of step 2 reaches the loop at save(3): step 3 is taken before it is raised (a
    loop that logged the error and went on lost step 3 without a word); step 2's own error is
    not changed by it."""
    from statesnap.checkpointer.pipeline import Flusher

    real = Flusher._write

    def fail_step_2(self, snap, staging, token):
        if snap.step == 2:
            raise OSError(27, "File too large")
        return real(self, snap, staging, token)

    monkeypatch.setattr(Flusher, "_write", fail_step_2)
    state = {"t": torch.ones(2)}
    ckpt = ss.Checkpointer(tmp_path, keep_last=5)
    ckpt.save(1, state).wait()
    assert isinstance(ckpt.save(2, state).durable.exception(timeout=30), Exception)
    state["t"].fill_(3)
    with pytest.raises(ss.CheckpointError, match="step 2") as raised:
        ckpt.save(3, state)
    assert "step 3" not in str(raised.value) and not getattr(raised.value, "__notes__", None)
    ckpt.close()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step")) == ["step-1", "step-3"]
    assert ss.open(tmp_path / "step-3").read("t").tolist() == [3.0, 3.0]


@pytest.mark.parametrize("setting", [{"durable": "false"}, {"allow_pickle": "no"}, {"take_over": "yes"},
                                     {"events": None}, {"storage_options": "x"}, {"node_id": -1}])
def test_switches_and_options_of_another_kind_are_refused(tmp_path, setting):
    """``durable="false"`` is true to Python: it synced, ``allow_pickle="no"`` unpickled."""
    name = next(iter(setting))
    with pytest.raises(ss.CheckpointError, match=f"{name} must"):
        ss.Checkpointer(tmp_path / "r", **setting)


def test_the_one_shot_api_refuses_switches_of_another_kind(tmp_path):
    state = {"t": torch.ones(2)}
    with pytest.raises(ss.CheckpointError, match="ss.save: allow_pickle must be True or False, not 'no'"):
        ss.save(state, tmp_path / "c", allow_pickle="no")
    ss.save(state, tmp_path / "c", durable=0)  # (0 and 1 are what they look like)
    for options in ({"cast": "no"}, {"strict": "false"}, {"partial": None}, {"allow_pickle": "no"}):
        with pytest.raises(ss.CheckpointError, match=f"ss.load: {next(iter(options))} must be True or False"):
            ss.load(state, tmp_path / "c", **options)
    with pytest.raises(ss.CheckpointError, match="ss.open: verify must be True or False"):
        ss.open(tmp_path / "c", verify="no")
    with pytest.raises(ss.CheckpointError, match="storage_options must be a dict"):
        ss.load(state, tmp_path / "c", storage_options="anon=True")


@pytest.mark.parametrize("call, setting, value", [
    ("save", "block_bytes", -1), ("save", "block_bytes", 0), ("save", "block_bytes", 2 ** 63),
    ("save", "block_bytes", True), ("save", "threads", -1), ("save", "timeout_s", float("nan")),
    ("save", "replica_check_mb", -1.0), ("save", "replica_check_mb", float("inf")), ("save", "progress", "yes"),
    ("load", "threads", 0),
    ("load", "timeout_s", -5), ("load", "timeout_s", float("inf")), ("load", "shared_reads", "no"),
    ("verify", "threads", -2)])
def test_numbers_out_of_their_range_are_refused_by_name_before_anything_is_written(tmp_path, call, setting, value):
    """A negative block_bytes made the save's checksums loop forever (its staging directory left
    behind), 2**63 committed a checkpoint no reader takes, 0 failed in range(); threads=-2 and
    timeout_s=nan raised bare ValueErrors from deep inside."""
    state = {"t": torch.ones(2)}
    ss.save(state, tmp_path / "c")
    before = sorted(os.listdir(tmp_path))
    run = {"save": lambda: ss.save(state, tmp_path / "d", **{setting: value}),
           "load": lambda: ss.load(state, tmp_path / "c", **{setting: value}),
           "verify": lambda: ss.open(tmp_path / "c").verify(**{setting: value})}[call]
    with pytest.raises(ss.CheckpointError, match=f"{setting} must be .*, not {re.escape(repr(value))}"):
        run()
    assert sorted(os.listdir(tmp_path)) == before
    ss.save(state, tmp_path / "e", block_bytes=np.int64(1000), threads=np.int64(2))  # (numpy integers are numbers)
    assert ss.open(tmp_path / "e").verify() == 8


def test_ctrl_c_in_a_save_that_reports_an_earlier_failure_stops_the_loop(tmp_path, monkeypatch):
    """A KeyboardInterrupt while save() takes its step is not turned into the earlier failure it
    reports (a loop catching CheckpointError went on): it goes through, the failure is raised at
    the next call."""
    from statesnap.checkpointer.pipeline import Flusher

    real = Flusher._write
    monkeypatch.setattr(Flusher, "_write", lambda self, snap, *rest: (
        (_ for _ in ()).throw(OSError(27, "File too large")) if snap.step == 2 else real(self, snap, *rest)))
    state = {"t": torch.ones(2)}
    ckpt = ss.Checkpointer(tmp_path, keep_last=5)
    ckpt.save(1, state).wait()
    assert isinstance(ckpt.save(2, state).durable.exception(timeout=30), Exception)
    monkeypatch.setattr(ss.Checkpointer, "_take", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(3, state)
    monkeypatch.undo()
    with pytest.raises(ss.CheckpointError, match="step 2"):
        ckpt.save(4, state)
    ckpt.close()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-1", "step-4"]


def test_numpy_switches_are_switches(tmp_path):
    import numpy as np

    ss.save({"t": torch.ones(2)}, tmp_path / "c", durable=np.True_, overwrite=np.int64(0))
    with ss.Checkpointer(tmp_path / "r", durable=np.bool_(False)) as ckpt:
        ckpt.save(1, {"t": torch.ones(2)}).wait()
    assert ss.open(tmp_path / "r" / "step-1", verify=np.True_).read("t").tolist() == [1.0, 1.0]


def test_a_staging_directory_that_cannot_be_removed_does_not_hang_the_checkpointer(tmp_path, monkeypatch):
    """The broadcast of step 2's staging directory fails and removing the directory fails too
    (storage unreachable): the removal's error used to escape before the flusher marked itself
    broken and freed the snapshot's arena regions, so the next save and close() hung."""
    from statesnap.engine import dist as ss_dist
    from statesnap.storage.local import LocalBackend

    class Unreachable(LocalBackend):
        def abort(self, staging, final, written=()):
            raise OSError(110, "Connection timed out")

    real = ss_dist.Comm.broadcast

    def lose_step_2(self, obj, src=0):
        if isinstance(obj, tuple) and obj and obj[-1] == 2:
            raise ss_dist.PeerLostError("rank 1 stopped answering")
        return real(self, obj, src)

    monkeypatch.setattr(ss_dist.Comm, "broadcast", lose_step_2)
    state = {"w": torch.randn(3_000_000)}  # 12 MB: streams through a 4 MB arena
    ckpt = ss.Checkpointer(tmp_path, backend=Unreachable(), host_memory_gb=0.004, keep_last=5, max_in_flight=1)
    ckpt.save(1, state).wait()
    assert isinstance(ckpt.save(2, state).durable.exception(timeout=30), ss_dist.PeerLostError)
    finished = threading.Event()

    def go_on():
        for call in (lambda: ckpt.save(3, state), ckpt.close):
            try:
                call()
            except ss.CheckpointError:
                pass
        finished.set()

    threading.Thread(target=go_on, daemon=True).start()
    assert finished.wait(60), "save() or close() hung after the failed removal"


@pytest.mark.parametrize("stage", ["_stager", "_flusher"])
def test_a_ctrl_c_while_save_hands_the_snapshot_on_leaves_close_able_to_finish(tmp_path, stage):
    """A KeyboardInterrupt between the snapshot's entry among those in flight and its hand-off to
    the background stages left close() waiting forever for a snapshot no stage had."""
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.01)
    ckpt.save(1, state).wait()
    target = getattr(ckpt, stage)
    real = target.submit

    def interrupted(snap):
        target.submit = real
        raise KeyboardInterrupt
    target.submit = interrupted
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, state)
    assert ckpt.save(3, state).wait().endswith("step-3")
    closing = threading.Thread(target=ckpt.close, daemon=True)
    closing.start()
    closing.join(60)
    assert not closing.is_alive()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-1", "step-2", "step-3"]
