"""Planning at scale, simulated in one process: Llama-shaped models plus AdamW over 1k-16k ranks.

Planning is pure computation (``plan/``), so a whole job's worth of it runs here without any
process: every simulated rank describes its pieces exactly as the state providers would for
torchtitan's layout (a 2-D mesh, FSDP outer x TP inner; attention and MLP input projections and
the embeddings and output ``ColwiseParallel``/row-sharded on dim 0, the output projections
``RowwiseParallel`` on dim 1, norms replicated over TP; FSDP then chunks dim 0 of the TP-local
tensor, which is the ``_StridedShard`` layout; with pipeline parallelism, the outermost mesh
dimension, each stage holds a contiguous run of layers, the first the embeddings, the last the
final norm and output). We measure

* save planning as ``ss.save`` runs it (plan/owners.py), every simulated rank's phases timed on
  their own: the slowest rank's total is what a job would wait for. With ``--whole`` also the
  whole-job planner every rank ran before (``plan_save`` over every rank's items plus
  ``build_manifest``), whose time is the same on every rank;
* load planning for one rank: ``plan_target`` for each of its items, same layout and resharded
  into another mesh (TP 4 x FSDP 256 by default);
* the manifest's size against DCP's metadata for the same layout. DCP's is estimated by building
  its public ``torch.distributed.checkpoint.metadata`` objects for a sample of layers, pickling
  them (as DCP stores ``.metadata``) and scaling per layer; ours is measured in full.
"""
from __future__ import annotations

import argparse
import gc
import pickle
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)

from ..engine.save import RankOutput, build_manifest, data_file_name, split_index
from ..format.checksum import DEFAULT_BLOCK_BYTES, piece_blocks
from ..format.dtypes import dtype_from_name, itemsize
from ..format.manifest import BOX, Manifest
from ..format.split import encode_section, section_name
from ..plan.load_plan import plan_target
from ..plan.owners import owner_of, place_writes, plan_owned, route
from ..plan.save_plan import plan_save
from .common import positive_int, publish
from ..monitor.trace import can_plot
from ..state.items import ItemMeta
from ..state.placement import chunk_bounds

LLAMA_70B = dict(layers=80, dim=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256)
LLAMA_405B = dict(layers=126, dim=16384, ffn=53248, heads=128, kv_heads=8, vocab=128256)
MODELS = {"70b": LLAMA_70B, "405b": LLAMA_405B}
COL, ROW, REP = "colwise", "rowwise", "replicate"  # how TP splits a parameter
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def llama_parameters(layers: int, dim: int, ffn: int, heads: int, kv_heads: int, vocab: int):
    """(name, shape, TP style) of every parameter, in torchtitan's naming."""
    kv = dim // heads * kv_heads
    out = [("tok_embeddings.weight", (vocab, dim), COL)]  # RowwiseParallel on an embedding: rows
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (dim, dim), COL), (p + "attention.wk.weight", (kv, dim), COL),
                (p + "attention.wv.weight", (kv, dim), COL), (p + "attention.wo.weight", (dim, dim), ROW),
                (p + "feed_forward.w1.weight", (ffn, dim), COL), (p + "feed_forward.w2.weight", (dim, ffn), ROW),
                (p + "feed_forward.w3.weight", (ffn, dim), COL),
                (p + "attention_norm.weight", (dim,), REP), (p + "ffn_norm.weight", (dim,), REP)]
    return out + [("norm.weight", (dim,), REP), ("output.weight", (vocab, dim), COL)]


def rank_box(shape: tuple, style: str, tp: int, tp_size: int, dp: int, dp_size: int) -> tuple[tuple, tuple]:
    """The box a (dp, tp) rank holds: TP splits first, FSDP chunks dim 0 of the TP-local tensor."""
    start, size = [0] * len(shape), list(shape)
    if style != REP:
        dim = 0 if style == COL else 1
        start[dim], size[dim] = chunk_bounds(shape[dim], tp_size, tp)
    offset, size[0] = chunk_bounds(size[0], dp_size, dp)
    start[0] += offset
    return tuple(start), tuple(size)


def item_names(params) -> list[tuple[str, ...]]:
    """Per parameter: its checkpoint names (parameter, AdamW moments, step), built once and
    shared by every simulated rank, as unpickled gathers would not but memory here must."""
    return [(f"model.{name}", *(f"optim.state.{name}.{s}" for s in ADAM_STATES), f"optim.state.{name}.step")
            for name, _, _ in params]


def stage_parameters(params, pp_size: int) -> list[list[int]]:
    """Per pipeline stage, the indices of the parameters it holds: layers split as evenly as
    ``chunk_bounds`` splits them, the embeddings on the first stage, the rest on the last."""
    layers = sum(1 for name, _, _ in params if name.startswith("layers.") and name.endswith("attention.wq.weight"))
    bounds = [chunk_bounds(layers, pp_size, s) for s in range(pp_size)]
    out: list[list[int]] = [[] for _ in range(pp_size)]
    for index, (name, _, _) in enumerate(params):
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            out[next(s for s, (lo, n) in enumerate(bounds) if lo <= layer < lo + n)].append(index)
        else:
            out[0 if name.startswith("tok_embeddings") else pp_size - 1].append(index)
    return out


def rank_items(rank: int, params, names, tp_size: int, dp_size: int, dtype: str = "float32",
               stages: list[list[int]] | None = None) -> list[ItemMeta]:
    """What the state providers of ``rank`` describe: each parameter of its stage (``stages``
    from ``stage_parameters``; None: no pipeline), its AdamW moments (same box) and its step
    count (a replicated scalar). TP is the inner mesh dimension, pipeline stages the outer."""
    tp, dp = rank % tp_size, rank // tp_size % dp_size
    held = range(len(params)) if stages is None else stages[rank // (tp_size * dp_size)]
    isz = itemsize(dtype_from_name(dtype))
    items = []
    for (_, shape, style), (*boxed, step) in ((params[i], names[i]) for i in held):
        start, size = rank_box(shape, style, tp, tp_size, dp, dp_size)
        nbytes = isz
        for s in size:
            nbytes *= s
        items += [ItemMeta(fqn, dtype, shape, BOX, start, size, nbytes) for fqn in boxed]
        items.append(ItemMeta(step, dtype, (), BOX, (), (), isz))
    return items


def simulated_outputs(plan, block_bytes: int) -> list[RankOutput]:
    """What each rank would report after writing: its file and one checksum per block."""
    outputs = [RankOutput(f"data-sim-r{rank:05d}.bin" if writes else None, plan.file_bytes[rank], {}, {}, set())
               for rank, writes in enumerate(plan.writes)]
    for pieces in plan.tensors.values():
        for rank, item, nbytes in zip(pieces.rank.tolist(), pieces.item.tolist(), pieces.nbytes.tolist()):
            outputs[rank].checksums[item] = [0xFFFFFFFFFFFFFFFF] * piece_blocks(nbytes, block_bytes)
    return outputs


@dataclass
class StorageInfo:
    """Stand-in for DCP's per-chunk storage record (file, offset, length) in ``storage_data``;
    the class itself is private to ``torch.distributed.checkpoint.filesystem``."""

    relative_path: str
    offset: int
    length: int


def dcp_metadata_bytes(manifest: Manifest) -> int:
    """Size of DCP's pickled ``Metadata`` describing the same pieces as ``manifest``."""
    state_meta, storage = {}, {}
    for fqn, entry in manifest.tensors.items():
        chunks = []
        for i in range(entry.num_pieces):
            offsets, sizes = torch.Size(entry.start[i].tolist()), torch.Size(entry.size[i].tolist())
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            storage[MetadataIndex(fqn, offsets, i)] = StorageInfo(
                f"__{int(entry.file[i])}_0.distcp", int(entry.offset[i]), int(entry.nbytes[i]))
        state_meta[fqn] = TensorStorageMetadata(TensorProperties(dtype=entry.dtype), torch.Size(entry.shape), chunks)
    return len(pickle.dumps(Metadata(state_dict_metadata=state_meta, storage_data=storage)))


def plan_save_job(params, tp_size: int, dp_size: int, block_bytes: int = DEFAULT_BLOCK_BYTES):
    """(manifest, seconds of plan_save + build_manifest) for the whole job."""
    world, names = tp_size * dp_size, item_names(params)
    per_rank = [rank_items(r, params, names, tp_size, dp_size) for r in range(world)]
    started = time.perf_counter()
    plan = plan_save(per_rank)
    planned = time.perf_counter()
    outputs = simulated_outputs(plan, block_bytes)
    built = time.perf_counter()
    manifest = build_manifest(plan, outputs, world, block_bytes, None)
    done = time.perf_counter()
    return manifest, (planned - started) + (done - built)


def simulate_owner_save(params, tp_size: int, dp_size: int, pp_size: int = 1,
                        block_bytes: int = DEFAULT_BLOCK_BYTES) -> tuple[bytes, dict[str, bytes], np.ndarray, int]:
    """(index, section files by name, seconds per rank, pieces) of the save planning ``ss.save``
    runs (plan/owners.py) and of its split manifest (format/split.py): each simulated rank's own
    phases are timed alone, the exchanges between them are not (what they move is O(own items)
    per rank). Checksums are made up, one per block. The garbage collector is off while timing:
    its passes over millions of simulated items would land in one rank's time, and a real rank
    holds only its own."""
    world, names = tp_size * dp_size * pp_size, item_names(params)
    stages = stage_parameters(params, pp_size) if pp_size > 1 else None
    per_rank = [rank_items(r, params, names, tp_size, dp_size, stages=stages) for r in range(world)]
    seconds = np.zeros(world)
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        owned = _owner_phases(per_rank, world, seconds, block_bytes)
        del per_rank
        files = [data_file_name("0123456789ab", rank) for rank in range(world)]
        sizes, sections, outputs, pieces = [0] * world, {}, [], 0
        for owner, (plan, reports) in sorted(owned.items()):
            started = time.perf_counter()
            entries = plan.entries(reports, range(world))  # every rank writes pieces here
            raw, rows = encode_section(entries)
            seconds[owner] += time.perf_counter() - started
            name = section_name("0123456789ab", owner)
            sections[name] = raw
            outputs.append((name, len(raw), rows))
            for entry in entries.values():
                pieces += entry.num_pieces
                for f, end in zip(entry.file.tolist(), (entry.offset + entry.nbytes).tolist()):
                    sizes[f] = max(sizes[f], end)
        started = time.perf_counter()
        ranks = [RankOutput(name, size, {}, {}, set()) for name, size in zip(files, sizes)]
        for out, section in zip(ranks, outputs):  # which rank reports which section does not matter
            out.section = section
        _, index = split_index(ranks, world, block_bytes, None)
        seconds[0] += time.perf_counter() - started
    finally:
        if gc_was_on:
            gc.enable()
    return index, sections, seconds, pieces


def _owner_phases(per_rank: list, world: int, seconds: np.ndarray, block_bytes: int) -> dict:
    """Phases 1-3 and the writers' reports of plan/owners.py for every simulated rank, each
    rank's share of the work added to ``seconds``; owner -> (its plan, the reports it receives)."""
    inboxes: dict[int, dict] = {}
    for rank, metas in enumerate(per_rank):
        started = time.perf_counter()
        routed = route(metas, (), world)
        seconds[rank] += time.perf_counter() - started
        for owner, sent in routed.items():
            inboxes.setdefault(owner, {})[rank] = sent
    owned, answers = {}, [[] for _ in range(world)]
    for owner, inbox in inboxes.items():
        started = time.perf_counter()
        owned[owner] = (plan_owned(inbox), {})
        seconds[owner] += time.perf_counter() - started
        for rank, decision in owned[owner][0].decisions.items():
            answers[rank].append(decision)
    del inboxes
    for rank, metas in enumerate(per_rank):
        started = time.perf_counter()
        writes, _, _ = place_writes(metas, answers[rank], rank)
        outgoing: dict[int, dict] = {}
        for index, offset in writes:
            sums = [0xFFFFFFFFFFFFFFFF] * piece_blocks(metas[index].nbytes, block_bytes)
            outgoing.setdefault(owner_of(metas[index].fqn, world), {})[index] = (offset, sums)
        seconds[rank] += time.perf_counter() - started
        for owner, sent in outgoing.items():
            owned[owner][1][rank] = sent
    return owned


def load_planning(index: bytes, sections: dict[str, bytes], params, tp_size: int, dp_size: int, ranks,
                  pp_size: int = 1) -> list[tuple[float, int]]:
    """(seconds, manifest bytes read) for each of ``ranks`` in a (pp_size x dp_size x tp_size)
    target layout to parse the index, read the parts of the sections its tensors need and plan
    every read. What the simulation holds is frozen out of the garbage collector's sight first:
    a loading rank's heap holds only its own state."""
    out, names = [], item_names(params)
    stages = stage_parameters(params, pp_size) if pp_size > 1 else None
    gc.collect()
    gc.freeze()
    for rank in ranks:
        items = rank_items(rank, params, names, tp_size, dp_size, stages=stages)
        started = time.perf_counter()
        manifest = Manifest.from_bytes(index, fetch=lambda name, offset, n: sections[name][offset:offset + n])
        for item in items:
            plan_target(manifest.tensor_part(item.fqn, item.layout, item.start, item.size), item.layout,
                        item.start, item.size)
        out.append((time.perf_counter() - started, len(index) + manifest.tensors.reader.bytes_read))
    gc.unfreeze()
    return out


def run(layers: int = 80, tp: int = 8, dp: int = 128, reshard_tp: int = 4, reshard_dp: int = 256,
        sample_ranks: int = 4, dcp_layers: int = 2, pp: int = 1, model: str = "70b", whole: bool = False) -> dict:
    """Simulate; return the figures (seconds and bytes) as a dict."""
    cfg = dict(MODELS[model], layers=layers)
    params = llama_parameters(**cfg)
    world, target_world = tp * dp * pp, reshard_tp * reshard_dp * pp
    figures: dict = {"model": cfg, "layout": f"TP {tp} x PP {pp} x FSDP {dp} ({world} ranks)"}
    if whole:
        _, figures["whole_job_save_planning_s"] = plan_save_job(params, tp, dp) if pp == 1 else (None, float("nan"))
    index, sections, per_rank, pieces = simulate_owner_save(params, tp, dp, pp)
    total = len(index) + sum(map(len, sections.values()))
    started = time.perf_counter()
    manifest = Manifest.from_bytes(index)
    parse_s = time.perf_counter() - started
    step = max(1, world // sample_ranks)
    same = load_planning(index, sections, params, tp, dp, range(0, world, step)[:sample_ranks], pp)
    tstep = max(1, target_world // sample_ranks)
    resharded = load_planning(index, sections, params, reshard_tp, reshard_dp,
                              range(0, target_world, tstep)[:sample_ranks], pp)
    dcp_bytes, ours_sample = _dcp_estimate(cfg, params, tp, dp, min(dcp_layers, layers), layers)
    figures.update({
        "tensors": len(manifest.tensors), "pieces": pieces,
        "items_per_rank": max(len(s) for s in stage_parameters(params, pp)) * (2 + len(ADAM_STATES)),
        "save_planning_s": float(per_rank.max()), "save_planning_s_median_rank": float(np.median(per_rank)),
        "save_planning_s_rank0": float(per_rank[0]),
        "index_parse_s": parse_s,
        "load_planning_s_same_layout": max(s for s, _ in same),
        "load_manifest_read_same_layout": max(n for _, n in same) / total,
        "load_planning_s_resharded": max(s for s, _ in resharded),
        "load_manifest_read_resharded": max(n for _, n in resharded) / total,
        "reshard_target": f"TP {reshard_tp} x PP {pp} x FSDP {reshard_dp}",
        "manifest_bytes": total, "index_bytes": len(index), "dcp_metadata_bytes_estimated": dcp_bytes,
        "manifest_vs_dcp": total / dcp_bytes, "sample_v1_manifest_vs_dcp": ours_sample,
    })
    return figures


def _dcp_estimate(cfg: dict, params, tp: int, dp: int, sample_layers: int, layers: int) -> tuple[int, float]:
    """DCP metadata bytes for ``layers`` layers, scaled from samples of 0 and ``sample_layers``
    layers (DCP pickles per chunk, so its size is linear in the layer count); also the ratio
    ours/DCP measured on the sample itself."""
    sizes = []
    for n in (0, sample_layers):
        sample_params = llama_parameters(**dict(cfg, layers=n))
        manifest, _ = plan_save_job(sample_params, tp, dp)
        sizes.append((len(manifest.to_bytes()), dcp_metadata_bytes(manifest)))
    (ours0, dcp0), (ours_n, dcp_n) = sizes
    per_layer = (dcp_n - dcp0) / max(sample_layers, 1)
    return int(dcp0 + per_layer * layers), ours_n / dcp_n


SCALING_DP = (8, 32, 128)  # TP 8 x PP 16 x FSDP 8, 32, 128: 1024, 4096 and 16,384 ranks


def scaling(png: str | None, sample_ranks: int = 4) -> list[dict]:
    """The 405B-shaped model over TP 8 x PP 16 x FSDP 8/32/128; figures per point, and a plot
    of the per-rank times and the manifest's bytes against the ranks when ``png`` is given."""
    points = [run(LLAMA_405B["layers"], 8, dp, 4, 2 * dp, sample_ranks, 2, 16, "405b") for dp in SCALING_DP]
    if png and can_plot():
        _plot_scaling(points, png)
    return points


def _plot_scaling(points: list[dict], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [8 * 16 * dp for dp in SCALING_DP]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("save_planning_s", "save planning, slowest rank"),
                       ("load_planning_s_same_layout", "load planning per rank, same layout"),
                       ("load_planning_s_resharded", "load planning per rank, resharded (TP 4)")):
        left.plot(ranks, [p[key] for p in points], "o-", label=label)
    left.axhline(2.0, color="grey", ls=":", lw=1)
    left.axhline(0.5, color="grey", ls="--", lw=1)
    left.set(xscale="log", xlabel="ranks (TP 8 x PP 16 x FSDP)", ylabel="seconds", title="planning time")
    for key, label in (("dcp_metadata_bytes_estimated", "DCP metadata (estimated)"),
                       ("manifest_bytes", "statesnap manifest (index + sections)")):
        right.plot(ranks, [p[key] / 1e6 for p in points], "o-", label=label)
    right.plot(ranks, [p["load_manifest_read_same_layout"] * p["manifest_bytes"] / 1e6 for p in points],
               "o-", label="manifest bytes one loading rank reads")
    right.set(xscale="log", yscale="log", xlabel="ranks (TP 8 x PP 16 x FSDP)", ylabel="MB",
              title="manifest size (405B-shaped + AdamW)")
    for ax in (left, right):
        ax.set_xticks(ranks, [f"{r:,}" for r in ranks])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap bench --suite planning", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="70b", help="Llama shape (layers: --layers)")
    parser.add_argument("--layers", type=positive_int, help="transformer layers (default: the model's, 80 or 126)")
    parser.add_argument("--tp", type=positive_int, default=8)
    parser.add_argument("--dp", type=positive_int, default=128, help="FSDP degree (world = tp * dp * pp)")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline stages")
    parser.add_argument("--reshard-tp", type=positive_int, default=4)
    parser.add_argument("--reshard-dp", type=positive_int, default=256)
    parser.add_argument("--sample-ranks", type=positive_int, default=4, help="ranks whose load planning is timed")
    parser.add_argument("--dcp-layers", type=positive_int, default=2, help="layers in DCP's metadata sample")
    parser.add_argument("--whole", action="store_true", help="also time the whole-job planner (no pipeline only)")
    parser.add_argument("--scaling", metavar="PNG", help="instead: the 405B-shaped model over TP 8 x PP 16 x "
                        "FSDP 8/32/128 (1k, 4k, 16k ranks), plotted here ('' for no plot)")
    parser.add_argument("--json", help="also write the figures as JSON here ('-' = stdout)")
    args = parser.parse_args(argv)
    if args.scaling is not None:
        points = scaling(args.scaling, args.sample_ranks)
        publish({"scaling": points}, "\n".join(
            f"{p['layout']:40} save {p['save_planning_s']:.3f} s, load {p['load_planning_s_same_layout']:.3f} s "
            f"(resharded {p['load_planning_s_resharded']:.3f} s) reading {100 * p['load_manifest_read_same_layout']:.2f} %"
            f" of {p['manifest_bytes'] / 1e6:.1f} MB, DCP {p['dcp_metadata_bytes_estimated'] / 1e6:.0f} MB"
            for p in points), args.json)
        return 0
    layers = args.layers if args.layers is not None else MODELS[args.model]["layers"]
    figures = run(layers, args.tp, args.dp, args.reshard_tp, args.reshard_dp, args.sample_ranks, args.dcp_layers,
                  args.pp, args.model, args.whole)
    publish(figures, "\n".join(f"{key:32} {value:.3f}" if isinstance(value, float) else f"{key:32} {value}"
                               for key, value in figures.items()), args.json)
    return 0
