"""Non-tensor values: tagged JSON by default, pickle only when the caller names it."""
from __future__ import annotations

import io
import pickle
from typing import Any

from ..errors import ManifestError, UnsafeCheckpointError
from ..format import plaindata
from ..format.manifest import ObjectEntry


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
        try:
            return plaindata.decode(entry.value, fqn)
        except ManifestError as exc:
            if not where:
                raise
            raise ManifestError(f"{where}: {exc}") from None
    if not allow_pickle:
        raise UnsafeCheckpointError(
            f"{fqn} is stored with pickle, which can run arbitrary code when loaded; pass "
            "allow_pickle=True only if you trust where this checkpoint came from")
    return pickle.loads(read_blob(fqn, entry.value))
