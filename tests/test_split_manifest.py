"""The split manifest (format version 2, format/split.py): written by the ranks that plan the
tensors, read in part by each loading rank, checked, and read whole by every tool; the
one-document manifest (version 1) of older checkpoints and small jobs still loads."""
import importlib
import json
import os

import numpy as np
import pytest
import torch

import statesnap as ss
from statesnap.bench import planning
from statesnap.cli import main
from statesnap.errors import CorruptCheckpointError, ManifestError
from statesnap.format import split
from statesnap.format.columns import InflationBudget
from statesnap.format.manifest import MANIFEST_NAME, Manifest
from statesnap.plan.load_plan import plan_target
from tests.dist_utils import local_level, run_ranks

ROWS, COLS = 101, 6
save_module = importlib.import_module("statesnap.engine.save")  # the module (statesnap.engine.save is the function)


def _full(seed: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _rows(rank: int, world: int) -> tuple[int, int]:
    step = -(-ROWS // world)
    return rank * step, max(0, min(step, ROWS - rank * step))


def _state(rank: int, world: int, values: torch.Tensor, bias: torch.Tensor) -> dict:
    lo, n = _rows(rank, world)
    return {"mp": {"w": ss.Sharded(values[lo:lo + n].clone(), values.shape, [lo, 0])}, "bias": bias.clone(),
            "extra": {"step": 7}}


def _save_then_load_resharded(rank, world, path):
    save_module.SPLIT_MIN_RANKS = 1  # this small job writes the split manifest a large one writes
    ss.save(_state(rank, world, _full(), torch.arange(5.0)), path)
    # load into another layout: the ranks in reverse order, so each needs another rank's rows
    target = _state(world - 1 - rank, world, torch.zeros(ROWS, COLS), torch.zeros(5))
    ss.load(target, path)
    lo, n = _rows(world - 1 - rank, world)
    return (torch.equal(target["mp"]["w"].local, _full()[lo:lo + n]), torch.equal(target["bias"], torch.arange(5.0)),
            target["extra"]["step"])


def test_split_manifest_of_three_ranks_loads_resharded_and_every_tool_reads_it(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    assert run_ranks(3, _save_then_load_resharded, path) == [(True, True, 7)] * 3
    doc = json.loads((tmp_path / "ckpt" / MANIFEST_NAME).read_bytes())
    assert doc["version"] == 2 and isinstance(doc["tensors"], dict) and "zjson" in doc["tensors"]
    reader = ss.open(path)
    sections = [reader.manifest.files[i] for i in reader.manifest.sections]
    assert sections and all(os.path.exists(os.path.join(path, name)) for name in sections)
    assert torch.equal(reader.read("mp.w"), _full()) and reader.read("extra.step") == 7
    assert reader.manifest.tensors["mp.w"].num_pieces == 3
    single = str(tmp_path / "single")  # the same values saved by one process: a version 1 manifest
    ss.save({"mp": {"w": _full()}, "bias": torch.arange(5.0), "extra": {"step": 7}}, single)
    assert json.loads((tmp_path / "single" / MANIFEST_NAME).read_bytes())["version"] == 1
    capsys.readouterr()
    assert main(["verify", path]) == 0 and main(["inspect", path]) == 0 and main(["diff", path, single]) == 0
    out = capsys.readouterr().out
    data_files = len(reader.manifest.files) - len(sections)
    assert "mp.w" in out and f"{data_files} data files" in out and f"and {len(sections)} section files" in out
    assert main(["inspect", "--json", path]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["totals"]["files"] == data_files and doc["totals"]["manifest_sections"] == len(sections)
    assert sorted(f["name"] for f in doc["files"] if f["kind"] == "manifest section") == sorted(sections)
    assert doc["totals"]["file_bytes"] == sum(f["bytes"] for f in doc["files"] if f["kind"] == "data")


def _values_at(step: int) -> torch.Tensor:
    return _full() * step


def _checkpointer_writes_split_manifests(rank, world, root, local_root):
    """Three checkpoints of changing values with the Checkpointer: its commits are planned and
    written by the tensor owners, like ``ss.save``'s, on every level."""
    save_module.SPLIT_MIN_RANKS = 1
    state = _state(rank, world, _values_at(1), torch.arange(5.0))
    with ss.Checkpointer(root, local_root=os.path.join(local_root, f"node{rank}"), local_every=1,
                         node_id=rank, persist_every=1, keep_last=3) as ckpt:
        for step in (1, 2, 3):
            lo, n = _rows(rank, world)
            state["mp"]["w"].local.copy_(_values_at(step)[lo:lo + n])
            state["extra"]["step"] = step
            ckpt.save(step, state).wait()
    return True


def _load_latest_resharded(rank, world, root):
    state = _state(rank, world, torch.zeros(ROWS, COLS), torch.zeros(5))
    with ss.Checkpointer(root) as ckpt:
        step = ckpt.load_latest(state)
    lo, n = _rows(rank, world)
    return step, torch.equal(state["mp"]["w"].local, _values_at(3)[lo:lo + n]), state["extra"]["step"]


def _save_empty_and_sharded(rank, world, path):
    save_module.SPLIT_MIN_RANKS = 1
    full = _full()
    lo, n = _rows(rank, world)
    ss.save({"e1": torch.zeros(0, 3), "e2": torch.zeros(0, 3),
             "v": ss.Sharded(full[lo:lo + n].clone(), full.shape, [lo, 0]),
             "w": ss.Sharded(full[lo:lo + n].clone() * 2, full.shape, [lo, 0])}, path)
    return True


@pytest.mark.parametrize("verify", [True, False])
def test_empty_tensors_beside_sharded_ones_of_a_split_manifest_load_exactly(tmp_path, verify):
    """An empty tensor's part of a split manifest holds no piece: with two of them beside two
    tensors of two pieces each, as many pieces as tensors made the load read each piece into its
    whole tensor's bytes (wrong values with verify=False, a good checkpoint called damaged)."""
    path = str(tmp_path / "c")
    assert run_ranks(2, _save_empty_and_sharded, path) == [True] * 2
    target = {"e1": torch.zeros(0, 3), "e2": torch.zeros(0, 3), "v": torch.zeros(ROWS, COLS),
              "w": torch.zeros(ROWS, COLS)}
    ss.load(target, path, verify=verify)
    assert torch.equal(target["v"], _full()) and torch.equal(target["w"], _full() * 2)


def test_the_checkpointer_commits_through_the_tensor_owners(tmp_path):
    root, local_root = str(tmp_path / "run"), str(tmp_path / "local")
    assert run_ranks(3, _checkpointer_writes_split_manifests, root, local_root) == [True] * 3
    for step in (1, 2, 3):
        path = os.path.join(root, f"step-{step}")
        doc = json.loads(open(os.path.join(path, MANIFEST_NAME), "rb").read())
        assert doc["version"] == 2
        reader = ss.open(path)
        assert torch.equal(reader.read("mp.w"), _values_at(step)) and reader.read("extra.step") == step
        assert reader.manifest.tensors["mp.w"].num_pieces == 3
        assert torch.equal(reader.read("bias"), torch.arange(5.0))
        assert reader.verify() > ROWS * COLS * 4
    # each node's local copy is one whole manifest of the job that describes the files it holds
    for node in range(3):
        local = ss.open(os.path.join(local_level(os.path.join(local_root, f"node{node}"), root), "step-3"))
        assert local.manifest.tensors["mp.w"].num_pieces == 3
        lo, n = _rows(node, 3)
        assert torch.equal(local.read("mp.w", (slice(lo, lo + n),)), _values_at(3)[lo:lo + n])
    assert run_ranks(2, _load_latest_resharded, root) == [(3, True, 3)] * 2


def test_a_loading_rank_reads_only_the_chunks_its_rows_need():
    """128 simulated ranks (TP 2 x FSDP 64): each sharded tensor has 128 pieces in 4 chunks. A
    rank's reads come from the chunks its box reaches and plan exactly what the whole entry plans."""
    params = planning.llama_parameters(layers=1, dim=64, ffn=128, heads=4, kv_heads=2, vocab=256)
    index, sections, _, _ = planning.simulate_owner_save(params, 2, 64)
    total = len(index) + sum(map(len, sections.values()))
    fetch = lambda name, offset, n: sections[name][offset:offset + n]  # noqa: E731
    names = planning.item_names(params)
    for rank in (0, 77, 127):
        part_of = Manifest.from_bytes(index, fetch=fetch)
        whole = Manifest.from_bytes(index, fetch=fetch)
        for item in planning.rank_items(rank, params, names, 2, 64):
            mine = part_of.tensor_part(item.fqn, item.layout, item.start, item.size)
            full = whole.tensors[item.fqn]
            reads = [(tuple(mine.start[r.piece]), r.lo, r.hi) for r in plan_target(mine, item.layout, item.start,
                                                                                   item.size).reads]
            expected = [(tuple(full.start[r.piece]), r.lo, r.hi) for r in plan_target(full, item.layout, item.start,
                                                                                     item.size).reads]
            assert reads == expected
            assert mine.num_pieces <= 2 * 32 < full.num_pieces or full.num_pieces <= 64  # at most 2 chunks
        assert len(index) + part_of.tensors.reader.bytes_read < 0.5 * total


def test_a_damaged_section_is_refused_naming_the_tensor(tmp_path, monkeypatch):
    monkeypatch.setattr(save_module, "SPLIT_MIN_RANKS", 1)
    path = tmp_path / "ckpt"
    ss.save({"w": _full()}, path)
    name = next(n for n in os.listdir(path) if n.endswith(".sec"))
    raw = bytearray((path / name).read_bytes())
    raw[len(raw) // 2] ^= 0x40
    (path / name).write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=f"section {name}: .*'w'"):
        ss.load({"w": torch.zeros(ROWS, COLS)}, path)
    assert main(["verify", str(path)]) != 0


def test_an_unknown_dtype_is_refused_naming_the_manifest_and_the_tensor_as_in_version_1(tmp_path, monkeypatch):
    for version, split_min_ranks in ((1, 64), (2, 1)):
        monkeypatch.setattr(save_module, "SPLIT_MIN_RANKS", split_min_ranks)
        path = tmp_path / f"v{version}"
        ss.save({"w": _full(), "bias": torch.zeros(5)}, path)
        doc = json.loads((path / MANIFEST_NAME).read_bytes())
        doc.pop("manifest_xxh3")  # (a manifest without its checksum of itself still loads)
        assert doc["version"] == version
        if version == 1:
            doc["tensors"]["w"]["dtype"] = "float128"
        else:
            doc["tensors"] = [row if row[0] != "w" else [row[0], "float128", *row[2:]]
                              for row in split.unpack_json(doc["tensors"], InflationBudget(1 << 20), "index")]
        (path / MANIFEST_NAME).write_text(json.dumps(doc))
        with pytest.raises(ManifestError) as caught:
            ss.open(path)
        assert str(caught.value) == (f"{path / MANIFEST_NAME}: tensor 'w': unknown dtype 'float128'; "
                                     "the checkpoint may come from a newer statesnap or torch")


def test_verify_goes_on_past_a_damaged_section(tmp_path, monkeypatch):
    """A section that cannot give a tensor's entry is one more problem in verify's report, named
    by file: the other tensors' bytes are still checked and their damage reported beside it."""
    monkeypatch.setattr(save_module, "SPLIT_MIN_RANKS", 1)
    path = tmp_path / "ckpt"
    ss.save({"w": _full(), "v": _full(1)}, path)
    manifest = ss.open(path).manifest
    data = path / next(n for n in manifest.files if n.endswith(".bin"))
    raw = bytearray(data.read_bytes())
    for fqn in ("w", "v"):  # whichever entry the section still gives, its bytes are damaged
        raw[int(manifest.tensors[fqn].offset[0])] ^= 0x40
    data.write_bytes(bytes(raw))
    section = next(n for n in os.listdir(path) if n.endswith(".sec"))
    raw = bytearray((path / section).read_bytes())
    raw[manifest.tensors.rows["w"].offset + 4] ^= 0x40  # inside w's head
    (path / section).write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError) as caught:
        ss.open(path).verify()
    message = str(caught.value)
    assert "2 damaged piece(s)" in message and f"section {section}: head of tensor 'w'" in message
    assert f"v in {data.name}: checksum mismatch" in message
    (path / section).unlink()
    with pytest.raises(ss.MissingFileError) as caught:
        ss.open(path).verify()
    assert str(caught.value) == f"{path}: manifest sections missing: {section} (needed for v, w)"


def test_one_document_manifests_of_older_checkpoints_still_load(tmp_path):
    """Version 1, as every statesnap before the split wrote it (and small jobs still do)."""
    path = tmp_path / "old"
    ss.save({"w": _full(), "extra": {"step": 3}}, path)
    doc = json.loads((path / MANIFEST_NAME).read_bytes())
    assert doc["version"] == 1 and doc["tensors"]["w"]["shape"] == [ROWS, COLS] and "sections" not in doc
    state = {"w": torch.zeros(ROWS, COLS), "extra": {"step": 0}}
    ss.load(state, path)
    assert torch.equal(state["w"], _full()) and state["extra"]["step"] == 3
    assert np.array_equal(ss.open(path).read("w").numpy(), _full().numpy())


def test_pieces_overlapping_in_the_region_read_are_refused():
    """A reader of part of a tensor cannot check the whole tiling: it checks its own region."""
    from statesnap.errors import ManifestError
    from statesnap.format.manifest import TensorEntry
    from statesnap.format.split import encode_section, section_name

    rows_0_3, rows_1_4 = [0, 0], [1, 0]  # rows 1 and 2 are in both pieces
    entry = TensorEntry(dtype=torch.float32, shape=(4, 2), layout="box", file=np.array([0, 0]),
                        offset=np.array([0, 0]), nbytes=np.array([24, 24]), start=np.array([rows_0_3, rows_1_4]),
                        size=np.array([[3, 2], [3, 2]]), checksum=np.zeros(2, np.uint64),
                        checksum_bounds=np.array([0, 1, 2]))
    raw, rows = encode_section({"w": entry})
    index = Manifest(files=["data-0123456789ab-r00000.bin", section_name("0123456789ab", 0)],
                     file_sizes=[64, len(raw)], tensors={}, objects={}, world_size=2, sections=[1]).index_bytes(rows)
    parsed = Manifest.from_bytes(index, fetch=lambda name, offset, n: raw[offset:offset + n])
    assert parsed.header("w").shape == (4, 2)
    with pytest.raises(ManifestError, match="'w'.*exactly once"):
        parsed.tensor_part("w", "box", (0, 0), (2, 2))
    with pytest.raises(ManifestError, match="'w'.*exactly once"):
        parsed.tensors["w"]


def test_the_scaling_plot_is_written(tmp_path):
    point = {"save_planning_s": 0.3, "load_planning_s_same_layout": 0.4, "load_planning_s_resharded": 0.4,
             "dcp_metadata_bytes_estimated": 4e8, "manifest_bytes": 2e7, "load_manifest_read_same_layout": 0.009}
    planning._plot_scaling([point] * len(planning.SCALING_DP), str(tmp_path / "scaling.png"))
    assert (tmp_path / "scaling.png").stat().st_size > 1000
