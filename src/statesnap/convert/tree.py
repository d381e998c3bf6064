"""Nested containers <-> flat dotted names: the one shape every foreign source is brought into.

A converted checkpoint should look as if ``ss.save`` had written it from the same objects, so
that ``ss.load`` accepts it. ``ss.save`` joins dict keys with ``.`` and keeps lists of plain data
(an optimizer's ``param_groups``) as one value; :func:`flatten_tree` does the same, and flattens a
list by index only when it holds a tensor too large to keep inline (DeepSpeed's ``fp32_groups``).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..errors import CheckpointError
from ..format import plaindata
from ..state.flatten import join


def flatten_tree(tree: Any, where: str, prefix: str = "") -> dict[str, Any]:
    """``{dotted name: tensor or plain value}`` of a nested dict; ``where`` names the source in errors."""
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"{where} holds a {type(tree).__name__}, not a dict of named values; "
                              "statesnap stores tensors by name")
    out: dict[str, Any] = {}
    _flatten(prefix, tree, out, where)
    return out


def _flatten(fqn: str, value: Any, out: dict[str, Any], where: str) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            _flatten(join(fqn, key), inner, out, where)
        return
    if isinstance(value, (list, tuple)) and not _is_plain(value):
        for index, inner in enumerate(value):
            _flatten(join(fqn, index), inner, out, where)
        return
    if fqn in out:
        raise CheckpointError(f"{where}: two entries are both named {fqn!r} once nested keys are joined with '.'; "
                              "rename one with a transform spec")
    # Parameters and tensors that require grad become plain tensors: a checkpoint holds values.
    out[fqn] = value.detach() if isinstance(value, torch.Tensor) else value


def _is_plain(value: Any) -> bool:
    try:
        plaindata.encode(value)
    except plaindata.NotPlainData:
        return False
    return True


def nest_paths(flat: dict[str, Any], paths: Mapping[str, tuple]) -> dict[str, Any]:
    """Rebuild the nested dicts and lists that ``flat`` was flattened from, given each key's path of
    dict keys (str) and list indices (int); keys without a path stay at the top level."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        path = tuple(paths.get(key) or (key,))
        node: Any = root
        for step, following in zip(path[:-1], path[1:]):
            node = _child(node, step, [] if isinstance(following, int) else {})
        _put(node, path[-1], value)
    return root


def _child(node: Any, step: Any, empty: Any) -> Any:
    if isinstance(node, list):
        if step >= len(node) or node[step] is None:
            _put(node, step, empty)
        return node[step]
    return node.setdefault(step, empty)


def _put(node: Any, step: Any, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (step + 1 - len(node)))
    node[step] = value
