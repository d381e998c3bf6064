"""Lightning with ``StatesnapCheckpointIO``: real Trainers (one process, and DDP on 2 gloo ranks)
run ``tests/integrations/lightning_train.py``: checkpoint every 2 steps (top-2 by the loss, plus
``last``), get SIGKILLed at step 7 with saves in flight, resume with ``ckpt_path="last"``, and
must then log the same losses and end with the same parameters as a run never killed, bit for
bit (one thread, fixed data, no shuffle: Lightning is deterministic here)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from statesnap.integrations.lightning import STORE_DIR, read_checkpoint

SCRIPT = os.path.join(os.path.dirname(__file__), "integrations", "lightning_train.py")


def _run(out, *args, killed=False):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(SCRIPT)}
    # its own session: the kill takes the whole process group (DDP's second rank included)
    done = subprocess.run([sys.executable, SCRIPT, str(out), *args], env=env, capture_output=True, text=True,
                          timeout=240, start_new_session=True)
    if killed:
        assert done.returncode == -9, done.stderr[-3000:]
    else:
        assert done.returncode == 0, done.stderr[-3000:]


def _losses(out, rank, resumed=False):
    with open(os.path.join(out, f"losses-{rank}{'-resumed' if resumed else ''}.json")) as f:
        return {int(k): v for k, v in json.load(f).items()}


def _assert_same_parameters(a, b, rank):
    first, second = (torch.load(os.path.join(d, f"final-{rank}.pt")) for d in (a, b))
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("devices", [1, 2])
def test_killed_run_resumes_from_last_bit_exact(tmp_path, devices):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _run(whole, "--devices", str(devices))
    _run(killed, "--devices", str(devices), "--kill-at", "7", killed=True)
    _run(killed, "--devices", str(devices), "--resume")
    for rank in range(devices):
        expected, resumed = _losses(whole, rank), _losses(killed, rank, resumed=True)
        assert min(resumed) <= 7 and max(resumed) == max(expected)  # resumed from before the kill
        assert resumed == {step: expected[step] for step in resumed}
        _assert_same_parameters(whole, killed, rank)
    # ModelCheckpoint's top-2 and last: deletions went through statesnap, nothing left behind
    for out in (whole, killed):
        with open(out / "checkpoints.json") as f:
            kept = json.load(f)
        assert sorted(kept["files"]) == sorted([*kept["kth"], "last.ckpt"]) and len(kept["kth"]) == 2
        pointed = {json.loads((out / "ckpt" / name).read_text())["checkpoint"] for name in kept["files"]}
        stored = {f"{STORE_DIR}/{n}" for n in os.listdir(out / "ckpt" / STORE_DIR) if n.startswith("step-")}
        assert stored == pointed
        assert not [n for n in os.listdir(out / "ckpt") if ".tmp-" in n]


def test_statesnap_checkpoints_leave_training_as_lightnings_own_do(tmp_path):
    """The lazy snapshots change nothing in the run; the stored state is the model's own."""
    ours, theirs = tmp_path / "statesnap", tmp_path / "torch"
    _run(ours)
    _run(theirs, "--io", "torch")
    assert _losses(ours, 0) == _losses(theirs, 0)
    _assert_same_parameters(ours, theirs, 0)
    ckpt = read_checkpoint(str(ours / "ckpt" / STORE_DIR / sorted(
        os.listdir(ours / "ckpt" / STORE_DIR), key=lambda n: int(n[5:]) if n.startswith("step-") else -1)[-1]))
    final = torch.load(ours / "final-0.pt")
    assert ckpt["global_step"] == 12 and set(ckpt["state_dict"]) == set(final)
    for name, value in final.items():
        assert torch.equal(ckpt["state_dict"][name], value), name
    assert isinstance(ckpt["optimizer_states"][0]["param_groups"][0]["betas"], tuple)
    assert set(ckpt["optimizer_states"][0]["state"]) == {0, 1, 2, 3}  # integer keys, as saved
