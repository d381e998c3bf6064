"""Nested containers <-> flat dotted names: the one shape every foreign source is brought into.

A converted checkpoint should look as if ``ss.save`` had written it from the same objects, so
that ``ss.load`` accepts it. ``ss.save`` joins dict keys with ``.`` and keeps lists of plain data
(an optimizer's ``param_groups``) as one value; :func:`flatten_tree` does the same, and flattens a
list by index only when it holds a tensor too large to keep inline (DeepSpeed's ``fp32_groups``).

What an unpickled file holds is a graph, not a tree: pickle's memo lets one list appear in many
places, or inside itself. :func:`check_graph` refuses, before anything walks the object as a
tree, what would make that walk hang, recurse without end or multiply a small file into a huge
checkpoint, and tensors that are not what a checkpoint stores (see its docstring).
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

import torch

from ..errors import CheckpointError, UnsafeCheckpointError
from ..format import plaindata
from ..state.flatten import join

MAX_DEPTH = 100  # nesting of dicts and lists; real checkpoints nest a dozen levels at most
# A value shared by reference is written out once per place it appears (JSON and the manifest have
# no references). Sharing may multiply the stored values by at most EXPANSION, or add at most
# EXPANDED_MIN values, whichever allows more: a config dict referenced twice is fine, twenty
# levels of [l, l] (a million-fold blow-up from a 1 KB file) are not.
EXPANSION = 16
EXPANDED_MIN = 1 << 20
# The same rule for tensors: a view may show more elements than its storage holds (an expanded
# or stride-0 view, which torch.save keeps as it is). Written out, it becomes its logical size;
# the file's tensors together may be at most EXPANSION times the bytes their storages hold, or
# add at most VIEW_BYTES_MIN bytes.
VIEW_BYTES_MIN = 64 << 20
_CONTAINERS = (Mapping, list, tuple, set, frozenset)


def check_graph(obj: Any, where: str) -> None:
    """Refuse, with a :class:`CheckpointError` naming ``where`` and the value's dotted path, an
    unpickled object that cannot be converted as the tree of named values it claims to be:

    - a container that holds itself (a cycle), or containers nested deeper than ``MAX_DEPTH``:
      walking them would recurse without end or past Python's stack;
    - containers shared so often that the tree they stand for is much larger than the file
      (see ``EXPANSION``): sizes are counted once per distinct object, so this costs time
      linear in the file, never in the tree;
    - tensors that are not plain strided tensors (sparse, nested, ...), which the format does
      not store;
    - views that show far more bytes than their storages hold. Expanded views are legitimate
      (``torch.ones(1).expand(4096)`` is saved as 4 bytes and a stride of 0), and converting
      writes them out at their logical size, which is correct; but a 1 KB file whose stride-0
      view claims 2 GiB would make that a denial of service, so the logical bytes of the file's
      tensors are bounded by the stored bytes (``EXPANSION``, ``VIEW_BYTES_MIN``)."""
    walk = _Walk(where)
    expanded = walk.size(obj, "", 0)
    if expanded > max(EXPANSION * walk.distinct, walk.distinct + EXPANDED_MIN):
        raise CheckpointError(f"{where}: its lists and dicts refer to each other so that, written out as a tree, "
                              f"{walk.distinct} stored values would become {expanded}; refusing to expand them")
    stored = sum(walk.storages.values())
    if walk.logical > max(EXPANSION * stored, stored + VIEW_BYTES_MIN):
        name, view = walk.widest
        raise CheckpointError(f"{where}: its tensors are views of {stored} stored bytes that would be written out as "
                              f"{walk.logical} bytes ({name or 'the top-level value'} alone shows {view} bytes); an "
                              "expanded view that large is refused rather than materialized")


class _Walk:
    """One pass over an object graph: each distinct container is sized once (memo by ``id``;
    the objects stay alive during the pass, so ids are not reused)."""

    def __init__(self, where: str):
        self.where = where
        self.sizes: dict[int, int] = {}
        self.open: set[int] = set()  # containers on the current path: meeting one again is a cycle
        self.distinct = 0
        self.storages: dict[tuple, int] = {}
        self.logical = 0
        self.widest = ("", 0)

    def size(self, obj: Any, path: str, depth: int) -> int:
        """The number of values ``obj`` stands for as a tree (itself and all it holds)."""
        if isinstance(obj, torch.Tensor):
            self.tensor(obj, path)
            return 1
        if not isinstance(obj, _CONTAINERS):
            return 1
        key = id(obj)
        if key in self.sizes:
            return self.sizes[key]
        if key in self.open:
            raise CheckpointError(f"{self.where}: the value at {path or 'the top level'} contains itself (a cycle); "
                                  "a checkpoint holds a tree of values")
        if depth >= MAX_DEPTH:
            raise CheckpointError(f"{self.where}: the value at {path[:200] or 'the top level'} is nested more than "
                                  f"{MAX_DEPTH} levels deep; refusing to walk it")
        self.open.add(key)
        items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
        total = 1
        for name, inner in items:
            total += self.size(inner, join(path, name), depth + 1)
        self.open.discard(key)
        self.sizes[key] = total
        self.distinct += 1 + len(obj)
        return total

    def tensor(self, t: torch.Tensor, path: str) -> None:
        if t.is_nested or t.layout != torch.strided:
            kind = "a nested tensor" if t.is_nested else f"a {str(t.layout).removeprefix('torch.')} tensor"
            raise CheckpointError(f"{self.where}: {path or 'the top-level value'} is {kind}; statesnap stores dense "
                                  "tensors only: convert it to a dense one (tensor.to_dense()) before saving")
        storage = t.untyped_storage()
        self.storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        view = t.numel() * t.element_size()
        self.logical += view
        if view > self.widest[1]:
            self.widest = (path, view)


def flatten_tree(tree: Any, where: str, prefix: str = "") -> dict[str, Any]:
    """``{dotted name: tensor or plain value}`` of a nested dict; ``where`` names the source in errors."""
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"{where} holds a {type(tree).__name__}, not a dict of named values; "
                              "statesnap stores tensors by name")
    check_graph(tree, where)
    out: dict[str, Any] = {}
    _flatten(prefix, tree, out, where)
    return out


def _flatten(fqn: str, value: Any, out: dict[str, Any], where: str) -> None:
    if isinstance(value, Mapping):
        if value or not fqn:
            for key, inner in value.items():
                _flatten(join(fqn, key), inner, out, where)
            return
        value = {}  # an empty dict is a value, as ss.save keeps it (a fresh optimizer's state)
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


class Refused:
    """In place of a value the source holds but statesnap refuses to read (a pickle naming a
    class it does not admit, as TransformerEngine's ``_extra_state`` BytesIO): kept by name, so
    that a transform spec can drop it, and raised by :func:`refuse_unread` if it is still there."""

    def __init__(self, error: UnsafeCheckpointError):
        self.error = error


def refuse_unread(values: dict[str, Any]) -> None:
    """Raise the error of the first :class:`Refused` value that the transform spec kept, saying
    how to drop it."""
    for name, value in values.items():
        if isinstance(value, Refused):
            spec = json.dumps({"ops": [{"drop": f"^{re.escape(name)}$"}]})
            raise UnsafeCheckpointError(f"{value.error} (to convert without it, drop it with the transform spec "
                                        f"{spec})")
