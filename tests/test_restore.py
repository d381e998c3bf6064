"""Restoring into a fresh model and optimizer (issue 15): a fresh Adam/AdamW gets its state
created in place, unfilled, instead of by a zero-lr step; the load fills it bit for bit, what it
does not fill (strict=False) is zero, never leftover memory, and a failed load leaves it fresh.
Files that are not in the page cache come back bit for bit and still verified."""
import functools
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import statesnap as ss
from statesnap.errors import CorruptCheckpointError
from statesnap.format.manifest import MANIFEST_NAME, Manifest
from statesnap.state import flatten, module_state
from statesnap.storage.local import LocalBackend

MIB = 1 << 20


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape, device and bytes (so NaN payloads and -0.0 count too)."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def model_of(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def trained(optimizer_class, steps: int = 3, only_first_layer: bool = False, **options):
    """A model and an optimizer after ``steps`` steps (grads on the first layer only, if asked)."""
    model = model_of(0)
    optim = optimizer_class(model.parameters(), lr=1e-2, **options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 16, generator=gen)).square().sum().backward()
        if only_first_layer:
            model[2].weight.grad = model[2].bias.grad = None
        optim.step()
        optim.zero_grad()
    return model, optim


def assert_same_optimizer(a_model, a_optim, b_model, b_optim):
    for (name, pa), (_, pb) in zip(a_model.named_parameters(), b_model.named_parameters(), strict=True):
        assert same_bits(pa.detach(), pb.detach()), name
        sa, sb = a_optim.state[pa], b_optim.state[pb]
        assert sa.keys() == sb.keys(), name
        for key in sa:
            assert same_bits(sa[key], sb[key]), (name, key)
    assert [{k: v for k, v in g.items() if k != "params"} for g in a_optim.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in b_optim.param_groups]


@pytest.mark.parametrize("optimizer_class, options", [
    (torch.optim.AdamW, {}), (torch.optim.Adam, {"amsgrad": True}), (torch.optim.SGD, {"momentum": 0.9}),
])
def test_fresh_optimizer_restores_bit_exact_and_steps_like_the_source(tmp_path, optimizer_class, options):
    model, optim = trained(optimizer_class, **options)
    ss.save({"model": model, "optim": optim}, tmp_path / "ck")
    fresh_model = model_of(5)
    fresh_optim = optimizer_class(fresh_model.parameters(), lr=0.5, **options)
    before = [p.detach().clone() for p in fresh_model.parameters()]
    ss.load({"model": fresh_model, "optim": fresh_optim}, tmp_path / "ck")
    assert_same_optimizer(model, optim, fresh_model, fresh_optim)
    assert not torch.equal(before[0], model[0].weight)  # the load did change the fresh model
    batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(9))
    for m, o in ((model, optim), (fresh_model, fresh_optim)):
        m(batch).square().sum().backward()
        o.step()
    assert_same_optimizer(model, optim, fresh_model, fresh_optim)


def test_fresh_adam_state_has_the_dtypes_its_first_step_would_give(tmp_path):
    model, optim = trained(torch.optim.AdamW)
    ss.save({"model": model, "optim": optim}, tmp_path / "ck")
    stepped_model = model_of(5)
    stepped_optim = torch.optim.AdamW(stepped_model.parameters())
    stepped_model(torch.ones(1, 16)).sum().backward()
    stepped_optim.step()
    fresh_model = model_of(5)
    fresh_optim = torch.optim.AdamW(fresh_model.parameters())
    ss.load({"model": fresh_model, "optim": fresh_optim}, tmp_path / "ck")
    for p, q in zip(stepped_model.parameters(), fresh_model.parameters()):
        for key, value in stepped_optim.state[p].items():
            loaded = fresh_optim.state[q][key]
            assert (loaded.dtype, loaded.shape, loaded.device) == (value.dtype, value.shape, value.device), key


def test_state_the_checkpoint_lacks_is_zero_with_strict_false(tmp_path):
    model, optim = trained(torch.optim.AdamW, only_first_layer=True)
    assert model[2].weight not in optim.state
    ss.save({"model": model, "optim": optim}, tmp_path / "ck")
    fresh_model = model_of(5)
    fresh_optim = torch.optim.AdamW(fresh_model.parameters())
    ss.load({"model": fresh_model, "optim": fresh_optim}, tmp_path / "ck", strict=False)
    assert same_bits(fresh_optim.state[fresh_model[0].weight]["exp_avg"], optim.state[model[0].weight]["exp_avg"])
    for p in (fresh_model[2].weight, fresh_model[2].bias):
        state = fresh_optim.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                assert not state[key].any(), key


def test_a_failed_load_leaves_a_fresh_optimizer_fresh(tmp_path, monkeypatch):
    model, optim = trained(torch.optim.AdamW)
    ss.save({"model": model, "optim": optim}, tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_text())
    entry = doc["tensors"]["optim.state.2.weight.exp_avg_sq"]
    data = tmp_path / "ck" / doc["files"][entry["file"][0]]
    raw = bytearray(data.read_bytes())
    raw[entry["offset"][0]] ^= 0x40
    data.write_bytes(bytes(raw))
    fresh_model = model_of(5)
    fresh_optim = torch.optim.AdamW(fresh_model.parameters())
    created = []
    real_create = flatten.create_state_from_checkpoint

    def create(optim, named_state, prefix, stored, out, *rest):
        made = real_create(optim, named_state, prefix, stored, out, *rest)
        created.extend(out)
        return made
    monkeypatch.setattr(flatten, "create_state_from_checkpoint", create)
    with pytest.raises(CorruptCheckpointError, match="optim.state.2.weight.exp_avg_sq"):
        ss.load({"model": fresh_model, "optim": fresh_optim}, tmp_path / "ck")
    assert not fresh_optim.state  # as it was: a load of a checkpoint without optimizer state finds it so
    assert created and not any(t.any() for t in created)  # and what the load had made is zero, not garbage


def evict(directory) -> None:
    """Drop the checkpoint's files from the page cache (clean pages: the save fsynced them)."""
    for name in directory.iterdir():
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def odd_state() -> dict:
    """Tensors whose sizes are no multiple of a disk block, so pieces start at unaligned offsets."""
    g = torch.Generator().manual_seed(3)
    return {"model": {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate((1_000_003, 7, 700_001, 2_500_000))}}


def test_cold_files_load_bit_exact(tmp_path):
    state = odd_state()
    ss.save(state, tmp_path / "ck")
    evict(tmp_path / "ck")
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    ss.load(target, tmp_path / "ck")
    for name, value in state["model"].items():
        assert same_bits(target["model"][name], value), name


def test_a_small_checkpoint_is_read_ahead_as_its_load_begins_and_a_large_one_is_not(tmp_path, monkeypatch):
    """Right after the manifest is read, the data files of a checkpoint of at most
    PREFETCH_MAX_BYTES are handed to the backend's prefetch (their disk reads then overlap the
    planning); a larger one's are not (its own parallel reads are faster alone). Either way the
    cold load is bit exact."""
    load_module = importlib.import_module("statesnap.engine.load")  # (the package names its function load)
    asked = []
    monkeypatch.setattr(LocalBackend, "prefetch", lambda self, paths: asked.append(sorted(paths)))
    state = odd_state()
    ss.save(state, tmp_path / "ck")
    data_files = sorted(str(p) for p in (tmp_path / "ck").iterdir() if p.name != MANIFEST_NAME)
    for limit, expected in ((load_module.PREFETCH_MAX_BYTES, [data_files]), (1 * MIB, [])):
        monkeypatch.setattr(load_module, "PREFETCH_MAX_BYTES", limit)
        asked.clear()
        evict(tmp_path / "ck")
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        ss.load(target, tmp_path / "ck")
        assert asked == expected
        for name, value in state["model"].items():
            assert same_bits(target["model"][name], value), name


def test_prefetch_passes_over_what_is_not_a_regular_file(tmp_path):
    """A FIFO (which a blocking open would wait on forever), a directory and a missing name among
    the files: the read-ahead skips them and ends; it is a hint, never an error."""
    from statesnap.storage import local

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_bytes(b"x" * 10_000)
    paths = [str(tmp_path / n) for n in ("fifo", "dir", "missing", "file")]
    local._read_ahead(paths)  # (what the backend's thread runs: it returns)
    LocalBackend().prefetch(paths)


def test_damage_in_a_cold_file_is_named(tmp_path):
    state = odd_state()
    ss.save(state, tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_text())
    entry = doc["tensors"]["model.t3"]
    data = tmp_path / "ck" / doc["files"][entry["file"][0]]
    raw = bytearray(data.read_bytes())
    raw[entry["offset"][0] + 5_000_000] ^= 0x40
    data.write_bytes(bytes(raw))
    os.sync()
    evict(tmp_path / "ck")
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    with pytest.raises(CorruptCheckpointError, match=f"model.t3.*{data.name}|{data.name}.*model.t3"):
        ss.load(target, tmp_path / "ck")


PEAK_SCRIPT = r"""
import os, sys
import torch
torch.set_num_threads(1)
import statesnap as ss

def status(field):  # kB
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

count, side = int(sys.argv[2]), int(sys.argv[3])
target = {"w0": torch.ones(side, side).t()}  # strided: filled through a host copy of one tensor
target.update({f"w{i}": torch.ones(side, side) for i in range(1, count)})
ss.load({"model": target}, sys.argv[1], threads=4)  # maps the code a load runs: not what it holds
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the kernel's peak RSS starts again from here
base = status("VmRSS")
for cold in (True, False):
    if cold:
        for name in os.listdir(sys.argv[1]):
            fd = os.open(os.path.join(sys.argv[1], name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    ss.load({"model": target}, sys.argv[1], threads=4)
print((status("VmHWM") - base) * 1024)
"""


def test_peak_extra_memory_of_a_load_is_one_tensor_plus_a_fixed_slack(tmp_path):
    """Loading 256 MiB into existing tensors, cold then warm, holds at most the largest tensor (a
    strided target's host copy; contiguous ones are read into in place) plus a fixed slack, never
    a second copy of the state. Measured here: 32 MiB."""
    count, side = 8, 2896  # 8 float32 tensors of 32 MiB
    g = torch.Generator().manual_seed(4)
    ss.save({"model": {f"w{i}": torch.randn(side, side, generator=g) for i in range(count)}}, tmp_path / "ck")
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "ck"), str(count), str(side)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.split()[-1])
    largest, total = side * side * 4, count * side * side * 4
    bound = largest + 24 * MIB  # the strided target's host copy, slack
    assert bound < total / 2
    assert growth < bound, f"peak RSS grew by {growth / MIB:.0f} MiB (bound {bound / MIB:.0f} MiB)"


def test_many_small_tensors_load_in_a_few_reads_and_damage_is_still_named(tmp_path, monkeypatch):
    """Pieces start on 64-byte boundaries: neighbours a few bytes apart are read in one request
    (the bytes between them discarded), each still checked against its own checksums."""
    from statesnap.storage import local

    gen = torch.Generator().manual_seed(0)
    state = {f"t{i:03d}": torch.randn(int(n), generator=gen)
             for i, n in enumerate(torch.randint(1, 300, (300,), generator=gen))}
    ss.save(state, tmp_path / "c")
    reads = []
    real = local._LocalReader.readinto
    monkeypatch.setattr(local._LocalReader, "readinto",
                        lambda self, offset, views: reads.append(len(views)) or real(self, offset, views))
    target = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    ss.load(target, tmp_path / "c")
    assert all(torch.equal(target[k], v) for k, v in state.items())
    assert len(reads) <= 2 and sum(reads) >= 300  # one request for all, gaps as extra buffers
    data = next(p for p in (tmp_path / "c").iterdir() if p.name.startswith("data-"))
    entry = ss.open(tmp_path / "c").manifest.tensors["t150"]
    with open(data, "r+b") as f:
        f.seek(int(entry.offset[0]))
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(CorruptCheckpointError, match="'t150'"):
        ss.load({k: torch.empty_like(v) for k, v in state.items()}, tmp_path / "c")
    with open(data, "r+b") as f:  # cut short inside t150: the error names it, and only it
        f.truncate(int(entry.offset[0]) + 4)
    with pytest.raises(CorruptCheckpointError, match="truncated") as caught:
        ss.load({k: torch.empty_like(v) for k, v in state.items()}, tmp_path / "c", verify=False)
    assert "'t150'" in str(caught.value) and "'t149'" not in str(caught.value) and "'t151'" not in str(caught.value)


def test_threads_read_their_own_stretch_of_the_file_in_order_through_their_own_descriptor(tmp_path, monkeypatch):
    """Each read thread gets a contiguous stretch of the file and reads it in order through a
    descriptor of its own, so the kernel reads ahead of every thread (a descriptor shared by
    threads taking requests in turn looks random to it, and cold loads ran 1.4x slower)."""
    from statesnap.storage import local

    gen = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(2 << 20, generator=gen) for i in range(16)}  # 128 MiB: 8 requests of 16
    ss.save(state, tmp_path / "c", block_bytes=MIB)
    # reader -> offsets it read, in order; keyed by the reader itself, which the dict keeps alive:
    # a descriptor's number is reused once a stream that finished early closes it
    reads: dict[object, list[int]] = {}
    real = local._LocalReader.readinto
    monkeypatch.setattr(local._LocalReader, "readinto",
                        lambda self, offset, views: reads.setdefault(self, []).append(offset)
                        or real(self, offset, views))
    target = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    info = ss.load(target, tmp_path / "c", threads=4)
    assert all(same_bits(target[k], v) for k, v in state.items())
    assert info.bytes == 128 * MIB
    assert len(reads) == 4  # four streams, four descriptors
    assert all(len(offsets) == 2 and offsets == sorted(offsets) for offsets in reads.values())
    stretches = sorted((offsets[0], offsets[-1]) for offsets in reads.values())
    assert all(end < start for (_, end), (start, _) in zip(stretches, stretches[1:]))  # no two overlap


def test_a_stream_reads_the_file_it_was_opened_from_even_once_its_name_is_taken(tmp_path):
    from statesnap.storage.local import LocalBackend

    path = tmp_path / "f"
    path.write_bytes(b"first" * 10)
    reader = LocalBackend().open_read(str(path))
    (tmp_path / "g").write_bytes(b"other" * 10)
    os.replace(tmp_path / "g", path)  # an overwrite renamed over it meanwhile
    stream = reader.stream()
    buffer = bytearray(5)
    assert stream.readinto(5, [memoryview(buffer)]) == 5 and bytes(buffer) == b"first"
    assert stream.fd != reader.fd
    stream.close()
    reader.close()


def test_streams_hold_one_descriptor_each_besides_one_per_file(tmp_path, monkeypatch):
    """A load over many files (a checkpoint written by many ranks) needs a descriptor per file
    and one more per stream, not one per file and stream."""
    import types

    from statesnap.engine import read
    from statesnap.engine.read import ReadExecutor
    from statesnap.plan.load_plan import PieceRead, Segment, TargetPlan
    from statesnap.storage import local

    monkeypatch.setattr(read, "STREAM_MIN_BYTES", 1)  # four streams of so few bytes
    names = [f"f{i}" for i in range(64)]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([i]) * 8192)
    opened, peak = set(), [0]
    real_init, real_close = local._LocalReader.__init__, local._LocalReader.close

    def counting_init(self, path):
        real_init(self, path)
        opened.add(self.fd)
        peak[0] = max(peak[0], len(opened))

    def counting_close(self):
        opened.discard(self.fd)
        real_close(self)
    monkeypatch.setattr(local._LocalReader, "__init__", counting_init)
    monkeypatch.setattr(local._LocalReader, "close", counting_close)
    executor = ReadExecutor(LocalBackend(), str(tmp_path), types.SimpleNamespace(files=names, block_bytes=MIB),
                            verify=False, threads=4)
    targets = [torch.empty(8192, dtype=torch.uint8) for _ in names]
    for i, target in enumerate(targets):
        entry = types.SimpleNamespace(file=[i], offset=[0], nbytes=[8192])
        executor.add(f"t{i}", entry, target, TargetPlan([PieceRead(0, 0, 8192, [Segment(0, 0, 8192)])], 8192))
    executor.run()
    assert all(int(t[0]) == i and int(t[-1]) == i for i, t in enumerate(targets))
    assert peak[0] <= len(names) + 4
    assert not opened  # every reader closed


DTYPES = [torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.bool, torch.complex64, torch.complex128]


def _dtypes_of(rows: int) -> dict:
    g = torch.Generator().manual_seed(5)
    out = {}
    for dtype in DTYPES:
        values = torch.randn(rows, 12, generator=g, dtype=torch.float64) * 50
        out[str(dtype)[6:]] = (values > 0 if dtype == torch.bool else
                               values.to(dtype) if not dtype.is_complex else torch.complex(values, -values).to(dtype))
    return out


def _save_columns(rank, world, path, rows, block_bytes=16 << 20):
    """Each rank holds half of every tensor's columns: each piece is a strided box of the whole."""
    state = {name: ss.Sharded(t[:, 6 * rank:6 * rank + 6].contiguous(), tuple(t.shape), (0, 6 * rank))
             for name, t in _dtypes_of(rows).items()}
    ss.save(state, path, block_bytes=block_bytes)


@pytest.mark.parametrize("rows", [4, 2048], ids=["small boxes", "large boxes"])
def test_column_split_pieces_of_every_dtype_load_whole_bit_exact(tmp_path, rows):
    """Each stored piece is a strided box of the target, copied out of the piece's bytes: for
    every dtype (bf16, bool and 16-byte complex included), small boxes and large, every bit
    lands where it belongs."""
    from dist_utils import run_ranks

    path = str(tmp_path / "columns")
    run_ranks(2, _save_columns, path, rows)
    expected = _dtypes_of(rows)
    target = {name: torch.zeros_like(t) for name, t in expected.items()}
    ss.load(target, path)
    for name, t in expected.items():
        assert torch.equal(target[name].view(torch.uint8) if t.dtype != torch.bool else target[name],
                           t.view(torch.uint8) if t.dtype != torch.bool else t), name


def test_boxes_of_column_split_pieces_load_bit_exact_with_a_block_size_no_multiple_of_the_itemsize(tmp_path):
    """The format allows any block size: a strided box read out of a block-widened span starts
    at a byte no multiple of the element size (complex128 in 1000-byte blocks) and still lands
    exactly, for every dtype."""
    from dist_utils import run_ranks

    path = str(tmp_path / "columns")
    run_ranks(2, _save_columns, path, 300, 1000)
    for name, t in _dtypes_of(300).items():
        box = torch.zeros(200, 10, dtype=t.dtype)
        ss.load({name: ss.Sharded(box, tuple(t.shape), (41, 1))}, path, strict=False)
        assert torch.equal(box.view(torch.uint8) if t.dtype != torch.bool else box,
                           t[41:241, 1:11].contiguous().view(torch.uint8) if t.dtype != torch.bool else t[41:241, 1:11]), name


def test_a_row_range_of_a_stored_tensor_is_read_in_place_in_several_requests(tmp_path, monkeypatch):
    """Rows that start and end inside checksum blocks: only the two partial blocks at the ends
    are staged (read whole to be verified); the blocks between go straight into the target, in
    requests the read threads share, as a whole tensor's do. (Counted by request, not by thread:
    which thread runs a request is the pool's choice.)"""
    from statesnap.storage import local

    block = 1 << 20
    values = torch.randn(8000, 1000, generator=torch.Generator().manual_seed(1))  # 32 MB: two requests or more
    ss.save({"w": values}, tmp_path / "c", block_bytes=block)
    staged, in_place = [], []
    real_map, real_readinto = local._LocalReader.map, local._LocalReader.readinto
    monkeypatch.setattr(local._LocalReader, "map", lambda self, offset, n: staged.append(n) or real_map(self, offset, n))
    monkeypatch.setattr(local._LocalReader, "readinto", lambda self, offset, views: in_place.append(
        sum(map(len, views))) or real_readinto(self, offset, views))
    rows = torch.full((7900, 1000), -1.0)
    ss.load({"w": ss.Sharded(rows, (8000, 1000), (33, 0))}, tmp_path / "c", threads=4)
    assert torch.equal(rows, values[33:7933])
    assert len(staged) <= 2 and sum(staged) <= 2 * block
    assert len(in_place) >= 2 and sum(in_place) >= rows.numel() * 4 - 2 * block


class Derived(nn.Module):
    """A module that recomputes a cached value whenever its weights are loaded."""

    def __init__(self, how: str):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        self.norm = None
        if how == "hook":
            self.register_load_state_dict_post_hook(lambda module, keys: module.recompute())
        self.how = how

    def recompute(self):
        self.norm = float(self.weight.detach().norm())

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        if self.how == "override":
            self.recompute()


class WithExtraState(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))
        self.extra = {"calls": 0}

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = dict(state)


@pytest.mark.parametrize("how", ["hook", "override"])
def test_loading_a_module_still_runs_its_load_hooks_and_overrides(tmp_path, how):
    """A load fills a plain module's tensors in place and does not hand them back through
    load_state_dict (a copy of each onto itself); a module that reacts to loading (a hook, its
    own _load_from_state_dict, extra state) still sees the load_state_dict call."""
    source = Derived(how)
    with torch.no_grad():
        source.weight.copy_(torch.tensor([3.0, 4.0, 0.0, 0.0]))
    ss.save({"model": nn.Sequential(source)}, tmp_path / "c")
    target = Derived(how)
    ss.load({"model": nn.Sequential(target)}, tmp_path / "c")
    assert same_bits(target.weight.detach(), source.weight.detach()) and target.norm == 5.0

    extra = WithExtraState()
    extra.extra = {"calls": 7}
    ss.save({"model": extra}, tmp_path / "e")
    fresh = WithExtraState()
    ss.load({"model": fresh}, tmp_path / "e")
    assert fresh.extra == {"calls": 7}


def test_a_plain_module_is_filled_in_place_without_load_state_dict(tmp_path, monkeypatch):
    source, target = model_of(0), model_of(1)
    ss.save({"model": source}, tmp_path / "c")
    calls, original = [], nn.Module.load_state_dict
    monkeypatch.setattr(nn.Module, "load_state_dict", lambda self, *a, **k: calls.append(self) or original(self, *a, **k))
    ss.load({"model": target}, tmp_path / "c")
    monkeypatch.undo()
    assert not calls
    for a, b in zip(source.state_dict().values(), target.state_dict().values()):
        assert same_bits(a, b)


class CopiesOnSave(nn.Linear):
    """A module whose state dict holds copies of its weights, not the weights themselves."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = destination[prefix + "weight"].clone()


def _cloned_state_dict(module, destination=None, prefix="", keep_vars=False):
    out = nn.Linear.state_dict(module, destination=destination, prefix=prefix, keep_vars=keep_vars)
    for name in [name for name in out if name.startswith(prefix)]:
        out[name] = out[name].clone()
    return out


def _clone_bias(module, state_dict, prefix, local_metadata):
    state_dict[prefix + "bias"] = state_dict[prefix + "bias"].clone()


@pytest.mark.parametrize("how", ["post_hook", "pre_hook", "save_to_state_dict", "state_dict"])
def test_a_module_whose_state_dict_holds_copies_gets_its_values_put_back(tmp_path, how):
    """Filled in place is taken on trust only for a state dict the module made as PyTorch does
    (each value a parameter or buffer detached): one whose hooks or overrides hand out copies
    gets what the load read into them put back, in every layer, nested ones too."""
    def build(seed):
        torch.manual_seed(seed)
        inner = CopiesOnSave(4, 3) if how == "save_to_state_dict" else nn.Linear(4, 3)
        model = nn.Sequential(nn.Sequential(inner), nn.Linear(3, 2))
        if how == "post_hook":
            inner.register_state_dict_post_hook(lambda m, sd, prefix, meta: _clone_bias(m, sd, prefix, meta))
        elif how == "pre_hook":  # a pre-hook alone hands out no copies: what matters is that it may act
            inner.register_state_dict_pre_hook(lambda m, prefix, keep_vars: None)
        elif how == "state_dict":
            inner.state_dict = functools.partial(_cloned_state_dict, inner)
        return model
    source = build(0)
    ss.save({"model": source}, tmp_path / "c")
    target = build(1)
    ss.load({"model": target}, tmp_path / "c")
    for (name, a), b in zip(source.named_parameters(), target.parameters()):
        assert same_bits(a.detach(), b.detach()), name


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_lazily_conjugated_or_negated_tensors_save_and_load_their_values(tmp_path, view):
    """A conjugate (or negative) view's memory does not hold its values: saving one stores its
    values, and loading into one puts the stored values where reading it gives them back."""
    base = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j], dtype=torch.complex64)
    lazy = base.conj() if view == "conj" else base._neg_view()
    ss.save({"x": lazy}, tmp_path / "c")
    plain = torch.zeros(3, dtype=torch.complex64)
    ss.load({"x": plain}, tmp_path / "c")
    assert torch.equal(plain, lazy.resolve_conj().resolve_neg())
    into = torch.zeros(3, dtype=torch.complex64)
    target = into.conj() if view == "conj" else into._neg_view()
    ss.load({"x": target}, tmp_path / "c")
    assert torch.equal(target.resolve_conj().resolve_neg(), lazy.resolve_conj().resolve_neg())


def test_a_load_counts_as_an_in_place_change_of_what_it_fills(tmp_path):
    """Autograd's version counters see the load: a backward through activations computed before
    it fails instead of mixing old activations with new weights, and anything keyed on versions
    (the Lightning integration's unchanged-state check) sees new values."""
    source, target = model_of(0), model_of(1)
    plain = torch.zeros(5)
    ss.save({"model": source, "x": torch.arange(5.0)}, tmp_path / "c")
    before = [p._version for p in target.parameters()] + [plain._version]
    loss = target(torch.ones(2, 16, requires_grad=True)).square().sum()
    ss.load({"model": target, "x": plain}, tmp_path / "c")
    assert all(a > b for a, b in zip([p._version for p in target.parameters()] + [plain._version], before))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_loading_hooks_set_on_the_instance_or_extra_state_in_a_buffer_still_get_load_state_dict(tmp_path):
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(2))
            self.register_buffer("scale", torch.zeros(1))
            self.restored = None

        def get_extra_state(self):
            return self.scale  # extra state that is one of the module's own buffers

        def set_extra_state(self, state):
            self.restored = state.clone()

    source = Scaled()
    with torch.no_grad():
        source.scale.fill_(3.0)
    ss.save({"model": source}, tmp_path / "c")
    target = Scaled()
    ss.load({"model": target}, tmp_path / "c")
    assert target.restored is not None and target.restored.item() == 3.0

    seen = []
    plain = model_of(1)
    original = plain.load_state_dict
    plain.load_state_dict = lambda *a, **k: seen.append(1) or original(*a, **k)
    ss.save({"model": model_of(0)}, tmp_path / "p")
    ss.load({"model": plain}, tmp_path / "p")
    assert seen


def test_lazily_conjugated_small_tensors_inside_plain_data_save_their_values(tmp_path):
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    ss.save({"l": [c.conj(), c._neg_view(), 7]}, tmp_path / "c")
    out = {"l": None}
    ss.load(out, tmp_path / "c")
    assert torch.equal(out["l"][0], c.conj().resolve_conj()) and torch.equal(out["l"][1], -c)


class Tied(nn.Module):
    """Tied weights, a buffer, a non-persistent buffer and extra state: what a state dict names."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(2)])
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def get_extra_state(self):
        return {"version": 2}

    def set_extra_state(self, state):
        pass


def _wrapped(kind: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    model = Tied()
    if kind == "compiled":
        return torch.compile(model)
    if kind == "checkpoint_wrapper":
        model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    if kind == "compiled_inside":
        model.blocks[1] = torch.compile(model.blocks[1])
    return model


@pytest.mark.parametrize("kind", ["plain", "compiled", "checkpoint_wrapper", "compiled_inside"])
def test_the_state_dict_a_load_flattens_is_what_pytorchs_helper_gives(kind):
    """A module that no wrapper renames is flattened from its own state dict (the helper costs a
    few microseconds per tensor and gives the same); the same keys and the same tensors either
    way, and wrapped modules, whose keys the helper renames, still go through it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    model = _wrapped(kind)
    ours, helpers = module_state.model_state_dict(model), get_model_state_dict(model)
    assert list(ours) == list(helpers)
    for key, value in helpers.items():
        if isinstance(value, torch.Tensor):
            assert (ours[key].data_ptr(), ours[key].dtype, ours[key].shape, ours[key].stride()) == (
                value.data_ptr(), value.dtype, value.shape, value.stride()), key
        else:
            assert ours[key] == value, key
    assert module_state.renamed_by_helper(model) == (kind != "plain")


def test_a_compiled_model_and_a_plain_one_load_each_others_checkpoints(tmp_path):
    source, target = Tied(), torch.compile(Tied())
    ss.save({"model": source}, tmp_path / "plain")
    ss.load({"model": target}, tmp_path / "plain")
    ss.save({"model": target}, tmp_path / "compiled")
    again = Tied()
    ss.load({"model": again}, tmp_path / "compiled")
    want, got = source.state_dict(), again.state_dict()
    assert list(want) == list(got)
    for key, value in want.items():
        assert same_bits(value, got[key]) if isinstance(value, torch.Tensor) else value == got[key]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_for_the_whole_load_and_left_as_the_caller_had_it(tmp_path, monkeypatch, enabled):
    """Paused from reading the manifest to the module's own loading at the end (the load's
    objects then die with it instead of being walked by a collection between its steps), and
    afterwards as the caller had it."""
    import gc
    ss.save({"model": model_of(0)}, tmp_path / "c")
    seen = {}

    def noting(name, function):
        def wrapper(*args, **kwargs):
            seen[name] = gc.isenabled()
            return function(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(Manifest, "from_bytes", classmethod(noting("manifest", Manifest.from_bytes.__func__)))
    monkeypatch.setattr(flatten, "load_module", noting("module", flatten.load_module))
    (gc.enable if enabled else gc.disable)()
    try:
        ss.load({"model": model_of(1)}, tmp_path / "c")
        after = gc.isenabled()
    finally:
        gc.enable()
    assert seen == {"manifest": False, "module": False} and after == enabled


def test_a_load_leaves_no_cycle_of_its_own_objects_for_the_collector(tmp_path):
    """Every object a load made (its manifest entries, the state's items, the plan) is freed by
    reference counting when it returns: a cycle among them kept a whole manifest alive until
    the collector next ran (never, for a caller that switched it off), and that collection was
    a tenth of a load of a thousand small tensors."""
    import gc
    from statesnap.format.manifest import TensorEntry
    from statesnap.state.items import TensorItem

    model = model_of(0)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optim.step()
    ss.save({"model": model, "optim": optim, "extra": {"step": 3, "pair": (1, 2.5)}}, tmp_path / "c")
    target = model_of(1)
    state = {"model": target, "optim": torch.optim.AdamW(target.parameters()), "extra": {"step": 0, "pair": (0, 0.0)}}
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        ss.load(state, tmp_path / "c")
        gc.collect()
        left = {type(o).__name__ for o in gc.garbage
                if isinstance(o, (Manifest, TensorEntry, TensorItem, flatten.Flattened, flatten.FilledPlaces))}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not left and state["extra"] == {"step": 3, "pair": (1, 2.5)}


class _ScaleInExtraState(nn.Module):
    """Extra state computed from a parameter (a norm kept as a constant): PyTorch's helper builds
    the state dict without autograd, so the value handed back to set_extra_state is plain."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.tensor(1.0)

    def get_extra_state(self):
        return {"scale": self.lin.weight.norm()}

    def set_extra_state(self, state):
        self.scale = state["scale"]

    def forward(self, x):
        return self.lin(x) * self.scale


def test_extra_state_derived_from_parameters_loads_without_an_autograd_graph(tmp_path):
    """The module's own state dict is taken without autograd, as the helper took it: a value
    derived from a parameter came back requiring grad, tied to the weights the load then wrote
    in place, and the next backward failed (modified by an inplace operation)."""
    ss.save({"model": _ScaleInExtraState()}, tmp_path / "c")
    model = _ScaleInExtraState()
    ss.load({"model": model}, tmp_path / "c")
    assert not model.scale.requires_grad and model.scale.grad_fn is None
    model(torch.randn(2, 4)).sum().backward()  # (raised before)
    assert module_state.model_state_dict(_ScaleInExtraState())["_extra_state"]["scale"].grad_fn is None


_PYTHON_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)


class _Dispatching(torch.Tensor):
    """A tensor subclass with memory of its own and a __torch_dispatch__ (numpy refuses it)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEY), torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    __torch_function__ = torch._C._disabled_torch_function_impl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_a_dispatching_tensor_subclass_with_memory_of_its_own_is_loaded_into(tmp_path, dtype):
    """Its bytes are read through a detached plain alias, as before the one-byte-view-per-target
    change (``.numpy()`` of the subclass itself is refused: 'not supported for tensor subclasses')."""
    values = torch.arange(12).reshape(3, 4).to(dtype)
    ss.save({"t": values}, tmp_path / "c")
    target = torch.Tensor._make_subclass(_Dispatching, torch.zeros(3, 4, dtype=dtype))
    ss.load({"t": target}, tmp_path / "c")
    assert torch.equal(torch.Tensor._make_subclass(torch.Tensor, target), values)


class BytesExtraState(nn.Module):
    """Transformer Engine's pattern: extra state as a uint8 tensor of serialized bytes, empty in a
    fresh module, of a length that depends on what it holds once trained."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))
        self.meta = b""

    def get_extra_state(self):
        if not self.meta:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(self.meta), dtype=torch.uint8)

    def set_extra_state(self, state):
        self.meta = bytes(state.tolist())


def test_extra_state_tensors_of_another_length_are_handed_to_set_extra_state(tmp_path):
    source = BytesExtraState()
    source.meta = b"amax=1.5;scale=0.25"
    ss.save({"model": nn.Sequential(source)}, tmp_path / "c")
    fresh = BytesExtraState()
    ss.load({"model": nn.Sequential(fresh)}, tmp_path / "c")
    assert fresh.meta == source.meta
    longer = BytesExtraState()
    longer.meta = b"x" * 100  # (a stored value shorter than the module's goes in whole, too)
    ss.load({"model": nn.Sequential(longer)}, tmp_path / "c")
    assert longer.meta == source.meta

    with ss.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(1, {"model": source})
        restored = BytesExtraState()
        assert ckpt.load_latest({"model": restored}) == 1  # (from host memory)
        assert restored.meta == source.meta
    with ss.Checkpointer(tmp_path / "root") as ckpt:
        restored = BytesExtraState()
        assert ckpt.load_latest({"model": restored}) == 1  # (from disk)
        assert restored.meta == source.meta
