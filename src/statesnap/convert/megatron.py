"""``source="megatron"``: megatron-core ``dist_checkpointing`` directories and Megatron-LM's classic
per-rank files, merged into one model's names.

Two layouts exist. ``dist_checkpointing.save`` with the ``torch_dist`` backend writes a DCP
directory plus ``common.pt`` (the non-sharded state: ``args``, ``iteration``, ...) and
``metadata.json``; its tensors are *global* (TP and PP already undone) but "layer-stacked": one
tensor per sub-module name with a leading layer axis (``decoder.layers.mlp.linear_fc1.weight``
of shape ``(layers, ...)``). The classic layout is ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``,
one ``torch.save`` of ``{"model": state_dict, "iteration", "args", "checkpoint_version", ...}`` per
tensor/pipeline rank; its tensors are per-rank slices with stage-local layer numbers.

Both come out under the names a megatron-core ``GPTModel`` built with the local layer spec gives
in ``state_dict()``, so a model trained on any TP/PP layout and saved in either format converts
to the same names and bytes:

- ``model.<param>``: ``decoder.layers.<global i>.<sub>`` per layer; the fused-norm names
  dist_checkpointing always writes (``self_attention.linear_qkv.layer_norm_weight``, the Transformer
  Engine names) become ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``; ``_extra_state``
  entries (Transformer Engine's FP8 metadata, ``None`` without it) are dropped. Tied embeddings
  are one tensor, ``embedding.word_embeddings.weight``, as in a one-stage model. With ``args``
  holding ``vocab_size`` and a larger ``padded_vocab_size``, the padded vocabulary rows are
  stripped (other sizes: add a ``{"vocab": ..., "size": N}`` op to the ``spec`` of ``ss.convert``).
- ``fp32.<param>``, ``optim.state.<param>.exp_avg|exp_avg_sq``: the distributed optimizer's fp32
  master weights and Adam moments, full shape (``fully_reshardable`` and ``dp_reshardable``);
  ``optim.param_groups`` (Megatron keeps Adam's step in them) and ``optim.step``.
- everything else in ``common.pt`` (or the classic file besides ``model``) as plain data:
  ``args.<field>`` (an ``argparse.Namespace`` read as a dict, never unpickled as a class),
  ``iteration``, ``checkpoint_version``. The classic files' ``optimizer``, ``rng_state`` and
  ``opt_param_scheduler`` are not imported (logged).

Classic TP slices are merged by a spec derived from megatron-core's parallel layers (see
:func:`classic_spec`); the optimizer buckets of ``dp_reshardable`` by :mod:`.megatron_buckets`.
"""
from __future__ import annotations

import json
import logging
import os
import re
from itertools import islice
from typing import Any

from ..errors import CheckpointError
from . import dcp, unpickler
from .megatron_buckets import bucket_values, sharded_object
from .transform import apply_spec, is_tensor, load_spec
from .tree import flatten_tree

log = logging.getLogger("statesnap.convert")

METADATA_JSON, COMMON = "metadata.json", "common.pt"
TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
SHOWN_MISSING = 8  # rank directories named in an error
_ITERATION = re.compile(r"iter_\d{7}|release")
_RANK_DIR = re.compile(r"mp_rank_(?P<tp>\d{2})(?:_(?P<pp>\d{3}))?")
_LAYER = re.compile(r"(?P<head>(?:.*\.)?decoder\.layers\.)(?P<index>\d+)\.(?P<tail>.*)")
# Keys of the classic files that are not model weights and are not imported.
_CLASSIC_SKIPPED = ("optimizer", "rng_state", "opt_param_scheduler", "lr_scheduler")
# megatron-core's tensor-parallel layers, by the attribute names GPTModel gives them: column-parallel
# weights are cut along their output rows (dim 0; the vocabulary for the embedding and the output
# layer), row-parallel ones along their inputs (dim 1); everything else is replicated on every TP rank.
COLUMN_PARALLEL = r"(?:embedding\.word_embeddings\.weight|output_layer\.(?:weight|bias)" \
                  r"|.*\.linear_qkv\.(?:weight|bias)|.*\.linear_fc1\.(?:weight|bias))"
ROW_PARALLEL = r".*\.(?:linear_proj|linear_fc2)\.weight"
# dist_checkpointing's Transformer Engine names for the norms fused into the next linear layer.
NORM_RENAMES = [{"rename": r"\.self_attention\.linear_qkv\.layer_norm_(weight|bias)\b", "to": r".input_layernorm.\1",
                 "optional": True},
                {"rename": r"\.mlp\.linear_fc1\.layer_norm_(weight|bias)\b", "to": r".pre_mlp_layernorm.\1",
                 "optional": True}]
# The vocabulary-sized tensors: weights, fp32 masters and Adam moments of the embedding and output layer.
VOCAB_TENSORS = (r"^(?:model|fp32|optim\.state)\.(?:embedding\.word_embeddings|output_layer)\.weight"
                 r"(?:\.exp_avg(?:_sq)?)?$")


def is_dist_checkpoint(src: str) -> bool:
    """Whether ``src`` is a dist_checkpointing directory (``metadata.json`` naming a backend, ``common.pt``)."""
    path = os.path.join(src, METADATA_JSON)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(src, COMMON)):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
        return isinstance(metadata, dict) and "sharded_backend" in metadata
    except (OSError, ValueError, TypeError, RecursionError):  # RecursionError: JSON nested too deeply
        return False


def _damaged_dist_checkpoint(src: str) -> str | None:
    """What is wrong with ``src`` if it holds some of dist_checkpointing's files but
    ``is_dist_checkpoint`` does not take it for one; None if it holds none of them."""
    present = [name for name in (METADATA_JSON, COMMON) if os.path.isfile(os.path.join(src, name))]
    if not present:
        return None
    missing = [name for name in (METADATA_JSON, COMMON) if name not in present]
    why = (f"{missing[0]} is missing" if missing else f"{METADATA_JSON} is not a JSON object naming a 'sharded_backend'")
    return (f"{src} holds {' and '.join(present)} of a dist_checkpointing directory, but {why}: the checkpoint "
            "is damaged or incomplete")


def is_megatron(src: str) -> bool:
    """Whether ``src`` looks like a Megatron checkpoint (for ``detect_source``): a dist_checkpointing
    directory, a run directory (tracker file or ``iter_*`` directories) or one iteration directory."""
    if is_dist_checkpoint(src):
        return True
    names = os.listdir(src)
    return TRACKER in names or any(
        (_ITERATION.fullmatch(n) or _RANK_DIR.fullmatch(n)) and os.path.isdir(os.path.join(src, n)) for n in names)


def read(src: str, notes: list[str] | None = None) -> dict[str, Any]:
    """``{name: tensor or plain value}`` of the Megatron checkpoint ``src``, in one model's names.

    What merging noticed without refusing (replicas that drifted) is appended to ``notes``."""
    if not os.path.isdir(src):
        raise CheckpointError(f"{src} is not a directory; a Megatron checkpoint is a run directory, an iter_* "
                              "directory or a dist_checkpointing directory")
    folder = src if is_dist_checkpoint(src) else iteration_dir(src)
    return read_dist(folder, notes) if is_dist_checkpoint(folder) else read_classic(folder, notes)


def iteration_dir(src: str) -> str:
    """The iteration directory of ``src``: the one its tracker file names, or ``src`` itself."""
    tracker = os.path.join(src, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker, "rb") as f:
            text = f.read(64).decode("ascii", errors="replace").strip()  # a number or "release"
        name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        if name is None or not os.path.isdir(os.path.join(src, name)):
            raise CheckpointError(f"{tracker} holds {text!r}, which names no iteration directory beside it")
        return os.path.join(src, name)
    if any(_RANK_DIR.fullmatch(n) for n in os.listdir(src)):
        return src
    iterations = sorted(n for n in os.listdir(src) if _ITERATION.fullmatch(n))
    if not iterations:
        damaged = _damaged_dist_checkpoint(src)
        if damaged is not None:
            raise CheckpointError(damaged)
        raise CheckpointError(f"{src} is not a Megatron checkpoint: no {TRACKER}, no iter_* directory, no "
                              f"mp_rank_* directory and no {METADATA_JSON}")
    raise CheckpointError(f"{src} has no {TRACKER}; pick one of its iteration directories ({', '.join(iterations)})")


# ---------------------------------------------------------------------------------------------------
# torch_dist (dist_checkpointing)

def read_dist(folder: str, notes: list[str] | None = None) -> dict[str, Any]:
    with open(os.path.join(folder, METADATA_JSON), encoding="utf-8") as f:
        backend = json.load(f).get("sharded_backend")
    if backend != "torch_dist":
        raise CheckpointError(f"{folder}: dist_checkpointing backend {backend!r} is not supported (only torch_dist); "
                              "re-save with the torch_dist backend")
    common = unpickler.load(os.path.join(folder, COMMON))
    if not isinstance(common, dict):
        raise CheckpointError(f"{os.path.join(folder, COMMON)} holds a {type(common).__name__}, not a dict")
    sharded = dcp.read(folder)
    # Megatron-LM also shards per-rank objects (rng_state, rerun_state_machine): not model state.
    skipped = sorted({n.split("/")[0] for n in sharded if not n.startswith(("model.", "optimizer."))})
    if skipped:
        log.warning("%s: not imported: %s", folder, ", ".join(skipped))
    optimizer = common.pop("optimizer", {})
    if not isinstance(optimizer, dict):
        raise CheckpointError(f"{os.path.join(folder, COMMON)}: 'optimizer' holds a {type(optimizer).__name__}, "
                              "not a dict")
    values = {name: value for name, value in sharded.items() if name.startswith("model.")}
    values.update(_model_space_optimizer(sharded, folder))
    ops = [{"drop": r"\._extra_state(?:/shard_\d+_\d+)?$", "optional": True},
           {"unstack": r"(?P<head>(?:model|fp32|optim\.state)\.(?:.*\.)?decoder\.layers\.)(?P<tail>[^\d].*)",
            "to": r"\g<head>{index}.\g<tail>", "dim": 0, "optional": True},
           *NORM_RENAMES]
    values = apply_spec(load_spec({"ops": ops}), values, notes=notes)
    inner = optimizer.get("optimizer", {})
    if not isinstance(inner, dict):
        raise CheckpointError(f"{os.path.join(folder, COMMON)}: 'optimizer.optimizer' holds a {type(inner).__name__}, "
                              "not a dict")
    groups = inner.get("param_groups")
    distributed = {n: v for n, v in sharded.items() if n.startswith("optimizer.distributed.")}
    if distributed:
        inner = sharded_object(distributed, folder, "optimizer")
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        values.update(bucket_values(distributed, parameter_order(values), folder))
    values = apply_spec(load_spec({"ops": _vocab_ops(common.get("args"))}), values, notes=notes)
    if groups is not None:
        values.update(_param_groups(groups, folder))
    values.update(flatten_tree(common, os.path.join(folder, COMMON)))
    if "param_state_sharding_type" in optimizer:
        values["optimizer.param_state_sharding_type"] = optimizer["param_state_sharding_type"]
    return values


def _model_space_optimizer(sharded: dict[str, Any], folder: str) -> dict[str, Any]:
    """``fully_reshardable`` state, model-shaped (``optimizer.state.<key>.model.<name>``), renamed
    like the DeepSpeed importer's: ``fp32.<name>`` and ``optim.state.<name>.<key>``."""
    out = {}
    for name, value in sharded.items():
        m = re.fullmatch(r"optimizer\.state\.(param|exp_avg|exp_avg_sq)\.model\.(.*)", name)
        if m:
            key, param = m.groups()
            out["fp32." + param if key == "param" else f"optim.state.{param}.{key}"] = value
        elif name.startswith("optimizer.") and not name.startswith("optimizer.distributed."):
            raise CheckpointError(f"{folder}: optimizer entry {name!r} is not Adam state (param, exp_avg, exp_avg_sq) "
                                  "of a model parameter")
    return out


def _param_groups(groups: Any, folder: str) -> dict[str, Any]:
    """``optim.param_groups`` as saved, and ``optim.step``: Megatron keeps Adam's step in the groups."""
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{folder}: the optimizer's param_groups is not a list of dicts: {str(groups)[:200]}")
    out: dict[str, Any] = {"optim.param_groups": groups}
    steps = {group.get("step") for group in groups}
    if len(steps) == 1 and None not in steps:
        out["optim.step"] = steps.pop()
    return out


def parameter_order(values: dict[str, Any]) -> list[tuple[str, tuple]]:
    """``(name, shape)`` of the ``model.*`` tensors in ``named_parameters()`` order: the names before
    the layers, then layer by layer (sub-modules in the order they first appear), then the rest.
    dist_checkpointing lists a model's keys in its state-dict order, layer-stacked."""
    before, layers, after, subs = [], {}, [], {}
    for name, value in values.items():
        if not name.startswith("model.") or not is_tensor(value):
            continue
        m = _LAYER.fullmatch(name)
        if m:
            subs.setdefault(m.group("tail"), len(subs))
            layers.setdefault(int(m.group("index")), []).append((name, tuple(value.shape), m.group("tail")))
        else:
            (after if layers else before).append((name, tuple(value.shape)))
    ordered = list(before)
    for index in sorted(layers):
        ordered += [(name, shape) for name, shape, _ in sorted(layers[index], key=lambda item: subs[item[2]])]
    return ordered + after


def _vocab_ops(args: Any) -> list[dict]:
    """Strip Megatron-LM's vocabulary padding when ``args`` records the true size."""
    if not isinstance(args, dict):
        return []
    size, padded = args.get("vocab_size"), args.get("padded_vocab_size")
    divisor, tp = args.get("make_vocab_size_divisible_by"), args.get("tensor_model_parallel_size", 1)
    if all(isinstance(v, int) and v > 0 for v in (size, padded, divisor, tp)):
        # Megatron-LM pads to the next multiple of divisor x TP; any other pair is not what it wrote
        multiple = divisor * tp
        if padded != -(-size // multiple) * multiple:
            raise CheckpointError(f"args: padded_vocab_size {padded} is not vocab_size {size} padded to a multiple "
                                  f"of make_vocab_size_divisible_by x tensor_model_parallel_size = {multiple}; "
                                  "the args are not Megatron's (pass source sizes through a spec instead)")
    if isinstance(size, int) and isinstance(padded, int) and 0 < size < padded:
        return [{"vocab": VOCAB_TENSORS, "size": size, "padded": padded, "dim": 0, "optional": True}]
    return []


# ---------------------------------------------------------------------------------------------------
# classic per-rank files

def read_classic(folder: str, notes: list[str] | None = None) -> dict[str, Any]:
    ranks = {}
    for name in sorted(os.listdir(folder)):
        m = _RANK_DIR.fullmatch(name)
        if m:
            ranks[(int(m.group("tp")), int(m.group("pp") or 0))] = os.path.join(folder, name, RANK_FILE)
    if not ranks:
        raise CheckpointError(f"{folder} holds no mp_rank_* directories")
    if (0, 0) not in ranks:
        raise CheckpointError(f"{folder}: the first rank's directory (mp_rank_00[_000]) is missing")
    first = unpickler.load(ranks[(0, 0)])
    args = first.get("args") if isinstance(first, dict) else None
    tp_size, pp_size = _sizes(args, ranks)
    # args may claim any sizes: list the first few missing directories, never all TP x PP of them
    missing = list(islice((f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp_size > 1 else "")
                           for t in range(tp_size) for p in range(pp_size) if (t, p) not in ranks), SHOWN_MISSING))
    absent = tp_size * pp_size - sum(t < tp_size and p < pp_size for t, p in ranks)
    missing += [f"and {absent - len(missing)} more"] if absent > len(missing) else []
    extra = sorted(os.path.dirname(path) for (t, p), path in ranks.items() if t >= tp_size or p >= pp_size)
    if missing or extra:
        problems = ([f"rank directories {', '.join(missing)} are missing"] if missing else []) + (
            [f"{', '.join(extra)} do not belong"] if extra else [])
        raise CheckpointError(f"{folder}: {' and '.join(problems)} (TP={tp_size}, PP={pp_size})")
    files = {key: first if key == (0, 0) else unpickler.load(path) for key, path in ranks.items()}
    for key, content in files.items():
        if not isinstance(content, dict) or not isinstance(content.get("model"), dict):
            raise CheckpointError(f"{ranks[key]} holds no 'model' state dict; not a Megatron model_optim_rng.pt")
        if any(k.startswith("model") and k != "model" for k in content):
            chunks = ", ".join(k for k in content if k.startswith("model"))
            raise CheckpointError(f"{ranks[key]}: virtual pipeline stages ({chunks}) are not supported")
    values, tied = {}, _tied(args, files, pp_size, ranks)
    for tp in range(tp_size):
        offset = 0
        for pp in range(pp_size):
            state, prefix = files[(tp, pp)]["model"], f"tp_rank_{tp:02d}." if tp_size > 1 else ""
            local = {_LAYER.fullmatch(n).group("index") for n in state if _LAYER.fullmatch(n)}
            for name, value in state.items():
                if value is None and name.endswith("_extra_state"):
                    continue
                if tied and pp == pp_size - 1 and name == "output_layer.weight":
                    name, stage = "embedding.word_embeddings.weight", "tied_01."
                elif tied and pp == 0 and name == "embedding.word_embeddings.weight":
                    stage = "tied_00."
                else:
                    stage = ""
                m = _LAYER.fullmatch(name)
                if m:
                    name = f"{m.group('head')}{int(m.group('index')) + offset}.{m.group('tail')}"
                _add(values, f"{prefix}{stage}model.{name}", value, ranks[(tp, pp)])
            offset += len(local)
    skipped = sorted({k for content in files.values() for k in content if k in _CLASSIC_SKIPPED})
    if skipped:
        log.warning("%s: not imported from the classic files: %s", folder, ", ".join(skipped))
    values = apply_spec(load_spec(classic_spec(values, tp_size, tied, args)), values, notes=notes)
    common = {k: v for k, v in first.items() if k != "model" and k not in _CLASSIC_SKIPPED}
    values.update(flatten_tree(common, ranks[(0, 0)]))
    return values


def _sizes(args: Any, ranks: dict) -> tuple[int, int]:
    """TP and PP sizes: from ``args`` when it records them (so a lost rank directory is noticed),
    else from the directories present."""
    sizes = [max(t for t, _ in ranks) + 1, max(p for _, p in ranks) + 1]
    for index, key in enumerate(("tensor_model_parallel_size", "pipeline_model_parallel_size")):
        if isinstance(args, dict) and type(args.get(key)) is int and args[key] > 0:
            sizes[index] = args[key]
    return sizes[0], sizes[1]


def _add(values: dict, name: str, value: Any, path: str) -> None:
    if name in values:
        raise CheckpointError(f"{path}: {name!r} appears on two pipeline stages")
    values[name] = value


def _tied(args: Any, files: dict, pp_size: int, ranks: dict) -> bool:
    """Whether the last stage's ``output_layer.weight`` is the first stage's word embeddings (kept
    in step by Megatron's embedding all-reduce), decided by ``args`` (tied unless
    ``untie_embeddings_and_output_weights``), the only place the checkpoint records it."""
    if pp_size == 1 or "output_layer.weight" not in files[(0, pp_size - 1)]["model"] or \
            "embedding.word_embeddings.weight" in files[(0, pp_size - 1)]["model"]:
        return False
    if not isinstance(args, dict) or "untie_embeddings_and_output_weights" not in args:
        raise CheckpointError(f"{ranks[(0, 0)]}: args does not say untie_embeddings_and_output_weights, so whether the "
                              "last stage's output_layer.weight is tied to the word embeddings is unknown")
    return not args["untie_embeddings_and_output_weights"]


def classic_spec(values: dict[str, Any], tp_size: int, tied: bool, args: Any) -> dict:
    """The spec that merges the classic per-rank names, derived from megatron-core's layers:

    - tied embeddings on the first and last pipeline stage (``tied_00.``/``tied_01.``): ``take``
      the first stage's (the last stage's copy is noted with its difference);
    - column-parallel (:data:`COLUMN_PARALLEL`): ``cat`` dim 0; ``linear_fc1`` of a gated MLP
      (SwiGLU: its rows are twice ``linear_fc2``'s inputs) with ``groups`` 2, each rank holding
      [gate_r; up_r]; row-parallel (:data:`ROW_PARALLEL`): ``cat`` dim 1; the rest: replicas that
      must be bit-identical (``same``);
    - the fused-norm renames and the vocabulary strip shared with dist_checkpointing."""
    ops: list[dict] = []
    if tied:
        ops.append({"fuse": r"(?P<tp>(?:tp_rank_\d+\.)?)tied_(?P<index>\d+)\.(?P<name>.*)", "to": r"\g<tp>\g<name>",
                    "take": 0})
    if tp_size > 1:
        part = r"tp_rank_(?P<index>\d+)\.(?P<name>model\.{})"
        gated = _gated(values)
        fc1 = r".*\.linear_fc1\.(?:weight|bias)"
        if gated:
            ops.append({"fuse": part.format(fc1), "to": r"\g<name>", "cat": 0, "groups": 2})
        ops += [{"fuse": part.format(COLUMN_PARALLEL), "to": r"\g<name>", "cat": 0, "optional": True},
                {"fuse": part.format(ROW_PARALLEL), "to": r"\g<name>", "cat": 1, "optional": True},
                {"fuse": part.format(".*"), "to": r"\g<name>", "same": True, "optional": True},
                {"expect": r"(?!tp_rank_).*"}]
    return {"ops": ops + NORM_RENAMES + _vocab_ops(args)}


def _gated(values: dict[str, Any]) -> bool:
    """SwiGLU/GeGLU: a rank's ``linear_fc1.weight`` has twice as many rows as its ``linear_fc2.weight``
    has inputs (gate and up stacked)."""
    for name, value in values.items():
        if name.endswith(".mlp.linear_fc1.weight"):
            fc2 = values.get(name[:-len("linear_fc1.weight")] + "linear_fc2.weight")
            if is_tensor(value) and is_tensor(fc2) and len(value.shape) >= 1 and len(fc2.shape) == 2:
                return value.shape[0] == 2 * fc2.shape[1]
    return False
