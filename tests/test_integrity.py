"""Damage is reported, never loaded silently: each kind raises its own error naming file and tensor."""
import json
import re
from pathlib import Path

import pytest
import torch

import statesnap as ss
from statesnap.format.manifest import MANIFEST_NAME
from dist_utils import run_ranks

BLOCK = 4096  # small checksum blocks, so tensors span several


def make_state():
    torch.manual_seed(0)
    return {"model": {"big": torch.randn(64, 64), "small": torch.randn(7)}, "extra": {"step": 3}}


def blank_like(state):
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "extra": {"step": 0}}


@pytest.fixture
def ckpt(tmp_path):
    """A good checkpoint next to the one the test damages."""
    state = make_state()
    ss.save(state, tmp_path / "good", block_bytes=BLOCK)
    ss.save(state, tmp_path / "ckpt", block_bytes=BLOCK)
    return tmp_path / "ckpt", state


def piece(path, fqn):
    """(data file path, byte offset, nbytes) of the first piece of ``fqn``."""
    doc = json.loads((path / MANIFEST_NAME).read_text())
    entry = doc["tensors"][fqn]
    return path / doc["files"][entry["file"][0]], entry["offset"][0], entry["nbytes"][0]


def flip_byte(file, position):
    data = bytearray(file.read_bytes())
    data[position] ^= 0x40
    file.write_bytes(bytes(data))


def edit_manifest(path, change):
    doc = json.loads((path / MANIFEST_NAME).read_text())
    change(doc)
    (path / MANIFEST_NAME).write_text(json.dumps(doc))


def assert_good_neighbour_loads(path, state):
    target = blank_like(state)
    ss.load(target, path.parent / "good")
    assert torch.equal(target["model"]["big"], state["model"]["big"])
    ss.open(path.parent / "good").verify()


def test_flipped_byte_is_detected_on_load_read_and_verify(ckpt):
    path, state = ckpt
    file, offset, nbytes = piece(path, "model.big")
    flip_byte(file, offset + nbytes - 100)  # in the last checksum block of the tensor
    with pytest.raises(ss.CorruptCheckpointError) as caught:
        ss.load(blank_like(state), path)
    assert file.name in str(caught.value) and "'model.big'" in str(caught.value)
    with pytest.raises(ss.CorruptCheckpointError, match=file.name):
        ss.open(path).read("model.big")
    with pytest.raises(ss.CorruptCheckpointError) as caught:
        ss.open(path).verify()
    assert "model.big" in str(caught.value) and file.name in str(caught.value)
    assert "model.small" not in str(caught.value)
    # Reading a region whose checksum blocks are intact still works.
    assert torch.equal(ss.open(path).read("model.big", slice(0, 8)), state["model"]["big"][:8])
    assert_good_neighbour_loads(path, state)


def test_verify_reports_a_data_file_of_another_size_than_recorded(ckpt):
    path, state = ckpt
    file, _, _ = piece(path, "model.big")
    size = file.stat().st_size
    with open(file, "ab") as f:  # appended to after the commit: every piece still reads back intact
        f.write(b"\0" * 100)
    with pytest.raises(ss.CorruptCheckpointError) as caught:
        ss.open(path).verify()
    assert f"another size than recorded: {file.name} is {size + 100} bytes, the manifest records {size}" in \
        str(caught.value)
    target = blank_like(state)
    ss.load(target, path)  # the tensors themselves are intact
    assert torch.equal(target["model"]["big"], state["model"]["big"])


def test_verify_accepts_unwritten_padding_recorded_by_older_checkpoints(ckpt):
    """Before sizes were exact, the recorded size could include alignment padding after the last
    piece that was never written: such a file is shorter than recorded, and still whole."""
    path, state = ckpt
    file, _, _ = piece(path, "model.big")
    manifest = json.loads((path / "manifest.json").read_text())
    index = manifest["files"].index(file.name)
    manifest["file_sizes"][index] += 40
    manifest.pop("manifest_xxh3", None)
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert ss.open(path).verify() > 0


@pytest.mark.parametrize("more", [64, 1 << 62])
def test_verify_refuses_a_file_shorter_than_recorded_past_the_padding(ckpt, more):
    """A recorded size the file lacks more than padding of: cut short after the pieces the
    manifest lists, or a size that would have verify report bytes it never read."""
    path, _ = ckpt
    file, _, _ = piece(path, "model.big")
    size = file.stat().st_size
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["file_sizes"][manifest["files"].index(file.name)] += more
    manifest.pop("manifest_xxh3", None)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ss.CorruptCheckpointError, match=f"{file.name} is {size} bytes, the manifest records "
                                                        f"{size + more}"):
        ss.open(path).verify()


def test_verify_false_skips_checksums(ckpt):
    path, state = ckpt
    file, offset, _ = piece(path, "model.small")
    flip_byte(file, offset)
    target = blank_like(state)
    ss.load(target, path, verify=False)
    assert torch.equal(target["model"]["big"], state["model"]["big"])
    assert not torch.equal(target["model"]["small"], state["model"]["small"])
    assert not torch.equal(ss.open(path, verify=False).read("model.small"), state["model"]["small"])


def test_truncated_data_file(ckpt):
    path, state = ckpt
    file, offset, nbytes = piece(path, "model.big")
    data = file.read_bytes()
    file.write_bytes(data[:offset + nbytes // 2])
    with pytest.raises(ss.CorruptCheckpointError) as caught:
        ss.load(blank_like(state), path)
    assert "truncated" in str(caught.value) and file.name in str(caught.value)
    assert "model.big" in str(caught.value)
    with pytest.raises(ss.CorruptCheckpointError, match="model.big"):
        ss.open(path).verify()
    assert_good_neighbour_loads(path, state)


def test_missing_data_file(ckpt):
    path, state = ckpt
    file, _, _ = piece(path, "model.big")
    file.unlink()
    with pytest.raises(ss.MissingFileError) as caught:
        ss.load(blank_like(state), path)
    assert file.name in str(caught.value) and "model." in str(caught.value)
    with pytest.raises(ss.MissingFileError) as caught:
        ss.open(path).verify()
    assert file.name in str(caught.value) and "model.big" in str(caught.value)
    assert_good_neighbour_loads(path, state)


def _put_in_place(kind: str, file) -> None:
    """A FIFO, a directory or a symbolic link to itself where ``file`` was."""
    import os

    file.unlink()
    {"fifo": os.mkfifo, "directory": os.mkdir, "loop": lambda f: os.symlink(f.name, f)}[kind](file)


@pytest.mark.parametrize("kind, said", [("fifo", "a FIFO"), ("directory", "a directory"),
                                        ("loop", "a symbolic link that loops")])
def test_a_data_file_that_is_not_a_regular_file(ckpt, kind, said):
    """A FIFO where a data file was used to block every reader forever (waiting for a writer), a
    directory raised a bare IsADirectoryError, and a link to itself was a read to retry for load
    but a missing file for verify: each is a CorruptCheckpointError naming the file and the
    tensor, from load, read and verify alike, and in the manifest's place too."""
    path, state = ckpt
    file, _, _ = piece(path, "model.big")
    _put_in_place(kind, file)
    for attempt in (lambda: ss.load(blank_like(state), path), lambda: ss.open(path).read("model.big"),
                    lambda: ss.open(path).verify()):
        with pytest.raises(ss.CorruptCheckpointError) as caught:
            attempt()
        assert file.name in str(caught.value) and "model.big" in str(caught.value)
        # damage, not a read that may succeed again: a restart goes back to an older step
        assert not isinstance(caught.value, ss.ReadFailedError)
    assert_good_neighbour_loads(path, state)
    _put_in_place(kind, path / MANIFEST_NAME)
    # (a directory there was "has no manifest.json", a ManifestError: a restart raised it, as a
    # newer format's, instead of going back to an older step)
    for attempt in (lambda: ss.open(path), lambda: ss.load(blank_like(state), path)):
        with pytest.raises(ss.CorruptCheckpointError, match=f"manifest.json is {said}") as caught:
            attempt()
        assert not isinstance(caught.value, ss.ReadFailedError)


def test_a_directory_where_a_pickled_object_was_is_damage(tmp_path):
    """As for tensors' files: load and verify call it damage (a CorruptCheckpointError, not a
    read to retry, nor a bare IsADirectoryError), naming the file and the object."""
    import os

    path = tmp_path / "c"
    ss.save({"o": {1, 2}}, path, allow_pickle=True)
    data = [p for p in path.iterdir() if p.name != MANIFEST_NAME]
    assert len(data) == 1
    data[0].unlink()
    data[0].mkdir()
    for attempt in (lambda: ss.load({"o": set()}, path, allow_pickle=True),
                    lambda: ss.open(path, allow_pickle=True).verify()):
        with pytest.raises(ss.CorruptCheckpointError, match=f"{data[0].name}.*'o'") as caught:
            attempt()
        assert not isinstance(caught.value, ss.ReadFailedError)
    assert os.path.isdir(data[0])


def test_a_manifest_the_storage_fails_to_read_is_a_read_failure_naming_it(ckpt, monkeypatch):
    """An I/O error reading the manifest (a mount that stopped answering): a ReadFailedError
    from open and load alike (the file may be intact, so a restart retries rather than going
    back to an older step), not a bare OSError."""
    import errno

    from statesnap.storage.local import LocalBackend

    path, state = ckpt
    real = LocalBackend.read_bytes

    def failing(self, where):
        if where.endswith(MANIFEST_NAME):
            raise OSError(errno.EIO, "Input/output error", where)
        return real(self, where)

    monkeypatch.setattr(LocalBackend, "read_bytes", failing)
    for attempt in (lambda: ss.open(path), lambda: ss.load(blank_like(state), path)):
        with pytest.raises(ss.ReadFailedError, match="manifest.json cannot be read.*Input/output error"):
            attempt()


def test_a_checkpoint_of_links_into_a_blob_store_loads_and_a_link_to_other_bytes_is_caught(ckpt, tmp_path):
    """A download cache (Hugging Face's) keeps a snapshot's files as links into its blob store:
    such a checkpoint loads, links followed, the directory itself reached through a link too. A
    link to a file with other bytes is damage the checksums catch, naming file and tensor."""
    import os
    import shutil

    path, state = ckpt
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for name in os.listdir(path):
        shutil.copy(path / name, blobs / f"blob-{name}")
        (snapshot / name).symlink_to(os.path.relpath(blobs / f"blob-{name}", snapshot))
    (tmp_path / "latest").symlink_to(snapshot)
    target = blank_like(state)
    ss.load(target, tmp_path / "latest")
    assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
    file, _, _ = piece(snapshot, "model.big")
    other = tmp_path / "other.bin"
    other.write_bytes(b"\0" * os.path.getsize(file))
    file.unlink()
    file.symlink_to(other)
    with pytest.raises(ss.CorruptCheckpointError) as caught:
        ss.load(blank_like(state), snapshot)
    assert file.name in str(caught.value) and "model.big" in str(caught.value)


@pytest.mark.parametrize("content", [b"", b"\x80\x04garbage", b"{not json", b"[1, 2]", b'{"format": "other"}'])
def test_garbage_manifest(ckpt, content):
    path, state = ckpt
    (path / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(ss.ManifestError, match=MANIFEST_NAME):
        ss.load(blank_like(state), path)
    with pytest.raises(ss.ManifestError):
        ss.open(path)
    assert_good_neighbour_loads(path, state)


def test_missing_manifest_means_not_committed(ckpt):
    path, state = ckpt
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(ss.ManifestError, match="not a committed"):
        ss.open(path)
    with pytest.raises(ss.CheckpointError, match="no checkpoint"):
        ss.open(path.parent / "nothing-here")


def test_foreign_checkpoints_are_named_and_pointed_to_convert(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    torch.save({"a": torch.ones(2)}, tmp_path / "t.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group exists
        dcp.save({"a": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "hf").mkdir()
    save_file({"a": torch.ones(2)}, str(tmp_path / "hf" / "model.safetensors"))
    for name, words in [("t.pt", "is a file"), ("dcp", "DCP checkpoint"), ("hf", "safetensors files")]:
        for attempt in (lambda: ss.open(tmp_path / name), lambda: ss.load({"a": torch.zeros(2)}, tmp_path / name)):
            with pytest.raises(ss.ManifestError, match=f"{words}.*ss.convert"):
                attempt()


def test_future_version_manifest(ckpt):
    path, state = ckpt
    edit_manifest(path, lambda doc: doc.update(version=999))
    with pytest.raises(ss.ManifestError, match="version 999") as caught:
        ss.load(blank_like(state), path)
    assert "upgrade" in str(caught.value)


@pytest.mark.parametrize("name", ["../evil", "/etc/passwd", "..", "sub/dir.bin", ""])
def test_manifest_paths_cannot_escape(ckpt, name):
    path, state = ckpt
    edit_manifest(path, lambda doc: doc["files"].__setitem__(0, name))
    with pytest.raises(ss.ManifestError, match="refusing") as caught:
        ss.load(blank_like(state), path)
    assert repr(name) in str(caught.value)


def test_out_of_range_offset(ckpt):
    path, state = ckpt

    def push_past_end(doc):
        doc["tensors"]["model.big"]["offset"][0] = doc["file_sizes"][doc["tensors"]["model.big"]["file"][0]]
    edit_manifest(path, push_past_end)
    with pytest.raises(ss.ManifestError) as caught:
        ss.load(blank_like(state), path)
    assert "'model.big'" in str(caught.value) and "beyond" in str(caught.value)


@pytest.mark.parametrize("change, words", [
    (lambda t: t.update(dtype="float128"), "unknown dtype"),
    (lambda t: t.update(shape=[8, 8]), "outside the global shape"),
    (lambda t: t.update(nbytes=[12]), "byte length"),
    (lambda t: t.update(file=[7]), "file index"),
    (lambda t: t.update(checksum=[[1, 2, 3, 4, 5]]), "checksums"),
    (lambda t: t.update(layout="spiral"), "layout"),
    (lambda t: t.pop("offset"), "malformed"),
])
def test_inconsistent_tensor_entries(ckpt, change, words):
    path, state = ckpt
    edit_manifest(path, lambda doc: change(doc["tensors"]["model.big"]))
    with pytest.raises(ss.ManifestError, match=words) as caught:
        ss.open(path)
    assert "model.big" in str(caught.value)


@pytest.mark.parametrize("change, words", [
    (lambda doc: doc["files"].__setitem__(0, doc["files"][0] + "\n"), "not a plain file name"),
    (lambda doc: doc.update(version=True), "format version"),
    (lambda doc: doc["tensors"]["model.big"].update(shape=[64.0, 64]), "malformed"),
    (lambda doc: doc.update(tensors=[]), "malformed"),
    (lambda doc: doc.update(world_size="1"), "malformed"),
    (lambda doc: doc["objects"].update({"model.big": {"json": 1}}), "both as a tensor and as an object"),
    (lambda doc: doc["objects"].update({"r": {"per_rank": [{"json": 1}, {"json": 2}]}}), "per-rank values"),
])
def test_manifest_values_of_the_wrong_kind(ckpt, change, words):
    """Values JSON can hold but the format does not allow are refused, not coerced."""
    path, state = ckpt
    edit_manifest(path, change)
    with pytest.raises(ss.ManifestError, match=words):
        ss.open(path)
    assert_good_neighbour_loads(path, state)


@pytest.mark.parametrize("value", [{"__ss_float": "1e400"}, {"__ss_what": 1}, {"__ss_bytes": "not base64!"}])
def test_a_malformed_plain_value_is_damage_to_verify_and_names_the_manifest(tmp_path, value):
    path = tmp_path / "c"
    ss.save({"w": torch.ones(2), "extra": {"step": 7, "other": [1]}}, path)
    edit_manifest(path, lambda doc: (doc.pop("manifest_xxh3"), doc["objects"].update({"extra.step": {"json": value}})))
    manifest = str(path / MANIFEST_NAME)
    with pytest.raises(ss.CorruptCheckpointError, match=r"1 damaged value\(s\): .*manifest\.json: .*extra\.step"):
        ss.open(path).verify()
    with pytest.raises(ss.ManifestError, match=re.escape(manifest) + ".*extra.step"):
        ss.open(path).read("extra.step")
    with pytest.raises(ss.ManifestError, match=re.escape(manifest) + ".*extra.step"):
        ss.load({"w": torch.zeros(2), "extra": {"step": 0, "other": [0]}}, path)
    assert ss.open(path).read("extra.other") == [1]


@pytest.mark.parametrize("pickled_first", [True, False])
def test_a_malformed_plain_value_of_one_rank_is_found_beside_a_pickled_one(tmp_path, pickled_first):
    path = tmp_path / "c"
    ss.save({"w": torch.ones(2), "obj": {1, 2}, "x": 3}, path, allow_pickle=True)

    def change(doc):
        doc.pop("manifest_xxh3")
        doc["world_size"] = 2
        values = [doc["objects"]["obj"], {"json": {"__ss_float": "1e400"}}]
        doc["objects"]["x"] = {"per_rank": values if pickled_first else values[::-1]}
    edit_manifest(path, change)
    with pytest.raises(ss.CorruptCheckpointError, match=r"1 damaged value\(s\): .*manifest\.json: .*at x"):
        ss.open(path).verify()


def test_damaged_pickled_object(tmp_path):
    ss.save({"obj": {1, 2, 3}}, tmp_path / "c", allow_pickle=True)
    doc = json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())
    file, offset, _, _ = doc["objects"]["obj"]["pickle"]
    flip_byte(tmp_path / "c" / doc["files"][file], offset + 3)
    with pytest.raises(ss.CorruptCheckpointError, match="obj"):
        ss.load({"obj": None}, tmp_path / "c", allow_pickle=True)


def test_missing_file_of_pickled_objects(tmp_path):
    ss.save({"obj": {1, 2}, "per_rank": ss.PerRank({3})}, tmp_path / "c", allow_pickle=True)
    (file,) = (tmp_path / "c").glob("*.bin")
    file.unlink()
    with pytest.raises(ss.MissingFileError, match=f"{file.name}.*'obj'"):
        ss.load({"obj": None, "per_rank": ss.PerRank(None)}, tmp_path / "c", allow_pickle=True)
    with pytest.raises(ss.MissingFileError, match=file.name):
        ss.open(tmp_path / "c", allow_pickle=True).read("obj")
    with pytest.raises(ss.MissingFileError, match=f"{file.name} .*obj, per_rank"):
        ss.open(tmp_path / "c").verify()


def _load_damaged(rank, world, path):
    """Every rank must raise, naming the damage, even if its own reads were fine."""
    state = {"w": ss.Sharded(torch.full((4, 8), float(rank)), (4 * world, 8), (4 * rank, 0))}
    ss.save(state, path)
    if rank == 0:
        doc = json.loads((Path(path) / MANIFEST_NAME).read_text())
        entry = doc["tensors"]["w"]
        last = entry["start"].index([4 * (world - 1), 0])
        flip_byte(Path(path) / doc["files"][entry["file"][last]], entry["offset"][last])
    torch.distributed.barrier()
    try:
        ss.load({"w": ss.Sharded(torch.zeros(4, 8), (4 * world, 8), (4 * rank, 0))}, path)
    except ss.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return None


def test_damage_seen_by_one_rank_fails_every_rank(tmp_path):
    results = run_ranks(2, _load_damaged, str(tmp_path / "c"))
    assert results[1][0] == "CorruptCheckpointError" and "'w'" in results[1][1]
    assert results[0] is not None and "rank 1" in results[0][1] and "checksum mismatch" in results[0][1]


def test_strided_reads_out_of_the_mapped_file_are_verified(ckpt):
    """A column slice is picked out of the file's mapping (no copy of the span): it is exact when
    the file is whole, and a flipped byte or a cut file inside the span it needs is still caught."""
    path, state = ckpt
    columns = (slice(None), slice(8, 16))
    assert torch.equal(ss.open(path).read("model.big", columns), state["model"]["big"][:, 8:16])
    file, offset, nbytes = piece(path, "model.big")
    flip_byte(file, offset + nbytes - 4)  # the last column: outside the slice, inside its blocks
    with pytest.raises(ss.CorruptCheckpointError, match=file.name):
        ss.open(path).read("model.big", columns)
    file.write_bytes(file.read_bytes()[:offset + nbytes // 2])
    with pytest.raises(ss.CorruptCheckpointError, match="truncated"):
        ss.open(path).read("model.big", columns)
    assert_good_neighbour_loads(path, state)


def _save_sharded(rank, world, path):
    ss.save({"w": ss.Sharded(torch.full((4, 8), float(rank)), (4 * world, 8), (4 * rank, 0))}, path)


def test_verify_reports_damage_beside_a_missing_file(tmp_path):
    """A missing data file does not hide what else is wrong: the other files are checked all the
    same and their damage is named in the same error."""
    run_ranks(2, _save_sharded, str(tmp_path / "c"))
    doc = json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())
    entry = doc["tensors"]["w"]
    (tmp_path / "c" / doc["files"][1]).unlink()
    flip_byte(tmp_path / "c" / doc["files"][0], entry["offset"][entry["file"].index(0)])
    with pytest.raises(ss.MissingFileError) as caught:
        ss.open(tmp_path / "c").verify()
    message = str(caught.value)
    assert f"data files missing: {doc['files'][1]} (needed for w)" in message
    assert "also 1 damaged piece(s): " in message and doc["files"][0] in message


def _save_row_blocks(rank, world, path):
    """Rows of ``w`` split over the ranks, each rank's part several checksum blocks long."""
    whole = torch.arange(world * 3000, dtype=torch.float32).reshape(world * 3, 1000)
    ss.save({"w": ss.Sharded(whole[3 * rank:3 * rank + 3].clone(), whole.shape, (3 * rank, 0))}, path,
            block_bytes=BLOCK)


def test_row_blocks_of_several_ranks_load_whole_and_damage_names_the_piece(tmp_path):
    """Pieces of whole rows, read straight into their place in a whole target (no plan of their
    own), each cut at its checksum blocks: exact, and a flipped byte in the second rank's second
    block is named by tensor, piece and byte range."""
    run_ranks(2, _save_row_blocks, str(tmp_path / "c"))
    target = torch.full((6, 1000), -1.0)
    ss.load({"w": target}, tmp_path / "c")
    assert torch.equal(target, torch.arange(6000, dtype=torch.float32).reshape(6, 1000))
    doc = json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())
    entry = doc["tensors"]["w"]
    second = entry["start"].index([3, 0])
    start = entry["offset"][second] + BLOCK
    flip_byte(tmp_path / "c" / doc["files"][entry["file"][second]], start + 5)
    with pytest.raises(ss.CorruptCheckpointError,
                       match=rf"tensor 'w', piece {second}, bytes \[{start}, {start + BLOCK}\) are damaged"):
        ss.load({"w": target}, tmp_path / "c")


def _many_small(count: int = 600) -> dict:
    """Small tensors read many to a request, and two of several checksum blocks among them."""
    gen = torch.Generator().manual_seed(3)
    state = {f"t{i:03d}": torch.randn(1 + i % 37, generator=gen) for i in range(count)}
    state["t100"] = torch.randn(3 * BLOCK // 4 + 5, generator=gen)  # 3 blocks and a bit
    state["t400"] = torch.randn(2, BLOCK // 4, generator=gen)  # two blocks exactly
    return state


def _in_file_order(path) -> tuple[list[str], dict]:
    """The names of a one-rank checkpoint's tensors in the order of their bytes, and where each
    lies: (data file, offset, nbytes). (Its manifest holds them in a table, not as entries.)"""
    manifest = ss.open(path).manifest
    places = {fqn: (path / manifest.files[int(e.file[0])], int(e.offset[0]), int(e.nbytes[0]))
              for fqn, e in manifest.tensors.items()}
    return sorted(places, key=lambda fqn: places[fqn][1]), places


def test_many_small_tensors_load_exactly_and_damage_in_the_middle_names_its_tensor(tmp_path):
    """A thousand-tensor state is read many pieces to a request: exact, and a flipped byte in a
    tensor in the middle of a request names that tensor, its file and its bytes."""
    state = _many_small()
    ss.save(state, tmp_path / "c", block_bytes=BLOCK)
    target = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    ss.load(target, tmp_path / "c")
    assert all(torch.equal(target[k].view(torch.int32), v.view(torch.int32)) for k, v in state.items())
    order, places = _in_file_order(tmp_path / "c")
    victim = order[len(order) // 2]
    file, offset, nbytes = places[victim]
    flip_byte(file, offset + nbytes - 1)
    with pytest.raises(ss.CorruptCheckpointError,
                       match=rf"{file.name} .*tensor '{victim}', piece 0, bytes \[{offset}, {offset + nbytes}\)"):
        ss.load({k: torch.zeros_like(v) for k, v in state.items()}, tmp_path / "c")


def test_many_small_tensors_truncated_in_the_middle_name_the_first_tensor_cut_short(tmp_path):
    state = _many_small()
    ss.save(state, tmp_path / "c", block_bytes=BLOCK)
    order, places = _in_file_order(tmp_path / "c")
    victim = order[len(order) // 3]
    file, offset, nbytes = places[victim]
    file.write_bytes(file.read_bytes()[:offset + nbytes // 2])
    with pytest.raises(ss.CorruptCheckpointError,
                       match=rf"{file.name} .* truncated: bytes \[{offset}, {offset + nbytes}\) of tensor '{victim}'"):
        ss.load({k: torch.zeros_like(v) for k, v in state.items()}, tmp_path / "c")


def test_a_file_cut_short_in_a_small_tensor_between_two_large_ones_names_the_small_one(tmp_path):
    """The requests of large pieces were joined across the small piece between them, read as a
    gap: a file cut short inside it blamed the large tensor after it."""
    gen = torch.Generator().manual_seed(4)
    state = {"a_big": torch.randn(2048, generator=gen), "b_small": torch.randn(16, generator=gen),
             "c_big": torch.randn(2048, generator=gen)}
    ss.save(state, tmp_path / "c", block_bytes=BLOCK)
    order, places = _in_file_order(tmp_path / "c")
    assert order == ["a_big", "b_small", "c_big"]
    file, offset, nbytes = places["b_small"]
    file.write_bytes(file.read_bytes()[:offset + 8])
    with pytest.raises(ss.CorruptCheckpointError,
                       match=rf"truncated: bytes \[{offset}, {offset + nbytes}\) of tensor 'b_small'"):
        ss.load({k: torch.zeros_like(v) for k, v in state.items()}, tmp_path / "c")
