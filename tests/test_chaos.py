"""The chaos suite's quick profile, as CI runs it: ``statesnap bench --suite chaos --profile quick``;
and the faults it found, pinned down deterministically.

Every scenario (kill -9 of a trainer, full disk, I/O errors, random damage and hostile manifests,
a dying gloo rank, two owners of a root, save racing close, load_latest during a flush) must run
at least one trial, and every trial must have its expected outcome: the suite's own checks say
what that is for each (``statesnap.bench.chaos``); a failure here lists the trials that went wrong.
"""
import json
import os
import threading

import pytest
import torch

import statesnap as ss
from statesnap import cli

SCENARIOS_PER_FAMILY = {"kill -9": 2, "disk full": 1, "I/O error": 3, "damage:": 6, "rank dies": 4,
                        "two owners": 1, "save during close": 1, "load_latest during": 1}


def test_quick_profile_every_scenario_runs_and_holds(tmp_path):
    report = tmp_path / "chaos.json"
    code = cli.main(["bench", "--suite", "chaos", "--profile", "quick", "--out", str(tmp_path / "out"),
                     "--json", str(report)])
    scenarios = json.loads(report.read_text())["scenarios"]
    for prefix, count in SCENARIOS_PER_FAMILY.items():
        assert len([s for s in scenarios if s["scenario"].startswith(prefix)]) == count, prefix
    assert all(s["trials"] >= 1 for s in scenarios), [s["scenario"] for s in scenarios if not s["trials"]]
    unexpected = [f"{s['scenario']}: {s['wrong']} wrong, {s['hang']} hung: {s['messages']}"
                  for s in scenarios if s["wrong"] or s["hang"]]
    assert not unexpected, "\n".join(unexpected)
    assert code == 0
    assert not (tmp_path / "out" / "chaos").exists(), "the suite's scratch must be removed"


def test_checkpointer_keeps_saving_when_its_events_file_cannot_be_written(tmp_path, caplog):
    """A full disk used to kill the flusher thread through the events file (EventLog.flush raised
    ENOSPC in it), after which no save ever finished and close() hung. A directory where the
    events file belongs makes every append fail the same way."""
    os.makedirs(tmp_path / "events" / "rank-00000.jsonl")
    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.05)
    for step in range(1, 4):
        assert ckpt.save(step, {"t": torch.full((10,), float(step))}).wait(timeout=30)
    ckpt.close()
    assert ss.open(tmp_path / "step-3").read("t")[0] == 3
    assert "cannot write events" in caplog.text


def test_save_racing_close_raises_instead_of_never_finishing(tmp_path):
    """close() on another thread while save() plans: the save used to queue its snapshot behind
    the stopped stager, so its handle never resolved (and close hung when a flush was queued)."""
    planning, closed = threading.Event(), threading.Event()

    class SlowToSnapshot:
        def state_dict(self):
            planning.set()
            closed.wait(60)
            return {"x": 1}

        def load_state_dict(self, state):
            pass

    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.05)
    closer = threading.Thread(target=lambda: (planning.wait(60), ckpt.close(), closed.set()))
    closer.start()
    with pytest.raises(ss.CheckpointError, match="closed while step 1 was being saved"):
        ckpt.save(1, {"t": torch.ones(3), "slow": SlowToSnapshot()})
    closer.join(60)
    assert not closer.is_alive()
