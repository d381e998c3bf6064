"""The tables of a version 3 or 4 manifest (format/table.py): tensors stored whole in one piece,
or in a few, written column by column. Round trips, the fallback to version 1 for a few tensors,
old manifests (version 3's nested ``pieces``), and tables a hostile writer made: each must be
refused by name, exactly as the same entries written as JSON objects are, or read as they are."""
from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import random
import warnings

import numpy as np
import pytest
import torch
import xxhash

import statesnap as ss
from statesnap.errors import CorruptCheckpointError, ManifestError
from statesnap.format.manifest import MANIFEST_NAME, Manifest
from statesnap.format.table import COLUMNS, FLAT_PIECES, PIECES, TABLE_MIN_TENSORS, WHOLE

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


SPLIT_COUNT = 3 * TABLE_MIN_TENSORS  # enough for both tables


def _split_state(rank: int, world: int) -> dict:
    """Every other tensor of ``_state`` of two or more dimensions split in row blocks over the
    ranks, the others replicated."""
    out = {}
    for i, (name, value) in enumerate(_state(count=SPLIT_COUNT).items()):
        if i % 2 == 0 and value.ndim >= 2 and value.shape[0] >= world:
            rows = value.shape[0] // world
            part = value[rank * rows:(rank + 1) * rows if rank < world - 1 else None]
            out[name] = ss.Sharded(part.clone(), value.shape, (rank * rows,) + (0,) * (value.ndim - 1))
        else:
            out[name] = value
    return out


def _save_many_split(rank: int, world: int, path: str) -> None:
    ss.save(_split_state(rank, world), path, block_bytes=BLOCK)


@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory):
    """A checkpoint of 2 gloo ranks: tensors of two pieces in ``pieces``, the others in ``table``."""
    from dist_utils import run_ranks

    path = tmp_path_factory.mktemp("split") / "c"
    run_ranks(2, _save_many_split, str(path))
    return path


def test_tensors_of_a_few_pieces_are_written_as_a_table_of_pieces(split_checkpoint, tmp_path):
    doc = _doc(split_checkpoint)
    assert doc["version"] == 4 and doc["tensors"] == {}
    assert len(doc["pieces"]["name"]) >= TABLE_MIN_TENSORS and len(doc["table"]["name"]) >= TABLE_MIN_TENSORS
    assert set(doc["pieces"]["pieces"]) == {2} and len(doc["pieces"]["file"]) == 2 * len(doc["pieces"]["name"])
    full = _state(count=SPLIT_COUNT)
    target = {k: torch.full_like(v, 7) for k, v in full.items()}
    ss.load(target, split_checkpoint)
    for name, value in full.items():
        assert torch.equal(target[name].view(-1).view(torch.uint8), value.view(-1).view(torch.uint8)), name
    objects = tmp_path / "objects"
    objects.mkdir()
    for name in doc["files"]:
        (objects / name).symlink_to(split_checkpoint / name)
    _sign(objects, _as_objects(doc))
    _equal_entries(ss.open(split_checkpoint).manifest, ss.open(objects).manifest)
    _sign(objects, _as_version3(doc))  # as an older statesnap wrote it: loads alike
    _equal_entries(ss.open(split_checkpoint).manifest, ss.open(objects).manifest)
    target = {k: torch.full_like(v, 7) for k, v in full.items()}
    ss.load(target, objects)
    assert all(torch.equal(target[k], v) for k, v in full.items())


def _as_version3(doc: dict) -> dict:
    """The same manifest as version 3 wrote it: in each column of ``pieces`` but name, dtype and
    shape, a list of the row's pieces' values (a box, a list of its dimensions)."""
    doc = json.loads(json.dumps(doc))
    flat, nested = doc["pieces"], {column: [] for column in COLUMNS[PIECES]}
    counts, shapes = flat["pieces"], flat["shape"]
    assert all(type(n) is int and n >= 0 for n in counts) and all(type(s) is list for s in shapes)
    assert sum(counts) == len(flat["file"]) == len(flat["offset"]) == len(flat["checksum"])
    assert sum(n * len(s) for n, s in zip(counts, shapes)) == len(flat["start"]) == len(flat["size"])
    piece = coordinate = 0
    for name, dtype, shape, count in zip(*(flat[c] for c in ("name", "dtype", "shape", "pieces"))):
        dims = len(shape)
        for column, value in (("name", name), ("dtype", dtype), ("shape", shape)):
            nested[column].append(value)
        for column in ("file", "offset", "checksum"):
            nested[column].append(flat[column][piece:piece + count])
        for column in ("start", "size"):
            nested[column].append([flat[column][coordinate + i * dims:coordinate + (i + 1) * dims]
                                   for i in range(count)])
        piece, coordinate = piece + count, coordinate + count * dims
    doc["pieces"], doc["version"] = nested, 3
    return doc


def test_a_tensor_in_both_tables_is_refused(split_checkpoint, tmp_path):
    doc = _doc(split_checkpoint)
    doc["table"] = {c: v + [doc["pieces"][c][0] if c in ("name", "dtype", "shape") else 0]
                    for c, v in doc["table"].items()}
    (tmp_path / "c").mkdir()
    _sign(tmp_path / "c", doc)
    with pytest.raises(ManifestError, match="two entries of tensor .*one in 'table', one in 'pieces'"):
        Manifest.from_bytes((tmp_path / "c" / MANIFEST_NAME).read_bytes())


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
    (lambda t: t["file"].pop(), "must all be of one length"),
    (lambda t: t.update(shape={}), "column 'shape' is not a list"),
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


@pytest.mark.parametrize("shape", [[1 << 62] * 20, [1 << 62] * 20 + [0]])
def test_a_shape_past_floats_is_refused_without_a_warning(tmp_path, shape):
    """The table's first check of a shape multiplies in float64: one past its range is inf (nan
    with a zero extent), which numpy warns of; a warning made an error (``-W error``) is raised
    instead of the ManifestError, and otherwise printed for every such manifest read."""
    ss.save(_state(), tmp_path / "c")
    doc = _doc(tmp_path / "c")
    doc["table"]["shape"][doc["table"]["name"].index(f"t{ROW:03d}")] = shape
    _sign(tmp_path / "c", doc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ManifestError, match=f"tensor 't{ROW:03d}'.*too large for a tensor"):
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


VALUES = [-1, 0, 1, 2, 3, 7, 72, 4096, 1 << 31, 1 << 62, 1 << 63, 1 << 64, True, None, 2.0, "3", [], [1], [[1]],
          [0, 3], [6, 3], [3, 6], [0, 1], [[0, 0], [3, 0]], [[3, 3], [3, 3]], [[1], [2]], [1, [2]], "float32",
          "int64", "bool", "float128"]


def test_mutated_tables_read_as_the_same_entries_written_as_objects(tmp_path, split_checkpoint):
    """Each value of a table changed at random (a value, or one piece's): the tables and the same
    entries written as JSON objects (read by the general reader) are both refused, or both read
    alike. A flat table of pieces (version 4) whose counts no longer add up is refused."""
    ss.save(_state(), tmp_path / "c", block_bytes=BLOCK)
    _mutate_and_compare(_doc(tmp_path / "c"), WHOLE, random.Random(0))
    _mutate_and_compare(_as_version3(_doc(split_checkpoint)), PIECES, random.Random(1))
    _mutate_and_compare(_doc(split_checkpoint), PIECES, random.Random(2), FLAT_PIECES)


def _mutate_and_compare(doc: dict, member: str, rng: random.Random, columns=None) -> None:
    doc.pop("manifest_xxh3")
    refused = read = unaligned = 0
    for _ in range(300):
        mutated = json.loads(json.dumps(doc))
        for _ in range(rng.choice((1, 1, 2))):
            column = mutated[member][rng.choice((columns or COLUMNS[member])[1:])]
            row = rng.randrange(len(column))
            if isinstance(column[row], list) and column[row] and rng.random() < 0.5:  # one piece's value
                column[row][rng.randrange(len(column[row]))] = rng.choice(VALUES)
            else:
                column[row] = rng.choice(VALUES)
        as_table = _outcome(json.dumps(mutated, separators=(",", ":")).encode())
        if columns is not None:
            try:
                mutated = _as_version3(mutated)
            except AssertionError:  # (a count, or a shape's length, no longer adds up)
                assert as_table is ManifestError, mutated
                unaligned += 1
                continue
        as_objects = _outcome(json.dumps(_as_objects(mutated), separators=(",", ":")).encode())
        if isinstance(as_table, Manifest):
            assert isinstance(as_objects, Manifest), mutated
            _equal_entries(as_table, as_objects)
            read += 1
        else:
            assert as_objects is as_table, mutated
            refused += 1
    assert refused > 150 and read > 10 and unaligned < 100  # each way taken


def _as_objects(doc: dict) -> dict:
    """The same manifest with its tables written as JSON objects (version 1), as docs/format.md §3
    says each row stands for one. The values of a row may be anything: the byte count of a piece
    whose box or dtype the general reader refuses does not matter (it refuses them first)."""
    doc = _as_version3(doc) if doc["version"] == 4 else json.loads(json.dumps(doc))
    for member in (WHOLE, PIECES):
        table = doc.pop(member, None)
        for row in zip(*(table[c] for c in COLUMNS[member])) if table else ():
            if member == WHOLE:
                name, dtype, shape, file, offset, checksum = row
                file, offset, start, size, checksum = [file], [offset], None, [shape], [checksum]
            else:
                name, dtype, shape, file, offset, start, size, checksum = row
            try:
                itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
                nbytes = [int(np.prod(box, dtype=object)) * itemsize for box in size]
                start = [[0] * len(shape)] if start is None else start
            except (TypeError, AttributeError, ValueError, OverflowError):
                nbytes, start = [0] * (len(file) if isinstance(file, list) else 1), [[]] if start is None else start
            doc["tensors"][name] = {"dtype": dtype, "shape": shape, "layout": "box", "file": file, "offset": offset,
                                    "nbytes": nbytes, "start": start, "size": size, "checksum": checksum}
    doc["version"] = 1
    return doc


def test_a_row_of_more_pieces_than_ranks_is_refused_as_its_entry_is(split_checkpoint, tmp_path):
    """The pieces of a row are capped by the world size as those of an entry are: a small row
    claiming many pieces is no allocation of pairs of them all."""
    (tmp_path / "c").mkdir()
    for doc in (_doc(split_checkpoint), _as_version3(_doc(split_checkpoint))):
        doc["world_size"] = 1
        _sign(tmp_path / "c", doc)
        with pytest.raises(ManifestError, match="has 2 pieces, more than the 1 ranks"):
            Manifest.from_bytes((tmp_path / "c" / MANIFEST_NAME).read_bytes())
    doc = _as_version3(_doc(split_checkpoint))
    doc["world_size"] = 1 << 20
    row = 0
    count = 20_000  # one-element pieces of a [20000] tensor: valid, read by the general reader
    doc["pieces"]["shape"][row], doc["pieces"]["dtype"][row] = [count], "uint8"
    doc["file_sizes"][0] += count
    doc["pieces"]["file"][row] = [0] * count
    doc["pieces"]["offset"][row] = [doc["file_sizes"][0] - count + i for i in range(count)]
    doc["pieces"]["start"][row] = [[i] for i in range(count)]
    doc["pieces"]["size"][row] = [[1]] * count
    doc["pieces"]["checksum"][row] = [0] * count
    _sign(tmp_path / "c", doc)
    entry = Manifest.from_bytes((tmp_path / "c" / MANIFEST_NAME).read_bytes()).tensors[doc["pieces"]["name"][row]]
    assert entry.num_pieces == count


@pytest.mark.parametrize("cell", [{"packed": "i8", "shape": [2], "data": "AAAAAAAAAAABAAAAAAAAAA=="}, 0])
def test_a_row_of_pieces_holds_lists_only(split_checkpoint, tmp_path, cell):
    doc = _as_version3(_doc(split_checkpoint))
    doc["pieces"]["file"][0] = cell
    (tmp_path / "c").mkdir()
    _sign(tmp_path / "c", doc)
    with pytest.raises(ManifestError, match="malformed field 'pieces' .*a list of its pieces' values"):
        Manifest.from_bytes((tmp_path / "c" / MANIFEST_NAME).read_bytes())


@pytest.mark.parametrize("version", [3, 4])
def test_a_negative_checksum_in_a_row_of_pieces_is_refused_by_name(split_checkpoint, tmp_path, version):
    doc = _doc(split_checkpoint)
    if version == 3:
        doc = _as_version3(doc)
        doc["pieces"]["checksum"][0][1] = -1
    else:
        doc["pieces"]["checksum"][1] = -1  # (the second piece of the first row)
    (tmp_path / "c").mkdir()
    _sign(tmp_path / "c", doc)
    with pytest.raises(ManifestError, match=f"tensor '{doc['pieces']['name'][0]}'.*'checksum'"):
        Manifest.from_bytes((tmp_path / "c" / MANIFEST_NAME).read_bytes())


def test_a_piece_counted_in_the_next_row_is_refused_naming_the_tensor(split_checkpoint, tmp_path):
    """Counts that still add up but give a piece of one row to the next: the first tensor's
    pieces no longer cover it, and it is named."""
    doc = _doc(split_checkpoint)
    shapes = doc["pieces"]["shape"]
    row = next(i for i in range(len(shapes) - 1) if len(shapes[i]) == len(shapes[i + 1]))
    doc["pieces"]["pieces"][row] -= 1
    doc["pieces"]["pieces"][row + 1] += 1
    (tmp_path / "c").mkdir()
    _sign(tmp_path / "c", doc)
    with pytest.raises(ManifestError, match=f"tensor '{doc['pieces']['name'][row]}'"):
        Manifest.from_bytes((tmp_path / "c" / MANIFEST_NAME).read_bytes())


@pytest.mark.parametrize("change, message", [
    (lambda t: t["pieces"].__setitem__(3, 3), "rows count .* pieces, but its columns 'file', 'offset' and 'checksum'"),
    (lambda t: t["pieces"].__setitem__(3, 1 << 62), "rows count .* pieces"),
    (lambda t: t["file"].pop(), "rows count .* pieces, but .* hold"),
    (lambda t: t["checksum"].append(0), "rows count .* pieces, but .* hold"),
    (lambda t: t["start"].pop(), "dimensions in all, but its columns 'start' and 'size'"),
    (lambda t: t["shape"][3].append(1), "dimensions in all"),
    (lambda t: t["pieces"].__setitem__(3, -1), "tensor '.*' needs a count of pieces"),
    (lambda t: t["pieces"].__setitem__(3, True), "tensor '.*' needs a count of pieces"),
    (lambda t: t["pieces"].__setitem__(3, [2]), "tensor '.*' needs a count of pieces"),
    (lambda t: t["shape"].__setitem__(3, "6x3"), "tensor '.*' needs a count of pieces .* and a shape"),
    (lambda t: t["pieces"].pop(), "columns of one value per row must all be of one length"),
    (lambda t: t.update(pieces={}), "column 'pieces' is not a list"),
    (lambda t: t.pop("pieces"), "columns .* are not the table's"),
])
def test_a_flat_table_of_pieces_that_does_not_add_up_is_refused(split_checkpoint, tmp_path, change, message):
    """In version 4 a row's pieces are told from the next row's by the counts alone: where they
    do not add up to the columns, no entry can be read, and the table is refused."""
    doc = _doc(split_checkpoint)
    change(doc["pieces"])
    (tmp_path / "c").mkdir()
    _sign(tmp_path / "c", doc)
    with pytest.raises(ManifestError, match=f"malformed field 'pieces' .*{message}"):
        Manifest.from_bytes((tmp_path / "c" / MANIFEST_NAME).read_bytes())


def _save_column_split(rank: int, world: int, path: str) -> None:
    """Tensors of two dimensions split in column blocks, and of one in ranges, over the ranks."""
    state = {}
    for i in range(TABLE_MIN_TENSORS + 4):
        value = torch.arange(24.0 + i).reshape(-1) if i % 2 else torch.arange(4.0 * (6 + i)).reshape(4, 6 + i)
        cut = value.shape[-1] // world
        part = value[..., rank * cut:(rank + 1) * cut if rank < world - 1 else None]
        state[f"c{i:03d}"] = ss.Sharded(part.clone(), value.shape, (0,) * (value.ndim - 1) + (rank * cut,))
    ss.save(state, path, block_bytes=BLOCK)


def _alone(entry):
    """``entry`` with its arrays of its own, as the general reader makes it."""
    from statesnap.format.manifest import TensorEntry

    return TensorEntry(entry.dtype, entry.shape, entry.layout, *(getattr(entry, c) for c in (
        "file", "offset", "nbytes", "start", "size", "checksum", "checksum_bounds")))


def test_entries_read_in_rows_plan_as_entries_read_alone(split_checkpoint, tmp_path):
    """Entries read all together keep their arrays as rows of their group's columns. What a load
    plans from those columns (where each piece lies, its checksum, where it lands in a whole
    target, whether the tensor is one whole piece) is what it plans from each entry's own arrays,
    for whole tensors, pieces of whole rows and pieces of columns, in any order of the entries."""
    from dist_utils import run_ranks
    from statesnap.engine.whole_pieces import _pieces_of, _pieces_one_by_one
    from statesnap.plan.load_plan import piece_offsets

    run_ranks(2, _save_column_split, str(tmp_path / "cols"))
    for path in (split_checkpoint, tmp_path / "cols"):
        entries = list(ss.open(path).manifest.tensors.values())
        assert all(entry.rows is not None for entry in entries)
        random.Random(0).shuffle(entries)
        for got, want in zip(_pieces_of(entries), _pieces_one_by_one([_alone(e) for e in entries])):
            assert got.tolist() == want.tolist()
        # a copy, or an entry given an array, plans from its own arrays, not its group's columns
        moved = dataclasses.replace(entries[0], offset=entries[0].offset + 64)
        assert moved.rows is None and (_pieces_of([moved])[4] == entries[0].offset + 64).all()
        narrowed = copy.copy(entries[1])
        narrowed.size = narrowed.size * 0
        assert narrowed.group is None and not narrowed.whole_in_one_piece
        fresh = next(iter(ss.open(path).manifest.tensors.values()))  # (none of its arrays made yet)
        pieces = len(fresh.group.file[fresh.row])
        fresh.offset = np.full(pieces, 7)
        assert fresh.group is None and fresh.offset.tolist() == [7] * pieces and len(fresh.file) == pieces
        assert len(pickle.dumps(fresh)) < 2000  # (its own arrays, not its group's)
        for entry in entries:
            alone = _alone(entry)
            assert entry.whole_in_one_piece == alone.whole_in_one_piece
            origin = (0,) * len(entry.shape)
            for start, size in ((origin, entry.shape), (origin, (1,) * len(entry.shape))):
                assert piece_offsets(entry, "box", start, size) == piece_offsets(alone, "box", start, size)
    columns = ss.open(tmp_path / "cols").manifest.tensors.values()
    apart = [piece_offsets(e, "box", (0,) * len(e.shape), e.shape) for e in columns]
    assert None in apart and [0, 48] in apart  # columns are planned; a range of 1-D: each half at its place
    target = {name: torch.zeros(shape) for name, shape in
              ((n, e.shape) for n, e in ss.open(tmp_path / "cols").manifest.tensors.items())}
    ss.load(target, tmp_path / "cols")
    for i in range(TABLE_MIN_TENSORS + 4):
        value = torch.arange(24.0 + i).reshape(-1) if i % 2 else torch.arange(4.0 * (6 + i)).reshape(4, 6 + i)
        assert torch.equal(target[f"c{i:03d}"], value)


def _signed(doc: dict) -> bytes:
    body = json.dumps(doc, separators=(",", ":")).encode()
    return b'%s,"manifest_xxh3":%d}' % (body[:-1], xxhash.xxh3_64_intdigest(body))


def _pieces_doc(pieces: dict, world_size: int, file_sizes: list[int]) -> dict:
    return {"format": "statesnap", "version": 4, "world_size": world_size, "block_bytes": 1 << 24, "meta": {},
            "files": [f"r{i}.bin" for i in range(len(file_sizes))], "file_sizes": file_sizes, "tensors": {},
            "pieces": pieces, "objects": {}}


def test_rows_of_a_0d_tensor_in_a_flat_table_read_as_in_version_3():
    """A 0-d tensor's pieces have no values in ``start`` and ``size``. Rows read one by one (here
    because one row has more pieces than the table's fast path takes) read as version 3's, and
    a 0-d tensor of two pieces is refused by name."""
    valid = {"name": ["s", "v"], "dtype": ["float32"] * 2, "shape": [[], [9]], "pieces": [1, 9], "file": [0] * 10,
             "offset": list(range(0, 40, 4)), "start": list(range(9)), "size": [1] * 9,
             "checksum": [xxhash.xxh3_64_intdigest(b"\0" * 4)] * 10}
    for doc in (_pieces_doc(valid, 16, [40]), _as_version3(_pieces_doc(valid, 16, [40]))):
        manifest = Manifest.from_bytes(_signed(doc))
        assert (manifest.tensors["s"].shape, manifest.tensors["v"].shape) == ((), (9,))
        assert manifest.tensors["v"].offset.tolist() == list(range(4, 40, 4))
    two = {"name": ["s"], "dtype": ["float32"], "shape": [[]], "pieces": [2], "file": [0, 1], "offset": [0, 0],
           "start": [], "size": [], "checksum": [0, 0]}
    for doc in (_pieces_doc(two, 2, [16, 16]), _as_version3(_pieces_doc(two, 2, [16, 16]))):
        with pytest.raises(ManifestError, match="tensor 's'"):
            Manifest.from_bytes(_signed(doc))


def test_a_flat_row_of_many_pieces_is_read_by_the_general_reader(split_checkpoint, tmp_path):
    """A row of more pieces than the fast path takes (and than a writer writes) that keeps the
    rules reads, its pieces in place, in version 4 as in version 3."""
    doc = _doc(split_checkpoint)
    doc["world_size"] = 1 << 20
    count, row = 20_000, 0
    table = doc["pieces"]
    doc["file_sizes"][0] += count
    piece_values = {"file": [0] * count, "offset": [doc["file_sizes"][0] - count + i for i in range(count)],
                    "checksum": [0] * count, "start": list(range(count)), "size": [1] * count}
    for column, values in piece_values.items():  # (the first row's values come first)
        table[column][:table["pieces"][row] * (len(table["shape"][row]) if column in ("start", "size") else 1)] = values
    table["shape"][row], table["dtype"][row], table["pieces"][row] = [count], "uint8", count
    (tmp_path / "c").mkdir()
    _sign(tmp_path / "c", doc)
    entry = Manifest.from_bytes((tmp_path / "c" / MANIFEST_NAME).read_bytes()).tensors[table["name"][row]]
    assert entry.num_pieces == count and entry.offset.tolist() == piece_values["offset"]
