"""``AcceleratorCheckpoints``: a real accelerate loop on the CPU (``tests/integrations/accelerate_train.py``,
with dropout, an LR scheduler and AdamW) saves every 4 steps, is SIGKILLed right after a save of
step 9 began (step 8 committed), restarts, restores from the newest committed step, and logs the same
losses and ends with the same parameters as a run never killed, bit for bit."""
import json
import os
import subprocess
import sys

import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "integrations", "accelerate_train.py")


def _run(out, *args, killed=False):
    done = subprocess.run([sys.executable, SCRIPT, str(out), *args], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == (-9 if killed else 0), done.stderr[-3000:]


def test_killed_accelerate_loop_resumes_bit_exact(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _run(whole)
    _run(killed, "--kill-at", "8", killed=True)
    _run(killed)
    expected = json.loads((whole / "losses-0.json").read_text())
    (name,) = [n for n in os.listdir(killed) if n.startswith("losses-")]  # step 9's save may have committed
    start = int(name[len("losses-"):-len(".json")])
    assert start in (8, 9)
    resumed = json.loads((killed / name).read_text())
    assert resumed["loaded_from"] == "persistent"
    assert resumed["losses"] == {step: loss for step, loss in expected["losses"].items() if int(step) > start}
    first, second = torch.load(whole / "final.pt"), torch.load(killed / "final.pt")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert {"step-4", "step-8", "step-12"} <= set(os.listdir(killed / "ckpt"))
