"""ss.convert / ss.export: foreign checkpoints in and out bit for bit, transforms, and safety."""
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import statesnap as ss
from statesnap import cli
from statesnap.convert import TransformError
from statesnap.convert import dcp as convert_dcp
from statesnap.convert.transform import apply_spec, load_spec, materialize
from dist_utils import run_ranks


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (so NaN payloads and -0.0 count too)."""
    return (a.dtype == b.dtype and a.shape == b.shape and
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def sample_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "f16_transposed": torch.randn(3, 6, generator=g).half().t(),
        "f64_scalar": torch.tensor(3.5, dtype=torch.float64),
        "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "mx_scales": torch.rand(6, generator=g).to(torch.float8_e8m0fnu),  # safetensors' F8_E8M0
        "i64": torch.arange(-5, 7),
        "u8": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
    }


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def test_torch_save_to_statesnap_to_safetensors_and_torch_bit_for_bit(tmp_path):
    tensors = sample_tensors()
    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]
    torch.save({"model": tensors, "epoch": 3, "groups": groups}, tmp_path / "src.pt")

    info = ss.convert(tmp_path / "src.pt", tmp_path / "ck")
    assert info.bytes > 0
    reader = ss.open(tmp_path / "ck")
    assert sorted(reader.keys()) == sorted([f"model.{k}" for k in tensors] + ["epoch", "groups"])
    for name, tensor in tensors.items():
        assert same_bits(reader.read(f"model.{name}"), tensor), name
    assert reader.read("epoch") == 3 and reader.read("groups") == groups
    assert reader.meta["converted_from"]["source"] == "torch"
    reader.verify()

    out = ss.export(tmp_path / "ck", tmp_path / "st", to="safetensors")
    assert out.files == ["model.safetensors"] and out.tensors == len(tensors)
    assert sorted(s.split(" ")[0] for s in out.skipped) == ["epoch", "groups"]
    exported = load_file(tmp_path / "st" / "model.safetensors")
    assert exported.keys() == {f"model.{k}" for k in tensors}
    for name, tensor in tensors.items():
        assert same_bits(exported[f"model.{name}"], tensor), name

    ss.export(tmp_path / "ck", tmp_path / "back.pt", to="torch")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["epoch"] == 3 and back["groups"] == groups
    for name, tensor in tensors.items():
        assert same_bits(back[f"model.{name}"], tensor), name


def test_converted_checkpoint_loads_into_a_model_with_ss_load(tmp_path):
    model = make_model(0)
    torch.save({"model": model.state_dict(), "step": 7}, tmp_path / "train.pt")
    ss.convert(tmp_path / "train.pt", tmp_path / "ck", source="torch")

    fresh = make_model(1)
    state = {"model": fresh, "step": 0}
    ss.load(state, tmp_path / "ck")
    assert state["step"] == 7
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert same_bits(a, b), name


def test_converting_a_statesnap_checkpoint_says_what_it_is(tmp_path):
    """Its data files are no torch.save files: the error says the source is a statesnap
    checkpoint already, and what to do with it, before anything is written."""
    ss.save({"model": make_model(0)}, tmp_path / "ck")
    with pytest.raises(ss.CheckpointError, match="is a statesnap checkpoint already .*ss.load, or ss.export"):
        ss.convert(tmp_path / "ck", tmp_path / "again")
    assert not (tmp_path / "again").exists()
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "again")]) != 0


def test_export_and_convert_refuse_to_overwrite_and_spec_applies_on_export(tmp_path):
    torch.save({"model": {"w": torch.ones(2, 2)}, "optim": {"m": torch.zeros(2)}}, tmp_path / "a.pt")
    ss.convert(tmp_path / "a.pt", tmp_path / "ck")
    with pytest.raises(ss.CheckpointExistsError):
        ss.convert(tmp_path / "a.pt", tmp_path / "ck")
    spec = {"ops": [{"keep": r"^model\."}, {"rename": r"^model\.", "to": ""}]}
    ss.export(tmp_path / "ck", tmp_path / "w.safetensors", spec=spec)
    assert load_file(tmp_path / "w.safetensors").keys() == {"w"}
    with pytest.raises(ss.CheckpointExistsError):
        ss.export(tmp_path / "ck", tmp_path / "w.safetensors", spec=spec)
    ss.export(tmp_path / "ck", tmp_path / "w.safetensors", overwrite=True)
    assert load_file(tmp_path / "w.safetensors").keys() == {"model.w", "optim.m"}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "staging left behind"

    # exports write local paths: a URL is refused (it was written under ./s3:/... and reported
    # done), a file:// URL is the local path it names
    for url in ("memory://bucket/w.safetensors", "s3://bucket/w.safetensors"):
        with pytest.raises(ss.CheckpointError, match="exports go to local paths"):
            ss.export(tmp_path / "ck", url)
    ss.export(tmp_path / "ck", f"file://{tmp_path}/u.safetensors")
    assert load_file(tmp_path / "u.safetensors").keys() == {"model.w", "optim.m"}
    assert not os.path.exists("s3:") and not os.path.exists("memory:")


def test_an_empty_dict_converts_as_ss_save_keeps_it(tmp_path):
    """A fresh optimizer's state ({}) and an empty dict of metadata are values: dropped by convert,
    the converted checkpoint did not load back into the state it came from."""
    model = torch.nn.Linear(3, 2)
    state = {"model": model.state_dict(), "meta": {},
             "optim": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict()}
    torch.save(state, tmp_path / "a.pt")
    ss.save(state, tmp_path / "saved")
    ss.convert(tmp_path / "a.pt", tmp_path / "converted")
    assert sorted(ss.open(tmp_path / "converted").keys()) == sorted(ss.open(tmp_path / "saved").keys())
    target = {"model": torch.nn.Linear(3, 2).state_dict(), "meta": {},
              "optim": torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9).state_dict()}
    ss.load(target, tmp_path / "converted")
    assert target["meta"] == {} and target["optim"]["state"] == {}
    assert target["optim"]["param_groups"][0]["lr"] == 0.1
    assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
    # DCP's own flattening drops empty dicts: an export there says which values it loses
    info = ss.export(tmp_path / "converted", tmp_path / "dcp", to="dcp")
    assert sorted(info.skipped) == ["meta (DCP drops empty dicts)", "optim.state (DCP drops empty dicts)"]
    ss.convert(tmp_path / "dcp", tmp_path / "back")  # what was written reads back whole
    assert "optim.param_groups" in ss.open(tmp_path / "back").keys()


def test_a_dcp_export_lists_values_whose_dict_keys_dcp_would_make_strings(tmp_path):
    """DCP's flattening names the items of every dict it walks (through dicts and lists) by
    ``str(key)``: ``[{1: "a"}]`` came back ``[{"1": "a"}]``, and ``skipped`` said nothing. A tuple
    it keeps whole, with what is in it."""
    state = {"hist": [{1: "a", None: 2.0}], "kept": ({2: 3}, [{4: 5}]), "names": [{"a": 1}], "w": torch.arange(3)}
    ss.save(state, tmp_path / "ck")
    info = ss.export(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    assert info.skipped == ["hist (DCP turns its dict keys that are not strings into strings; "
                            "export to torch to keep them)"]
    ss.convert(tmp_path / "dcp", tmp_path / "back")
    back = ss.open(tmp_path / "back")
    assert sorted(back.keys()) == ["kept", "names", "w"]
    assert back.read("kept") == state["kept"] and back.read("names") == state["names"]
    assert torch.equal(back.read("w"), state["w"])


def test_export_skips_per_rank_values(tmp_path):
    ss.save({"w": torch.arange(3), "rng": ss.PerRank({"seed": 3})}, tmp_path / "ck")
    info = ss.export(tmp_path / "ck", tmp_path / "out.pt", to="torch")
    assert [s.split(" ")[0] for s in info.skipped] == ["rng"]
    assert torch.load(tmp_path / "out.pt", weights_only=True).keys() == {"w"}


def test_an_empty_bytes_value_is_skipped_by_torch_exports_and_reads_back_from_dcp(tmp_path):
    """torch.save pickles b"" as a call of ``bytes``, which torch.load(weights_only=True) refuses:
    one empty bytes value made the whole exported .pt unloadable the way the export promises,
    and statesnap's own reader refused a DCP export holding one ("Unsupported global: GLOBAL
    bytes"). The torch export lists it in ``skipped``; the DCP export keeps it and reads back."""
    ss.save({"w": torch.arange(3), "blob": b"", "pair": (b"", 1), "ok": b"x"}, tmp_path / "ck")
    info = ss.export(tmp_path / "ck", tmp_path / "out.pt", to="torch")
    assert sorted(s.split(" ")[0] for s in info.skipped) == ["blob", "pair"]
    assert torch.load(tmp_path / "out.pt", weights_only=True).keys() == {"w", "ok"}
    ss.export(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    ss.convert(tmp_path / "dcp", tmp_path / "back")
    back = ss.open(tmp_path / "back")
    assert back.read("blob") == b"" and back.read("pair") == (b"", 1) and back.read("ok") == b"x"


def _write_hf_shards(root, tensors: dict, per_file: int) -> None:
    """A sharded checkpoint laid out as transformers' save_pretrained writes it."""
    names = list(tensors)
    chunks = [names[i:i + per_file] for i in range(0, len(names), per_file)]
    weight_map = {}
    for k, chunk in enumerate(chunks):
        file = f"model-{k + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in chunk}, root / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                   "weight_map": weight_map}))


def test_sharded_safetensors_to_statesnap_and_sharded_export_round_trip(tmp_path):
    tensors = sample_tensors()
    (tmp_path / "hf").mkdir()
    _write_hf_shards(tmp_path / "hf", tensors, per_file=3)

    ss.convert(tmp_path / "hf", tmp_path / "ck")
    reader = ss.open(tmp_path / "ck")
    assert sorted(reader.keys()) == sorted(tensors)
    for name, tensor in tensors.items():
        assert same_bits(reader.read(name), tensor), name

    out = ss.export(tmp_path / "ck", tmp_path / "sharded", max_shard_bytes=100)
    shards = [f for f in out.files if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in out.files
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(shards)

    ss.convert(tmp_path / "sharded" / "model.safetensors.index.json", tmp_path / "again")
    again = ss.open(tmp_path / "again")
    for name, tensor in tensors.items():
        assert same_bits(again.read(name), tensor), name


def test_one_file_exports_refuse_what_needs_a_directory_naming_the_destination(tmp_path):
    """A ``.safetensors`` file with ``max_shard_bytes`` smaller than the tensors, or any one-file
    export onto a directory (empty or not, overwrite or not), is refused before anything is
    written, in words that name the user's destination, never the hidden staging name."""
    ss.save({"a": torch.ones(100), "b": torch.zeros(100)}, tmp_path / "ck")
    with pytest.raises(ss.CheckpointError, match=r"m\.safetensors is one file, and max_shard_bytes=500 splits these "
                                                 r"800 bytes into shards: export to a directory") as caught:
        ss.export(tmp_path / "ck", tmp_path / "m.safetensors", max_shard_bytes=500)
    assert ".tmp-" not in str(caught.value)
    ss.export(tmp_path / "ck", tmp_path / "fits.safetensors", max_shard_bytes=800)  # one shard: one file
    ss.convert(tmp_path / "fits.safetensors", tmp_path / "back")
    assert torch.equal(ss.open(tmp_path / "back").read("b"), torch.zeros(100))
    (tmp_path / "empty").mkdir()
    for to, overwrite in [("torch", False), ("torch", True), ("safetensors", False)]:
        dst = tmp_path / "empty" if to == "torch" else tmp_path / "empty.safetensors"
        if to == "safetensors":
            dst.mkdir()
        with pytest.raises(ss.CheckpointError, match="is a directory, and this export writes one file"):
            ss.export(tmp_path / "ck", dst, to=to, overwrite=overwrite)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "ck", "empty", "empty.safetensors",
                                                          "fits.safetensors"]


def test_safetensors_index_missing_tensor_is_an_error(tmp_path):
    (tmp_path / "hf").mkdir()
    _write_hf_shards(tmp_path / "hf", {"a": torch.ones(2), "b": torch.zeros(3)}, per_file=1)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    index["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ss.CheckpointError, match="index lists tensors that no shard holds: c"):
        ss.convert(tmp_path / "hf", tmp_path / "ck")


def _fsdp2_dcp_producer(rank, world, out):
    """Train an FSDP2 model 2 steps, save it with DCP, and its full tensors (ground truth) with torch.save."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(0)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=out)
    full_m, full_o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save((full_m, full_o["state"]), out + ".ref.pt")


def _dcp_contents(path) -> dict:
    """Every value of a DCP checkpoint, read by DCP itself in one process."""
    metadata = FileSystemReader(path).read_metadata()
    flat = {k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
            for k, md in metadata.state_dict_metadata.items()}
    dcp.load(flat, storage_reader=FileSystemReader(path), no_dist=True)
    return flat


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_fsdp2_to_statesnap_loads_into_model_and_optimizer_and_exports_back_to_dcp(tmp_path, monkeypatch):
    src = str(tmp_path / "dcp")
    run_ranks(2, _fsdp2_dcp_producer, src)
    full_model, full_optim = torch.load(src + ".ref.pt", weights_only=True)

    ss.convert(src, tmp_path / "ck")
    reader = ss.open(tmp_path / "ck")
    # the same, with every tensor read on its own from the two ranks' shards (as large ones are)
    monkeypatch.setattr(convert_dcp, "EAGER_BYTES", -1)
    ss.convert(src, tmp_path / "ck_lazy")
    lazy = ss.open(tmp_path / "ck_lazy")
    assert lazy.keys() == reader.keys()
    for name in reader.keys():
        if name in reader.manifest.tensors:
            assert same_bits(lazy.read(name), reader.read(name)), name
        else:
            assert lazy.read(name) == reader.read(name), name
    assert reader.read("step") == 2
    assert isinstance(reader.read("optim.param_groups"), list)
    for name, tensor in full_model.items():
        assert same_bits(reader.read(f"model.{name}"), tensor), name

    model = make_model(3)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim, "step": 0}
    ss.load(state, tmp_path / "ck")
    assert state["step"] == 2
    for name, tensor in model.state_dict().items():
        assert same_bits(tensor, full_model[name]), name
    named = dict(model.named_parameters())
    for name, moments in full_optim.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert same_bits(optim.state[named[name]][key], moments[key]), (name, key)

    out = ss.export(tmp_path / "ck", tmp_path / "dcp_back", to="dcp")
    assert ".metadata" in out.files and not out.skipped
    original, exported = _dcp_contents(src), _dcp_contents(tmp_path / "dcp_back")
    assert original.keys() == exported.keys()
    for key, value in original.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(exported[key], value), key
        else:
            assert exported[key] == value, key


def _megatron_tp_fixture(root):
    """Two TP ranks' files, Megatron style: QKV fused and interleaved by query group (2 groups,
    one per rank), the output projection split by columns, the layer norm replicated."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(8, 6, generator=g), torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    proj, norm = torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    root.mkdir()
    for rank in range(2):
        qkv = torch.cat([q[4 * rank:4 * rank + 4], k[2 * rank:2 * rank + 2], v[2 * rank:2 * rank + 2]])
        layer = {"qkv.weight": qkv, "proj.weight": proj[:, 4 * rank:4 * rank + 4].clone(), "norm.weight": norm.clone()}
        torch.save({"layers": {"0": layer}, "iteration": 10}, root / f"tp_rank_{rank:02d}.pt")
    return {"layers.0.q.weight": q, "layers.0.k.weight": k, "layers.0.v.weight": v,
            "layers.0.proj.weight": proj, "layers.0.norm.weight": norm}


TP_SPEC = {"ops": [
    {"drop": r"^tp_rank_0[1-9]\.iteration$"},
    {"rename": r"^tp_rank_00\.iteration$", "to": "iteration"},
    {"fuse": r"tp_rank_(?P<index>\d+)\.(?P<name>.*qkv\.weight)", "to": r"\g<name>", "cat": 0},
    {"fuse": r"tp_rank_(?P<index>\d+)\.(?P<name>.*proj\.weight)", "to": r"\g<name>", "cat": 1},
    {"fuse": r"tp_rank_(?P<index>\d+)\.(?P<name>.*norm\.weight)", "to": r"\g<name>", "same": True},
    {"split": r"(.*)\.qkv\.weight", "to": [r"\1.q.weight", r"\1.k.weight", r"\1.v.weight"],
     "dim": 0, "sizes": [4, 2, 2], "groups": 2},
]}


def test_megatron_tp_shards_fuse_and_qkv_split_through_the_spec(tmp_path):
    expected = _megatron_tp_fixture(tmp_path / "tp")
    ss.convert(tmp_path / "tp", tmp_path / "ck", spec=TP_SPEC)
    reader = ss.open(tmp_path / "ck")
    assert sorted(reader.keys()) == sorted([*expected, "iteration"])
    for name, tensor in expected.items():
        assert same_bits(reader.read(name), tensor), name
    assert reader.read("iteration") == 10


def test_transform_errors_name_the_tensor(tmp_path):
    _megatron_tp_fixture(tmp_path / "tp")
    diverged = torch.load(tmp_path / "tp" / "tp_rank_01.pt", weights_only=True)
    diverged["layers"]["0"]["norm.weight"][0] += 1
    torch.save(diverged, tmp_path / "tp" / "tp_rank_01.pt")
    with pytest.raises(TransformError, match=r"layers\.0\.norm\.weight: replica 'tp_rank_01\.layers\.0\.norm\.weight'"):
        ss.convert(tmp_path / "tp", tmp_path / "ck", spec=TP_SPEC)

    os.rename(tmp_path / "tp" / "tp_rank_01.pt", tmp_path / "tp" / "tp_rank_02.pt")
    with pytest.raises(TransformError, match=r"layers\.0\.qkv\.weight: parts \[0, 2\] found"):
        ss.convert(tmp_path / "tp", tmp_path / "ck", spec=TP_SPEC)

    typo = {"ops": [{"rename": r"^modle\.", "to": ""}]}
    with pytest.raises(TransformError, match="matched no name"):
        ss.convert(tmp_path / "tp", tmp_path / "ck", spec=typo)
    assert not (tmp_path / "ck").exists()
    for bad in ({"ops": [{"rename": "x"}]}, {"ops": [{"fuse": "(.*)", "to": "y", "cat": 0}]},
                {"ops": [{"split": "x", "to": ["a"], "dim": 0, "typo": 1}]}, {"steps": []}):
        with pytest.raises(TransformError):
            ss.convert(tmp_path / "tp", tmp_path / "ck", spec=bad)


def test_transform_stack_and_equal_split():
    experts = {f"moe.experts.{i}.w": torch.randn(3, 4) for i in range(3)}
    ops = load_spec({"ops": [
        {"fuse": r"moe\.experts\.(?P<index>\d+)\.w", "to": "moe.w", "stack": 0},
        {"split": r"moe\.w", "to": ["moe.w_a", "moe.w_b"], "dim": 2},
        {"drop": "never-there", "optional": True},
    ]})
    out = {k: materialize(v) for k, v in apply_spec(ops, {**experts, "step": 4}).items()}
    stacked = torch.stack(list(experts.values()))
    assert list(out) == ["moe.w_a", "moe.w_b", "step"]
    assert same_bits(out["moe.w_a"], stacked[:, :, :2].contiguous())
    assert same_bits(out["moe.w_b"], stacked[:, :, 2:].contiguous())


class _Payload:
    """An object whose unpickling would run ``os.mkdir(marker)``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_malicious_torch_save_is_refused_naming_the_file(tmp_path, capsys):
    marker = str(tmp_path / "code-ran")
    torch.save({"w": torch.ones(2), "payload": _Payload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(ss.UnsafeCheckpointError, match=r"evil\.pt: refused to unpickle.*posix\.mkdir"):
        ss.convert(tmp_path / "evil.pt", tmp_path / "ck")
    assert cli.main(["convert", str(tmp_path / "evil.pt"), str(tmp_path / "ck")]) == 2
    assert "evil.pt: refused to unpickle" in capsys.readouterr().err
    assert not os.path.exists(marker) and not (tmp_path / "ck").exists()


class _WithBytesExtraState(nn.Module):
    """As TransformerEngine's layers: extra state kept as an io.BytesIO, which DCP pickles."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def get_extra_state(self):
        return __import__("io").BytesIO(b"fp8 meta")

    def set_extra_state(self, state):
        pass


def test_a_dcp_value_refused_to_unpickle_can_be_dropped_by_the_spec_it_names(tmp_path):
    """A DCP checkpoint of a module whose extra state is a BytesIO: the value is refused (a global
    not admitted), but only if the conversion keeps it; the error names the file and the value and
    gives the spec that drops it, and that spec converts the rest bit for bit."""
    torch.manual_seed(0)
    model = _WithBytesExtraState()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(ss.UnsafeCheckpointError, match=r"__0_0\.distcp: value 'model\._extra_state': refused to "
                                                      r"unpickle.*BytesIO.*drop it with the transform spec") as caught:
        ss.convert(tmp_path / "dcp", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    spec = json.loads(str(caught.value).rsplit("transform spec ", 1)[1][:-1])
    ss.convert(tmp_path / "dcp", tmp_path / "ck", spec=spec)
    reader = ss.open(tmp_path / "ck")
    assert sorted(reader.keys()) == ["model.lin.bias", "model.lin.weight"]
    assert torch.equal(reader.read("model.lin.weight"), model.lin.weight.detach())
    assert torch.equal(reader.read("model.lin.bias"), model.lin.bias.detach())


@pytest.mark.parametrize("content", [b"garbage", b"", b"\x80\x09 not a pickle"])
def test_a_file_that_is_no_torch_save_file_is_reported_damaged_not_unsafe(tmp_path, content):
    (tmp_path / "model.pt").write_bytes(content)
    with pytest.raises(ss.CorruptCheckpointError, match=r"model\.pt is not a torch\.save file"):
        ss.convert(tmp_path / "model.pt", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_a_legacy_torch_save_file_still_converts(tmp_path):
    torch.save({"w": torch.arange(3.0)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    ss.convert(tmp_path / "old.pt", tmp_path / "ck")
    assert torch.equal(ss.open(tmp_path / "ck").read("w"), torch.arange(3.0))


def test_cli_convert_and_export(tmp_path, capsys):
    expected = _megatron_tp_fixture(tmp_path / "tp")
    (tmp_path / "spec.json").write_text(json.dumps(TP_SPEC))
    assert cli.main(["convert", str(tmp_path / "tp"), str(tmp_path / "ck"), "--spec", str(tmp_path / "spec.json")]) == 0
    assert cli.main(["export", str(tmp_path / "ck"), str(tmp_path / "hf"), "--max-shard-size", "0.1KB"]) == 0
    printed = capsys.readouterr().out
    assert "skipped iteration" in printed
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = {}
    for file in set(index["weight_map"].values()):
        shards.update(load_file(tmp_path / "hf" / file))
    assert shards.keys() == expected.keys()
    for name, tensor in expected.items():
        assert same_bits(shards[name], tensor), name
    assert cli.main(["export", str(tmp_path / "ck"), str(tmp_path / "x"), "--to", "torch", "--max-shard-size", "1GB"]) == 2
    assert "safetensors exports only" in capsys.readouterr().err


def test_a_tensor_of_a_dtype_safetensors_lacks_is_skipped_not_the_whole_export(tmp_path):
    """complex128 (RoPE's ``freqs_cis``): safetensors has no name for it. The export failed
    whole, writing nothing; it now writes the rest and lists that one in ``skipped``."""
    freqs = torch.polar(torch.ones(4, 2, dtype=torch.float64), torch.arange(8.0, dtype=torch.float64).view(4, 2))
    ss.save({"w": torch.arange(6.0), "freqs_cis": freqs}, tmp_path / "ck")
    out = ss.export(tmp_path / "ck", tmp_path / "st", to="safetensors")
    assert out.skipped == ["freqs_cis (safetensors has no dtype complex128; export to torch or dcp)"]
    assert torch.equal(load_file(tmp_path / "st" / "model.safetensors")["w"], torch.arange(6.0))


@pytest.mark.parametrize("value, says", [
    (torch.empty(3, device="meta"), "reading it from the source failed"),
    (torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8), r"t.dequantize\(\), or t.int_repr\(\)"),
])
def test_a_value_the_checkpoint_cannot_take_is_named_with_its_source_file(tmp_path, value, says):
    torch.save({"w": value}, tmp_path / "src.pt")
    with pytest.raises(ss.CheckpointError, match=rf"^converting {tmp_path / 'src.pt'}: w: .*{says}"):
        ss.convert(tmp_path / "src.pt", tmp_path / "ck")
