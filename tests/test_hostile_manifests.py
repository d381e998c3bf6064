"""Manifests a hostile (or thoroughly unlucky) writer made: every check passes that a writer can
recompute, so the self-checksum holds, and what the fields claim must still never size an
allocation, overflow a computation, take time out of proportion to the manifest, or escape as
anything but a CheckpointError. Found by an audit that fuzzed every field."""
from __future__ import annotations

import base64
import importlib
import json
import re
import zlib

import pytest
import torch
import xxhash

import statesnap as ss
from statesnap.errors import CorruptCheckpointError, ManifestError, NewerFormatError
from statesnap.format.manifest import MANIFEST_NAME

save_module = importlib.import_module("statesnap.engine.save")
HUGE = 1 << 50  # a petabyte: what no test machine can allocate


def _checkpoint(path) -> dict:
    state = {"w": torch.arange(12.0).reshape(3, 4)}
    ss.save(state, path)
    return {"w": torch.zeros(3, 4)}


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "c"


def _rewrite(path, change) -> None:
    """Edit the manifest and sign it again, as a writer can."""
    doc = json.loads((path / MANIFEST_NAME).read_bytes())
    doc.pop("manifest_xxh3")
    change(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    (path / MANIFEST_NAME).write_bytes(b'%s,"manifest_xxh3":%d}' % (body[:-1], xxhash.xxh3_64_intdigest(body)))


@pytest.mark.parametrize("bit, message", [
    (0x04, "fails its own checksum .* newer than this statesnap"),  # 1 -> 5: no version this reads
    (0x02, "fails its own checksum: its bytes hash"),  # 1 -> 3: a version this reads, read as one
])
def test_a_flipped_bit_in_the_version_is_damage_and_load_latest_falls_back(tmp_path, bit, message):
    """"version":1 -> "version":5 is one bit: not a newer format (its checksum fails), so a
    restart loads the step before instead of stopping with "upgrade statesnap"."""
    model = torch.nn.Linear(4, 3)
    ckpt = ss.Checkpointer(tmp_path, keep_last=2)
    for step in (1, 2):
        ckpt.save(step, {"model": model}).wait()
    ckpt.close()
    where = tmp_path / "step-2" / MANIFEST_NAME
    raw = where.read_bytes()
    version = raw.index(b'"version":') + len(b'"version":')
    where.write_bytes(raw[:version] + bytes([raw[version] | bit]) + raw[version + 1:])
    with pytest.raises(CorruptCheckpointError, match=message):
        ss.open(tmp_path / "step-2")
    with ss.Checkpointer(tmp_path) as restarted, pytest.warns(RuntimeWarning, match="step 2 could not be restored"):
        assert restarted.load_latest({"model": torch.nn.Linear(4, 3)}) == 1


def test_a_signed_newer_version_still_asks_for_an_upgrade(ckpt_dir):
    _checkpoint(ckpt_dir)
    _rewrite(ckpt_dir, lambda doc: doc.update(version=99))
    with pytest.raises(NewerFormatError, match="upgrade statesnap"):
        ss.open(ckpt_dir)


def test_a_pickle_reference_past_the_real_file_allocates_nothing(ckpt_dir):
    _checkpoint(ckpt_dir)

    def claim(doc):
        doc["file_sizes"][0] = HUGE + 4096
        doc["objects"]["blob"] = {"pickle": [0, 0, HUGE, 0]}
    _rewrite(ckpt_dir, claim)
    with pytest.raises(CorruptCheckpointError, match=r"object 'blob' in data-.*the file ends before"):
        ss.open(ckpt_dir).verify()
    with pytest.raises(CorruptCheckpointError, match="object 'blob'"):
        ss.load({"blob": None}, ckpt_dir, allow_pickle=True, partial=True)


def test_verify_sizes_no_buffer_by_a_made_up_block_or_piece(ckpt_dir):
    _checkpoint(ckpt_dir)

    def claim(doc):
        doc["block_bytes"] = 1 << 60
        doc["file_sizes"][0] = HUGE
        doc["tensors"]["big"] = {"dtype": "uint8", "shape": [HUGE], "layout": "box", "file": [0], "offset": [0],
                                 "nbytes": [HUGE], "start": [[0]], "size": [[HUGE]], "checksum": [0]}
    _rewrite(ckpt_dir, claim)
    with pytest.raises(CorruptCheckpointError, match="big in data-.*: file truncated before byte"):
        ss.open(ckpt_dir).verify()
    with pytest.raises(ss.CheckpointError, match="big: cannot allocate"):
        ss.open(ckpt_dir).read("big")


def test_empty_tensors_with_large_extents_round_trip(ckpt_dir):
    """Shapes torch makes (strides within 64 bits) are not refused for holding no bytes."""
    state = {"a": torch.empty((0, 1 << 31, 1 << 31)), "b": torch.empty((1 << 40, 0, 1 << 40), dtype=torch.uint8)}
    ss.save(state, ckpt_dir)
    target = {"a": torch.empty((0, 1 << 31, 1 << 31)), "b": torch.empty((1 << 40, 0, 1 << 40), dtype=torch.uint8)}
    ss.load(target, ckpt_dir)
    assert target["a"].shape == state["a"].shape and target["b"].shape == state["b"].shape


def test_an_unsigned_edit_of_the_version_still_asks_for_an_upgrade(ckpt_dir):
    """Only a manifest that passes its checksum once a version of ours is put back is damage: a
    newer format might checksum itself otherwise (here: the checksum field moved)."""
    _checkpoint(ckpt_dir)
    doc = json.loads((ckpt_dir / MANIFEST_NAME).read_bytes())
    doc["version"] = 7
    (ckpt_dir / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(NewerFormatError, match="upgrade statesnap"):
        ss.open(ckpt_dir)


@pytest.mark.parametrize("shape", [[0, 1 << 62, 1 << 62], [1] * 80_000 + [1 << 62, 4]])
def test_shapes_no_tensor_can_have_are_refused_briefly(ckpt_dir, shape):
    """An empty shape whose strides overflow, and one of 80,000 dimensions (its product used to
    be computed on ever larger integers, for seconds): refused, in a message of sensible length."""
    _checkpoint(ckpt_dir)
    _rewrite(ckpt_dir, lambda doc: doc["tensors"]["w"].update(shape=shape, size=[shape]))
    with pytest.raises(ManifestError, match="'w' has malformed field 'shape'.* too large for a tensor") as caught:
        ss.open(ckpt_dir)
    assert len(str(caught.value)) < 500


def test_an_integer_literal_longer_than_python_converts_is_a_manifest_error(ckpt_dir):
    target = _checkpoint(ckpt_dir)
    raw = (ckpt_dir / MANIFEST_NAME).read_bytes()
    (ckpt_dir / MANIFEST_NAME).write_bytes(raw.replace(b'"world_size":1', b'"world_size":' + b"9" * 5000))
    with pytest.raises(ManifestError, match="is not valid JSON"):
        ss.load(target, ckpt_dir)


def _split_checkpoint(path, monkeypatch) -> dict:
    monkeypatch.setattr(save_module, "SPLIT_MIN_RANKS", 1)  # the split manifest of a large job
    target = _checkpoint(path)
    assert json.loads((path / MANIFEST_NAME).read_bytes())["version"] == 2
    return target


def test_a_packed_value_that_inflates_to_absurd_nesting_is_a_manifest_error(ckpt_dir, monkeypatch):
    target = _split_checkpoint(ckpt_dir, monkeypatch)
    bomb = base64.b64encode(zlib.compress(b"[" * 20_000 + b"]" * 20_000, 9)).decode()
    _rewrite(ckpt_dir, lambda doc: doc.update(tensors={"zjson": bomb}, meta={"pad": "x" * 3000}))
    for attempt in (lambda: ss.open(ckpt_dir), lambda: ss.load(target, ckpt_dir)):
        with pytest.raises(ManifestError, match="malformed field 'tensors'.*recursion"):
            attempt()


def test_a_split_row_no_tensor_can_have_is_refused(ckpt_dir, monkeypatch):
    target = _split_checkpoint(ckpt_dir, monkeypatch)

    def claim(doc):
        rows = json.loads(zlib.decompress(base64.b64decode(doc["tensors"]["zjson"]))) \
            if isinstance(doc["tensors"], dict) else doc["tensors"]
        rows[0][2] = [1 << 62, 4]
        doc["tensors"] = rows
    _rewrite(ckpt_dir, claim)
    with pytest.raises(ManifestError, match="too large for a tensor"):
        ss.load(target, ckpt_dir)


def test_a_file_table_naming_one_file_twice_is_refused(ckpt_dir):
    _checkpoint(ckpt_dir)

    def twice(doc):
        doc["files"].append(doc["files"][0])
        doc["file_sizes"].append(1_000_000)
    _rewrite(ckpt_dir, twice)
    with pytest.raises(ManifestError, match="malformed field 'files'.*named twice"):
        ss.open(ckpt_dir)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinity_literals_are_a_manifest_error_naming_it(ckpt_dir, value):
    """Python's json reads NaN, Infinity and -Infinity, which RFC 8259 (and so every other
    reader) refuses; statesnap writes none (plain data tags non-finite floats), and one read
    would make `statesnap inspect --json` print what JSON parsers refuse."""
    target = _checkpoint(ckpt_dir)
    _rewrite(ckpt_dir, lambda doc: doc.update(meta={"loss": value}))  # json.dumps writes the literal
    literal = json.dumps(value)
    assert literal.encode() in (ckpt_dir / MANIFEST_NAME).read_bytes()
    where = re.escape(str(ckpt_dir / MANIFEST_NAME))
    for attempt in (lambda: ss.open(ckpt_dir), lambda: ss.load(target, ckpt_dir)):
        with pytest.raises(ManifestError, match=f"^{where} is not valid JSON \\({literal} is not a JSON value"):
            attempt()


def test_a_number_past_the_largest_float_is_a_manifest_error(ckpt_dir):
    """1e999 is JSON, but Python reads it as inf: as good as an Infinity literal."""
    _checkpoint(ckpt_dir)
    _rewrite(ckpt_dir, lambda doc: doc.update(meta={"lr": 0.25}))
    raw = (ckpt_dir / MANIFEST_NAME).read_bytes()
    (ckpt_dir / MANIFEST_NAME).write_bytes(raw.replace(b'"lr":0.25', b'"lr":1e999'))
    with pytest.raises(ManifestError, match="is not valid JSON .*1e999 is past the largest 64-bit float"):
        ss.open(ckpt_dir)


@pytest.mark.parametrize("where", ["meta", "top"])
def test_a_key_given_twice_is_a_manifest_error(ckpt_dir, where):
    """Which of two equal keys counts is up to each JSON parser: one file, two checkpoints."""
    target = _checkpoint(ckpt_dir)
    _rewrite(ckpt_dir, lambda doc: doc.update(meta={"note": "hi"}))
    raw = (ckpt_dir / MANIFEST_NAME).read_bytes()
    twice = b'"note":"hi","note":"evil"' if where == "meta" else b'"note":"hi"},"meta":{"note":"evil"'
    doc = raw.replace(b'"note":"hi"', twice)
    body = doc[:doc.rindex(b',"manifest_xxh3"')] + b"}"
    (ckpt_dir / MANIFEST_NAME).write_bytes(b'%s,"manifest_xxh3":%d}' % (body[:-1], xxhash.xxh3_64_intdigest(body)))
    key = "note" if where == "meta" else "meta"
    for attempt in (lambda: ss.open(ckpt_dir), lambda: ss.load(target, ckpt_dir)):
        with pytest.raises(ManifestError, match=f"is not valid JSON \\(the key '{key}' appears twice in one object"):
            attempt()


def test_a_packed_value_holding_nan_is_a_manifest_error(ckpt_dir, monkeypatch):
    target = _split_checkpoint(ckpt_dir, monkeypatch)
    packed = base64.b64encode(zlib.compress(b"[NaN, 1]")).decode()
    _rewrite(ckpt_dir, lambda doc: doc.update(file_sizes={"zjson": packed}))
    for attempt in (lambda: ss.open(ckpt_dir), lambda: ss.load(target, ckpt_dir)):
        with pytest.raises(ManifestError, match=f"^{re.escape(str(ckpt_dir / MANIFEST_NAME))} has malformed "
                                                "field 'file_sizes' .*NaN is not a JSON value"):
            attempt()


def test_a_packed_value_with_bytes_after_its_zlib_stream_is_a_manifest_error(ckpt_dir, monkeypatch):
    target = _split_checkpoint(ckpt_dir, monkeypatch)

    def append(doc):
        doc["file_sizes"] = {"zjson": base64.b64encode(zlib.compress(json.dumps(doc["file_sizes"]).encode())
                                                       + b"junk").decode()}
    _rewrite(ckpt_dir, append)
    for attempt in (lambda: ss.open(ckpt_dir), lambda: ss.load(target, ckpt_dir)):
        with pytest.raises(ManifestError, match="field 'file_sizes' .*4 bytes follow the end of the zlib stream"):
            attempt()


MEMORY_BOUND_LOADER = """
import resource, sys, torch, statesnap as ss
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # far below the manifest's 64 GiB
for call in (lambda: ss.open(sys.argv[1]), lambda: ss.load({"t": torch.zeros(3)}, sys.argv[1])):
    try:
        call()
        print("loaded")
    except ss.CheckpointError as exc:
        print(type(exc).__name__, exc)
"""


def test_a_manifest_larger_than_memory_is_a_manifest_error(tmp_path):
    """A manifest grown to gigabytes (a sparse file here) raised a bare MemoryError from ss.open,
    and ss.load failed "on rank 0:" with no reason at all."""
    import subprocess
    import sys
    ss.save({"t": torch.ones(3)}, tmp_path / "c")
    with open(tmp_path / "c" / MANIFEST_NAME, "r+b") as f:
        f.truncate(64 << 30)
    done = subprocess.run([sys.executable, "-c", MEMORY_BOUND_LOADER, str(tmp_path / "c")], capture_output=True,
                          text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 2, done.stderr[-2000:]
    assert all(re.fullmatch(r"ManifestError the manifest .*manifest\.json is too large to read into this "
                            r"process's memory", line) for line in lines), lines


def test_a_shape_edited_to_hold_no_elements_is_damage_not_an_empty_tensor(ckpt_dir):
    """Nothing is read for a tensor of no elements, so a shape edited to [0, 4] (with its box and
    byte count, and the manifest signed again) loaded the tensor empty without a word; the
    checksum of its piece is still that of the 48 bytes written."""
    _checkpoint(ckpt_dir)

    def empty(doc):
        entry = doc["tensors"]["w"]
        entry.update(shape=[0, 4], size=[[0, 4]], nbytes=[0])
    _rewrite(ckpt_dir, empty)
    says = r"tensor 'w', piece 0, bytes \[\d+, \d+\) are damaged"
    with pytest.raises(CorruptCheckpointError, match=says):
        ss.open(ckpt_dir).read("w")
    with pytest.raises(CorruptCheckpointError, match=says):
        ss.load({"w": torch.zeros(0, 4)}, ckpt_dir)
    with pytest.raises(CorruptCheckpointError, match="w in data-"):
        ss.open(ckpt_dir).verify()
    ss.save({"w": torch.zeros(0, 4)}, ckpt_dir.parent / "empty")  # a tensor saved empty loads
    target = {"w": torch.ones(0, 4)}
    ss.load(target, ckpt_dir.parent / "empty")
    assert ss.open(ckpt_dir.parent / "empty").read("w").shape == (0, 4)


def test_a_malformed_param_groups_value_names_the_manifest_on_load(ckpt_dir):
    """A fresh optimizer's load reads the stored param groups before anything else; a malformed
    value there named neither the checkpoint nor its manifest."""
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    ss.save({"model": model, "optim": optim}, ckpt_dir)
    _rewrite(ckpt_dir, lambda doc: doc["objects"]["optim.param_groups"].update(json={"__ss_tuple": "x"}))
    fresh = torch.nn.Linear(2, 2)
    with pytest.raises(ManifestError, match=re.escape(str(ckpt_dir / MANIFEST_NAME)) + ": malformed tuple value at "
                       "optim.param_groups"):
        ss.load({"model": fresh, "optim": torch.optim.Adam(fresh.parameters())}, ckpt_dir)
