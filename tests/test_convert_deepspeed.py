"""``ss.convert(..., source="deepspeed")`` on checkpoints DeepSpeed writes in the test (2 gloo ranks).

Every tensor is compared bit for bit with three references: the ground truth each producer
gathered through DeepSpeed's public API beside its checkpoint, DeepSpeed's own ``zero_to_fp32``
(fp32 master weights) and ``ds_to_universal`` (fp32 masters and every Adam moment).
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import statesnap as ss
from statesnap.convert import deepspeed as ds_import
from statesnap.convert import unpickler
from statesnap.errors import CheckpointError, UnsafeCheckpointError

from producers import once_each, run_producer

# Tests here run the real libraries' producers on 2 ranks (tests/producers), a first test several
# of them: on a loaded machine (the CI's clean run of 2026-11-28 here, at about half this VM's
# usual speed) that took longer than the 300 s one test is otherwise given.
pytestmark = pytest.mark.timeout(900)

# name -> (script, args before the output directory, args after it)
PRODUCERS = {
    "z1": ("ds_train.py", ["1"], ["fp32"]), "z2": ("ds_train.py", ["2"], ["fp32"]),
    "z3": ("ds_train.py", ["3"], ["fp32"]), "z1_bf16": ("ds_train.py", ["1"], ["bf16"]),
    "z3_bf16": ("ds_train.py", ["3"], ["bf16"]), "pipe": ("ds_pipe.py", [], []), "autotp": ("ds_autotp.py", [], []),
    "autotp_phi3": ("ds_autotp.py", [], ["phi3"]), "pipe_tp": ("ds_pipe_tp.py", [], []),
}
RANKS = {"pipe_tp": 4}  # gloo ranks of a producer, 2 unless named
MOMENTS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    """A function giving the run directory of one producer, each run at most once per module."""
    def make(name: str, out: str) -> None:
        script, before, after = PRODUCERS[name]
        run_producer(script, *before, out, *after, nproc=RANKS.get(name, 2))

    return once_each(tmp_path_factory.mktemp("ds"), make)


@pytest.fixture(scope="module")
def converted(produced, tmp_path_factory):
    return once_each(tmp_path_factory.mktemp("converted"),
                     lambda name, out: ss.convert(produced(name), out, source="deepspeed"))


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


def test_unpickler_reads_numpy_arrays_but_not_the_globals_inside_object_arrays(tmp_path):
    """Megatron-LM's rng_state holds numpy's RNG state: numpy arrays load as data; an object
    array's elements still go through the allow-list."""
    import numpy as np

    path = str(tmp_path / "rng.pt")
    state = np.random.RandomState(7).get_state()
    torch.save({"rng_state": [{"np_rng_state": state}]}, path)
    loaded = unpickler.load(path)["rng_state"][0]["np_rng_state"]
    assert loaded[0] == "MT19937" and np.array_equal(loaded[1], state[1]) and loaded[1].dtype == np.uint32
    marker = tmp_path / "ran"
    torch.save({"x": np.array([_Evil(str(marker))], dtype=object)}, path)
    with pytest.raises(UnsafeCheckpointError, match="system"):
        unpickler.load(path)
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


def _producer_net():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "producers"))
    try:
        from ds_train import Net
    finally:
        sys.path.pop(0)
    return Net


def test_loads_into_a_plain_model_and_adamw(produced, converted):
    Net = _producer_net()
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


def test_fp32_masters_load_into_a_bf16_model_with_cast(produced, converted):
    """UCP's precision-agnostic resume: the fp32 master weights into a bf16 model, rounded once."""
    Net = _producer_net()
    truth = torch.load(os.path.join(produced("z3"), "truth.pt"))
    model = Net().to(torch.bfloat16)
    # strict=False: the frozen norm weight has no fp32 master (the optimizer never held it)
    ss.load({"fp32": model}, converted("z3"), strict=False, cast=True)
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert bits_equal(param.detach(), truth["fp32"][name].to(torch.bfloat16)), name


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


def test_pipeline_of_tensor_parallel_stages_merges_stages_and_slices(produced, converted, tmp_path):
    """PP=2 x TP=2 (rank = stage x 2 + TP rank): each rank's truth is its slice, joined here by hand:
    column-parallel weights and biases along dim 0, row-parallel weights along dim 1, the row-parallel
    bias whole on both TP ranks."""
    run = produced("pipe_tp")
    files = os.listdir(os.path.join(run, "global_step3"))
    assert {"layer_03-model_01-model_states.pt", "mp_rank_03_model_states.pt",
            "bf16_zero_pp_rank_0_mp_rank_03_optim_states.pt"} <= set(files)
    reader = ss.open(converted("pipe_tp"))
    reader.verify()
    folder = universal(run, tmp_path, inject=False)
    truths = [torch.load(os.path.join(run, f"truth_rank{r}.pt")) for r in range(4)]
    cat_dims = {"0.weight": 0, "0.bias": 0, "1.weight": 1, "1.bias": None,
                "2.weight": 0, "2.bias": 0, "3.weight": 1, "3.bias": None}
    for param, dim in cat_dims.items():
        stage = int(param[0]) // 2
        for state in ("model", "fp32", *MOMENTS):
            slices = [truths[2 * stage + tp][state][param] for tp in (0, 1)]
            if dim is None:
                assert bits_equal(slices[0], slices[1]), (param, state)
            expected = slices[0] if dim is None else torch.cat(slices, dim)
            ours = reader.read(f"{state}.{param}" if state in ("model", "fp32") else f"optim.state.{param}.{state}")
            assert bits_equal(ours, expected), (param, state)
            if state != "model":
                assert bits_equal(ours, universal_tensor(folder, param, state)), (param, state)
    assert reader.read("model.0.weight").dtype == torch.bfloat16 and reader.read("optim.state.3.bias.step") == 3
    assert reader.read("optim.param_groups")[0]["params"] == list(cat_dims)
    assert reader.read("my_extra") == 42 and not any(k.startswith("tp_rank_") for k in reader.keys())


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


def test_autotp_llama_exports_to_safetensors_that_from_pretrained_loads(produced, converted, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from statesnap.convert import specs

    out = tmp_path / "hf"
    out.mkdir()  # an existing empty directory, as save_pretrained accepts
    ss.export(converted("autotp"), str(out), to="safetensors", spec=specs.path("deepspeed_to_hf"))
    # the producer's config (tests/producers/ds_autotp.py)
    LlamaConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                intermediate_size=48, vocab_size=64, max_position_embeddings=32,
                tie_word_embeddings=False).save_pretrained(out)
    model, loading = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    reader = ss.open(converted("autotp"))
    loaded = model.state_dict()
    assert sorted(f"model.{name}" for name in loaded) == sorted(k for k in reader.keys() if k.startswith("model."))
    for name, tensor in loaded.items():
        assert bits_equal(tensor, reader.read(f"model.{name}")), name


def test_autotp_sub_parameters_of_uneven_sizes_merge_as_deepspeed_gathers_them(produced, converted, tmp_path):
    """Phi-3 under GQA: qkv_proj's q, k and v have 32, 16 and 16 rows, each cut over the 2 ranks
    (``parameter_with_sub_params`` with ``sub_param_shard_widths``); gate_up_proj is [gate | up]."""
    run = produced("autotp_phi3")
    states = unpickler.load(os.path.join(run, "global_step3", "mp_rank_00_model_states.pt"))
    widths = states["universal_checkpoint_info"]["sub_param_shard_widths"]
    assert widths[r"^model\.layers\.0\.self_attn\.qkv_proj\.weight$"] == [[16, 16], [8, 8], [8, 8]]
    reader = ss.open(converted("autotp_phi3"))
    reader.verify()
    gathered = torch.load(os.path.join(run, "gathered_model.pt"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in gathered
    for param, value in gathered.items():  # DeepSpeed's own gather of the slices
        assert bits_equal(reader.read(f"model.{param}"), value), param
    folder = universal(run, tmp_path, inject=False)
    for param in gathered:
        for state, ours in (("fp32", f"fp32.{param}"), *((m, f"optim.state.{param}.{m}") for m in MOMENTS)):
            assert bits_equal(reader.read(ours), universal_tensor(folder, param, state)), (param, state)
    ss.convert(folder, str(tmp_path / "from_ucp"), source="ucp")
    from_ucp = ss.open(str(tmp_path / "from_ucp"))
    assert sorted(from_ucp.keys()) == sorted(reader.keys())
    for key in reader.keys():
        ours = reader.read(key)
        if isinstance(ours, torch.Tensor):
            assert bits_equal(from_ucp.read(key), ours), key


def _legacy_sub_params(states: dict) -> None:
    """universal_checkpoint_info as written before version 0.4: sub-parameter sizes, no per-rank widths."""
    info = states["universal_checkpoint_info"]
    info["universal_checkpoint_version"] = 0.3
    del info["sub_param_shard_widths"]


def test_sub_parameters_without_widths_before_version_0_4_are_cut_evenly(damaged, converted, tmp_path):
    tag = damaged("autotp_phi3")
    for rank in (0, 1):
        _edit(os.path.join(tag, f"mp_rank_{rank:02d}_model_states.pt"), _legacy_sub_params)
    ss.convert(tag, str(tmp_path / "out"), source="deepspeed")
    legacy, reader = ss.open(str(tmp_path / "out")), ss.open(converted("autotp_phi3"))
    compared = 0
    for key in reader.keys():
        if key.startswith(("model.", "fp32.", "optim.state.")) and isinstance(reader.read(key), torch.Tensor):
            assert bits_equal(legacy.read(key), reader.read(key)), key
            compared += 1
    assert compared == 9 * 5  # model, fp32, two moments and torch AdamW's step tensor of each parameter


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


def test_missing_layer_file_of_one_tp_rank(damaged, tmp_path):
    """Without it the stage's other TP rank alone would pass for the whole layer."""
    tag = damaged("pipe_tp")
    os.remove(os.path.join(tag, "layer_02-model_01-model_states.pt"))
    with pytest.raises(CheckpointError, match="layer_02-model_01-model_states.pt"):
        ss.convert(tag, str(tmp_path / "out"), source="deepspeed")


def test_pipeline_with_tp_from_before_checkpoint_parallel_dimensions(damaged, converted, tmp_path):
    """DeepSpeed before checkpoint_parallel_dimensions: TP is read from the layer files' names."""
    tag = damaged("pipe_tp")
    for rank in range(4):
        _edit(os.path.join(tag, f"mp_rank_{rank:02d}_model_states.pt"),
              lambda states: states.pop("checkpoint_parallel_dimensions"))
    ss.convert(tag, str(tmp_path / "out"), source="deepspeed")
    older, reader = ss.open(str(tmp_path / "out")), ss.open(converted("pipe_tp"))
    assert sorted(older.keys()) == sorted(reader.keys())
    for key in reader.keys():
        if isinstance(reader.read(key), torch.Tensor):
            assert bits_equal(older.read(key), reader.read(key)), key


def test_foreign_global_in_a_rank_file(damaged, tmp_path):
    tag = damaged("z1")
    path = os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"optimizer_state_dict": _Evil(str(tmp_path / "ran"))}, path)
    with pytest.raises(UnsafeCheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        ss.convert(os.path.dirname(tag), str(tmp_path / "out"))  # detected as deepspeed from 'latest'
    assert not (tmp_path / "ran").exists()


# --- hostile pickles and garbage in every field ------------------------------------------------

def _crafted(path: str, body: bytes) -> None:
    """A torch.save zip whose pickle is ``body`` (protocol 2 opcodes), to name any global with any arguments."""
    torch.save({}, path)
    with zipfile.ZipFile(path) as zf:
        entries = {info.filename: zf.read(info) for info in zf.infolist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in entries.items():
            zf.writestr(name, b"\x80\x02" + body + b"." if name.endswith("/data.pkl") else data)


def _glob(name: str) -> bytes:
    module, _, attr = name.rpartition(".")
    return b"c" + module.encode() + b"\n" + attr.encode() + b"\n"


def _text(s: str) -> bytes:
    return b"X" + len(s).to_bytes(4, "little") + s.encode()


FRAGMENT, SCALER = "deepspeed.utils.tensor_fragment.fragment_address", "deepspeed.runtime.fp16.loss_scaler.LossScaler"
HOSTILE = {
    "eval": _glob("builtins.eval") + _text("print('ran')") + b"\x85R",  # eval(...)
    "system": _glob("os.system") + _text("true") + b"\x85R",
    "popen": _glob("subprocess.Popen") + _text("true") + b"\x85R",
    "made-up DeepSpeed name": _glob("deepspeed.runtime.evil.X") + b")\x81",
    "fragment without state": _glob(FRAGMENT) + b")\x81",  # NEWOBJ, no BUILD
    "fragment negative": _glob(FRAGMENT) + b")\x81}(" + _text("numel") + b"J\xfb\xff\xff\xff" + _text("start")
    + b"K\x00ub",  # BUILD {numel: -5, start: 0}
    "zero stage text": _glob("deepspeed.runtime.zero.config.ZeroStageEnum") + _text("3") + b"\x85R",
    "scaler state list": _glob(SCALER) + b")\x81]b",  # BUILD with []
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_pickles_are_refused_without_effect(case, tmp_path):
    path = str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _crafted(path, HOSTILE[case])
    before = set(torch.serialization.get_safe_globals())
    with pytest.raises(UnsafeCheckpointError) as err:
        unpickler.load(path)
    assert path in str(err.value) and "Weights only load failed" not in str(err.value)
    assert set(torch.serialization.get_safe_globals()) == before  # nothing admitted beyond the load
    _crafted(path, _glob(SCALER) + b")\x81")
    with pytest.raises(pickle.UnpicklingError):  # a plain weights-only load still refuses DeepSpeed's names
        torch.load(path, weights_only=True)


def _edit(path: str, change) -> None:
    loaded = torch.load(path, weights_only=False)  # DeepSpeed is installed here: the test may trust it
    change(loaded)
    torch.save(loaded, path)


def _shift_fragment(optim: dict) -> None:
    mapping = optim["optimizer_state_dict"]["param_slice_mappings"][0]
    name = list(mapping)[1]
    mapping[name] = type(mapping[name])(numel=mapping[name].numel, start=0)  # on top of the first


QKV = r"^model\.layers\.0\.self_attn\.qkv_proj\.weight$"
GARBAGE = {  # name -> (run, file, change, what the error names)
    "shape of text": ("z1", "mp_rank_00_model_states.pt",
                      lambda o: o["param_shapes"][0].__setitem__("fc1.weight", "abc"), "fc1.weight"),
    "param_shapes not groups": ("z1", "mp_rank_00_model_states.pt",
                                lambda o: o.__setitem__("param_shapes", "abc"), "param_shapes"),
    "overlapping fragments": ("z1", "zero_pp_rank_0_mp_rank_00_optim_states.pt", _shift_fragment, "overlaps"),
    "partition_count 0": ("z1", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                          lambda o: o["optimizer_state_dict"].__setitem__("partition_count", [0]), "partition_count"),
    "no zero_stage": ("z1", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                      lambda o: o["optimizer_state_dict"].pop("zero_stage"), "zero_stage"),
    "no base optimizer": ("z1", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                          lambda o: o["optimizer_state_dict"].pop("base_optimizer_state"), "base_optimizer_state"),
    "a rank without exp_avg": ("z1", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                               lambda o: o["optimizer_state_dict"]["base_optimizer_state"]["state"][0].pop("exp_avg"),
                               "exp_avg"),
    "ranks of two runs": ("z3", "zero_pp_rank_1_mp_rank_00_model_states.pt",
                          lambda o: o.update(dp_world_size=4, global_steps=7), "dp_world_size"),
    "no inner optimizer": ("z3", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                           lambda o: o["optimizer_state_dict"].pop("optimizer_state_dict"), "param_groups"),
    "sub-parameter widths that do not add up": (
        "autotp_phi3", "mp_rank_00_model_states.pt",
        lambda o: o["universal_checkpoint_info"]["sub_param_shard_widths"][QKV].__setitem__(0, [16, 8]),
        "sub_param_shard_widths of"),
    "sub-parameters without widths at version 0.4": (
        "autotp_phi3", "mp_rank_00_model_states.pt",
        lambda o: o["universal_checkpoint_info"].pop("sub_param_shard_widths"), "no sub_param_shard_widths"),
    "sub-parameter shape that reshapes": (
        "autotp_phi3", "mp_rank_00_model_states.pt",
        lambda o: o["universal_checkpoint_info"]["parameter_with_sub_params"][0].__setitem__(
            "shape", [(32, 16, 16), 4, -1]), "reshapes"),
    "sub-parameter sizes 2 ranks do not divide": (
        "autotp_phi3", "mp_rank_00_model_states.pt",
        lambda o: (_legacy_sub_params(o), o["universal_checkpoint_info"]["parameter_with_sub_params"][0].__setitem__(
            "shape", [(31, 17, 16), -1])), "do not divide"),
}


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_fields_are_checkpoint_errors(case, damaged, tmp_path):
    run, name, change, says = GARBAGE[case]
    tag = damaged(run)
    _edit(os.path.join(tag, name), change)
    with pytest.raises(CheckpointError, match=f"{re.escape(name)}.*{says}"):
        ss.convert(os.path.dirname(tag), str(tmp_path / "out"), source="deepspeed")


@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b"../../etc", b"global_step9", b"x" * 10000])
def test_latest_naming_no_tag_beside_it(content, damaged, tmp_path):
    run = os.path.dirname(damaged("z1"))
    with open(os.path.join(run, "latest"), "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointError, match="latest names"):
        ss.convert(run, str(tmp_path / "out"), source="deepspeed")
