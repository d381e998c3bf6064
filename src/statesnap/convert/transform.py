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
      {"fuse": "tp_rank_(?P<index>\\d+)\\.(?P<name>.*norm\\.weight)", "to": "\\g<name>", "same": true},
      {"split": "(.*)\\.qkv\\.weight", "to": ["\\1.q.weight", "\\1.k.weight", "\\1.v.weight"],
       "dim": 0, "sizes": [16, 8, 8], "groups": 2}
    ]}

Strict, because silent mistakes here become silently wrong models: a pattern that matches nothing,
a missing shard, replicas that differ, sizes that do not add up, or two names that collide are
errors naming the tensor. Tensors are handled as :class:`Lazy` values where the source allows it,
so an export holds one tensor at a time, not the checkpoint.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import CheckpointError

SHOWN_NAMES = 8


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


# op name -> (required keys, optional keys), besides the op key itself and "optional"
_OPS = {
    "drop": ((), ()),
    "keep": ((), ()),
    "rename": (("to",), ()),
    "fuse": (("to",), ("cat", "stack", "same")),
    "split": (("to", "dim"), ("sizes", "groups")),
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
    if not isinstance(spec, dict) or set(spec) != {"ops"} or not isinstance(spec["ops"], list):
        raise TransformError(f'{where} must be an object {{"ops": [...]}}, got {str(spec)[:200]}')
    for number, op in enumerate(spec["ops"]):
        _check_op(op, f"{where}, op #{number}")
    return spec["ops"]


def _check_op(op: Any, where: str) -> None:
    names = [k for k in op if k in _OPS] if isinstance(op, dict) else []
    if len(names) != 1:
        raise TransformError(f"{where}: {op!r} must have exactly one of {', '.join(_OPS)}")
    required, optional = _OPS[names[0]]
    unknown = set(op) - {names[0], "optional", *required, *optional}
    missing = [k for k in required if k not in op]
    if unknown or missing:
        raise TransformError(f"{where}: {op!r} has unknown keys {sorted(unknown)} or lacks {missing}")
    try:
        re.compile(op[names[0]])
    except (re.error, TypeError) as exc:
        raise TransformError(f"{where}: bad pattern {op[names[0]]!r}: {exc}") from None
    if names[0] == "fuse":
        if sum(k in op for k in ("cat", "stack", "same")) != 1:
            raise TransformError(f'{where}: fuse needs exactly one of "cat": DIM, "stack": DIM or "same": true')
        if "index" not in re.compile(op["fuse"]).groupindex:
            raise TransformError(f"{where}: a fuse pattern needs a group (?P<index>\\d+) giving each part's position")
    if names[0] == "split" and (not isinstance(op["to"], list) or not op["to"]):
        raise TransformError(f'{where}: split needs "to": a list of name templates, one per part')


def apply_spec(ops: list[dict], values: dict[str, Any]) -> dict[str, Any]:
    """Apply ``ops`` in order to ``{name: tensor, Lazy or plain value}``; return the new map."""
    for number, op in enumerate(ops):
        kind = next(k for k in op if k in _OPS)
        result, matched = _APPLY[kind](op, values)
        if not matched and not op.get("optional", False):
            shown = ", ".join(list(values)[:SHOWN_NAMES])
            raise TransformError(f"transform op #{number} {op!r} matched no name (names are {shown}"
                                 f"{', ...' if len(values) > SHOWN_NAMES else ''}); fix the pattern or "
                                 'mark the op "optional": true')
        values = result
    return values


def _filter(op: dict, values: dict, keep: bool) -> tuple[dict, bool]:
    pattern = re.compile(op["keep" if keep else "drop"])
    hits = {k for k in values if pattern.search(k)}
    return {k: v for k, v in values.items() if (k in hits) == keep}, bool(hits)


def _rename(op: dict, values: dict) -> tuple[dict, bool]:
    pattern, out, matched = re.compile(op["rename"]), {}, False
    for name, value in values.items():
        new, count = pattern.subn(op["to"], name)
        matched = matched or count > 0
        _add(out, new, value, name)
    return out, matched


def _add(out: dict, name: str, value: Any, origin: str) -> None:
    if name in out:
        raise TransformError(f"transform maps {origin!r} onto {name!r}, which another value already has")
    out[name] = value


def _fuse(op: dict, values: dict) -> tuple[dict, bool]:
    pattern = re.compile(op["fuse"])
    groups: dict[str, dict[int, str]] = {}
    for name in values:
        m = pattern.fullmatch(name)
        if m:
            target, index = m.expand(op["to"]), int(m.group("index"))
            parts = groups.setdefault(target, {})
            if index in parts:
                raise TransformError(f"{target}: {parts[index]!r} and {name!r} are both part {index}")
            parts[index] = name
    out: dict[str, Any] = {}
    consumed = {name for parts in groups.values() for name in parts.values()}
    first_part = {min(parts.items())[1]: target for target, parts in groups.items()}
    for name, value in values.items():
        if name in first_part:
            target = first_part[name]
            _add(out, target, _fused(op, target, groups[target], values), name)
        elif name not in consumed:
            _add(out, name, value, name)
    return out, bool(groups)


def _fused(op: dict, target: str, parts: dict[int, str], values: dict) -> Lazy:
    if sorted(parts) != list(range(len(parts))):
        raise TransformError(f"{target}: parts {sorted(parts)} found, expected 0..{len(parts) - 1} with none missing "
                             f"({', '.join(parts.values())})")
    names = [parts[i] for i in range(len(parts))]
    tensors = [values[n] for n in names]
    for name, value in zip(names, tensors):
        if not is_tensor(value):
            raise TransformError(f"{target}: part {name!r} is not a tensor")
    first = tensors[0]
    if any(t.dtype != first.dtype for t in tensors):
        raise TransformError(f"{target}: parts have different dtypes {[str(t.dtype) for t in tensors]}")
    shapes = [tuple(t.shape) for t in tensors]
    if "same" in op:
        _require(all(s == shapes[0] for s in shapes), target, "replicas have different shapes", shapes)
        return Lazy(first.dtype, shapes[0], lambda: _one_replica(target, names, tensors))
    if "stack" in op:
        dim = _dim(op["stack"], len(shapes[0]) + 1, target)
        _require(all(s == shapes[0] for s in shapes), target, "parts to stack have different shapes", shapes)
        shape = shapes[0][:dim] + (len(shapes),) + shapes[0][dim:]
        return Lazy(first.dtype, shape, lambda: torch.stack([materialize(t) for t in tensors], dim))
    dim = _dim(op["cat"], len(shapes[0]), target)
    _require(all(len(s) == len(shapes[0]) and s[:dim] + s[dim + 1:] == shapes[0][:dim] + shapes[0][dim + 1:]
                 for s in shapes), target, f"parts differ outside dimension {dim}", shapes)
    shape = shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1:]
    return Lazy(first.dtype, shape, lambda: torch.cat([materialize(t) for t in tensors], dim))


def _one_replica(target: str, names: list[str], tensors: list) -> torch.Tensor:
    """The first replica, after checking bit for bit (NaNs included) that every other one equals it."""
    first = materialize(tensors[0])
    for name, other in zip(names[1:], tensors[1:]):
        if not torch.equal(_bits(first), _bits(materialize(other))):
            raise TransformError(f"{target}: replica {name!r} differs from {names[0]!r}; the parts are not "
                                 'replicated (use "cat" or "stack" to combine them)')
    return first


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _split(op: dict, values: dict) -> tuple[dict, bool]:
    pattern, out, matched = re.compile(op["split"]), {}, False
    for name, value in values.items():
        m = pattern.fullmatch(name)
        if not m:
            _add(out, name, value, name)
            continue
        matched = True
        if not is_tensor(value):
            raise TransformError(f"{name}: split matched a value that is not a tensor")
        for target, part in zip(op["to"], _split_parts(op, name, value)):
            _add(out, m.expand(target), part, name)
    return out, matched


def _split_parts(op: dict, name: str, value: Any) -> list[Lazy]:
    """One Lazy per part. With ``groups`` G the dimension is G repeats of [part sizes] (Megatron
    interleaves Q, K and V by query group), so part i takes its slice out of every group."""
    shape = tuple(value.shape)
    dim = _dim(op["dim"], len(shape), name)
    groups = op.get("groups", 1)
    count = len(op["to"])
    _require(isinstance(groups, int) and groups > 0 and shape[dim] % groups == 0, name,
             f"dimension {dim} of size {shape[dim]} does not divide into {groups} groups", [shape])
    per_group = shape[dim] // groups
    sizes = op.get("sizes") or ([per_group // count] * count if per_group % count == 0 else None)
    _require(sizes is not None and len(sizes) == count and sum(sizes) == per_group, name,
             f"part sizes {op.get('sizes')} x {groups} groups do not add up to dimension {dim} for {count} parts",
             [shape])
    parts, offset = [], 0
    for size in sizes:
        part_shape = shape[:dim] + (size * groups,) + shape[dim + 1:]
        parts.append(Lazy(value.dtype, part_shape,
                          lambda o=offset, s=size: materialize(value).unflatten(dim, (groups, per_group))
                          .narrow(dim + 1, o, s).flatten(dim, dim + 1)))
        offset += size
    return parts


def _dim(dim: Any, ndim: int, name: str) -> int:
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise TransformError(f"{name}: dimension {dim!r} is out of range for a {ndim}-d tensor")
    return dim % ndim


def _require(ok: bool, name: str, problem: str, shapes: list) -> None:
    if not ok:
        raise TransformError(f"{name}: {problem} (shapes {[list(s) for s in shapes]})")


_APPLY = {
    "drop": lambda op, values: _filter(op, values, keep=False),
    "keep": lambda op, values: _filter(op, values, keep=True),
    "rename": _rename,
    "fuse": _fuse,
    "split": _split,
}
