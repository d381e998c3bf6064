"""The transform spec's operators, on hand-built tensors: bit-exact results against expectations
built independently with plain torch, round trips between each op and its inverse, the worked
Megatron cases (GQA QKV and SwiGLU gate|up under TP=2), laziness, and the strictness rules."""
import logging
import re

import pytest
import torch

from statesnap.convert import TransformError
from statesnap.convert.transform import Lazy, apply_spec, load_spec, materialize


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (so NaN payloads and -0.0 count too)."""
    return (a.dtype == b.dtype and a.shape == b.shape and
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def run(ops, values, notes=None):
    """Apply a spec (validated as a user's would be) and read every value."""
    return {k: materialize(v) for k, v in apply_spec(load_spec({"ops": ops}), values, notes).items()}


class Counted:
    """Lazy views of tensors that count how often each is read."""

    def __init__(self):
        self.reads: dict[str, int] = {}

    def lazy(self, name, tensor):
        def read():
            self.reads[name] = self.reads.get(name, 0) + 1
            return tensor.clone()
        return Lazy(tensor.dtype, tuple(tensor.shape), read)


TP_REPLICA = r"tp_rank_(?P<index>\d+)\.(?P<name>.*)"


# --- fuse + average -----------------------------------------------------------------------------

def test_average_is_the_float64_mean_cast_back_and_notes_the_drift(caplog):
    base = randn(4, 5)
    replicas = [base, base + 1e-3 * randn(4, 5, seed=1), base - 2e-3 * randn(4, 5, seed=2)]
    values = {f"tp_rank_{r:02d}.norm.weight": t for r, t in enumerate(replicas)}
    notes = []
    with caplog.at_level(logging.INFO, logger="statesnap.convert"):
        out = run([{"fuse": TP_REPLICA, "to": r"\g<name>", "average": True}], values, notes)
    wide = [t.to(torch.float64) for t in replicas]
    expected = ((wide[0] + wide[1] + wide[2]) / 3).to(torch.float32)
    assert list(out) == ["norm.weight"] and same_bits(out["norm.weight"], expected)
    spread = (torch.stack(wide).amax(0) - torch.stack(wide).amin(0)).max().item()
    assert len(notes) == 1 and "norm.weight" in notes[0] and f"{spread:.6g}" in notes[0]
    assert notes[0] in caplog.messages


def test_average_of_bf16_and_of_identical_replicas_is_bit_exact():
    a, b = randn(3, 8, dtype=torch.bfloat16), randn(3, 8, seed=5, dtype=torch.bfloat16)
    notes = []
    out = run([{"fuse": TP_REPLICA, "to": r"\g<name>", "average": True}],
              {"tp_rank_0.w": a, "tp_rank_1.w": b, "tp_rank_0.v": a.clone(), "tp_rank_1.v": a.clone()}, notes)
    assert same_bits(out["w"], ((a.double() + b.double()) / 2).to(torch.bfloat16))
    assert same_bits(out["v"], a)
    assert any(line.startswith("v:") and "difference between them 0" in line for line in notes)


def test_average_beyond_atol_is_an_error_naming_the_tensor_and_the_op():
    values = {"tp_rank_0.norm": torch.zeros(3), "tp_rank_1.norm": torch.tensor([0.0, 0.5, 0.0])}
    op = {"fuse": TP_REPLICA, "to": r"\g<name>", "average": True, "atol": 0.1}
    with pytest.raises(TransformError, match=r"norm: replicas differ by up to 0\.5, more than atol=0\.1 "
                                             r"\(transform op #1 fuse\)"):
        run([{"drop": "nothing", "optional": True}, op], values)
    assert same_bits(run([{**op, "atol": 0.5}], values)["norm"], torch.tensor([0.0, 0.25, 0.0]))
    with pytest.raises(TransformError, match=r"norm: cannot average torch\.int64 replicas"):
        run([{"fuse": TP_REPLICA, "to": r"\g<name>", "average": True}],
            {"tp_rank_0.norm": torch.arange(3), "tp_rank_1.norm": torch.arange(3)})


# --- fuse + take --------------------------------------------------------------------------------

def test_take_keeps_one_tied_copy_and_notes_how_far_the_others_drifted():
    first_stage = randn(10, 4)
    last_stage = first_stage.clone()
    last_stage[2, 1] += 0.25
    values = {"stage_0.embed": first_stage, "stage_1.embed": last_stage, "stage_1.head": randn(4, 4, seed=3)}
    notes = []
    out = run([{"fuse": r"stage_(?P<index>\d+)\.embed", "to": "embedding.weight", "take": 0}], values, notes)
    assert list(out) == ["embedding.weight", "stage_1.head"]
    assert same_bits(out["embedding.weight"], first_stage)
    assert notes == [f"embedding.weight: took part 0 of 2 replicas (stage_0.embed, stage_1.embed); "
                     f"max abs difference between them {0.25:.6g}"]
    taken = run([{"fuse": r"stage_(?P<index>\d+)\.embed", "to": "e", "take": 1}], values)
    assert same_bits(taken["e"], last_stage)
    with pytest.raises(TransformError, match=r"e: replicas differ by up to 0\.25, more than atol=0\.01"):
        run([{"fuse": r"stage_(?P<index>\d+)\.embed", "to": "e", "take": 1, "atol": 0.01}], values)


def test_take_refuses_other_shapes_dtypes_and_a_missing_part():
    fuse = {"fuse": r"stage_(?P<index>\d+)\.embed", "to": "e", "take": 0}
    with pytest.raises(TransformError, match=r"e: replicas have different shapes .*\[\[10, 4\], \[9, 4\]\]"):
        run([fuse], {"stage_0.embed": randn(10, 4), "stage_1.embed": randn(9, 4)})
    with pytest.raises(TransformError, match=r"e: parts have different dtypes"):
        run([fuse], {"stage_0.embed": randn(10, 4), "stage_1.embed": randn(10, 4).half()})
    with pytest.raises(TransformError, match=r"e: take 2, but there are 2 parts"):
        run([{**fuse, "take": 2}], {"stage_0.embed": randn(10, 4), "stage_1.embed": randn(10, 4)})
    with pytest.raises(TransformError, match=r"e: parts \[0, 2\] found"):
        run([fuse], {"stage_0.embed": randn(10, 4), "stage_2.embed": randn(10, 4)})


# --- fuse + cat + groups, split + groups: the worked Megatron cases ------------------------------

def test_swiglu_gate_up_under_tp2_fuses_to_gate_then_up_and_splits_back():
    hidden, ffn, tp = 6, 8, 2
    gate, up = randn(ffn, hidden, seed=1), randn(ffn, hidden, seed=2)
    rows = ffn // tp
    # Megatron's linear_fc1 on TP rank r: [gate_r; up_r].
    ranks = {f"tp_rank_{r:02d}.mlp.linear_fc1.weight":
             torch.cat([gate[r * rows:(r + 1) * rows], up[r * rows:(r + 1) * rows]]) for r in range(tp)}
    fuse = {"fuse": TP_REPLICA, "to": r"\g<name>", "cat": 0, "groups": 2}
    fused = run([fuse], ranks)
    assert same_bits(fused["mlp.linear_fc1.weight"], torch.cat([gate, up]))
    parts = run([fuse, {"split": r"(.*)\.linear_fc1\.weight", "to": [r"\1.gate.weight", r"\1.up.weight"],
                        "dim": 0}], ranks)
    assert same_bits(parts["mlp.gate.weight"], gate) and same_bits(parts["mlp.up.weight"], up)
    # Export: the full [gate; up] cut back into the per-rank [gate_r; up_r] (split + groups).
    back = run([{"split": r"mlp\.linear_fc1\.weight", "to": [f"tp_rank_{r:02d}.mlp.linear_fc1.weight"
                                                             for r in range(tp)], "dim": 0, "groups": 2}], fused)
    assert back.keys() == ranks.keys() and all(same_bits(back[k], ranks[k]) for k in ranks)


def test_gqa_qkv_megatron_layout_under_tp2_fuses_and_splits_into_q_k_v_and_back():
    heads, groups, head_dim, hidden, tp = 8, 4, 3, 5, 2
    per_group = heads // groups
    q = randn(heads * head_dim, hidden, seed=1)
    k, v = randn(groups * head_dim, hidden, seed=2), randn(groups * head_dim, hidden, seed=3)
    # Megatron: per query group g, [the q heads of g | k_g | v_g]; TP rank r holds its groups.
    layout = torch.cat([torch.cat([q[g * per_group * head_dim:(g + 1) * per_group * head_dim],
                                   k[g * head_dim:(g + 1) * head_dim], v[g * head_dim:(g + 1) * head_dim]])
                        for g in range(groups)])
    per_rank = layout.shape[0] // tp
    ranks = {f"tp_rank_{r}.attn.linear_qkv.weight": layout[r * per_rank:(r + 1) * per_rank].clone() for r in range(tp)}
    ops = [{"fuse": TP_REPLICA, "to": r"\g<name>", "cat": 0},
           {"split": r"(.*)\.linear_qkv\.weight", "to": [r"\1.q.weight", r"\1.k.weight", r"\1.v.weight"],
            "dim": 0, "sizes": [per_group * head_dim, head_dim, head_dim], "groups": groups}]
    out = run(ops, ranks)
    assert same_bits(out["attn.q.weight"], q) and same_bits(out["attn.k.weight"], k)
    assert same_bits(out["attn.v.weight"], v)
    # Back: q, k, v interleaved by query group again (fuse + cat + groups), then cut per rank.
    back = run([{"rename": r"attn\.([qkv])\.weight", "to": r"attn.\1"},
                {"rename": r"attn\.q$", "to": "attn.0"}, {"rename": r"attn\.k$", "to": "attn.1"},
                {"rename": r"attn\.v$", "to": "attn.2"},
                {"fuse": r"attn\.(?P<index>\d)", "to": "attn.linear_qkv.weight", "cat": 0, "groups": groups},
                {"split": r"attn\.linear_qkv\.weight", "to": [f"tp_rank_{r}.attn.linear_qkv.weight" for r in range(tp)],
                 "dim": 0}], out)
    assert back.keys() == ranks.keys() and all(same_bits(back[n], ranks[n]) for n in ranks)


def test_sub_parameters_of_uneven_widths_fuse_sub_parameter_by_sub_parameter():
    """DeepSpeed AutoTP's GQA qkv: rank r holds [q_r; k_r; v_r], q wider than k and v, and a rank's
    share of a sub-parameter may differ from another's (``sub_param_shard_widths``)."""
    q, k, v = randn(6, 3, seed=1), randn(2, 3, seed=2), randn(2, 3, seed=3)
    widths = [[4, 2], [1, 1], [1, 1]]  # q: 4 rows on rank 0, 2 on rank 1
    ranks = {"tp_rank_0.qkv": torch.cat([q[:4], k[:1], v[:1]]), "tp_rank_1.qkv": torch.cat([q[4:], k[1:], v[1:]])}
    fused = run([{"fuse": TP_REPLICA, "to": r"\g<name>", "cat": 0, "widths": widths}], ranks)
    assert same_bits(fused["qkv"], torch.cat([q, k, v]))
    parts = {"tp_rank_0.x": randn(2, 4, seed=4), "tp_rank_1.x": randn(2, 4, seed=5)}  # equal widths are groups
    assert same_bits(run([{"fuse": TP_REPLICA, "to": r"\g<name>", "cat": 1, "widths": [[2, 2], [2, 2]]}], parts)["x"],
                     run([{"fuse": TP_REPLICA, "to": r"\g<name>", "cat": 1, "groups": 2}], parts)["x"])
    with pytest.raises(TransformError, match=r"qkv: sub-parameter widths .* do not give the 2 parts' dimension 0"):
        run([{"fuse": TP_REPLICA, "to": r"\g<name>", "cat": 0, "widths": [[4, 2], [1, 1], [1, 2]]}], ranks)
    with pytest.raises(TransformError, match=r"qkv: sub-parameter widths"):
        run([{"fuse": TP_REPLICA, "to": r"\g<name>", "cat": 0, "widths": [[8], [1], [1]]}], ranks)


def test_cat_groups_and_split_sizes_that_do_not_add_up_are_errors():
    with pytest.raises(TransformError, match=r"fc1: dimension 0 of a part does not divide into 2 groups"):
        run([{"fuse": TP_REPLICA, "to": r"\g<name>", "cat": 0, "groups": 2}],
            {"tp_rank_0.fc1": randn(3, 2), "tp_rank_1.fc1": randn(3, 2)})
    with pytest.raises(TransformError, match=r"qkv: part sizes \[4, 2, 1\] x 2 groups do not add up"):
        run([{"split": "qkv", "to": ["q", "k", "v"], "dim": 0, "sizes": [4, 2, 1], "groups": 2}], {"qkv": randn(16, 2)})


# --- vocab --------------------------------------------------------------------------------------

def test_vocab_strips_padded_rows_and_pads_to_a_multiple_round_trip():
    padded = randn(12, 4)
    stripped = run([{"vocab": r"embed\.weight$", "size": 10, "dim": 0}], {"embed.weight": padded, "step": 3})
    assert same_bits(stripped["embed.weight"], padded[:10].clone()) and stripped["step"] == 3
    assert stripped["embed.weight"].untyped_storage().nbytes() == 10 * 4 * 4  # not a view of the padded tensor
    repadded = run([{"vocab": r"embed\.weight$", "multiple": 8}], {"embed.weight": stripped["embed.weight"]})
    assert same_bits(repadded["embed.weight"], torch.cat([padded[:10], torch.zeros(6, 4)]))
    again = run([{"vocab": r"embed\.weight$", "size": 10}], repadded)
    assert same_bits(again["embed.weight"], padded[:10].clone())
    columns = run([{"vocab": "out", "multiple": 4, "dim": 1}], {"out": torch.ones(2, 3, dtype=torch.bfloat16)})
    assert same_bits(columns["out"], torch.tensor([[1, 1, 1, 0]] * 2, dtype=torch.bfloat16))
    with pytest.raises(TransformError, match=r"embed\.weight: has 12 rows along dimension 0, fewer than the "
                                             r"vocabulary size 13 \(shapes \[\[12, 4\]\]\) \(transform op #0 vocab\)"):
        run([{"vocab": r"embed\.weight$", "size": 13}], {"embed.weight": padded})
    # "padded": the rows the source says it padded to are checked before any row is cut
    assert same_bits(run([{"vocab": "embed", "size": 10, "padded": 12}], {"embed": padded})["embed"], padded[:10].clone())
    with pytest.raises(TransformError, match="has 12 rows along dimension 0, not the 16 the source says it padded to"):
        run([{"vocab": "embed", "size": 10, "padded": 16}], {"embed": padded})


# --- unstack ------------------------------------------------------------------------------------

def test_unstack_names_each_index_and_fuse_stack_is_its_inverse():
    stacked = randn(3, 4, 5)
    out = run([{"unstack": r"(.*)\.experts\.w1", "to": r"\1.experts.{index}.w1", "dim": 0}],
              {"moe.experts.w1": stacked, "moe.router": randn(2, seed=4)})
    assert list(out) == ["moe.experts.0.w1", "moe.experts.1.w1", "moe.experts.2.w1", "moe.router"]
    assert all(same_bits(out[f"moe.experts.{i}.w1"], stacked[i].clone()) for i in range(3))
    back = run([{"fuse": r"(?P<name>.*)\.experts\.(?P<index>\d+)\.w1", "to": r"\g<name>.experts.w1", "stack": 0}], out)
    assert same_bits(back["moe.experts.w1"], stacked)
    by_column = run([{"unstack": "w", "to": "w{index}", "dim": 1}], {"w": stacked})
    assert all(same_bits(by_column[f"w{i}"], stacked[:, i].contiguous()) for i in range(4))
    with pytest.raises(TransformError, match=r"w1: 'w' is mapped onto a name another value already has"):
        run([{"unstack": "w", "to": "w{index}", "dim": 0}], {"w1": randn(1), "w": stacked})


# --- cast ---------------------------------------------------------------------------------------

def test_cast_changes_floating_tensors_only():
    weight, bias, counter = randn(3, 4), randn(4, dtype=torch.float16), torch.tensor(7)
    out = run([{"cast": r"^model\.", "dtype": "bfloat16"}],
              {"model.w": weight, "model.b": bias, "model.num_batches_tracked": counter, "other": weight})
    assert same_bits(out["model.w"], weight.to(torch.bfloat16)) and same_bits(out["model.b"], bias.to(torch.bfloat16))
    assert same_bits(out["model.num_batches_tracked"], counter) and same_bits(out["other"], weight)
    with pytest.raises(TransformError, match="matched no name"):
        run([{"cast": "num_batches", "dtype": "float32"}], {"num_batches": counter})


# --- expect -------------------------------------------------------------------------------------

def test_expect_lists_the_names_the_spec_left_uncovered():
    values = {"tp_rank_0.w": randn(2), "tp_rank_1.w": randn(2), "tp_rank_0.extra": randn(1), "step": 1}
    fuse = {"fuse": r"tp_rank_(?P<index>\d+)\.(?P<name>w)", "to": r"\g<name>", "cat": 0}
    with pytest.raises(TransformError, match=r"1 names are left uncovered by the spec .*: tp_rank_0\.extra "
                                             r"\(transform op #1 expect\)"):
        run([fuse, {"expect": r"w|step"}], values)
    assert sorted(run([fuse, {"drop": "extra"}, {"expect": r"w|step"}], values)) == ["step", "w"]


# --- laziness and strictness shared by every op -------------------------------------------------

def test_ops_stay_lazy_and_a_split_source_is_read_once():
    source = Counted()
    stacked, qkv = randn(2, 3), randn(6, 3, seed=1)
    values = {"tp_rank_0.n": source.lazy("n0", stacked[0]), "tp_rank_1.n": source.lazy("n1", stacked[0]),
              "e": source.lazy("e", stacked), "qkv": source.lazy("qkv", qkv), "emb": source.lazy("emb", qkv)}
    ops = load_spec({"ops": [{"fuse": TP_REPLICA, "to": r"\g<name>", "average": True},
                             {"unstack": "e", "to": "e{index}"}, {"split": "qkv", "to": ["q", "k", "v"], "dim": 0},
                             {"vocab": "emb", "size": 5}, {"cast": ".", "dtype": "float16"}, {"expect": ".*"}]})
    lazy = apply_spec(ops, values)
    assert source.reads == {} and all(isinstance(v, Lazy) for v in lazy.values())
    assert lazy["q"].shape == (2, 3) and lazy["emb"].shape == (5, 3) and lazy["e1"].dtype == torch.float16
    out = {k: materialize(v) for k, v in lazy.items()}
    assert source.reads == {"n0": 1, "n1": 1, "e": 1, "qkv": 1, "emb": 1}
    assert same_bits(out["k"], qkv[2:4].half()) and same_bits(out["e1"], stacked[1].half())


def test_malformed_ops_are_refused_before_any_value_is_read():
    for op in ({"fuse": TP_REPLICA, "to": "x", "stack": 0, "groups": 2},
               {"fuse": TP_REPLICA, "to": "x", "cat": 0, "atol": 0.1},
               {"fuse": TP_REPLICA, "to": "x", "take": True}, {"fuse": TP_REPLICA, "to": "x", "average": 1},
               {"fuse": TP_REPLICA, "to": "x", "cat": 0, "same": True}, {"fuse": "(.*)", "to": "x", "average": True},
               {"vocab": "e", "size": 10, "multiple": 8}, {"vocab": "e"}, {"vocab": "e", "size": 0},
               {"unstack": "e", "to": "e.0"}, {"cast": "x", "dtype": "int32"}, {"cast": "x", "dtype": "nonsense"},
               {"expect": "("}, {"expect": "x", "to": "y"}, {"split": "x", "to": ["a", "b"], "dim": 0, "sizes": [1]},
               {"split": "x", "to": ["a"], "dim": 0, "groups": 0},
               {"rename": "x", "to": 5}, {"fuse": TP_REPLICA, "to": 3, "cat": 0}, {"split": "x", "to": [1, 2], "dim": 0},
               {"drop": "x", "optional": "no"}, {"fuse": TP_REPLICA, "to": "x", "cat": 0, "widths": [[1, 2], [3]]},
               {"fuse": TP_REPLICA, "to": "x", "cat": 0, "groups": 2, "widths": [[1], [1]]},
               {"fuse": TP_REPLICA, "to": "x", "same": True, "widths": [[1]]},
               {"fuse": TP_REPLICA, "to": "x", "cat": 0, "widths": [[1, -1]]},
               {"fuse": TP_REPLICA, "to": "x", "cat": 0, "widths": []}):
        with pytest.raises(TransformError, match="op #0"):
            load_spec({"ops": [op]})


@pytest.mark.parametrize("op, words", [({"vocab": "e", "size": 0}, 'vocab\'s "size" must be a positive count, not 0'),
                                       ({"vocab": "e", "multiple": -8}, '"multiple" must be a positive count, not -8'),
                                       ({"vocab": "e"}, "vocab needs exactly one of")])
def test_a_vocab_op_says_which_value_is_wrong(op, words):
    with pytest.raises(TransformError, match=re.escape(words)):
        load_spec({"ops": [op]})


def test_templates_that_do_not_fit_their_pattern_are_errors_naming_the_value():
    """A group the pattern lacks, or an index that is not a number, shows only once a name
    matches: an error naming it and the op, not re.error, IndexError or ValueError."""
    values = {"a.0": randn(2), "a.1": randn(2)}
    for op, problem in (({"rename": "a", "to": "\\9"}, "invalid group reference 9"),
                        ({"rename": "a", "to": "\\g<zz>"}, "unknown group name 'zz'"),
                        ({"fuse": r"a\.(?P<index>\d)", "to": "\\2", "cat": 0}, "invalid group reference 2"),
                        ({"split": "a.0", "to": ["\\g<x>", "y"], "dim": 0}, "unknown group name 'x'"),
                        ({"unstack": "a.0", "to": "\\1.{index}"}, "invalid group reference 1"),
                        ({"fuse": r"(?P<index>a)\.\d", "to": "b", "cat": 0}, "group 'index' matched 'a'")):
        with pytest.raises(TransformError, match=rf"a\.0: .*{problem}.*\(transform op #0 {next(iter(op))}\)"):
            run([op], values)


def test_patterns_that_match_nothing_and_collisions_are_errors():
    values = {"a": randn(2), "b": randn(2)}
    for op in ({"vocab": "zzz", "size": 1}, {"unstack": "zzz", "to": "{index}"}, {"cast": "zzz", "dtype": "float16"},
               {"fuse": r"zzz(?P<index>\d)", "to": "y", "take": 0}):
        with pytest.raises(TransformError, match="matched no name"):
            run([op], values)
        assert run([{**op, "optional": True}], values).keys() == values.keys()
    with pytest.raises(TransformError, match=r"c: 'b' is mapped onto a name another value already has "
                                             r"\(transform op #0 rename\)"):
        run([{"rename": "[ab]", "to": "c"}], values)
