"""The convert pipeline: streaming writes, import without copying, progress bars, exports into
empty directories (issue 10, items 4 to 6)."""
import errno
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import statesnap as ss
from statesnap import cli
from statesnap.convert import dcp as convert_dcp
from statesnap.convert import dcp_chunks
from statesnap.convert import writer as convert_writer
from statesnap.format.manifest import MANIFEST_NAME

from dist_utils import run_ranks

MIB = 1 << 20
BIG_TENSORS, BIG_SIDE = 6, 4096  # 6 float32 tensors of 64 MiB: 384 MiB in all


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (so NaN payloads and -0.0 count too)."""
    return (a.dtype == b.dtype and a.shape == b.shape and
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def big_tensor(i: int) -> torch.Tensor:
    return torch.randn(BIG_SIDE, BIG_SIDE, generator=torch.Generator().manual_seed(i))


@pytest.fixture(scope="module")
def big_dcp(tmp_path_factory):
    """A DCP checkpoint of many 16 MiB tensors and an optimizer-like nesting, written once."""
    path = tmp_path_factory.mktemp("big") / "dcp"
    state = {"model": {f"w{i}": big_tensor(i) for i in range(BIG_TENSORS)},
             "optim": {"param_groups": [{"lr": 0.1, "betas": [0.9, 0.99], "params": ["model.w0", "model.w1"]}],
                       "state": {"model.w0": {"step": torch.tensor(7.0)}}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


PEAK_SCRIPT = r"""
import os, sys, threading, time
import torch
torch.set_num_threads(1)
import statesnap as ss
import statesnap.convert.api  # before the baseline (import statesnap is lazy): the peak is what converting holds

page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

peak, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.001)

base = rss()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
ss.convert(sys.argv[1], sys.argv[2], source="dcp", progress=False)
done.set()
sampler.join()
print(peak[0] - base)
"""


def test_dcp_source_streams_with_peak_memory_of_one_tensor_plus_buffers(big_dcp, tmp_path):
    """Converting 384 MiB of DCP holds one 64 MiB tensor at a time plus fixed buffers (the chunks
    are read straight into it, not deserialized and copied as dcp.load does), never the
    checkpoint; every byte arrives."""
    dst = tmp_path / "ck"
    # glibc serves large blocks from its heap once one was freed, and may keep up to twice that
    # unreturned; a fixed mmap threshold returns each freed tensor to the system at once, so the
    # peak measures what the converter holds, not what the allocator keeps. Measured: 84 MiB (the
    # tensor + 20 MiB of buffers and what the first conversion allocates); through dcp.load, which
    # deserializes each chunk and copies it, 2 tensors + the same; 405 MiB when every tensor is
    # materialized first.
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(big_dcp), str(dst)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.split()[-1])
    largest, total = BIG_SIDE * BIG_SIDE * 4, BIG_TENSORS * BIG_SIDE * BIG_SIDE * 4
    bound = largest + 40 * MIB  # the tensor; modules imported, the writer's buffers, slack
    assert bound < 2 * largest < total / 2
    assert growth < bound, f"peak RSS grew by {growth / MIB:.0f} MiB (bound {bound / MIB:.0f} MiB)"
    reader = ss.open(dst)
    for i in range(BIG_TENSORS):
        assert same_bits(reader.read(f"model.w{i}"), big_tensor(i)), i
    # the nesting DCP flattened away is rebuilt from planner_data: the param groups are one value
    assert reader.read("optim.param_groups") == [{"lr": 0.1, "betas": [0.9, 0.99], "params": ["model.w0", "model.w1"]}]
    assert same_bits(reader.read("optim.state.model.w0.step"), torch.tensor(7.0))
    assert reader.meta["converted_from"]["source"] == "dcp"
    assert reader.verify() > BIG_TENSORS * largest


def _column_sharded_dcp(rank, world, out):
    """DTensors cut along columns (each rank's chunk is a strided region of the whole) and rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    whole = column_state()
    dcp.save({name: distribute_tensor(tensor, mesh, [Shard(1 if tensor.dim() > 1 else 0)])
              for name, tensor in whole.items()}, checkpoint_id=out)


def column_state() -> dict:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(64, 48, generator=g), "h": torch.randn(10, 6, 4, generator=g).to(torch.bfloat16),
            "v": torch.arange(40, dtype=torch.int64)}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_chunks_of_any_cut_are_read_in_place_bit_exact(tmp_path, monkeypatch):
    src = str(tmp_path / "dcp")
    run_ranks(2, _column_sharded_dcp, src)
    monkeypatch.setattr(convert_dcp, "EAGER_BYTES", -1)  # every tensor through the streaming path
    monkeypatch.setattr(dcp_chunks, "BOUNCE_BYTES", 100)  # column chunks through a few rows at a time

    def no_fallback(*args):
        raise AssertionError("a chunk went through dcp.load")

    monkeypatch.setattr(convert_dcp, "_load", no_fallback)
    ss.convert(src, tmp_path / "ck", source="dcp", progress=False)
    reader = ss.open(tmp_path / "ck")
    for name, tensor in column_state().items():
        assert same_bits(reader.read(name), tensor), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_chunk_in_a_layout_not_read_in_place_goes_through_dcp_load(tmp_path, monkeypatch):
    """A chunk stored as a transposed view (DCP keeps the view's strides) is not row-major: the
    reader hands it to dcp.load rather than misplace its elements."""
    transposed = torch.randn(40, 30, generator=torch.Generator().manual_seed(2)).t()
    dcp.save({"t": transposed}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    monkeypatch.setattr(convert_dcp, "EAGER_BYTES", -1)
    calls = []
    monkeypatch.setattr(convert_dcp, "_load", lambda reader, state: calls.append(list(state)) or
                        dcp.load(state, storage_reader=reader, no_dist=True))
    ss.convert(tmp_path / "dcp", tmp_path / "ck", source="dcp", progress=False)
    assert calls == [["t"]]
    assert same_bits(ss.open(tmp_path / "ck").read("t"), transposed.contiguous())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_chunk_cut_short_is_an_error_naming_file_and_tensor(tmp_path):
    g = torch.Generator().manual_seed(4)
    dcp.save({"a": torch.randn(600, 600, generator=g), "b": torch.randn(600, 600, generator=g), "step": 3},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    data = tmp_path / "dcp" / "__0_0.distcp"
    with open(data, "r+b") as f:  # "a" is whole, "b" is cut in its middle (they are written in order)
        f.truncate(600 * 600 * 4 * 3 // 2)
    with pytest.raises(ss.CheckpointError, match=r"__0_0\.distcp.*'b'|'b'.*__0_0\.distcp"):
        ss.convert(tmp_path / "dcp", tmp_path / "ck", source="dcp", progress=False)
    assert not (tmp_path / "ck").exists()
    with open(data, "r+b") as f:  # now the small values too: named with their file
        f.truncate(1000)
    with pytest.raises(ss.CheckpointError, match=r"__0_0\.distcp: value 'step' is not a readable torch\.save file "
                                                 r"\(truncated or damaged\?\)"):
        ss.convert(tmp_path / "dcp", tmp_path / "ck", source="dcp", progress=False)


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g).to(torch.bfloat16),
            "ids": torch.arange(-4, 9), "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 5), "step": 12, "name": "run-1", "groups": [{"lr": 0.01}, {"lr": 0.1}]}


def test_converted_checkpoint_is_what_ss_save_writes(tmp_path):
    """Same plan, same bytes, same checksums, same plain values: only the provenance differs."""
    state = mixed_state()
    torch.save(state, tmp_path / "src.pt")
    ss.convert(tmp_path / "src.pt", tmp_path / "converted")
    ss.save(state, tmp_path / "saved")
    converted, saved = ss.open(tmp_path / "converted"), ss.open(tmp_path / "saved")
    assert converted.keys() == saved.keys()
    for name in saved.keys():
        a, b = converted.manifest.tensors.get(name), saved.manifest.tensors.get(name)
        if b is None:
            assert converted.manifest.objects[name] == saved.manifest.objects[name], name
            continue
        assert (a.dtype, a.shape, a.layout) == (b.dtype, b.shape, b.layout), name
        for column in ("offset", "nbytes", "start", "size", "checksum", "checksum_bounds"):
            assert (getattr(a, column) == getattr(b, column)).all(), (name, column)
    assert converted.manifest.file_sizes == saved.manifest.file_sizes
    data = [(tmp_path / d / r.manifest.files[0]).read_bytes() for d, r in (("converted", converted), ("saved", saved))]
    assert data[0] == data[1]
    assert converted.verify() == saved.verify()


def write_hf(root, shards: list[dict]) -> dict:
    """A sharded Hugging Face safetensors directory with its index; returns every tensor."""
    os.makedirs(root, exist_ok=True)
    weight_map, everything = {}, {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(root, name))
        weight_map.update(dict.fromkeys(shard, name))
        everything.update(shard)
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return everything


def hf_shards() -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"embed.weight": torch.randn(64, 48, generator=g), "norm.weight": torch.randn(48, generator=g).half()},
            {"layer.0.weight": torch.randn(96, 48, generator=g).to(torch.bfloat16),
             "layer.0.bias": torch.randn(96, generator=g), "empty": torch.empty(0, 2), "count": torch.tensor(3)}]


def test_import_without_copying_links_the_source_and_reads_like_any_checkpoint(tmp_path):
    expected = write_hf(tmp_path / "hf", hf_shards())
    sources = sorted((tmp_path / "hf").glob("*.safetensors"))
    info = ss.convert(tmp_path / "hf", tmp_path / "ck", copy=False)
    reader = ss.open(tmp_path / "ck")
    # the data files are the source files (one inode), named and held inside the checkpoint
    assert sorted(os.listdir(tmp_path / "ck")) == sorted([*reader.manifest.files, MANIFEST_NAME])
    assert all("/" not in name for name in reader.manifest.files)
    source_inodes = {os.stat(p).st_ino for p in sources}
    assert {os.stat(tmp_path / "ck" / n).st_ino for n in reader.manifest.files} == source_inodes
    assert info.bytes == sum(os.path.getsize(p) for p in sources)
    assert reader.verify() == info.bytes
    for name, tensor in expected.items():
        assert same_bits(reader.read(name), tensor), name
    # ss.load, and a resharded load of one block of a tensor (what a TP rank reads)
    target = {name: torch.empty_like(t) for name, t in expected.items()}
    ss.load(target, tmp_path / "ck")
    for name, tensor in expected.items():
        assert same_bits(target[name], tensor), name
    block = torch.empty(32, 24)
    ss.load({"embed.weight": ss.Sharded(block, (64, 48), offsets=(32, 24))}, tmp_path / "ck", strict=False)
    assert same_bits(block, expected["embed.weight"][32:, 24:])
    assert same_bits(reader.read("layer.0.weight", (slice(10, 20),)), expected["layer.0.weight"][10:20])
    # a hard link outlives the source's name: deleting the source leaves the checkpoint whole
    for path in sources:
        os.remove(path)
    assert ss.open(tmp_path / "ck").verify() == info.bytes
    assert cli.main(["verify", str(tmp_path / "ck")]) == 0


def test_source_written_in_place_after_import_is_caught_by_checksums(tmp_path):
    """The link shares the inode: a write into the source is a write into the checkpoint, and
    verify and load name the file and the tensor it hit."""
    expected = write_hf(tmp_path / "hf", hf_shards())
    ss.convert(tmp_path / "hf", tmp_path / "ck", copy=False)
    reader = ss.open(tmp_path / "ck")
    entry = reader.manifest.tensors["layer.0.bias"]
    data_file = reader.manifest.files[int(entry.file[0])]
    shard = tmp_path / "hf" / "model-00002-of-00002.safetensors"
    offset = int(entry.offset[0]) + 8
    with open(shard, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ss.CorruptCheckpointError, match=rf"layer\.0\.bias in {data_file}: checksum mismatch"):
        ss.open(tmp_path / "ck").verify()
    with pytest.raises(ss.CheckpointError, match=r"layer\.0\.bias"):
        ss.load({"layer.0.bias": torch.empty(96)}, tmp_path / "ck", strict=False)
    # the other tensors still load
    out = torch.empty(96, 48, dtype=torch.bfloat16)
    ss.load({"layer.0.weight": out}, tmp_path / "ck", strict=False)
    assert same_bits(out, expected["layer.0.weight"])


def test_import_without_copying_through_symlinks_links_the_file_they_point_at(tmp_path):
    """The Hugging Face hub cache: snapshots/<rev>/model.safetensors is a relative symlink to
    blobs/<hash>. Linux's link() links a symlink itself, which in the checkpoint would dangle
    (relative) or follow whatever later sits at the path; the checkpoint must share the blob's inode."""
    tensors = {"w": torch.randn(8, 8), "b": torch.randn(3)}
    (tmp_path / "blobs").mkdir()
    save_file(tensors, tmp_path / "blobs" / "abc123")
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to("../../blobs/abc123")
    ss.convert(snapshot, tmp_path / "ck", copy=False)
    reader = ss.open(tmp_path / "ck")
    (data,) = reader.manifest.files
    assert not os.path.islink(tmp_path / "ck" / data)
    assert os.stat(tmp_path / "ck" / data).st_ino == os.stat(tmp_path / "blobs" / "abc123").st_ino
    os.remove(tmp_path / "blobs" / "abc123")  # the cache evicted: the checkpoint keeps the bytes
    reader = ss.open(tmp_path / "ck")
    reader.verify()
    assert all(same_bits(reader.read(name), value) for name, value in tensors.items())


def test_import_without_copying_across_file_systems_copies_with_one_read(tmp_path, monkeypatch):
    """Where neither a hard link nor a reflink is possible (EXDEV), the tensors are written like
    any conversion's: the checkpoint is whole and independent of the source."""
    expected = write_hf(tmp_path / "hf", hf_shards())

    def no_link(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    def no_clone(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(convert_writer.os, "link", no_link)
    monkeypatch.setattr(convert_writer.fcntl, "ioctl", no_clone)
    ss.convert(tmp_path / "hf", tmp_path / "ck", copy=False)
    reader = ss.open(tmp_path / "ck")
    assert all(os.stat(p).st_nlink == 1 for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(reader.manifest.files) == 1
    for name, tensor in expected.items():
        assert same_bits(reader.read(name), tensor), name
    reader.verify()


def test_source_replaced_between_reading_its_header_and_linking_it_is_refused(tmp_path, monkeypatch):
    """The offsets come from the file as it was when its header was read: a file renamed over the
    path before the link (another download finishing) must not be linked with those offsets."""
    write_hf(tmp_path / "hf", hf_shards())
    shard = sorted((tmp_path / "hf").glob("*.safetensors"))[0]
    link = convert_writer._link

    def replaced_then_linked(source, target):
        other = tmp_path / "other.safetensors"
        save_file({"x": torch.arange(100, dtype=torch.float32)}, str(other))
        os.replace(other, shard)
        return link(source, target)

    monkeypatch.setattr(convert_writer, "_link", replaced_then_linked)
    with pytest.raises(ss.CheckpointError, match="changed while it was being converted"):
        ss.convert(tmp_path / "hf", tmp_path / "ck", copy=False)
    assert not (tmp_path / "ck").exists()


def test_import_without_copying_writes_what_the_spec_computes_and_links_the_rest(tmp_path):
    expected = write_hf(tmp_path / "hf", hf_shards())
    spec = {"ops": [{"rename": "^layer\\.0\\.", "to": "block."},
                    {"split": "embed\\.weight", "to": ["embed.top", "embed.bottom"], "dim": 0}]}
    ss.convert(tmp_path / "hf", tmp_path / "ck", spec=spec, copy=False)
    reader = ss.open(tmp_path / "ck")
    linked = {os.stat(p).st_ino for p in (tmp_path / "hf").glob("*.safetensors")}
    files = {name: os.stat(tmp_path / "ck" / name).st_ino for name in reader.manifest.files}
    assert len(set(files.values()) & linked) == 2 and len(files) == 3  # both shards linked, one file written
    assert same_bits(reader.read("block.weight"), expected["layer.0.weight"])
    assert same_bits(reader.read("embed.top"), expected["embed.weight"][:32])
    assert same_bits(reader.read("embed.bottom"), expected["embed.weight"][32:])
    reader.verify()


def test_import_without_copying_is_refused_where_it_cannot_apply(tmp_path):
    torch.save({"w": torch.randn(4)}, tmp_path / "src.pt")
    with pytest.raises(ss.CheckpointError, match="a 'torch' source is decoded, so it is copied: use copy=True"):
        ss.convert(tmp_path / "src.pt", tmp_path / "ck", copy=False)
    save_file({"w": torch.randn(4)}, tmp_path / "m.safetensors")
    with pytest.raises(ss.CheckpointError, match="the transform spec computes every one"):
        ss.convert(tmp_path / "m.safetensors", tmp_path / "ck", copy=False,
                   spec={"ops": [{"split": "w", "to": ["a", "b"], "dim": 0}]})
    assert not (tmp_path / "ck").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ck")]  # no staging left behind


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw[:4], "4 bytes are too few to hold the 8-byte header length"),
    (lambda raw: b"", "0 bytes are too few to hold the 8-byte header length"),
    (lambda raw: raw[:12], "header length .* does not fit a file of 12 bytes"),
    (lambda raw: raw[:8] + b"\xff" + raw[9:], "header is not JSON"),
    (lambda raw: raw[:-1], "'b' ends at byte"),
    (lambda raw: raw.replace(b'"F32"', b'"F99"', 1), "'a' has a malformed header entry"),
])
def test_damaged_safetensors_is_an_error_naming_file_and_tensor(tmp_path, damage, message):
    save_file({"a": torch.ones(4), "b": torch.ones(2)}, tmp_path / "m.safetensors")
    raw = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(damage(raw))
    with pytest.raises(ss.CheckpointError, match=rf"m\.safetensors.*{message}"):
        ss.convert(tmp_path / "m.safetensors", tmp_path / "ck")


def test_overlapping_safetensors_tensors_are_refused(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    encoded = json.dumps(header).encode()
    (tmp_path / "m.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + bytes(12))
    with pytest.raises(ss.CheckpointError, match=r"m\.safetensors: tensors 'a' and 'b' overlap"):
        ss.convert(tmp_path / "m.safetensors", tmp_path / "ck")


@pytest.mark.parametrize("offsets, data_bytes, message", [
    ([[0, 8], [12, 20]], 20, r"bytes \[8, 12\) of its data, before tensor 'b', belong to no tensor"),
    ([[4, 12], [12, 20]], 20, r"bytes \[0, 4\) of its data, before tensor 'a', belong to no tensor"),
    ([[0, 8], [8, 16]], 24, "its last 8 bytes belong to no tensor"),
])
def test_safetensors_data_with_holes_is_refused(tmp_path, offsets, data_bytes, message):
    """The format indexes every byte of the data (no other content may hide in a file that loads
    as tensors), and safetensors itself refuses a file with holes: so does convert, naming them."""
    header = {name: {"dtype": "F32", "shape": [2], "data_offsets": span} for name, span in zip("ab", offsets)}
    encoded = json.dumps(header).encode()
    (tmp_path / "m.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + bytes(data_bytes))
    with pytest.raises(ss.CheckpointError, match=rf"m\.safetensors is not a valid safetensors file: {message}"):
        ss.convert(tmp_path / "m.safetensors", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("header, message", [
    (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
     "names given twice: 'a'"),
    (b'{"a":{"dtype":"F32","shape":[0,1180591620717411303424],"data_offsets":[0,0]}}', "'a'.*too large"),
    (b'{"a":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],"data_offsets":[0,0]}}',
     "'a'.*too large"),
    (b"[" * 100000 + b"]" * 100000, "header is not JSON"),
    (b'{"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,4]}}', "'a'.*unknown dtype 'Q9'"),
])
def test_hostile_safetensors_header_is_an_error_naming_file_and_tensor(tmp_path, header, message):
    """A tensor named twice (json keeps the last), sizes beyond int64 with no bytes (a 0 dimension),
    nesting deeper than the parser's recursion: errors naming the file, not ValueError or
    RecursionError from deep inside, and never a silently chosen byte range."""
    (tmp_path / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ss.CheckpointError, match=rf"m\.safetensors.*{message}"):
        ss.convert(tmp_path / "m.safetensors", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("weight_map", [["a"], {}])
def test_index_whose_weight_map_names_no_tensors_is_refused(tmp_path, weight_map):
    """A truncated or foreign index must not become an empty checkpoint (or an AttributeError)."""
    src = tmp_path / "src"
    src.mkdir()
    save_file({"a": torch.ones(2)}, src / "s1.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ss.CheckpointError, match=r"index\.json is not a safetensors index.*weight_map"):
        ss.convert(src, tmp_path / "ck")


def test_progress_bars_only_on_a_terminal_or_when_asked(tmp_path, capsys):
    write_hf(tmp_path / "hf", hf_shards())
    ss.convert(tmp_path / "hf", tmp_path / "ck")  # stderr is captured here: not a terminal
    ss.export(tmp_path / "ck", tmp_path / "out")
    ss.open(tmp_path / "ck").verify()
    assert capsys.readouterr().err == ""
    ss.convert(tmp_path / "hf", tmp_path / "ck2", progress=True)
    ss.export(tmp_path / "ck", tmp_path / "out2", progress=True)
    ss.open(tmp_path / "ck").verify(progress=True)
    err = capsys.readouterr().err
    for what in ("convert -> ck2", "export -> out2", "verify"):
        assert what in err and "100%" in err
    assert cli.main(["verify", str(tmp_path / "ck"), "--progress"]) == 0
    assert "100%" in capsys.readouterr().err


def test_cli_convert_no_copy(tmp_path, capsys):
    expected = write_hf(tmp_path / "hf", hf_shards())
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--no-copy"]) == 0
    assert capsys.readouterr().err == ""
    reader = ss.open(tmp_path / "ck")
    assert all(os.stat(tmp_path / "ck" / n).st_nlink == 2 for n in reader.manifest.files)
    assert same_bits(reader.read("embed.weight"), expected["embed.weight"])


def test_export_into_an_existing_empty_directory(tmp_path):
    expected = write_hf(tmp_path / "hf", hf_shards())
    ss.convert(tmp_path / "hf", tmp_path / "ck")
    (tmp_path / "out").mkdir()
    info = ss.export(tmp_path / "ck", tmp_path / "out")
    assert info.files == ["model.safetensors"]
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert loaded.keys() == expected.keys()
    assert all(same_bits(loaded[n], t) for n, t in expected.items())
    # a directory that holds anything is refused, and left as it was
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ss.CheckpointExistsError, match="not an empty directory"):
        ss.export(tmp_path / "ck", tmp_path / "full")
    assert os.listdir(tmp_path / "full") == ["notes.txt"]
    # with overwrite=True it is replaced as a whole
    ss.export(tmp_path / "ck", tmp_path / "full", to="dcp", overwrite=True)
    assert "notes.txt" not in os.listdir(tmp_path / "full") and ".metadata" in os.listdir(tmp_path / "full")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging left behind


def test_notes_of_the_spec_reach_the_result_and_the_cli(tmp_path, capsys):
    """Replicas averaged by the spec may have drifted: how far is reported, not hidden."""
    norm = torch.linspace(0, 1, 8)
    torch.save({"tp_rank_00": {"norm": norm}, "tp_rank_01": {"norm": norm + 2**-10}}, tmp_path / "src.pt")
    spec = {"ops": [{"fuse": r"tp_rank_(?P<index>\d+)\.norm", "to": "norm", "average": True}]}
    info = ss.convert(tmp_path / "src.pt", tmp_path / "ck", spec=spec)
    assert len(info.notes) == 1 and "norm" in info.notes[0] and "0.000976562" in info.notes[0]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert cli.main(["convert", str(tmp_path / "src.pt"), str(tmp_path / "ck2"), "--spec", str(tmp_path / "spec.json")]) == 0
    assert "note: norm" in capsys.readouterr().out
    assert same_bits(ss.open(tmp_path / "ck").read("norm"), norm + 2**-11)


def test_unsupported_dtype_is_named(tmp_path):
    packed = torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    torch.save({"w": packed}, tmp_path / "src.pt")
    with pytest.raises(ss.CheckpointError, match=r"^converting .*src.pt: w: dtype torch.float4_e2m1fn_x2 is not "
                                                 r"supported"):
        ss.convert(tmp_path / "src.pt", tmp_path / "ck")


def test_convert_streams_to_an_fsspec_url_and_copy_false_needs_a_local_destination(tmp_path):
    expected = write_hf(tmp_path / "hf", hf_shards())
    url = f"memory://convert-{os.getpid()}/ck"
    ss.convert(tmp_path / "hf", url)
    reader = ss.open(url)
    assert reader.verify() > 0
    for name, tensor in expected.items():
        assert same_bits(reader.read(name), tensor), name
    with pytest.raises(ss.CheckpointError, match="copy=False links files on a local file system"):
        ss.convert(tmp_path / "hf", f"memory://convert-{os.getpid()}/ck2", copy=False)
