"""``ss.load(..., cast=True)``: a stored floating dtype loads into a target of another floating
dtype (fp32 master weights into a bf16 model), equal bit for bit to ``stored.to(target dtype)``,
on one process and resharded onto DTensor shards on 2 gloo ranks; without ``cast`` the mismatch
stays an error, integer <-> floating is refused even with it, and the stored bytes are still
verified against their checksums."""
import json

import pytest
import torch

import statesnap as ss
from statesnap.errors import CorruptCheckpointError, StateMismatchError
from statesnap.format.manifest import MANIFEST_NAME
from dist_utils import run_ranks

BLOCK = 256  # small checksum blocks: reads are widened to block edges and staged


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (so NaN payloads and -0.0 count too)."""
    return (a.dtype == b.dtype and a.shape == b.shape and
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def fp32_state() -> dict:
    """fp32 values with the cases a conversion gets wrong first: ties between two bf16 values,
    overflow past bf16/fp16, subnormals, signed zeros, infinities, NaN."""
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 70000.0, 1e-40, -0.0, 0.0, float("inf"),
                            -float("inf"), float("nan"), 3.0e38])
    return {"model": {"w": torch.randn(13, 10, generator=g), "v": torch.randn(9, 6, generator=g),
                      "special": special},
            "optim": {"step": torch.tensor(5), "mask": torch.tensor([True, False])}}


def blank(state: dict, dtype: torch.dtype) -> dict:
    return {"model": {k: torch.zeros(v.shape, dtype=dtype) for k, v in state["model"].items()},
            "optim": {k: torch.zeros_like(v) for k, v in state["optim"].items()}}


@pytest.fixture
def fp32_ckpt(tmp_path):
    state = fp32_state()
    ss.save(state, tmp_path / "ck", block_bytes=BLOCK)
    return tmp_path / "ck", state


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_fp32_checkpoint_loads_into_another_precision_as_the_cast_would_give(fp32_ckpt, dtype):
    path, state = fp32_ckpt
    target = blank(state, dtype)
    transposed = torch.zeros(10, 13, dtype=dtype)
    target["model"]["w"] = transposed.t()  # a strided target: filled through a host copy
    ss.load(target, path, cast=True)
    for name, value in state["model"].items():
        assert same_bits(target["model"][name].contiguous(), value.to(dtype)), name
    assert same_bits(transposed, state["model"]["w"].to(dtype).t().contiguous())
    assert same_bits(target["optim"]["step"], state["optim"]["step"])
    assert same_bits(target["optim"]["mask"], state["optim"]["mask"])


def test_bf16_checkpoint_loads_into_fp32_exactly(tmp_path):
    stored = {"w": torch.randn(17, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)}
    ss.save(stored, tmp_path / "ck", block_bytes=BLOCK)
    target = {"w": torch.zeros(17, 5)}
    ss.load(target, tmp_path / "ck", cast=True)
    assert same_bits(target["w"], stored["w"].to(torch.float32))


def test_without_cast_a_dtype_mismatch_stays_an_error(fp32_ckpt):
    path, state = fp32_ckpt
    target = blank(state, torch.bfloat16)
    with pytest.raises(StateMismatchError, match=r"shape/dtype mismatch \(3\): model\.special \(checkpoint "
                                                 r"float32\[10\], target bfloat16\[10\]\).*Pass cast=True") as info:
        ss.load(target, path)
    assert sorted(m.split(" ")[0] for m in info.value.mismatched) == ["model.special", "model.v", "model.w"]
    assert all(not v.any() for v in target["model"].values())  # nothing was loaded


def test_integer_and_floating_are_never_cast_into_each_other(fp32_ckpt):
    path, state = fp32_ckpt
    target = blank(state, torch.bfloat16)
    target["optim"]["step"] = torch.zeros((), dtype=torch.float32)  # an integer counter into a float
    target["model"]["v"] = torch.zeros(9, 6, dtype=torch.int32)  # floats into integers
    with pytest.raises(StateMismatchError, match=r"model\.v \(checkpoint float32\[9, 6\], target int32\[9, 6\]\) "
                                                 r"\(cast=True converts between floating dtypes only\)") as info:
        ss.load(target, path, cast=True)
    assert sorted(m.split(" ")[0] for m in info.value.mismatched) == ["model.v", "optim.step"]
    assert "Pass cast=True" not in str(info.value)
    ss.load(target, path, cast=True, strict=False)  # loads what it may, leaves the refused ones
    assert same_bits(target["model"]["w"], state["model"]["w"].to(torch.bfloat16))
    assert not target["model"]["v"].any() and target["optim"]["step"] == 0


def test_cast_loads_verify_the_stored_bytes(fp32_ckpt):
    path, state = fp32_ckpt
    doc = json.loads((path / MANIFEST_NAME).read_text())
    entry = doc["tensors"]["model.w"]
    file = path / doc["files"][entry["file"][0]]
    data = bytearray(file.read_bytes())
    data[entry["offset"][0] + 300] ^= 0x01  # the lowest mantissa bit: invisible once rounded to bf16
    file.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch .*tensor 'model\.w'"):
        ss.load(blank(state, torch.bfloat16), path, cast=True)


def test_checkpointer_load_latest_casts_when_asked(tmp_path):
    state = {"w": torch.randn(6, 3, generator=torch.Generator().manual_seed(2))}
    with ss.Checkpointer(tmp_path, events=False) as ckpt:
        ckpt.save(3, state).wait()
    with ss.Checkpointer(tmp_path, events=False) as ckpt:
        target = {"w": torch.zeros(6, 3, dtype=torch.bfloat16)}
        with pytest.raises(StateMismatchError, match="cast=True") as caught:
            ckpt.load_latest(target)
        assert "load_latest restores the whole state" in str(caught.value)
        assert "Pass strict=False" not in str(caught.value)  # load_latest has no strict
        with pytest.raises(StateMismatchError, match=r"missing in checkpoint \(1\): v\. load_latest restores") as caught:
            ckpt.load_latest({"w": torch.zeros(6, 3), "v": torch.zeros(1)})
        assert "cast=True" not in str(caught.value)
        assert ckpt.load_latest(target, cast=True) == 3
    assert same_bits(target["w"], state["w"].to(torch.bfloat16))


def _load_sharded(rank, world, path):
    """DTensor shards of another dtype than stored: rows (uneven, 7 + 6), columns (a strided
    box out of each stored row), and a replicated plain tensor that one rank reads for both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    target = {"model": {"w": distribute_tensor(torch.zeros(13, 10, dtype=torch.bfloat16), mesh, [Shard(0)]),
                        "v": distribute_tensor(torch.zeros(9, 6, dtype=torch.bfloat16), mesh, [Shard(1)]),
                        "special": torch.zeros(10, dtype=torch.float16)},
              "optim": {"step": torch.tensor(0), "mask": torch.tensor([False, False])}}
    ss.load(target, path, cast=True, shared_reads=True)
    widened = {"h": distribute_tensor(torch.zeros(7, 4), mesh, [Shard(0)])}
    ss.load(widened, f"{path}-bf16", cast=True)
    return {"w": target["model"]["w"].full_tensor(), "v": target["model"]["v"].full_tensor(),
            "special": target["model"]["special"], "step": target["optim"]["step"],
            "h": widened["h"].full_tensor()}


def test_resharded_cast_load_on_two_ranks(fp32_ckpt):
    path, state = fp32_ckpt
    half = torch.randn(7, 4, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ss.save({"h": half}, f"{path}-bf16", block_bytes=BLOCK)
    for got in run_ranks(2, _load_sharded, str(path)):
        assert same_bits(got["w"], state["model"]["w"].to(torch.bfloat16))
        assert same_bits(got["v"], state["model"]["v"].to(torch.bfloat16))
        assert same_bits(got["special"], state["model"]["special"].to(torch.float16))
        assert same_bits(got["step"], state["optim"]["step"])
        assert same_bits(got["h"], half.to(torch.float32))
