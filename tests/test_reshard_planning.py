"""Save planning at scale (pure computation) and the 1024-rank planning simulation, at a small size."""
import numpy as np
import pytest

from statesnap.bench import planning
from statesnap.errors import CheckpointError
from statesnap.plan.load_plan import plan_target
from statesnap.plan.save_plan import ALIGN, plan_save
from statesnap.state.items import ItemMeta


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
    with pytest.raises(CheckpointError, match="disagree on dtype"):
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
