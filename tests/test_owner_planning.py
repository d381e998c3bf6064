"""Save planning by tensor owners (plan/owners.py), simulated in one process: the same stored
pieces as the whole-job planner, replicas written once and spread by bytes, errors named."""
import numpy as np
import pytest

from statesnap.bench import planning
from statesnap.errors import CheckpointError
from statesnap.plan.owners import owner_of, place_writes, plan_owned, route
from statesnap.plan.save_plan import plan_save
from statesnap.state.items import ItemMeta


def _plan_by_owners(per_rank):
    """Run the phases for every rank; (owned plans, each rank's writes and file end)."""
    world = len(per_rank)
    inboxes = {}
    for rank, metas in enumerate(per_rank):
        for owner, sent in route(metas, (), world).items():
            inboxes.setdefault(owner, {})[rank] = sent
    owned = {owner: plan_owned(inbox) for owner, inbox in inboxes.items()}
    answers = [[o.decisions[r] for o in owned.values() if r in o.decisions] for r in range(world)]
    return owned, [place_writes(metas, answers[r], r)[:2] for r, metas in enumerate(per_rank)]


def _pieces(tables):
    return {fqn: sorted(map(tuple, np.hstack([p.start, p.size]).tolist())) for fqn, p in tables.items()}


def test_owners_store_the_same_pieces_as_the_whole_job_plan_with_pipeline_stages():
    params = planning.llama_parameters(layers=3, dim=64, ffn=96, heads=4, kv_heads=2, vocab=100)
    names, stages = planning.item_names(params), planning.stage_parameters(params, 2)
    per_rank = [planning.rank_items(r, params, names, 2, 3, stages=stages) for r in range(12)]
    owned, placed = _plan_by_owners(per_rank)
    tables = {fqn: p for o in owned.values() for fqn, p in o.tensors.items()}
    assert _pieces(tables) == _pieces(plan_save(per_rank).tensors)
    for fqn, pieces in tables.items():  # each tensor planned by its owner only
        assert fqn in owned[owner_of(fqn, 12)].tensors
        for rank, item in zip(pieces.rank.tolist(), pieces.item.tolist()):
            assert item in dict(placed[rank][0]) and per_rank[rank][item].fqn == fqn
    # stage 0 holds the embeddings, stage 1 the output; the 3 layers split 2 + 1
    assert {m.fqn for m in per_rank[0]} >= {"model.tok_embeddings.weight", "model.layers.1.attention.wq.weight"}
    assert "model.output.weight" in {m.fqn for m in per_rank[6]} and "model.layers.2.attention.wq.weight" not in \
        {m.fqn for m in per_rank[0]}


def test_replicas_are_written_once_and_split_by_bytes_among_their_holders():
    items = [ItemMeta(f"w{i}", "float32", (64, 64), "box", (0, 0), (64, 64), 64 * 64 * 4) for i in range(12)]
    owned, placed = _plan_by_owners([items] * 3)
    written = sorted(index for writes, _ in placed for index, _ in writes)
    assert written == list(range(12))  # every tensor once
    assert [len(writes) for writes, _ in placed] == [4, 4, 4]  # 4 of the 12 equal tensors each


def test_ranks_disagreeing_on_a_tensor_are_named():
    a = ItemMeta("w", "float32", (4, 4), "box", (0, 0), (4, 4), 64)
    b = ItemMeta("w", "float32", (4, 5), "box", (0, 0), (4, 5), 80)
    with pytest.raises(CheckpointError, match="tensor 'w': rank 0 holds it as float32 of shape .* and rank 1 as"):
        _plan_by_owners([[a], [b]])
    c = ItemMeta("w", "float32", (4, 4), "box", (0, 0), (3, 4), 48)
    with pytest.raises(CheckpointError, match="must cover it exactly once"):
        _plan_by_owners([[c], [c]])
