"""Format v1: every dtype, odd tensor shapes and plain data round-trip bit for bit; pickle is opt-in."""
import json
import math

import pytest
import torch

import statesnap as ss
from statesnap.format.dtypes import NAME_TO_DTYPE
from statesnap.format.manifest import MANIFEST_NAME


def random_of(dtype: torch.dtype, shape=(5, 7)) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype``: exercises every bit pattern (NaNs, subnormals)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, dtype=torch.bool)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``torch.equal`` treats NaN != NaN, and float8 lacks comparison ops)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(as_bytes(a), as_bytes(b))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", sorted(NAME_TO_DTYPE))
def test_every_dtype_round_trips_bit_for_bit(tmp_path, name):
    dtype = NAME_TO_DTYPE[name]
    torch.manual_seed(hash(name) % 1000)
    original = random_of(dtype)
    ss.save({"t": original, "transposed": original.t()}, tmp_path / "c")
    strided_storage = torch.zeros_like(original)
    target = {"t": torch.zeros_like(original), "transposed": strided_storage.t()}
    ss.load(target, tmp_path / "c")
    assert same_bits(target["t"], original)
    assert same_bits(strided_storage, original)  # loaded through a non-contiguous view
    reader = ss.open(tmp_path / "c")
    assert same_bits(reader.read("t"), original)
    assert same_bits(reader.read("transposed", (slice(1, 6), slice(2, 4))), original.t()[1:6, 2:4])


def test_all_dtypes_people_checkpoint_are_supported():
    expected = {"float32", "float16", "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "int16",
                "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128"}
    assert expected <= set(NAME_TO_DTYPE)


def test_zero_dim_empty_and_non_contiguous(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "empty_1d": torch.empty(0, dtype=torch.int64),
        "transposed": base.t(),
        "sliced": base[1:5:2, 3:9],
        "expanded": torch.arange(3.0).expand(4, 3),
    }
    ss.save(state, tmp_path / "c")
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    ss.load(target, tmp_path / "c")
    reader = ss.open(tmp_path / "c")
    for key, original in state.items():
        assert torch.equal(target[key], original), key
        assert torch.equal(reader.read(key), original), key
    assert reader.info("scalar").shape == ()


@pytest.mark.parametrize("index", [slice(2, 9), 3, -1, (slice(1, 12), slice(4, 9)), (slice(None), 7, slice(1, 4)),
                                   (-1, -2), slice(5, 5), (4, 16, 0)])
def test_reader_reads_regions(tmp_path, index):
    original = torch.randn(13, 17, 5)
    ss.save({"t": original}, tmp_path / "c", block_bytes=64)
    assert torch.equal(ss.open(tmp_path / "c").read("t", index), original[index])


def test_reader_region_reads_only_its_bytes(tmp_path, monkeypatch):
    original = torch.randn(256, 64)  # 64 KiB in 256 rows of 256 bytes
    ss.save({"t": original}, tmp_path / "c", block_bytes=1024)
    reader = ss.open(tmp_path / "c")
    read = []
    real = reader.backend.open_read

    def counting_open(path):
        file = real(path)
        inner = file.readinto
        file.readinto = lambda offset, views: read.append(inner(offset, views)) or read[-1]
        return file
    monkeypatch.setattr(reader.backend, "open_read", counting_open)
    assert torch.equal(reader.read("t", slice(100, 104)), original[100:104])
    assert sum(read) <= 2 * 1024  # the rows' checksum blocks, not the tensor


def test_views_sharing_storage_both_load(tmp_path):
    base = torch.randn(8, 8)
    state = {"whole": base, "row": base[2], "block": base[4:, :4]}
    ss.save(state, tmp_path / "c")
    target = {"whole": torch.zeros(8, 8), "row": torch.zeros(8), "block": torch.zeros(4, 4)}
    ss.load(target, tmp_path / "c")
    assert torch.equal(target["whole"], base)
    assert torch.equal(target["row"], base[2])
    assert torch.equal(target["block"], base[4:, :4])

    # Loading into views that share storage again leaves a consistent tensor.
    shared = torch.zeros(8, 8)
    ss.load({"whole": shared, "row": shared[2], "block": shared[4:, :4]}, tmp_path / "c")
    assert torch.equal(shared, base)


PLAIN = {
    "tuple": (1, "two", 3.0, (4, None)),
    "int_keys": {1: "a", 2: [1, 2], (3, 4): "tuple key"},
    "floats": [float("inf"), float("-inf"), -0.0, 1e-308, 1.5],
    "bytes": b"\x00\xffbinary",
    "none": None,
    "bool": True,
    "big": 2 ** 62,
    "nested": {"a": {"b": [1, {"c": (2, 3)}, {5: "int key inside a list"}], "__ss_tricky": "looks like a tag"}},
    "string": "unicode \u2713",
    "dtype": torch.bfloat16,
}


def blank(value):
    """A load template with the structure of ``value``: nested dicts kept, every leaf None.

    Nested dicts in ``state`` flatten into dotted names on save, so a load template mirrors them."""
    return {k: blank(v) for k, v in value.items()} if isinstance(value, dict) else None


def test_plain_data_round_trips(tmp_path):
    ss.save({"extra": PLAIN, "nan": float("nan")}, tmp_path / "c")
    target = {"extra": blank(PLAIN), "nan": 0.0}
    ss.load(target, tmp_path / "c")
    assert target["extra"] == PLAIN
    assert type(target["extra"]["tuple"]) is tuple and type(target["extra"]["tuple"][3]) is tuple
    assert math.isnan(target["nan"])
    assert math.copysign(1.0, target["extra"]["floats"][2]) == -1.0
    reader = ss.open(tmp_path / "c")
    assert reader.read("extra.nested.a.b") == PLAIN["nested"]["a"]["b"]
    assert reader.read("extra.int_keys.(3, 4)") == "tuple key"
    assert reader.read("extra.bytes") == PLAIN["bytes"]


def test_plain_data_inside_a_list_keeps_non_str_keys(tmp_path):
    value = [{1: "a", (2, 3): {None: 1.5}}, ({"x": float("inf")},)]
    ss.save({"v": value}, tmp_path / "c")
    assert ss.open(tmp_path / "c").read("v") == value


def test_empty_dicts_round_trip(tmp_path):
    state = {"extra": {"cfg": {}, "n": 1, "deep": {"x": {}}}, "t": torch.ones(2)}
    ss.save(state, tmp_path / "c")
    target = {"extra": {"cfg": None, "n": 0, "deep": {"x": None}}, "t": torch.zeros(2)}
    ss.load(target, tmp_path / "c")
    assert target["extra"] == {"cfg": {}, "n": 1, "deep": {"x": {}}}
    assert ss.open(tmp_path / "c").read("extra.cfg") == {}


def test_small_tensors_inside_plain_data_round_trip(tmp_path):
    rng = torch.get_rng_state()
    ss.save({"extra": {"rng": [rng, 5]}}, tmp_path / "c")
    value = ss.open(tmp_path / "c").read("extra.rng")
    assert torch.equal(value[0], rng) and value[1] == 5


class Custom:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Custom) and other.x == self.x


def test_custom_object_needs_allow_pickle_at_save(tmp_path):
    with pytest.raises(ss.UnsafeCheckpointError, match="obj"):
        ss.save({"obj": Custom(1)}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_pickled_object_needs_allow_pickle_at_load(tmp_path):
    ss.save({"obj": Custom(7), "t": torch.ones(3)}, tmp_path / "c", allow_pickle=True)
    with pytest.raises(ss.UnsafeCheckpointError, match="obj"):
        ss.load({"obj": None, "t": torch.zeros(3)}, tmp_path / "c")
    with pytest.raises(ss.UnsafeCheckpointError):
        ss.open(tmp_path / "c").read("obj")
    target = {"obj": None, "t": torch.zeros(3)}
    ss.load(target, tmp_path / "c", allow_pickle=True)
    assert target["obj"] == Custom(7) and torch.equal(target["t"], torch.ones(3))
    assert ss.open(tmp_path / "c", allow_pickle=True).read("obj") == Custom(7)


def test_pickled_values_of_any_size(tmp_path):
    value = Custom(bytes(range(256)) * 400)  # 100 KB: spans many 4 KiB checksum blocks
    ss.save({"obj": value}, tmp_path / "c", allow_pickle=True, block_bytes=4096)
    target = {"obj": None}
    ss.load(target, tmp_path / "c", allow_pickle=True)
    assert target["obj"] == value
    ss.open(tmp_path / "c").verify()


def test_manifest_is_json_never_pickle(tmp_path):
    ss.save({"t": torch.ones(2), "extra": PLAIN}, tmp_path / "c")
    raw = (tmp_path / "c" / MANIFEST_NAME).read_bytes()
    doc = json.loads(raw)
    assert doc["format"] == "statesnap" and doc["version"] == 1
    assert not raw.startswith(b"\x80")  # no pickle protocol header
    entry = doc["tensors"]["t"]
    assert entry["dtype"] == "float32" and entry["shape"] == [2] and entry["layout"] == "box"
    assert all(isinstance(c, int) for c in entry["checksum"])
    assert all(name.endswith(".bin") for name in doc["files"])


def test_data_files_are_exactly_their_recorded_size(tmp_path):
    """Readers may detect truncation by size: the alignment tail is written, not left out."""
    ss.save({"a": torch.ones(3), "b": torch.empty(0), "c": torch.ones(5, dtype=torch.int8), "o": {1, 2}},
            tmp_path / "c", allow_pickle=True)
    doc = json.loads((tmp_path / "c" / MANIFEST_NAME).read_bytes())
    for name, size in zip(doc["files"], doc["file_sizes"]):
        assert (tmp_path / "c" / name).stat().st_size == size
