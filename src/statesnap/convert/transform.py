"""A small declarative language that renames, drops, fuses and splits tensors while converting.

Foreign checkpoints rarely match the names and shapes a model wants: wrappers add prefixes
(``module.``), tensor parallelism leaves one slice per rank (Megatron's ``tp_rank_00``,
``tp_rank_01``), and one model fuses what another keeps apart (QKV). Instead of a script per case,
a spec lists operations applied in order to the flat map ``{name: value}``; this is UCP's idea of
pattern lists (replicated, row-/column-parallel, sub-parameter shapes; see
research/ucp_bytecheckpoint.md) made explicit and strict::

    {"ops": [
      {"drop": "\\._extra_state$"},
      {"rename": "^module\\.", "to": "model."},
      {"fuse": "tp_rank_(?P<index>\\d+)\\.(?P<name>.*qkv\\.weight)", "to": "\\g<name>", "cat": 0},
      {"fuse": "tp_rank_(?P<index>\\d+)\\.(?P<name>.*fc1\\.weight)", "to": "\\g<name>", "cat": 0, "groups": 2},
      {"fuse": "tp_rank_(?P<index>\\d+)\\.(?P<name>.*qkv_proj\\.weight)", "to": "\\g<name>", "cat": 0,
       "widths": [[16, 16], [8, 8], [8, 8]]},
      {"fuse": "tp_rank_(?P<index>\\d+)\\.(?P<name>.*norm\\.weight)", "to": "\\g<name>", "average": true},
      {"fuse": "stage_(?P<index>\\d+)\\.(?P<name>.*embed\\.weight)", "to": "\\g<name>", "take": 0},
      {"vocab": "embed\\.weight$", "size": 50257, "dim": 0},
      {"split": "(.*)\\.qkv\\.weight", "to": ["\\1.q.weight", "\\1.k.weight", "\\1.v.weight"],
       "dim": 0, "sizes": [16, 8, 8], "groups": 2},
      {"unstack": "(.*)\\.experts\\.w", "to": "\\1.experts.{index}.w", "dim": 0},
      {"cast": "^model\\.", "dtype": "bfloat16"},
      {"expect": "model\\..*|step"}
    ]}

Strict, because silent mistakes here become silently wrong models: a pattern that matches nothing,
a missing shard, replicas that differ, sizes that do not add up, two names that collide, or a name
the spec left uncovered (``expect``) are errors naming the tensor and the op. Tensors are handled
as :class:`Lazy` values where the source allows it, so an export holds one tensor at a time, not
the checkpoint; the checks that need the values (replicas equal, drift within ``atol``) therefore
run when a value is read.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch

from ..errors import CheckpointError

SHOWN_NAMES = 8
log = logging.getLogger("statesnap.convert")


class TransformError(CheckpointError):
    """The transform spec is malformed, or applying it to a checkpoint's names failed."""


@dataclass(frozen=True)
class Lazy:
    """A tensor known by dtype and shape, read only when :func:`materialize` asks for it."""

    dtype: torch.dtype
    shape: tuple
    read: Callable[[], torch.Tensor]


def is_tensor(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, Lazy))


def materialize(value: Any) -> Any:
    return value.read() if isinstance(value, Lazy) else value


_FUSE_MODES = ("cat", "stack", "same", "average", "take")
# op name -> (required keys, optional keys), besides the op key itself and "optional"
_OPS = {
    "drop": ((), ()),
    "keep": ((), ()),
    "rename": (("to",), ()),
    "fuse": (("to",), (*_FUSE_MODES, "groups", "widths", "atol")),
    "split": (("to", "dim"), ("sizes", "groups")),
    "vocab": ((), ("size", "multiple", "dim", "padded")),
    "unstack": (("to",), ("dim",)),
    "cast": (("dtype",), ()),
    "expect": ((), ()),
}


def load_spec(spec: Any) -> list[dict]:
    """The list of operations of ``spec``: a dict ``{"ops": [...]}``, or a JSON file holding one."""
    if spec is None:
        return []
    where = "transform spec"
    if isinstance(spec, (str, os.PathLike)):
        where = f"transform spec {spec}"
        try:
            with open(spec, encoding="utf-8") as f:
                spec = json.load(f)
        except (OSError, ValueError) as exc:
            raise TransformError(f"cannot read {where}: {exc}") from None
        except RecursionError:  # json nests by recursion: an op is a flat object, so this is no spec
            raise TransformError(f"{where} is nested too deeply to be a transform spec") from None
    if not isinstance(spec, dict) or set(spec) != {"ops"} or not isinstance(spec["ops"], list):
        raise TransformError(f'{where} must be an object {{"ops": [...]}}, got {_shown(spec)}')
    for number, op in enumerate(spec["ops"]):
        _check_op(op, f"{where}, op #{number}")
    return spec["ops"]


def _shown(value: Any) -> str:
    """The start of ``value``'s text for an error message (text of a deeply nested value cannot be made)."""
    try:
        return str(value)[:200]
    except RecursionError:
        return f"a {type(value).__name__} nested too deeply to show"


def _count(value: Any, least: int = 1) -> bool:
    """Whether ``value`` is an integer >= ``least`` (JSON's true is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check_op(op: Any, where: str) -> None:
    names = [k for k in op if k in _OPS] if isinstance(op, dict) else []
    if len(names) != 1:
        raise TransformError(f"{where}: {_shown(op)} must have exactly one of {', '.join(_OPS)}")
    kind = names[0]
    required, optional = _OPS[kind]
    unknown = set(op) - {kind, "optional", *required, *optional}
    missing = [k for k in required if k not in op]
    if unknown or missing:
        raise TransformError(f"{where}: {_shown(op)} has unknown keys {sorted(unknown)} or lacks {missing}")
    try:
        pattern = re.compile(op[kind])
    except (re.error, TypeError) as exc:
        raise TransformError(f"{where}: bad pattern {op[kind]!r}: {exc}") from None
    problem = _OP_CHECKS.get(kind, lambda op, pattern: None)(op, pattern)
    templates = op.get("to", "")  # a list of templates for split (checked to be one above), else one
    if not problem and not all(isinstance(t, str) for t in (templates if kind == "split" else [templates])):
        problem = '"to" must be a name template (a string)' + (", one per part" if kind == "split" else "")
    if not problem and not isinstance(op.get("optional", False), bool):
        problem = '"optional" must be true or false'
    if problem:
        raise TransformError(f"{where}: {_shown(op)}: {problem}")


def _check_fuse(op: dict, pattern: re.Pattern) -> str | None:
    modes = [k for k in _FUSE_MODES if k in op]
    if len(modes) != 1:
        return 'fuse needs exactly one of "cat": DIM, "stack": DIM, "same": true, "average": true or "take": K'
    if "index" not in pattern.groupindex:
        return "a fuse pattern needs a group (?P<index>\\d+) giving each part's position"
    if modes[0] in ("same", "average") and op[modes[0]] is not True:
        return f'"{modes[0]}" must be true'
    if modes[0] == "take" and not _count(op["take"], 0):
        return '"take" must be the index of the part to keep'
    if "groups" in op and (modes[0] != "cat" or not _count(op["groups"])):
        return '"groups" (a positive count) goes with "cat" only'
    widths = op.get("widths")
    if "widths" in op and (modes[0] != "cat" or "groups" in op or not isinstance(widths, list) or not widths
                           or not all(isinstance(w, list) and w and len(w) == len(widths[0]) for w in widths)
                           or not all(_count(n, 0) for w in widths for n in w)):
        return ('"widths" (per sub-parameter, its width in each part: a list of equally long lists of integers '
                '>= 0) goes with "cat" only, instead of "groups"')
    atol = op.get("atol", 0)
    if "atol" in op and (modes[0] not in ("average", "take") or isinstance(atol, bool)
                         or not isinstance(atol, (int, float)) or not atol >= 0):
        return '"atol" (a number >= 0) goes with "average" or "take" only'
    return None


def _check_split(op: dict, pattern: re.Pattern) -> str | None:
    if not isinstance(op["to"], list) or not op["to"]:
        return 'split needs "to": a list of name templates, one per part'
    sizes = op.get("sizes")
    if sizes is not None and (not isinstance(sizes, list) or len(sizes) != len(op["to"])
                              or not all(_count(size, 0) for size in sizes)):
        return '"sizes" must list one size (an integer >= 0) per name in "to"'
    if "groups" in op and not _count(op["groups"]):
        return '"groups" must be a positive count'
    return None


def _check_vocab(op: dict, pattern: re.Pattern) -> str | None:
    if sum(k in op for k in ("size", "multiple")) != 1:
        return 'vocab needs exactly one of "size": N (strip rows to N) or "multiple": M (pad rows to a multiple of M)'
    key = "size" if "size" in op else "multiple"
    if not _count(op[key]):
        return f'vocab\'s "{key}" must be a positive count, not {_shown(op[key])}'
    if "padded" in op and ("size" not in op or not _count(op["padded"]) or op["padded"] < op["size"]):
        return '"padded": P (the rows the tensor must have before stripping) goes with "size": N <= P'
    return None


def _check_unstack(op: dict, pattern: re.Pattern) -> str | None:
    if not isinstance(op["to"], str) or "{index}" not in op["to"]:
        return 'unstack needs "to": a name template holding {index}'
    return None


def _check_cast(op: dict, pattern: re.Pattern) -> str | None:
    dtype = getattr(torch, op["dtype"], None) if isinstance(op["dtype"], str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return (f'"dtype" {op["dtype"]!r} is not a floating dtype (float32, bfloat16, float16, ...); '
                "casts change precision, never the kind of number")
    return None


_OP_CHECKS = {"fuse": _check_fuse, "split": _check_split, "vocab": _check_vocab, "unstack": _check_unstack,
              "cast": _check_cast}


@dataclass(frozen=True)
class _Step:
    """One op being applied: its fields, where it sits in the spec, and where drift notes go."""

    op: dict
    label: str
    notes: list | None

    def error(self, name: str, problem: str) -> TransformError:
        return TransformError(f"{name}: {problem} ({self.label})")

    def require(self, ok: bool, name: str, problem: str, shapes: list) -> None:
        if not ok:
            raise self.error(name, f"{problem} (shapes {[list(s) for s in shapes]})")

    def expand(self, m: re.Match, template: str) -> str:
        """``template`` filled from a match, or an error naming the name and the bad reference
        (a group the pattern lacks is only found once a name matches)."""
        try:
            return m.expand(template)
        except (re.error, IndexError) as exc:
            raise self.error(m.string, f"the template {template!r} does not fit the pattern: {exc}") from None

    def note(self, line: str) -> None:
        log.info("%s", line)
        if self.notes is not None:
            self.notes.append(line)


def apply_spec(ops: list[dict], values: dict[str, Any], notes: list | None = None) -> dict[str, Any]:
    """Apply ``ops`` in order to ``{name: tensor, Lazy or plain value}``; return the new map.

    ``notes`` receives one human-readable line per averaged or taken replica set, giving how far
    the replicas drifted apart; values stay lazy, so the lines arrive as the values are read."""
    for number, op in enumerate(ops):
        kind = next(k for k in op if k in _OPS)
        result, matched = _APPLY[kind](_Step(op, f"transform op #{number} {kind}", notes), values)
        if not matched and not op.get("optional", False):
            shown = ", ".join(list(values)[:SHOWN_NAMES])
            raise TransformError(f"transform op #{number} {_shown(op)} matched no name (names are {shown}"
                                 f"{', ...' if len(values) > SHOWN_NAMES else ''}); fix the pattern or "
                                 'mark the op "optional": true')
        values = result
    return values


def _filter(step: _Step, values: dict, keep: bool) -> tuple[dict, bool]:
    pattern = re.compile(step.op["keep" if keep else "drop"])
    hits = {k for k in values if pattern.search(k)}
    return {k: v for k, v in values.items() if (k in hits) == keep}, bool(hits)


def _rename(step: _Step, values: dict) -> tuple[dict, bool]:
    pattern, out, matched = re.compile(step.op["rename"]), {}, False
    for name, value in values.items():
        try:
            new, count = pattern.subn(step.op["to"], name)
        except (re.error, IndexError) as exc:
            raise step.error(name, f"the template {step.op['to']!r} does not fit the pattern: {exc}") from None
        matched = matched or count > 0
        _add(step, out, new, value, name)
    return out, matched


def _add(step: _Step, out: dict, name: str, value: Any, origin: str) -> None:
    if name in out:
        raise step.error(name, f"{origin!r} is mapped onto a name another value already has")
    out[name] = value


def _fuse(step: _Step, values: dict) -> tuple[dict, bool]:
    pattern = re.compile(step.op["fuse"])
    groups: dict[str, dict[int, str]] = {}
    for name in values:
        m = pattern.fullmatch(name)
        if m:
            target, index = step.expand(m, step.op["to"]), m.group("index")
            if index is None or not index.isdecimal():
                raise step.error(name, f"group 'index' matched {index!r}, not a part number")
            index = int(index)
            parts = groups.setdefault(target, {})
            if index in parts:
                raise step.error(target, f"{parts[index]!r} and {name!r} are both part {index}")
            parts[index] = name
    out: dict[str, Any] = {}
    consumed = {name for parts in groups.values() for name in parts.values()}
    first_part = {min(parts.items())[1]: target for target, parts in groups.items()}
    for name, value in values.items():
        if name in first_part:
            target = first_part[name]
            _add(step, out, target, _fused(step, target, groups[target], values), name)
        elif name not in consumed:
            _add(step, out, name, value, name)
    return out, bool(groups)


def _fused(step: _Step, target: str, parts: dict[int, str], values: dict) -> Lazy:
    op = step.op
    if sorted(parts) != list(range(len(parts))):
        raise step.error(target, f"parts {sorted(parts)} found, expected 0..{len(parts) - 1} with none missing "
                                 f"({', '.join(parts.values())})")
    names = [parts[i] for i in range(len(parts))]
    tensors = [values[n] for n in names]
    for name, value in zip(names, tensors):
        if not is_tensor(value):
            raise step.error(target, f"part {name!r} is not a tensor")
    first = tensors[0]
    if any(t.dtype != first.dtype for t in tensors):
        raise step.error(target, f"parts have different dtypes {[str(t.dtype) for t in tensors]}")
    shapes = [tuple(t.shape) for t in tensors]
    mode = next(k for k in _FUSE_MODES if k in op)
    if mode in ("same", "average", "take"):
        step.require(all(s == shapes[0] for s in shapes), target, "replicas have different shapes", shapes)
        if mode == "same":
            return Lazy(first.dtype, shapes[0], lambda: _one_replica(step, target, names, tensors))
        if mode == "take":
            step.require(op["take"] < len(names), target, f"take {op['take']}, but there are {len(names)} parts",
                         shapes)
            return Lazy(first.dtype, shapes[0], lambda: _taken(step, target, names, tensors))
        if not first.dtype.is_floating_point:
            raise step.error(target, f"cannot average {first.dtype} replicas (use \"same\" or \"take\")")
        return Lazy(first.dtype, shapes[0], lambda: _averaged(step, target, names, tensors))
    if mode == "stack":
        dim = _dim(step, op["stack"], len(shapes[0]) + 1, target)
        step.require(all(s == shapes[0] for s in shapes), target, "parts to stack have different shapes", shapes)
        shape = shapes[0][:dim] + (len(shapes),) + shapes[0][dim:]
        return Lazy(first.dtype, shape, lambda: torch.stack([materialize(t) for t in tensors], dim))
    dim = _dim(step, op["cat"], len(shapes[0]), target)
    step.require(all(len(s) == len(shapes[0]) and s[:dim] + s[dim + 1:] == shapes[0][:dim] + shapes[0][dim + 1:]
                     for s in shapes), target, f"parts differ outside dimension {dim}", shapes)
    if "widths" in op:
        widths = op["widths"]
        step.require(all(len(w) == len(shapes) for w in widths) and all(
            sum(w[r] for w in widths) == s[dim] for r, s in enumerate(shapes)), target,
            f"sub-parameter widths {widths} do not give the {len(shapes)} parts' dimension {dim}", shapes)
    else:
        groups = op.get("groups", 1)
        step.require(all(s[dim] % groups == 0 for s in shapes), target,
                     f"dimension {dim} of a part does not divide into {groups} groups", shapes)
        widths = [[s[dim] // groups for s in shapes]] * groups
    shape = shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1:]
    return Lazy(first.dtype, shape, lambda: _cat_groups([materialize(t) for t in tensors], dim, widths))


def _cat_groups(tensors: list[torch.Tensor], dim: int, widths: list[list[int]]) -> torch.Tensor:
    """Sub-parameter 0 of every part, then sub-parameter 1 of every part, ...: the inverse of
    ``split`` with ``groups``; ``widths[g][r]`` is the width of sub-parameter g in part r. Megatron's
    SwiGLU fc1 under TP holds [gate_r; up_r] on rank r, the model [gate; up]; DeepSpeed AutoTP's
    GQA qkv holds [q_r; k_r; v_r] with q wider than k and v (its ``sub_param_shard_widths``)."""
    pieces = [t.split([w[r] for w in widths], dim) for r, t in enumerate(tensors)]
    return torch.cat([part[g] for g in range(len(widths)) for part in pieces], dim)


def _one_replica(step: _Step, target: str, names: list[str], tensors: list) -> torch.Tensor:
    """The first replica, after checking bit for bit (NaNs included) that every other one equals it."""
    first = materialize(tensors[0])
    for name, other in zip(names[1:], tensors[1:]):
        if not torch.equal(_bits(first), _bits(materialize(other))):
            raise step.error(target, f"replica {name!r} differs from {names[0]!r}; the parts are not replicated "
                                     '(use "average" or "take" for replicas that may drift, "cat" or "stack" '
                                     "to combine them)")
    return first


def _averaged(step: _Step, target: str, names: list[str], tensors: list) -> torch.Tensor:
    """The mean of replicas that may have drifted apart (UCP averages TP-replicated params),
    summed in float64 so the order of the parts does not change the result's bits; replicas
    that agree bit for bit are returned as they are (their mean, but NaN payloads kept)."""
    first = materialize(tensors[0])
    total = first.to(torch.float64, copy=True)
    low, high, identical = total.clone(), total.clone(), True
    for other in tensors[1:]:
        other = materialize(other)
        identical = identical and torch.equal(_bits(first), _bits(other))
        wide = other.to(torch.float64)
        total += wide
        torch.minimum(low, wide, out=low)
        torch.maximum(high, wide, out=high)
    _drift(step, target, names, 0.0 if identical else _largest(high - low), "averaged")
    return first if identical else (total / len(tensors)).to(first.dtype)


def _taken(step: _Step, target: str, names: list[str], tensors: list) -> torch.Tensor:
    """Part ``take`` of tied or pipeline-replicated weights, the others read to note their drift."""
    chosen_index = step.op["take"]
    chosen = materialize(tensors[chosen_index])
    spread = 0.0
    for index, other in enumerate(tensors):
        other = materialize(other)
        if index != chosen_index and not torch.equal(_bits(chosen), _bits(other)):
            difference = _largest((other.to(torch.float64) - chosen.to(torch.float64)).abs())
            spread = difference if math.isnan(difference) or difference > spread else spread
    _drift(step, target, names, spread, f"took part {chosen_index} of")
    return chosen


def _largest(values: torch.Tensor) -> float:
    """The largest element (NaN where replicas disagree on a NaN), 0 for an empty tensor."""
    return values.max().item() if values.numel() else 0.0


def _drift(step: _Step, target: str, names: list[str], spread: float, how: str) -> None:
    step.note(f"{target}: {how} {len(names)} replicas ({', '.join(names)}); "
              f"max abs difference between them {spread:.6g}")
    atol = step.op.get("atol")
    if atol is not None and not spread <= atol:
        raise step.error(target, f"replicas differ by up to {spread:.6g}, more than atol={atol}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _Shared:
    """One source tensor read once for the ``users`` parts cut from it (split, unstack), and let
    go when the last part has been cut, so splitting costs one read, not one per part."""

    def __init__(self, value: Any, users: int):
        self.value, self.left, self.tensor = value, users, None

    def take(self) -> torch.Tensor:
        tensor = self.tensor if self.tensor is not None else materialize(self.value)
        self.left -= 1
        self.tensor = tensor if self.left > 0 else None
        return tensor


def _owned(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``part`` in storage of its own: a view would keep the whole source tensor alive (and
    torch.save would write all of it)."""
    return part.clone() if part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() else part


def _cut(shared: _Shared, how: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    whole = shared.take()
    return _owned(how(whole), whole)


def _one_to_many(step: _Step, values: dict,
                 parts: Callable[[re.Match, str, Any], list[tuple[str, Lazy]]]) -> tuple[dict, bool]:
    """Replace each tensor whose name fullmatches the op's pattern by the named ``parts`` of it."""
    pattern, out, matched = re.compile(step.op[next(k for k in step.op if k in _OPS)]), {}, False
    for name, value in values.items():
        m = pattern.fullmatch(name)
        if not m:
            _add(step, out, name, value, name)
            continue
        matched = True
        if not is_tensor(value):
            raise step.error(name, "the pattern matched a value that is not a tensor")
        for target, part in parts(m, name, value):
            _add(step, out, target, part, name)
    return out, matched


def _split_parts(step: _Step, m: re.Match, name: str, value: Any) -> list[tuple[str, Lazy]]:
    """One named Lazy per part. With ``groups`` G the dimension is G repeats of [part sizes] (Megatron
    interleaves Q, K and V by query group), so part i takes its slice out of every group."""
    op, shape = step.op, tuple(value.shape)
    dim = _dim(step, op["dim"], len(shape), name)
    groups = op.get("groups", 1)
    count = len(op["to"])
    step.require(_count(groups) and shape[dim] % groups == 0, name,
                 f"dimension {dim} of size {shape[dim]} does not divide into {groups} groups", [shape])
    per_group = shape[dim] // groups
    sizes = op.get("sizes") or ([per_group // count] * count if per_group % count == 0 else None)
    step.require(sizes is not None and len(sizes) == count and sum(sizes) == per_group, name,
                 f"part sizes {op.get('sizes')} x {groups} groups do not add up to dimension {dim} for {count} parts",
                 [shape])
    shared, parts, offset = _Shared(value, count), [], 0
    for size in sizes:
        part_shape = shape[:dim] + (size * groups,) + shape[dim + 1:]
        parts.append(Lazy(value.dtype, part_shape, lambda o=offset, s=size: _cut(
            shared, lambda t: t.unflatten(dim, (groups, per_group)).narrow(dim + 1, o, s).flatten(dim, dim + 1))))
        offset += size
    return [(step.expand(m, target), part) for target, part in zip(op["to"], parts)]


def _unstack_parts(step: _Step, m: re.Match, name: str, value: Any) -> list[tuple[str, Lazy]]:
    """One tensor per index along ``dim`` (MoE experts, layer-stacked weights): the inverse of
    ``fuse`` with ``stack``."""
    shape = tuple(value.shape)
    dim = _dim(step, step.op.get("dim", 0), len(shape), name)
    shared = _Shared(value, shape[dim])
    return [(step.expand(m, step.op["to"].replace("{index}", str(index))),
             Lazy(value.dtype, shape[:dim] + shape[dim + 1:], lambda i=index: _cut(shared, lambda t: t.select(dim, i))))
            for index in range(shape[dim])]


def _vocab(step: _Step, values: dict) -> tuple[dict, bool]:
    """Strip the rows Megatron and DeepSpeed pad a vocabulary with (``size``), or pad with zero
    rows to the multiple a TP run needs (``multiple``)."""
    op, pattern, out, matched = step.op, re.compile(step.op["vocab"]), {}, False
    for name, value in values.items():
        out[name] = value
        if not pattern.search(name):
            continue
        matched = True
        if not is_tensor(value):
            raise step.error(name, "vocab matched a value that is not a tensor")
        shape = tuple(value.shape)
        dim = _dim(step, op.get("dim", 0), len(shape), name)
        rows = shape[dim]
        wanted = op["size"] if "size" in op else -(-rows // op["multiple"]) * op["multiple"]
        step.require("multiple" in op or rows >= wanted, name,
                     f"has {rows} rows along dimension {dim}, fewer than the vocabulary size {wanted}", [shape])
        # A source's own record of its padding is checked, not trusted: a wrong size would cut real rows.
        step.require(op.get("padded", rows) == rows, name,
                     f"has {rows} rows along dimension {dim}, not the {op.get('padded')} the source says it padded to",
                     [shape])
        if wanted != rows:
            out[name] = Lazy(value.dtype, shape[:dim] + (wanted,) + shape[dim + 1:],
                             lambda v=value, d=dim, w=wanted: _resized(materialize(v), d, w))
    return out, matched


def _resized(tensor: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    if rows <= tensor.shape[dim]:
        return _owned(tensor.narrow(dim, 0, rows), tensor)
    pad = list(tensor.shape)
    pad[dim] = rows - tensor.shape[dim]
    return torch.cat([tensor, tensor.new_zeros(pad)], dim)


def _cast(step: _Step, values: dict) -> tuple[dict, bool]:
    """Cast floating tensors to ``dtype``. Integer and bool tensors that match (step counters,
    masks) keep their dtype: ``{"cast": ".", "dtype": "bfloat16"}`` must not round a counter."""
    pattern, dtype = re.compile(step.op["cast"]), getattr(torch, step.op["dtype"])
    out, matched = {}, False
    for name, value in values.items():
        out[name] = value
        if pattern.search(name) and is_tensor(value) and value.dtype.is_floating_point:
            matched = True
            if value.dtype != dtype:
                out[name] = Lazy(dtype, tuple(value.shape), lambda v=value: materialize(v).to(dtype))
    return out, matched


def _expect(step: _Step, values: dict) -> tuple[dict, bool]:
    pattern = re.compile(step.op["expect"])
    stray = [name for name in values if not pattern.fullmatch(name)]
    if stray:
        shown = ", ".join(stray[:4 * SHOWN_NAMES]) + (", ..." if len(stray) > 4 * SHOWN_NAMES else "")
        raise TransformError(f"{len(stray)} names are left uncovered by the spec (they do not match "
                             f"{step.op['expect']!r}): {shown} ({step.label})")
    return values, True


def _dim(step: _Step, dim: Any, ndim: int, name: str) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool) or not -ndim <= dim < ndim:
        raise step.error(name, f"dimension {dim!r} is out of range for a {ndim}-d tensor")
    return dim % ndim


_APPLY = {
    "drop": lambda step, values: _filter(step, values, keep=False),
    "keep": lambda step, values: _filter(step, values, keep=True),
    "rename": _rename,
    "fuse": _fuse,
    "split": lambda step, values: _one_to_many(step, values, partial(_split_parts, step)),
    "vocab": _vocab,
    "unstack": lambda step, values: _one_to_many(step, values, partial(_unstack_parts, step)),
    "cast": _cast,
    "expect": _expect,
}
