"""Restarts past damage: ``load_latest`` goes on to the next copy of a step when one fails, and
to older steps only when every copy of the newer one is damaged; what else fails is raised, and
retention spares good steps while a damaged newer one is still on disk."""
import errno
import json
import os
import warnings

import pytest
import torch
import xxhash

import statesnap as ss
from statesnap.checkpointer import restore
from statesnap.format.manifest import FORMAT_VERSION, MANIFEST_NAME
from statesnap.storage.local import LocalBackend
from dist_utils import local_level
from test_checkpointer import assert_state_equals, make_training, reference, train_step

SETTINGS = dict(keep_last=3, host_memory_gb=0.01)


def _damage(step_dir, how: str) -> None:
    data = next(p for p in step_dir.iterdir() if p.suffix == ".bin")
    if how == "flipped":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    elif how == "missing":
        data.unlink()
    else:
        (step_dir / MANIFEST_NAME).write_bytes(b'{"format": "statesnap", "tensors": [[[')


@pytest.mark.parametrize("how", ["flipped", "missing", "manifest"])
def test_load_latest_falls_back_past_a_damaged_newest_step(tmp_path, how):
    """A newest checkpoint damaged on every level (flipped bits, a lost data file, a garbled
    manifest) is skipped with a warning for the step before it, bit for bit, and the resumed run
    saves that step again over it; when every step is damaged the error names what failed in each."""
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    refs = {}
    with ss.Checkpointer(tmp_path, keep_last=3, host_memory_gb=0.01) as ckpt:
        for step in (1, 2, 3):
            train_step(model, optim, step)
            refs[step] = reference(state)
            ckpt.save(step, state).wait()
    _damage(tmp_path / "step-3", how)
    fresh = _fresh_state()
    with ss.Checkpointer(tmp_path, keep_last=3, host_memory_gb=0.01) as restarted:
        with pytest.warns(RuntimeWarning, match="step 3 could not be restored .*trying step 2, the newest before it"):
            assert restarted.load_latest(fresh) == 2
        assert restarted.loaded_from == "persistent"
        assert_state_equals(fresh, refs[2])
        train_step(fresh["model"], fresh["optim"], 3)  # the run goes on: step 3 again, saved over the damaged one
        restarted.save(3, fresh).wait()
    again = _fresh_state()
    with ss.Checkpointer(tmp_path, keep_last=3, host_memory_gb=0.01) as restarted:
        assert restarted.load_latest(again) == 3
    assert_state_equals(again, refs[3])

    for step in (1, 2, 3):
        _damage(tmp_path / f"step-{step}", how)
    with ss.Checkpointer(tmp_path, keep_last=3, host_memory_gb=0.01) as restarted:
        with pytest.warns(RuntimeWarning), pytest.raises(ss.CorruptCheckpointError) as raised:
            restarted.load_latest(_fresh_state())
    message = str(raised.value)
    assert message.startswith("no checkpoint could be restored")
    for step in (3, 2, 1):
        assert f"step {step} from the persistent level: " in message and f"step-{step}" in message


def test_load_latest_raises_a_state_mismatch_without_trying_older_steps(tmp_path):
    model, optim = make_training()
    with ss.Checkpointer(tmp_path, keep_last=3, host_memory_gb=0.01) as ckpt:
        for step in (1, 2):
            train_step(model, optim, step)
            ckpt.save(step, {"model": model, "optim": optim}).wait()
    other = {"model": make_training(width=16)[0]}
    with ss.Checkpointer(tmp_path, keep_last=3, host_memory_gb=0.01) as restarted:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fall-back warning: the next step would not match either
            with pytest.raises(ss.StateMismatchError, match="step-2"):
                restarted.load_latest(other)


def _fresh_state():
    model, optim = make_training(seed=5)
    return {"model": model, "optim": optim}




def test_an_io_error_is_raised_not_taken_for_damage(tmp_path, monkeypatch):
    """A read error that a retry may not meet again (a mount that stopped answering) must not
    send the run back to an older step, which it would later save over the good one."""
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    with ss.Checkpointer(tmp_path, **SETTINGS) as ckpt:
        for step in (1, 2):
            train_step(model, optim, step)
            ckpt.save(step, state).wait()
    ref = reference(state)
    real_open = LocalBackend.open_read

    def flaky(self, path):
        if "step-2" in str(path) and path.endswith(".bin"):
            raise OSError(errno.EIO, "NFS server not responding")
        return real_open(self, path)
    with monkeypatch.context() as patch:
        patch.setattr(LocalBackend, "open_read", flaky)
        with ss.Checkpointer(tmp_path, **SETTINGS) as restarted, warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ss.ReadFailedError, match="step-2.*NFS server not responding"):
                restarted.load_latest(_fresh_state())
    fresh = _fresh_state()
    with ss.Checkpointer(tmp_path, **SETTINGS) as restarted:  # the mount is back
        assert restarted.load_latest(fresh) == 2
    assert_state_equals(fresh, ref)


class Note:
    """Not plain data: saved only with pickle."""

    def __init__(self, text):
        self.text = text


def test_a_setting_every_step_would_refuse_is_raised_at_once(tmp_path):
    model, _ = make_training()
    with ss.Checkpointer(tmp_path, allow_pickle=True, **SETTINGS) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"model": model, "note": Note(str(step))}).wait()
    with ss.Checkpointer(tmp_path, **SETTINGS) as restarted, warnings.catch_warnings():
        warnings.simplefilter("error")  # no step is tried after the first
        with pytest.raises(ss.UnsafeCheckpointError):
            restarted.load_latest({"model": model, "note": Note("")})


def test_a_fall_back_to_a_step_saved_before_the_first_optimizer_step(tmp_path):
    """The failed load of the newer step created a fresh AdamW's state; the step before any
    optimizer step has none, so that state must be gone again for it to load."""
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    with ss.Checkpointer(tmp_path, **SETTINGS) as ckpt:
        ckpt.save(0, state).wait()
        ref = reference(state)
        train_step(model, optim, 1)
        ckpt.save(1, state).wait()
    _damage(tmp_path / "step-1", "flipped")
    fresh = _fresh_state()
    with ss.Checkpointer(tmp_path, **SETTINGS) as restarted:
        with pytest.warns(RuntimeWarning, match="trying step 0"):
            assert restarted.load_latest(fresh) == 0
    assert not fresh["optim"].state
    assert_state_equals(fresh, ref)


def test_retention_spares_good_steps_while_a_damaged_newer_one_is_on_disk(tmp_path):
    """Resumed at step 4 past a damaged step 6, the run saves step 5: the damaged step 6 must
    take neither the place of a good step on root nor the further level's only place; once
    the run saves step 6 again, retention goes on as before."""
    root, further = tmp_path / "root", tmp_path / "further"
    settings = dict(SETTINGS, further_root=str(further), further_every=1, further_keep_last=1)
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    with ss.Checkpointer(root, **settings) as ckpt:
        for step in (2, 4, 6):
            train_step(model, optim, step)
            ckpt.save(step, state).wait()
    for level in (root, further):
        _damage(level / "step-6", "flipped")
    fresh = _fresh_state()

    def steps(level):
        return sorted(int(n[5:]) for n in os.listdir(level) if n.startswith("step-"))
    with ss.Checkpointer(root, **settings) as restarted:
        with pytest.warns(RuntimeWarning) as caught:
            assert restarted.load_latest(fresh) == 4
        assert "trying step 4, the newest before it" in str(caught[-1].message)
        train_step(fresh["model"], fresh["optim"], 5)
        restarted.save(5, fresh).wait()
    assert steps(root) == [2, 4, 5, 6] and steps(further) == [5, 6]

    fresh = _fresh_state()
    with ss.Checkpointer(root, **settings) as restarted:  # a restart before the run is past step 6
        with pytest.warns(RuntimeWarning) as caught:
            assert restarted.load_latest(fresh) == 5
        assert "trying step 5, the newest before it" in str(caught[-1].message)
        train_step(fresh["model"], fresh["optim"], 6)
        restarted.save(6, fresh).wait()
        ref = reference(fresh)
    assert steps(root) == [4, 5, 6] and steps(further) == [6]
    again = _fresh_state()
    with ss.Checkpointer(root, **settings) as restarted, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert restarted.load_latest(again) == 6
    assert_state_equals(again, ref)


def test_a_step_of_a_newer_format_is_raised_not_given_up(tmp_path):
    model, optim = make_training()
    with ss.Checkpointer(tmp_path, **SETTINGS) as ckpt:
        for step in (1, 2):
            train_step(model, optim, step)
            ckpt.save(step, {"model": model, "optim": optim}).wait()
    manifest = tmp_path / "step-2" / MANIFEST_NAME
    doc = json.loads(manifest.read_text())
    doc.pop("manifest_xxh3")
    doc["version"] = FORMAT_VERSION + 1
    body = json.dumps(doc, separators=(",", ":")).encode()  # signed, as a newer statesnap writes it
    manifest.write_bytes(b'%s,"manifest_xxh3":%d}' % (body[:-1], xxhash.xxh3_64_intdigest(body)))
    with ss.Checkpointer(tmp_path, **SETTINGS) as restarted, warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ss.ManifestError, match="newer than this statesnap reads"):
            restarted.load_latest(_fresh_state())
    assert (tmp_path / "step-2").exists()


def test_a_node_local_copy_that_cannot_be_read_is_given_up_for_the_stored_levels(tmp_path, monkeypatch):
    """A failing node disk must not stop the job: the steps on root serve the restart."""
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    settings = dict(SETTINGS, local_root=tmp_path / "local", persist_every=2)
    refs = {}
    with ss.Checkpointer(tmp_path / "root", **settings) as ckpt:
        for step in (1, 2, 3):
            train_step(model, optim, step)
            refs[step] = reference(state)
            ckpt.save(step, state).wait()
    real_open = LocalBackend.open_read

    def failing_disk(self, path):
        if str(tmp_path / "local") in str(path) and path.endswith(".bin"):
            raise OSError(errno.EIO, "Input/output error")
        return real_open(self, path)
    monkeypatch.setattr(LocalBackend, "open_read", failing_disk)
    fresh = _fresh_state()
    with ss.Checkpointer(tmp_path / "root", **settings) as restarted:
        with pytest.warns(RuntimeWarning) as caught:
            assert restarted.load_latest(fresh) == 2
        assert "step 3 could not be restored from the node-local level" in str(caught[0].message)
        assert restarted.loaded_from == "persistent"
    assert_state_equals(fresh, refs[2])


def test_a_failed_restore_from_memory_goes_on_to_storage_and_past_damage(tmp_path, monkeypatch):
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    with ss.Checkpointer(tmp_path, **SETTINGS) as ckpt:
        train_step(model, optim, 1)
        ref = reference(state)
        ckpt.save(1, state).wait()
        train_step(model, optim, 2)
        ckpt.save(2, state).wait()
        _damage(tmp_path / "step-2", "flipped")
        monkeypatch.setattr(restore, "restore_from_memory", lambda *args: 1 / 0)
        with pytest.warns(RuntimeWarning) as caught:
            assert ckpt.load_latest(state) == 1
        assert ckpt.loaded_from == "persistent"
    assert "step 2 could not be restored from the memory level" in str(caught[0].message)
    assert_state_equals(state, ref)


class Broken:
    """A stateful value whose state_dict fails: flattening fails after the optimizer before it."""

    def state_dict(self):
        raise RuntimeError("cannot say")

    def load_state_dict(self, sd):
        pass


def test_a_load_that_fails_while_flattening_leaves_a_fresh_optimizer_fresh(tmp_path):
    model, optim = make_training()
    train_step(model, optim, 1)
    ss.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh = _fresh_state()
    with pytest.raises(ss.CheckpointError, match="cannot say"):
        ss.load({**fresh, "broken": Broken()}, tmp_path / "c")
    assert not fresh["optim"].state


def test_an_error_every_copy_would_meet_deletes_no_node_local_step(tmp_path):
    """A value the state cannot take (here a tuple's) fails every copy alike: it is raised, and
    the node-local steps, some of them nowhere else, are all still there once the state is fixed."""
    settings = dict(SETTINGS, local_root=tmp_path / "local", persist_every=2)
    model, _ = make_training()
    with ss.Checkpointer(tmp_path / "root", **settings) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"model": model, "t": (torch.zeros(300_000), step)}).wait()
    with ss.Checkpointer(tmp_path / "root", **settings) as restarted:
        model = make_training(seed=5)[0]
        before = reference({"model": model})
        with pytest.raises(ss.CheckpointError, match="lies in a tuple"):
            restarted.load_latest({"model": model, "t": (torch.zeros(300_000), 0)})
        assert_state_equals({"model": model}, before)  # refused before anything was read into it
    assert sorted(n for n in os.listdir(local_level(tmp_path / "local", tmp_path / "root"))
                  if n.startswith("step-")) == ["step-2", "step-3"]
    with ss.Checkpointer(tmp_path / "root", **settings) as restarted:
        assert restarted.load_latest({"model": make_training(seed=5)[0], "t": (torch.zeros(300_000), 3)}) == 3


def test_a_tuple_the_snapshot_in_memory_does_not_fit_is_refused_before_any_copy(tmp_path):
    """From host memory as from storage: a tuple whose plain value differs from the snapshot's
    is refused, and the state is left as it was."""
    model, _ = make_training()
    with ss.Checkpointer(tmp_path, **SETTINGS) as ckpt:
        ckpt.save(1, {"model": model, "t": (torch.ones(300_000), 1)}).wait()
        target = make_training(seed=5)[0]
        before, held = reference({"model": target}), torch.zeros(300_000)
        with pytest.raises(ss.CheckpointError, match="t.1 lies in a tuple"):
            ckpt.load_latest({"model": target, "t": (held, 2)})
        assert_state_equals({"model": target}, before)
        assert not held.any()
        assert ckpt.load_latest({"model": target, "t": (held, 1)}) == 1 and ckpt.loaded_from == "memory"
        assert held.all()


def test_only_copies_all_damaged_are_summarised_as_damage():
    """The summary error of a restart that found no copy to load says "damaged" only when every
    copy given up was: node-local I/O errors, or a failed memory copy, keep the last error's kind."""
    from statesnap.checkpointer.fallback import Fallback
    from statesnap.engine.dist import Comm

    def outcome(choices, errors):
        fallback = Fallback(Comm(None), choices)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for index, error in enumerate(errors):
                fallback.record(error, index)
                try:
                    fallback.go_on_or_raise(error, index)
                except ss.CheckpointError as exc:
                    return exc
        return None

    io = outcome([(5, 1, "local"), (4, 1, "local")], [ss.ReadFailedError("EIO 5"), ss.ReadFailedError("EIO 4")])
    assert type(io) is ss.ReadFailedError and str(io) == "EIO 4"
    mixed = outcome([(7, 0, "memory"), (7, 2, "persistent")],
                    [ss.CheckpointError("copy failed"), ss.CorruptCheckpointError("checksum mismatch")])
    assert type(mixed) is ss.CorruptCheckpointError and str(mixed) == "checksum mismatch"
    damaged = outcome([(7, 2, "persistent"), (6, 2, "persistent")],
                      [ss.CorruptCheckpointError("flip 7"), ss.MissingFileError("gone 6")])
    assert type(damaged) is ss.CorruptCheckpointError and str(damaged) == (
        "no checkpoint could be restored: every copy of every step is damaged (step 7 from the persistent level: "
        "flip 7; step 6 from the persistent level: gone 6)")
