"""``source="ucp"``: DeepSpeed universal checkpoint folders that ``ds_to_universal`` wrote in the test.

Two runs of ``producers/ds_train.py`` on 2 gloo ranks (a tied weight, a frozen parameter, sizes that
do not divide by the world size, a WarmupLR scheduler, client state): ZeRO-1 in bf16 (converted
with ``--inject_missing_state``, as a HF/accelerate-style checkpoint without
``universal_checkpoint_info`` needs) and ZeRO-3 in fp32 (flat per-parameter tensors, no
``step.pt``, placeholder module weights); and an AutoTP x2 run (``producers/ds_autotp.py``), whose
tensor-parallel slices ds_to_universal merged. The converted checkpoint must hold DeepSpeed's own
ground truth bit for bit, and the same values under the same names as ``source="deepspeed"``
gives for the native checkpoint of the same run.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import statesnap as ss
from statesnap.convert import ucp, unpickler
from statesnap.convert.api import detect_source
from statesnap.errors import CheckpointError, UnsafeCheckpointError
from producers import run_producer

AUTOTP = "autotp"  # producers/ds_autotp.py: a tiny Llama, AutoTP x2 with ZeRO-1
PRODUCED = {"z1_bf16": ["ds_train.py", "1", "{run}", "bf16"], "z3_fp32": ["ds_train.py", "3", "{run}", "fp32"],
            AUTOTP: ["ds_autotp.py", "{run}"]}
RUNS = ["z1_bf16", "z3_fp32"]  # the runs with whole-model ground truth
# The module fixture (three producer runs, three ds_to_universal runs, six conversions) counts
# towards its first test's time limit; on a loaded machine it may take longer than one test should.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per run: the run directory (DeepSpeed's checkpoint, the universal folder beside it, the
    ground truth) and the run converted from each source."""
    root = tmp_path_factory.mktemp("ucp")
    out = {}
    for key, command in PRODUCED.items():
        run = str(root / key)
        run_producer(*(part.format(run=run) for part in command))
        universal = os.path.join(run, "global_step3_universal")
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        os.path.join(run, "global_step3"), "--output_folder", universal, "--inject_missing_state",
                        "--num_extract_workers", "1", "--num_merge_workers", "1"],  # the other worker's cores
                       check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
        converted = {source: str(root / f"{key}_{source}") for source in ("ucp", "deepspeed")}
        ss.convert(universal, converted["ucp"])  # detected
        ss.convert(run, converted["deepspeed"], source="deepspeed")
        truth = os.path.join(run, "truth.pt")
        out[key] = {"run": run, "universal": universal, "converted": converted,
                    "truth": torch.load(truth, weights_only=True) if os.path.exists(truth) else None}
    yield out
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def damaged(runs, tmp_path):
    """A copy of the ZeRO-3 universal folder (and its latest_universal) to break."""
    parent = tmp_path / "run"
    folder = parent / "global_step3_universal"
    shutil.copytree(runs["z3_fp32"]["universal"], folder)
    (parent / ucp.LATEST).write_text("global_step3_universal")
    return folder


def _read_all(path: str) -> dict:
    reader = ss.open(path)
    return {name: reader.read(name) for name in reader.keys()}


@pytest.mark.parametrize("run", RUNS)
def test_holds_deepspeeds_ground_truth_bit_for_bit(runs, run):
    got = _read_all(runs[run]["converted"]["ucp"])
    truth = runs[run]["truth"]
    checked = 0
    for kind, tensors in truth.items():  # model (as the module held them), fp32, exp_avg, exp_avg_sq
        for name, expected in tensors.items():
            key = f"{kind}.{name}" if kind in ("model", "fp32") else f"optim.state.{name}.{kind}"
            assert got[key].dtype == expected.dtype and torch.equal(got[key], expected), key
            checked += 1
    assert checked == 7 + 3 * 6  # 7 module weights; fp32 and 2 moments of the 6 trainable ones
    assert torch.equal(got["model.head.weight"], got["model.emb.weight"])  # the tied alias
    assert "fp32.norm.weight" not in got and "optim.state.norm.weight.exp_avg" not in got  # frozen
    expected_dtype = torch.bfloat16 if run == "z1_bf16" else torch.float32
    assert got["model.fc1.weight"].dtype == expected_dtype and got["fp32.fc1.weight"].dtype == torch.float32


@pytest.mark.parametrize("run", RUNS)
def test_steps_param_groups_and_client_state(runs, run):
    got = _read_all(runs[run]["converted"]["ucp"])
    trainable = ["emb.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "norm.bias"]
    for name in trainable:
        assert torch.equal(got[f"optim.state.{name}.step"], torch.tensor(3.0)), name
    (group,) = got["optim.param_groups"]
    assert sorted(group["params"]) == sorted(trainable)
    # WarmupLR (log warmup to 1e-2 over 10 steps) had set the lr of step 3; it comes along.
    assert group["lr"] == pytest.approx(1e-2 * math.log(3) / math.log(10), rel=1e-12)
    assert got["global_steps"] == 3 and got["my_extra"] == 42
    assert got["ds_zero_stage"] == int(PRODUCED[run][1])
    assert got["lr_scheduler.last_batch_iteration"] == 2  # WarmupLR counts from -1


@pytest.mark.parametrize("run", [*RUNS, AUTOTP])
def test_same_names_and_bytes_as_the_deepspeed_source(runs, run):
    """Also for AutoTP, where ds_to_universal merged the tensor-parallel slices by its patterns and
    the deepspeed source by the spec it derives from the same ``universal_checkpoint_info``."""
    ours, theirs = (_read_all(runs[run]["converted"][s]) for s in ("ucp", "deepspeed"))
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == theirs[name].dtype and torch.equal(value, theirs[name]), name
        else:
            assert value == theirs[name], name


def test_folder_its_parent_and_detection(runs):
    universal = runs["z3_fp32"]["universal"]
    run = runs["z3_fp32"]["run"]
    assert detect_source(universal) == "ucp"
    # ds_to_universal put latest_universal beside DeepSpeed's latest: that directory is the native run.
    assert detect_source(run) == "deepspeed"
    assert ucp.folder_of(run) == universal
    assert ucp.read(run).keys() == ucp.read(universal).keys()


def test_missing_moment_names_the_file(damaged):
    os.remove(damaged / "zero" / "fc1.weight" / "exp_avg_sq.pt")
    with pytest.raises(CheckpointError, match=r"fc1\.weight/exp_avg_sq\.pt"):
        ucp.read(str(damaged))


def test_wrong_size_names_the_file_and_tensor(damaged):
    torch.save(torch.zeros(7), damaged / "zero" / "fc2.bias" / "fp32.pt")
    with pytest.raises(CheckpointError, match=r"fc2\.bias/fp32\.pt: fc2\.bias has shape \(7,\)"):
        ucp.read(str(damaged))


def test_truncated_file_is_an_error_naming_it(damaged):
    path = damaged / "zero" / "emb.weight" / "exp_avg.pt"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"emb\.weight/exp_avg\.pt"):
        ucp.read(str(damaged))


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_foreign_global_is_refused_without_running_it(damaged):
    torch.save({"param": _Payload()}, damaged / "zero" / "fc1.bias" / "fp32.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"fc1\.bias/fp32\.pt"):
        ucp.read(str(damaged))


def test_pipeline_folders_are_refused_with_the_way_out(damaged):
    path = damaged / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    states = unpickler.load(str(path))
    torch.save({**states, "module": None}, path)  # as a pipeline engine's mp_rank files hold it
    with pytest.raises(CheckpointError, match="pipeline-parallel universal checkpoint.*source='deepspeed'"):
        ucp.read(str(damaged))


def test_incomplete_folders_are_errors(damaged):
    os.remove(damaged / "zero" / "optimizer_state.pt")
    with pytest.raises(CheckpointError, match="optimizer_state.pt"):
        ucp.read(str(damaged))
    (damaged.parent / ucp.LATEST).write_text("../elsewhere")
    with pytest.raises(CheckpointError, match="latest_universal names"):
        ucp.read(str(damaged.parent))
    shutil.rmtree(damaged / "zero")
    with pytest.raises(CheckpointError, match="not a DeepSpeed universal checkpoint"):
        ucp.read(str(damaged))
