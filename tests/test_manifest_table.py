"""The table of a version 3 manifest (format/table.py): tensors stored whole in one piece, written
column by column. Round trips, the fallback to version 1 for a few tensors, old manifests, and
tables a hostile writer made: each must be refused by name, exactly as the same entries written
as JSON objects are, or read as they are."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import xxhash

import statesnap as ss
from statesnap.errors import CorruptCheckpointError, ManifestError
from statesnap.format.manifest import MANIFEST_NAME, Manifest
from statesnap.format.table import COLUMNS, TABLE_MIN_TENSORS

BLOCK = 4096  # small checksum blocks: tensors of several blocks without large tensors


def _state(count: int = TABLE_MIN_TENSORS + 6) -> dict:
    gen = torch.Generator().manual_seed(0)
    state = {f"t{i:03d}": torch.randn(1 + i % 7, 3, generator=gen) for i in range(count)}
    state.update(scalar=torch.tensor(2.5), empty=torch.zeros(0, 4), big=torch.randn(3000, generator=gen),
                 half=torch.randn(5, dtype=torch.float16, generator=gen), flags=torch.tensor([True, False]),
                 ids=torch.arange(7, dtype=torch.int32), cube=torch.randn(2, 3, 4, generator=gen))
    return state


def _doc(path) -> dict:
    return json.loads((path / MANIFEST_NAME).read_bytes())


def _sign(path, doc: dict) -> None:
    """Write ``doc`` as the manifest, signed anew, as a writer can."""
    doc.pop("manifest_xxh3", None)
    body = json.dumps(doc, separators=(",", ":")).encode()
    (path / MANIFEST_NAME).write_bytes(b'%s,"manifest_xxh3":%d}' % (body[:-1], xxhash.xxh3_64_intdigest(body)))


def _as_objects(doc: dict) -> dict:
    """The same manifest with its table written as JSON objects (version 1)."""
    doc = json.loads(json.dumps(doc))
    table = doc.pop("table")
    for name, dtype, shape, file, offset, checksum in zip(*(table[c] for c in COLUMNS)):
        itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        doc["tensors"][name] = {"dtype": dtype, "shape": shape, "layout": "box", "file": [file], "offset": [offset],
                                "nbytes": [int(np.prod(shape, dtype=np.int64)) * itemsize],
                                "start": [[0] * len(shape)], "size": [shape], "checksum": [checksum]}
    doc["version"] = 1
    return doc


def _equal_entries(a: Manifest, b: Manifest) -> None:
    assert a.tensors.keys() == b.tensors.keys()
    for name, x in a.tensors.items():
        y = b.tensors[name]
        assert (x.dtype, x.shape, x.layout) == (y.dtype, y.shape, y.layout), name
        for column in ("file", "offset", "nbytes", "start", "size", "checksum", "checksum_bounds"):
            assert np.array_equal(getattr(x, column), getattr(y, column)), (name, column)


def test_many_whole_tensors_are_written_as_a_table_and_load_bit_exact(tmp_path):
    state = _state()
    ss.save(state, tmp_path / "c", block_bytes=BLOCK)
    doc = _doc(tmp_path / "c")
    assert doc["version"] == 3 and doc["tensors"] == {}
    assert set(doc["table"]["name"]) == set(state)
    big = doc["table"]["name"].index("big")
    assert len(doc["table"]["checksum"][big]) == 3  # 12,000 bytes in 4,096-byte blocks
    target = {k: torch.full_like(v, 7) for k, v in state.items()}
    ss.load(target, tmp_path / "c")
    for name, value in state.items():
        assert torch.equal(target[name].view(-1).view(torch.uint8), value.view(-1).view(torch.uint8)), name
    assert ss.open(tmp_path / "c").verify()


def test_a_few_tensors_stay_json_objects_of_version_1(tmp_path):
    ss.save(_state(count=TABLE_MIN_TENSORS - 8), tmp_path / "c")
    doc = _doc(tmp_path / "c")
    assert doc["version"] == 1 and "table" not in doc and len(doc["tensors"]) == TABLE_MIN_TENSORS - 1


def test_a_table_and_the_same_entries_as_json_objects_read_alike(tmp_path):
    ss.save(_state(), tmp_path / "c", block_bytes=BLOCK)
    table = Manifest.from_bytes((tmp_path / "c" / MANIFEST_NAME).read_bytes())
    _sign(tmp_path / "c", _as_objects(_doc(tmp_path / "c")))
    objects = Manifest.from_bytes((tmp_path / "c" / MANIFEST_NAME).read_bytes())
    assert (table.version, objects.version) == (3, 1)
    _equal_entries(table, objects)
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    ss.load(target, tmp_path / "c")  # a version 1 manifest of many tensors loads as before
    assert all(torch.equal(target[k], v) for k, v in _state().items())


def _save_split(rank: int, world: int, path: str) -> None:
    """Every tensor of ``_state`` replicated, and ``split`` in a row block per rank (a flat range
    per rank for ``flat``)."""
    whole = torch.arange(24.0).reshape(world * 3, 4)
    ss.save({**_state(), "split": ss.Sharded(whole[rank * 3:rank * 3 + 3].clone(), whole.shape, (rank * 3, 0)),
             "flat": ss.Sharded(whole.reshape(-1)[rank * 12:rank * 12 + 12].clone(), whole.shape,
                                flat_offset=rank * 12)}, path)


def test_tensors_of_several_pieces_stay_objects_beside_the_table(tmp_path):
    from dist_utils import run_ranks

    run_ranks(2, _save_split, str(tmp_path / "c"))
    doc = _doc(tmp_path / "c")
    assert doc["version"] == 3 and set(doc["tensors"]) == {"split", "flat"}
    assert set(doc["table"]["name"]) == set(_state())
    target = {**{k: torch.zeros_like(v) for k, v in _state().items()}, "split": torch.zeros(6, 4),
              "flat": torch.zeros(6, 4)}
    ss.load(target, tmp_path / "c")
    assert all(torch.equal(target[k], v) for k, v in _state().items())
    assert torch.equal(target["split"], torch.arange(24.0).reshape(6, 4))
    assert torch.equal(target["flat"], torch.arange(24.0).reshape(6, 4))


def test_a_table_with_another_entry_of_its_name_is_refused(tmp_path):
    ss.save(_state(), tmp_path / "c")
    doc = _doc(tmp_path / "c")
    doc["tensors"]["t001"] = _as_objects(doc)["tensors"]["t001"]
    _sign(tmp_path / "c", doc)
    with pytest.raises(ManifestError, match="two entries of tensor 't001'"):
        ss.open(tmp_path / "c")
    doc = _doc(tmp_path / "c")
    del doc["tensors"]["t001"]
    doc["objects"]["t002"] = {"json": 1}
    _sign(tmp_path / "c", doc)
    with pytest.raises(ManifestError, match="'t002' both as a tensor and as an object"):
        ss.open(tmp_path / "c")


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("offset"), "columns .* are not the table's"),
    (lambda t: t.update(extra=[]), "columns .* are not the table's"),
    (lambda t: t["file"].pop(), "all of one length"),
    (lambda t: t.update(shape={}), "must be a list"),
    (lambda t: t["name"].__setitem__(3, 3), "names must be strings"),
    (lambda t: t["name"].__setitem__(3, t["name"][2]), "has two rows"),
])
def test_a_malformed_table_is_refused(tmp_path, change, message):
    ss.save(_state(), tmp_path / "c")
    doc = _doc(tmp_path / "c")
    change(doc["table"])
    _sign(tmp_path / "c", doc)
    with pytest.raises(ManifestError, match=f"malformed field 'table' .*{message}"):
        ss.open(tmp_path / "c")


ROW = 5  # the row the cases below change: tensor t005, float32 [6, 3] (72 bytes)


@pytest.mark.parametrize("column, value, message", [
    ("dtype", "float128", "unknown dtype 'float128'"),
    ("dtype", ["float32"], "unknown dtype"),
    ("shape", [6, -3], "malformed field 'shape'"),
    ("shape", [6, 3.0], "malformed field 'shape'"),
    ("shape", [1 << 62, 1 << 62], "too large for a tensor"),
    ("shape", "6x3", "malformed field 'shape'"),
    ("file", 7, "file index outside the file table"),
    ("file", True, "column 'file'"),
    ("file", -1, "file index outside the file table"),
    ("offset", 1 << 40, "beyond the recorded size"),
    ("offset", 1 << 64, "column 'offset'"),
    ("offset", 8.0, "column 'offset'"),
    ("checksum", -1, "malformed field 'checksum'"),
    ("checksum", 1 << 64, "malformed field 'checksum'"),
    ("checksum", [1, 2], "wrong number of checksums"),
    ("checksum", [], "wrong number of checksums"),
    ("checksum", "7", "malformed field 'checksum'"),
])
def test_a_bad_value_in_a_row_is_refused_naming_its_tensor(tmp_path, column, value, message):
    ss.save(_state(), tmp_path / "c")
    doc = _doc(tmp_path / "c")
    row = doc["table"]["name"].index(f"t{ROW:03d}")
    doc["table"][column][row] = value
    _sign(tmp_path / "c", doc)
    with pytest.raises(ManifestError, match=f"tensor 't{ROW:03d}'.*{message}"):
        ss.open(tmp_path / "c")


def test_a_changed_checksum_in_a_row_is_damage_named_at_load(tmp_path):
    state = _state()
    ss.save(state, tmp_path / "c")
    doc = _doc(tmp_path / "c")
    row = doc["table"]["name"].index("t004")
    doc["table"]["checksum"][row] ^= 1
    _sign(tmp_path / "c", doc)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch .*tensor 't004'"):
        ss.load({k: torch.zeros_like(v) for k, v in state.items()}, tmp_path / "c")


def _outcome(raw: bytes):
    """What a parse of ``raw`` gives: its entries, or the kind of error it raised."""
    try:
        return Manifest.from_bytes(raw)
    except ManifestError as exc:
        return type(exc)


def test_mutated_tables_read_as_the_same_entries_written_as_objects(tmp_path):
    """Each value of a table changed at random: the table and the same entries written as JSON
    objects (read by the general reader) are both refused, or both read alike."""
    ss.save(_state(), tmp_path / "c", block_bytes=BLOCK)
    doc = _doc(tmp_path / "c")
    doc.pop("manifest_xxh3")
    rng = random.Random(0)
    values = [-1, 0, 1, 3, 7, 72, 4096, 1 << 31, 1 << 62, 1 << 63, 1 << 64, True, None, 2.0, "3", [], [1], [[1]],
              [0, 3], [6, 3], [3, 6], "float32", "int64", "bool", "float128"]
    refused = read = 0
    for _ in range(300):
        mutated = json.loads(json.dumps(doc))
        for _ in range(rng.choice((1, 1, 2))):
            column = rng.choice(COLUMNS[1:])
            mutated["table"][column][rng.randrange(len(mutated["table"]["name"]))] = rng.choice(values)
        as_table = _outcome(json.dumps(mutated, separators=(",", ":")).encode())
        as_objects = _outcome(json.dumps(_as_objects_lenient(mutated), separators=(",", ":")).encode())
        if isinstance(as_table, Manifest):
            assert isinstance(as_objects, Manifest), mutated
            _equal_entries(as_table, as_objects)
            read += 1
        else:
            assert as_objects is as_table, mutated
            refused += 1
    assert refused > 200 and read > 10  # both ways taken


def _as_objects_lenient(doc: dict) -> dict:
    """``_as_objects`` of a table whose values may be anything: the byte count of a row whose
    shape or dtype the general reader refuses does not matter (it refuses them first)."""
    doc = json.loads(json.dumps(doc))
    table = doc.pop("table")
    for name, dtype, shape, file, offset, checksum in zip(*(table[c] for c in COLUMNS)):
        try:
            itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            nbytes = int(np.prod(shape, dtype=object)) * itemsize
            start = [0] * len(shape)
        except (TypeError, AttributeError, ValueError, OverflowError):
            nbytes, start = 0, []
        doc["tensors"][name] = {"dtype": dtype, "shape": shape, "layout": "box", "file": [file], "offset": [offset],
                                "nbytes": [nbytes], "start": [start], "size": [shape], "checksum": [checksum]}
    doc["version"] = 1
    return doc
