"""A framework's checkpoint dict as statesnap state: tensors by name, everything else as data.

Trainers hand over one nested structure (Lightning's checkpoint dict, a Trainer's state) that
mixes tensors with lists, tuples, dicts keyed by integers and plain values. statesnap stores
tensors by dotted name, so the structure is kept apart as a *skeleton*: the same containers, each
tensor replaced by a reference to its name, encoded as tagged JSON (``format/plaindata.py``:
tuples, integer keys and non-finite floats come back as they were). Loading rebuilds the dict
exactly. Objects that are not plain data are refused by name unless pickle is allowed, and so
are subclasses of plain types that would come back as their base type (an enum on ``int``, a
namedtuple, a ``defaultdict``).
"""
from __future__ import annotations

import base64
import collections
import json
import pickle
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from ..format import plaindata

_REF = "__statesnap_tensor__"  # {_REF: name} stands for a tensor in the skeleton
_PICKLED = "__statesnap_pickled__"
_COUNTER = "__statesnap_counter__"  # {_COUNTER: {key: count}} stands for a collections.Counter


def split(tree: Any, allow_pickle: bool = False) -> tuple[str, dict[str, torch.Tensor]]:
    """(skeleton as a JSON string, {name: tensor}); names join the keys and indices on the way
    to each tensor with ``.``. The tensors are the tree's own (no copy)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _strip(tree, "", tensors, allow_pickle)
    try:
        return json.dumps(plaindata.encode(skeleton)), tensors
    except plaindata.NotPlainData as exc:  # _strip let nothing else through
        raise CheckpointError(f"cannot store the checkpoint's structure: {exc}") from None


def join(skeleton: str, tensors: dict[str, torch.Tensor], allow_pickle: bool = False, where: str = "") -> Any:
    """The tree :func:`split` took apart, with ``tensors`` put back by name."""
    return _fill(plaindata.decode(json.loads(skeleton), where), tensors, allow_pickle, where)


def tensor_names(skeleton: str, where: str = "") -> list[str]:
    names: list[str] = []
    _walk_refs(plaindata.decode(json.loads(skeleton), where), names)
    return names


def _strip(value: Any, name: str, tensors: dict, allow_pickle: bool) -> Any:
    if isinstance(value, torch.Tensor):
        if name in tensors:
            raise CheckpointError(f"two tensors of the checkpoint are both named {name!r} once keys are joined "
                                  "with '.'")
        tensors[name] = value.detach()
        return {_REF: name}
    if _plain_mapping(value) and all(_exactly_plain(k) for k in value):  # loaded as a dict
        stripped = {k: _strip(v, f"{name}.{k}" if name else str(k), tensors, allow_pickle) for k, v in value.items()}
        return {_COUNTER: stripped} if type(value) is collections.Counter else stripped
    if type(value) in (list, tuple):
        return type(value)(_strip(v, f"{name}.{i}" if name else str(i), tensors, allow_pickle)
                           for i, v in enumerate(value))
    if _exactly_plain(value):
        try:
            plaindata.encode(value)  # (an int too long for JSON is not)
            return value
        except plaindata.NotPlainData:
            pass
    if not allow_pickle:
        raise CheckpointError(f"{name or 'the checkpoint'} holds a {type(value).__module__}.{type(value).__name__}, "
                              "which is not plain data; statesnap stores it only with allow_pickle=True")
    return {_PICKLED: base64.b64encode(pickle.dumps(value)).decode("ascii")}


# (a bytearray would come back as bytes). numpy's float64 is a float that comes back as a Python
# float of the same value: an lr drawn with numpy (a sweep) keeps it through the schedulers, and
# its arithmetic is the same, so it is not refused.
_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes, torch.dtype, np.float64)


def _plain_mapping(value: Any) -> bool:
    """A dict, or a subclass its reader takes as one: an ``OrderedDict`` (a state dict),
    Lightning's ``AttributeDict`` (hyper-parameters); loaded, each is a dict. A ``Counter``
    (``MultiStepLR``'s milestones) is one too, tagged so that it comes back a Counter: a
    ``MultiStepLR`` stepped with an explicit epoch calls ``milestones.elements()``. Any other
    subclass (a ``defaultdict``: a missing key would raise) would come back as a plain dict and
    behave otherwise."""
    kind = type(value)
    return kind in (dict, collections.OrderedDict, collections.Counter) or (
        kind.__name__ == "AttributeDict" and kind.__module__.startswith(("lightning", "pytorch_lightning")))


def _exactly_plain(value: Any) -> bool:
    """Of a type that plain data gives back as it was: not a subclass of one (an ``IntEnum``, an
    enum on ``str``, a namedtuple), which would come back as its base type. A ``torch.Size`` is
    taken as the tuple of ints it is (a shape among the hyper-parameters or in a callback's
    state): loaded as a tuple, which compares, hashes and makes tensors the same, as it was
    stored before subclasses were refused."""
    if type(value) in (tuple, torch.Size):
        return all(_exactly_plain(v) for v in value)
    if type(value) is torch.Tensor:  # as a key or in a tuple key: plain data holds small ones inline
        return plaindata.inlinable(value)
    return type(value) in _PLAIN_LEAVES


def _fill(value: Any, tensors: dict, allow_pickle: bool, where: str) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and _REF in value:
            name = value[_REF]
            if name not in tensors:
                raise CheckpointError(f"{where}: the checkpoint's structure names tensor {name!r}, which it "
                                      "does not hold")
            return tensors[name]
        if len(value) == 1 and _COUNTER in value:
            return collections.Counter(_fill(value[_COUNTER], tensors, allow_pickle, where))
        if len(value) == 1 and _PICKLED in value:
            if not allow_pickle:
                raise CheckpointError(f"{where} holds a pickled value; load it only from a trusted source, "
                                      "with allow_pickle=True")
            return pickle.loads(base64.b64decode(value[_PICKLED]))  # noqa: S301 (allowed by name)
        return {k: _fill(v, tensors, allow_pickle, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors, allow_pickle, where) for v in value)
    return value


def _walk_refs(value: Any, names: list[str]) -> None:
    if isinstance(value, dict):
        if len(value) == 1 and _REF in value:
            names.append(value[_REF])
            return
        for v in value.values():
            _walk_refs(v, names)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _walk_refs(v, names)
