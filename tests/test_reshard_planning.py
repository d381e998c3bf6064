"""Save planning at scale (pure computation): pieces checked to hold every element exactly once, load
coverage that counts exactly, and the 1024-rank planning simulation at a small size."""
import dataclasses

import numpy as np
import pytest
import torch

import statesnap as ss
from statesnap.bench import planning
from statesnap.engine.save import build_manifest
from statesnap.errors import CheckpointError
from statesnap.format.manifest import Manifest
from statesnap.plan.load_plan import plan_target
from statesnap.plan.save_plan import ALIGN, plan_save
from statesnap.state.items import ItemMeta
from statesnap.state.placement import chunk_bounds


def meta(fqn, start, size, shape=(10, 4), dtype="float32"):
    return ItemMeta(fqn, dtype, shape, "box", start, size, 4 * int(np.prod(size)))


def test_replicas_are_written_once_by_the_least_loaded_holder():
    shard = [meta("w", (r * 5, 0), (5, 4)) for r in range(2)]
    norm = meta("norm", (0,), (4,), shape=(4,))
    step = ItemMeta("step", "float32", (), "box", (), (), 4)
    plan = plan_save([[shard[0], norm, step], [shard[1], norm, step]])
    assert plan.tensors["w"].rank.tolist() == [0, 1]
    assert plan.tensors["norm"].rank.tolist() + plan.tensors["step"].rank.tolist() in ([0, 1], [1, 0])
    for writes, size in zip(plan.writes, plan.file_bytes):
        offsets = [offset for _, offset in writes]
        assert all(o % ALIGN == 0 for o in offsets) and offsets == sorted(offsets) and size >= offsets[-1]
    assert plan.tensors["w"].start.tolist() == [[0, 0], [5, 0]]
    assert plan.tensors["step"].start.shape == (1, 0)


def test_ranks_that_disagree_or_overlap_are_refused():
    with pytest.raises(CheckpointError, match="hold one tensor under each name"):
        plan_save([[meta("w", (0, 0), (5, 4))], [meta("w", (5, 0), (5, 4), dtype="bfloat16")]])
    with pytest.raises(CheckpointError, match="overlap"):
        plan_save([[meta("w", (0, 0), (6, 4))], [meta("w", (4, 0), (6, 4))]])


def test_empty_ranks_plan_nothing():
    plan = plan_save([[], [meta("w", (0, 0), (10, 4))], []])
    assert plan.writes == [[], [(0, 0)], []] and plan.file_bytes == [0, 160, 0]  # a file ends with its last piece


def test_simulated_tp_fsdp_boxes_tile_every_tensor():
    params = planning.llama_parameters(layers=1, dim=64, ffn=96, heads=4, kv_heads=2, vocab=100)
    names = planning.item_names(params)
    per_rank = [planning.rank_items(r, params, names, 2, 3) for r in range(6)]
    plan = plan_save(per_rank)
    for fqn, pieces in plan.tensors.items():
        assert int(pieces.size.prod(axis=1).sum()) == int(np.prod(pieces.shape)), fqn


def test_planning_simulation_runs_and_reshards_into_another_mesh():
    figures = planning.run(layers=1, tp=2, dp=4, reshard_tp=1, reshard_dp=3, sample_ranks=2, dcp_layers=1)
    assert figures["pieces"] > 0 and figures["manifest_bytes"] > 0 and figures["dcp_metadata_bytes_estimated"] > 0
    assert figures["load_planning_s_resharded"] > 0
    assert figures["items_per_rank"] == 4 * 12  # 12 parameters x (weight, 2 moments, step)


def test_load_plan_of_a_resharded_rank_covers_its_box():
    params = planning.llama_parameters(layers=1, dim=64, ffn=96, heads=4, kv_heads=2, vocab=100)
    manifest, _ = planning.plan_save_job(params, 2, 4)
    for item in planning.rank_items(2, params, planning.item_names(params), 1, 3):
        plan = plan_target(manifest.tensors[item.fqn], item.layout, item.start, item.size)
        assert plan.covered == int(np.prod(item.size)), item.fqn


def test_reshard_benchmark_runs_at_a_tiny_size(tmp_path, capsys):
    from statesnap.bench import reshard

    assert reshard.main(["--dim", "32", "--layers", "2", "--repeat", "1", "--out", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "reshard_vs_same" in shown and "replicated cold shared=True" in shown
    assert "replicated remote shared=True" in shown and "shared_vs_not_remote" in shown


# ---- exact overlap and coverage at save: box arithmetic, not element counts ----
def flat(fqn, start, size, shape=(12, 4)):
    return ItemMeta(fqn, "float32", shape, "flat", (start,), (size,), 4 * size)


def test_rows_0_to_5_and_4_to_9_are_refused_although_48_of_48_elements_are_there():
    with pytest.raises(CheckpointError) as caught:
        plan_save([[meta("w", (0, 0), (6, 4), shape=(12, 4))], [meta("w", (4, 0), (6, 4), shape=(12, 4))]])
    assert str(caught.value) == ("w: the ranks' pieces must cover it exactly once, but rank 0's piece [0:6, 0:4] and "
                                 "rank 1's piece [4:10, 0:4] overlap in [4:6, 0:4]; how it is sharded (ss.Sharded "
                                 "offsets, DTensor placements) is inconsistent across ranks or leaves part of it out")


@pytest.mark.parametrize("per_rank, words", [
    ([[meta("w", (0, 0), (6, 4), shape=(12, 4))], [meta("w", (6, 0), (4, 4), shape=(12, 4))]],
     r"w: .* \[10:12, 0:4\] is in no piece"),
    ([[meta("w", (0, 0), (12, 2), shape=(12, 4))], [meta("w", (0, 1), (12, 3), shape=(12, 4))]],
     r"rank 0's piece \[0:12, 0:2\] and rank 1's piece \[0:12, 1:4\] overlap in \[0:12, 1:2\]"),
    ([[flat("f", 0, 30)], [flat("f", 24, 24)]], r"f: .*\(flat ranges.*\[0:30\] and .*\[24:48\] overlap in \[24:30\]"),
    ([[flat("f", 0, 20)], [flat("f", 24, 24)]], r"f: .*flat.*\[20:24\] is in no piece"),
    ([[flat("f", 0, 24)], [meta("f", (6, 0), (6, 4), shape=(12, 4))]], "hold one tensor under each name"),
    ([[meta("c", (0, 0, 0), (2, 3, 4), shape=(2, 6, 4))], [meta("c", (0, 2, 0), (2, 4, 4), shape=(2, 6, 4))]],
     r"c: .*\[0:2, 0:3, 0:4\] and .*\[0:2, 2:6, 0:4\] overlap in \[0:2, 2:3, 0:4\]"),
    ([[meta("c", (0, 0, 0), (2, 3, 2), shape=(2, 6, 4))], [meta("c", (0, 3, 0), (2, 3, 4), shape=(2, 6, 4))]],
     r"c: .*\[0:2, 0:3, 2:4\] is in no piece"),
    ([[meta("w", (8, 0), (6, 4), shape=(12, 4))], [meta("w", (0, 0), (8, 4), shape=(12, 4))]],
     r"rank 0's piece \[8:14, 0:4\] lies outside its global shape \[12, 4\]"),
    ([[meta("h", (0, 0), (1, 4), shape=(1 << 62, 4))]], r"h: global shape .* more than 2\*\*63 - 1 bytes"),
])
def test_overlaps_holes_and_strays_are_refused_at_save(per_rank, words):
    with pytest.raises(CheckpointError, match=words):
        plan_save(per_rank)


def empty_ranks(fqn):
    """2 rows over 4 ranks: 1, 1, 0, 0 (torch.chunk); the empty ranks' zero-size pieces sit at
    different places (the end, the start), so they are distinct pieces, not replicas."""
    out = [meta(fqn, (chunk_bounds(2, 4, r)[0], 0), (chunk_bounds(2, 4, r)[1], 4), shape=(2, 4)) for r in range(3)]
    assert [m.size[0] for m in out] == [1, 1, 0]
    return out + [meta(fqn, (0, 0), (0, 4), shape=(2, 4))]


def test_legitimate_layouts_still_plan():
    shape = (10, 4)
    uneven = [meta("w", (chunk_bounds(10, 4, r)[0], 0), (chunk_bounds(10, 4, r)[1], 4)) for r in range(4)]
    empty = empty_ranks("e")
    step = ItemMeta("step", "float32", (), "box", (), (), 4)
    zero_flat = [flat("z", 0, 16, shape=(8, 8)), flat("z", 16, 48, shape=(8, 8))]
    grid = [meta("g", (5 * (r // 2), 2 * (r % 2)), (5, 2), shape=shape) for r in range(4)]
    plan = plan_save([[uneven[r], empty[r], step, zero_flat[r % 2], grid[r]] for r in range(4)])
    assert plan.tensors["w"].size[:, 0].tolist() == [3, 3, 3, 1]
    assert sorted(plan.tensors["e"].size[:, 0].tolist()) == [0, 0, 1, 1] and len(plan.tensors["step"].rank) == 1


def test_saving_part_of_a_tensor_is_refused(tmp_path):
    """One process declaring half of a tensor would write a checkpoint no layout can load whole."""
    with pytest.raises(CheckpointError, match=r"shard: .*\[8:16\] is in no piece"):
        ss.save({"shard": ss.Sharded(torch.ones(8), (16,), (0,))}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_load_plan_coverage_counts_each_element_once():
    """With disjoint pieces (guaranteed by the manifest check) ``covered`` is exact: zero-size
    pieces add nothing and are not read, a region a piece only partly overlaps counts its overlap."""
    plan = plan_save([[m] for m in empty_ranks("w")])
    outputs = planning.simulated_outputs(plan, 1 << 20)
    manifest = Manifest.from_bytes(build_manifest(plan, outputs, 4, 1 << 20, None).to_bytes())
    entry = manifest.tensors["w"]
    assert entry.num_pieces == 4 and (entry.size[:, 0] == 0).sum() == 2
    whole = plan_target(entry, "box", (0, 0), (2, 4))
    assert whole.covered == 8 and len(whole.reads) == 2
    part = plan_target(entry, "box", (1, 1), (1, 2))
    assert part.covered == 2 and [r.piece for r in part.reads] == [int(np.flatnonzero(entry.start[:, 0] == 1)[0])]
    assert plan_target(entry, "flat", (3,), (4,)).covered == 4
    assert plan_target(entry, "box", (0, 0), (0, 4)).covered == 0


def _grid_tiling(rng, shape):
    """Pieces of ``shape`` cut along a random grid (some of them empty), in a random order."""
    cuts = [sorted({0, n, *rng.integers(0, n + 1, size=rng.integers(0, 2)).tolist()}) for n in shape]
    boxes = [[]]
    for c in cuts:
        boxes = [b + [(lo, hi)] for b in boxes for lo, hi in zip(c, c[1:])] or [b + [(0, 0)] for b in boxes]
    rng.shuffle(boxes)
    return [[lo for lo, _ in b] for b in boxes], [[hi - lo for lo, hi in b] for b in boxes]


def _few_piece_cases(rng) -> list:
    """Entries of up to FEW_PIECES pieces cut along random grids, each with the plan of a whole target."""
    from statesnap.format.manifest import TensorEntry
    from statesnap.plan import load_plan

    cases = []
    for _ in range(300):
        shape = tuple(int(n) for n in rng.integers(0, 6, size=rng.integers(1, 4)))
        start, size = _grid_tiling(rng, shape)
        if len(start) > load_plan.FEW_PIECES:
            continue
        n = len(start)
        entry = TensorEntry(dtype=torch.float32, shape=shape, layout="box", file=np.arange(n),
                            offset=np.zeros(n, np.int64),
                            nbytes=np.array([4 * int(np.prod(s)) for s in size], np.int64),
                            start=np.array(start, np.int64).reshape(n, len(shape)),
                            size=np.array(size, np.int64).reshape(n, len(shape)), checksum=np.zeros(n, np.uint64),
                            checksum_bounds=np.arange(n + 1))
        cases.append((entry, plan_target(entry, "box", (0,) * len(shape), shape)))
    return cases


def test_a_whole_target_of_a_few_pieces_is_planned_as_the_general_search_plans_it(monkeypatch):
    """A checkpoint of a few ranks loaded by one process: every piece lands whole, planned without
    the overlap search, exactly as the search plans it (contiguous pieces as one segment at their
    place, strided ones as box copies)."""
    from statesnap.plan import load_plan

    cases = _few_piece_cases(np.random.default_rng(5))
    assert len(cases) > 200 and any(any(r.box for r in plan.reads) for _, plan in cases)
    monkeypatch.setattr(load_plan, "FEW_PIECES", 0)  # every entry through the vectorised search
    for entry, plan in cases:
        searched = plan_target(entry, "box", (0,) * len(entry.shape), entry.shape)
        assert plan.covered == searched.covered == int(np.prod(entry.shape))
        assert plan.reads == searched.reads, entry


def test_pieces_of_whole_rows_land_where_their_plan_puts_them():
    """``piece_offsets`` (a whole target read without a plan) gives each piece the place its plan
    gives it, for every entry whose pieces are runs of whole rows, and declines the others: a
    strided piece, a target that is a part, another layout, pieces that leave a gap."""
    from statesnap.plan.load_plan import piece_offsets

    rows_only = 0
    for entry, plan in _few_piece_cases(np.random.default_rng(6)):
        shape = entry.shape
        offsets = piece_offsets(entry, "box", (0,) * len(shape), shape)
        by_rows = all(size[1:] == list(shape[1:]) for size in entry.size.tolist())
        if entry.num_pieces == 1:
            assert offsets == [0]
            continue
        assert (offsets is not None) == by_rows, entry
        if offsets is None:
            continue
        rows_only += 1
        placed = {r.piece: (r.segments[0].dst, r.hi - r.lo) for r in plan.reads}
        assert all(r.box is None and len(r.segments) == 1 and r.lo == 0 for r in plan.reads)
        assert placed == {i: (offsets[i], int(entry.nbytes[i])) for i in range(entry.num_pieces) if entry.nbytes[i]}
        assert piece_offsets(entry, "flat", (0,), (int(np.prod(shape)),)) is None
        if shape[0] > 1:
            assert piece_offsets(entry, "box", (1,) + (0,) * (len(shape) - 1), (shape[0] - 1,) + shape[1:]) is None
            part = dataclasses.replace(entry, file=entry.file[:1], offset=entry.offset[:1], nbytes=entry.nbytes[:1],
                                       start=entry.start[:1], size=entry.size[:1],
                                       checksum=entry.checksum[:1], checksum_bounds=entry.checksum_bounds[:2])
            if entry.size[0, 0] < shape[0]:  # a split manifest's entry of the one piece a target reached
                assert piece_offsets(part, "box", (0,) * len(shape), shape) is None
    assert rows_only > 20
