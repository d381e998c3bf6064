"""``ss.convert(..., source="deepspeed")`` on checkpoints DeepSpeed writes in the test (2 gloo ranks).

Every tensor is compared bit for bit with three references: the ground truth each producer
gathered through DeepSpeed's public API beside its checkpoint, DeepSpeed's own ``zero_to_fp32``
(fp32 master weights) and ``ds_to_universal`` (fp32 masters and every Adam moment).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import statesnap as ss
from statesnap.convert import deepspeed as ds_import
from statesnap.convert import unpickler
from statesnap.errors import CheckpointError, UnsafeCheckpointError

from producers import run_producer

# name -> (script, args before the output directory, args after it)
PRODUCERS = {
    "z1": ("ds_train.py", ["1"], ["fp32"]), "z2": ("ds_train.py", ["2"], ["fp32"]),
    "z3": ("ds_train.py", ["3"], ["fp32"]), "z1_bf16": ("ds_train.py", ["1"], ["bf16"]),
    "z3_bf16": ("ds_train.py", ["3"], ["bf16"]), "pipe": ("ds_pipe.py", [], []), "autotp": ("ds_autotp.py", [], []),
}
MOMENTS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    """A function giving the run directory of one producer, each run at most once per module."""
    root = tmp_path_factory.mktemp("ds")
    done: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in done:
            script, before, after = PRODUCERS[name]
            out = str(root / name)
            run_producer(script, *before, out, *after)
            done[name] = out
        return done[name]

    return get


@pytest.fixture(scope="module")
def converted(produced, tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    done: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in done:
            done[name] = str(root / name)
            ss.convert(produced(name), done[name], source="deepspeed")
        return done[name]

    return get


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def universal(run: str, tmp_path, inject: bool) -> str:
    """``ds_to_universal``'s output folder for the run's tag."""
    out = str(tmp_path / "univ" / "global_step3_universal")
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               os.path.join(run, "global_step3"), "--output_folder", out, "--num_extract_workers", "1",
               "--num_merge_workers", "1"] + (["--inject_missing_state"] if inject else [])
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def universal_tensor(folder: str, name: str, state: str) -> torch.Tensor:
    value = torch.load(os.path.join(folder, "zero", name, f"{state}.pt"), weights_only=False)
    return value["param"] if isinstance(value, dict) else value


# --- the unpickler ---------------------------------------------------------------------------

class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_unpickler_refuses_other_globals_without_running_them(tmp_path):
    marker, path = tmp_path / "ran", str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"optimizer_state_dict": _Evil(str(marker))}, path)
    with pytest.raises(UnsafeCheckpointError) as err:
        unpickler.load(path)
    assert path in str(err.value) and "system" in str(err.value)
    assert not marker.exists()


def test_deepspeed_files_load_without_deepspeed(produced):
    runs = [produced("z1"), produced("z3_bf16"), produced("pipe"), produced("autotp")]
    script = (
        "import sys, glob\n"
        "sys.modules['deepspeed'] = None\n"
        "from statesnap.convert import unpickler\n"
        "files = [f for run in sys.argv[1:] for f in glob.glob(run + '/global_step3/*.pt')]\n"
        "loaded = [unpickler.load(f) for f in files]\n"
        "scalers = [o['optimizer_state_dict']['loss_scaler'] for o in loaded if 'optimizer_state_dict' in o]\n"
        "assert scalers and all(type(s) is dict and 'cur_scale' in s for s in scalers), scalers\n"
        "assert 'deepspeed.runtime' not in sys.modules\n"
        "print(len(files))\n")
    done = subprocess.run([sys.executable, "-c", script, *runs], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert int(done.stdout) >= 12


# --- ZeRO, data parallel only --------------------------------------------------------------

@pytest.mark.parametrize("name", ["z1", "z2", "z3", "z1_bf16", "z3_bf16"])
def test_zero_matches_truth_and_zero_to_fp32(name, produced, converted):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run, dst = produced(name), converted(name)
    reader = ss.open(dst)
    reader.verify()
    truth = torch.load(os.path.join(run, "truth.pt"))
    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    assert set(truth["model"]) == {"emb.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "norm.weight",
                                   "norm.bias"}
    for param, value in truth["model"].items():  # the frozen norm.weight included
        assert value.dtype == dtype and bits_equal(reader.read(f"model.{param}"), value), param
    assert bits_equal(reader.read("model.head.weight"), truth["model"]["emb.weight"])  # tied to emb.weight
    for param, value in truth["fp32"].items():
        assert bits_equal(reader.read(f"fp32.{param}"), value), param
        for moment in MOMENTS:
            assert bits_equal(reader.read(f"optim.state.{param}.{moment}"), truth[moment][param]), (param, moment)
        assert reader.read(f"optim.state.{param}.step").item() == 3
    reference = get_fp32_state_dict_from_zero_checkpoint(run)
    for param in truth["fp32"]:
        assert bits_equal(reader.read(f"fp32.{param}"), reference[param].float()), param
    assert reader.read("global_steps") == 3 and reader.read("skipped_steps") == 0
    assert reader.read("my_extra") == 42
    assert reader.read("lr_scheduler.last_batch_iteration") == 2
    assert reader.read("ds_zero_stage") == int(name[1])
    assert reader.read("ds_loss_scaler.cur_scale") == 1
    groups = reader.read("optim.param_groups")
    assert groups[0]["params"] == ["emb.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "norm.bias"]


@pytest.mark.parametrize("name", ["z1", "z2", "z3"])
def test_zero_moments_match_ds_to_universal(name, produced, converted, tmp_path):
    folder = universal(produced(name), tmp_path, inject=name != "z3")
    reader = ss.open(converted(name))
    for param in reader.read("optim.param_groups")[0]["params"]:
        for state, ours in (("fp32", f"fp32.{param}"), *((m, f"optim.state.{param}.{m}") for m in MOMENTS)):
            value = reader.read(ours)
            assert bits_equal(value, universal_tensor(folder, param, state).reshape(value.shape)), (param, state)


def test_loads_into_a_plain_model_and_adamw(produced, converted):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "producers"))
    try:
        from ds_train import Net
    finally:
        sys.path.pop(0)
    truth = torch.load(os.path.join(produced("z3"), "truth.pt"))
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1.0)
    # The checkpoint holds more (fp32 masters, counters, client state): load what the state names.
    ss.load({"model": model, "optim": opt}, converted("z3"), strict=False)
    for name, param in model.named_parameters():
        assert bits_equal(param.detach(), truth["model"][name]), name
    assert model.head.weight is model.emb.weight
    for name, param in model.named_parameters():
        if param.requires_grad:
            state = opt.state[param]
            assert bits_equal(state["exp_avg"], truth["exp_avg"][name]) and state["step"].item() == 3, name
    assert opt.param_groups[0]["lr"] == pytest.approx(0.004771212547196624)


# --- pipeline and tensor parallelism -------------------------------------------------------

def test_pipeline_stages_merge_into_one_name_space(produced, converted):
    reader = ss.open(converted("pipe"))
    reader.verify()
    compared = 0
    for rank in (0, 1):
        truth = torch.load(os.path.join(produced("pipe"), f"truth_rank{rank}.pt"))
        for param, value in truth["model"].items():
            assert bits_equal(reader.read(f"model.{param}"), value), param
            assert bits_equal(reader.read(f"fp32.{param}"), truth["fp32"][param]), param
            for moment in MOMENTS:
                assert bits_equal(reader.read(f"optim.state.{param}.{moment}"), truth[moment][param]), param
            compared += 1
    assert compared == 6  # three Linear layers (0, 2, 4) over two stages
    assert reader.read("optim.param_groups")[0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias",
                                                              "4.weight", "4.bias"]


def test_autotp_slices_merge_by_the_derived_spec(produced, converted, tmp_path):
    run = produced("autotp")
    spec = ds_import.derive_spec(run)
    assert spec["ops"] and all(isinstance(op, dict) for op in spec["ops"])
    reader = ss.open(converted("autotp"))
    reader.verify()
    folder = universal(run, tmp_path, inject=False)
    truths = [torch.load(os.path.join(run, f"truth_rank{r}.pt")) for r in (0, 1)]
    for param in truths[0]["model"]:
        full = reader.read(f"model.{param}")
        slices = [t["model"][param] for t in truths]
        if slices[0].shape == full.shape:
            assert all(bits_equal(s, full) for s in slices), param
        else:
            dim = next(d for d in range(full.dim()) if slices[0].shape[d] != full.shape[d])
            assert bits_equal(torch.cat(slices, dim), full), param
        for state, ours in (("fp32", f"fp32.{param}"), *((m, f"optim.state.{param}.{m}") for m in MOMENTS)):
            assert bits_equal(reader.read(ours), universal_tensor(folder, param, state)), (param, state)
    assert reader.read("my_extra") == 42 and not any(k.startswith("tp_rank_") for k in reader.keys())


# --- damaged input -------------------------------------------------------------------------

@pytest.fixture
def damaged(produced, tmp_path):
    def copy(name: str) -> str:
        dst = str(tmp_path / name)
        shutil.copytree(produced(name), dst)
        return os.path.join(dst, "global_step3")
    return copy


def test_truncated_optimizer_file(damaged, tmp_path):
    tag = damaged("z1")
    path = os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        ss.convert(tag, str(tmp_path / "out"), source="deepspeed")


def test_missing_rank_file(damaged, tmp_path):
    tag = damaged("z3")
    os.remove(os.path.join(tag, "zero_pp_rank_1_mp_rank_00_model_states.pt"))
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_model_states.pt"):
        ss.convert(tag, str(tmp_path / "out"), source="deepspeed")
    os.remove(os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    shutil.copy(os.path.join(tag, "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                os.path.join(tag, "zero_pp_rank_1_mp_rank_00_model_states.pt"))
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        ss.convert(tag, str(tmp_path / "out"), source="deepspeed")


def test_partition_that_disagrees_with_param_shapes(damaged, tmp_path):
    tag = damaged("z3")
    path = os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    loaded = torch.load(path, weights_only=False)  # DeepSpeed is installed here: the test may trust it
    flat = loaded["optimizer_state_dict"]["fp32_flat_groups"]
    flat[0] = flat[0][:-5].clone()
    torch.save(loaded, path)
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt.*param_shapes"):
        ss.convert(tag, str(tmp_path / "out"), source="deepspeed")


def test_foreign_global_in_a_rank_file(damaged, tmp_path):
    tag = damaged("z1")
    path = os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"optimizer_state_dict": _Evil(str(tmp_path / "ran"))}, path)
    with pytest.raises(UnsafeCheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        ss.convert(os.path.dirname(tag), str(tmp_path / "out"))  # detected as deepspeed from 'latest'
    assert not (tmp_path / "ran").exists()
