"""Non-tensor values: tagged JSON by default, pickle only when the caller names it."""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ..errors import UnsafeCheckpointError
from ..format import plaindata
from ..format.manifest import ObjectEntry
from ..state.flatten import join


def encode_value(fqn: str, value: Any, allow_pickle: bool) -> tuple[ObjectEntry, bytes | None]:
    """(entry, pickled bytes or None). Pickled entries get their file reference filled in later."""
    try:
        return ObjectEntry("json", plaindata.encode(value)), None
    except plaindata.NotPlainData as exc:
        if not allow_pickle:
            raise UnsafeCheckpointError(
                f"{fqn}: {exc}; statesnap stores only plain data (numbers, strings, lists, dicts, small "
                "tensors) without pickle. Convert it, or pass allow_pickle=True to save (and to load)") from None
        buf = io.BytesIO()
        pickle.dump(value, buf, protocol=pickle.HIGHEST_PROTOCOL)
        return ObjectEntry("pickle", None), buf.getvalue()


def decode_value(fqn: str, entry: ObjectEntry, allow_pickle: bool, read_blob, where: str = "") -> Any:
    """The stored value; for a per-rank entry, the list of every saved rank's value. ``where``:
    the manifest the entry comes from, named by a ManifestError about its value."""
    if entry.kind == "per_rank":
        return [decode_value(fqn, e, allow_pickle, read_blob, where) for e in entry.per_rank]
    if entry.kind == "json":
        return plaindata.decode(entry.value, fqn, where)
    if not allow_pickle:
        raise UnsafeCheckpointError(
            f"{fqn} is stored with pickle{f' (in {where})' if where else ''}, which can run arbitrary code when "
            "loaded; pass allow_pickle=True only if you trust where this checkpoint came from")
    return pickle.loads(read_blob(fqn, entry.value))


def castable(stored: torch.dtype, target: torch.dtype) -> bool:
    """Whether ``cast=True`` may convert ``stored`` values into a ``target`` tensor: between
    floating dtypes only. Integer and bool tensors hold counts, indices and masks; turning them
    into floats or back would round or truncate them without anyone having asked for that."""
    return stored.is_floating_point and target.is_floating_point


class Mismatch(str):
    """A mismatch as it is said (``name (checkpoint float32[4], target bfloat16[4])``) that holds
    its ``name`` apart: a name may hold spaces, and one cut from the text at the first space made a
    load with strict=False skip another name and fill the mismatched target with what it could."""

    def __new__(cls, name: str, detail: str, after: str = ""):
        said = super().__new__(cls, f"{name} ({detail}){after}")
        said.name = name
        return said

    def __reduce__(self):  # (pickled or copied with the error that lists it: from what it says)
        return _said, (str(self), self.name)


def _said(text: str, name: str) -> Mismatch:
    said = str.__new__(Mismatch, text)
    said.name = name
    return said


def fitted_to_held(fqn: str, held: Any, value: Any, cast: bool) -> tuple[Any, list[str], bool]:
    """``value``, a stored plain value, made ready to go where the state holds ``held``; the
    tensors the state holds in it (named under ``fqn``) whose stored value has another shape or
    dtype, or is no tensor, each with both; and whether some differ in floating precision alone.
    Those are mismatches like any other, not plain data to replace: a small tensor held in a
    list, as an optimizer's parameters may be, is also the one the optimizer trains, and the
    list's element replaced by the stored one left the optimizer training the old one without a
    word. So the held tensor stays in the value given back (a load with strict=False leaves it as
    it was), and with ``cast`` one of another floating dtype is converted to the held one's. An
    empty tensor holds nothing to keep: a placeholder, it takes whatever is stored (an RNG state
    loaded into ``[torch.empty(0, dtype=torch.uint8)]``). Containers are followed as the load
    fills them (``state/flatten.py``'s ``_merged``). Only for the state's own containers: a value
    in a module's, optimizer's or stateful object's state dict (``ObjectItem.owned``) is put back
    by its ``load_state_dict``, which takes what is stored (an lr stored as a float, for an
    optimizer whose lr is a tensor now)."""
    if isinstance(held, torch.Tensor) and held.numel():
        same_shape = isinstance(value, torch.Tensor) and value.shape == held.shape
        if same_shape and value.dtype == held.dtype:
            return value, [], False
        convertible = same_shape and castable(value.dtype, held.dtype)
        if cast and convertible:
            return value.to(held.dtype), [], False
        stored = (f"{str(value.dtype)[6:]}{list(value.shape)}" if isinstance(value, torch.Tensor)
                  else f"a {type(value).__name__}")
        target = f"{str(held.dtype)[6:]}{list(held.shape)}"
        return held, [Mismatch(fqn, f"checkpoint {stored}, target {target}")], convertible
    if isinstance(held, dict) and isinstance(value, dict):
        pairs = [(key, held[key]) if key in held else (key, None) for key in value]
    elif (isinstance(held, list) and isinstance(value, list)) or (
            isinstance(held, tuple) and isinstance(value, tuple) and len(held) == len(value)):
        pairs = list(enumerate(held[:len(value)]))
    else:
        return value, [], False
    fitted, names, precision_only = [], [], False
    for key, element in pairs:
        one, bad, precision = fitted_to_held(join(fqn, key), element, value[key], cast)
        fitted.append(one)
        names += bad
        precision_only = precision_only or precision
    if all(one is value[key] for (key, _), one in zip(pairs, fitted)):
        return value, names, precision_only  # (as it was: a namedtuple, say, needs no rebuilding)
    if isinstance(value, dict):
        return dict(zip(value, fitted)), names, precision_only
    elements = fitted + list(value[len(fitted):])
    kind = type(value)
    return (kind._make(elements) if hasattr(kind, "_make") else kind(elements)), names, precision_only
