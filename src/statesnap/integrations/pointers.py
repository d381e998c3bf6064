"""Small files that name a statesnap checkpoint, for trainers that choose their own paths.

Lightning names a checkpoint ``epoch=1-step=400.ckpt``, the Hugging Face Trainer a directory
``checkpoint-400``; both find, sort and delete those names themselves. The integrations keep the
checkpoints in a :class:`statesnap.Checkpointer` store beside them and write, under the name the
trainer expects, a pointer to the store's ``step-N``, once that step is committed. A pointer is
replaced atomically, so whatever a crash interrupts, every pointer names a whole checkpoint.
"""
from __future__ import annotations

import json
import os
import uuid

import fsspec
import fsspec.implementations.local

from ..errors import CheckpointError

POINTER_MAX_BYTES = 4096


def step_of(name: str) -> int | None:
    """N for a path ending in ``step-N``, else None."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return int(base[5:]) if base.startswith("step-") and base[5:].isdigit() else None


def pointer_bytes(fmt: str, relative: str) -> bytes:
    return json.dumps({"format": fmt, "checkpoint": relative}).encode()


def parse_pointer(raw: bytes, fmt: str, where: str) -> str | None:
    """The relative path a pointer of format ``fmt`` names (None if ``raw`` is no such pointer).
    A pointer that names something other than a ``step-N`` beside it is refused."""
    try:
        pointer = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(pointer, dict) or pointer.get("format") != fmt:
        return None
    relative = pointer.get("checkpoint")
    if not isinstance(relative, str) or step_of(relative) is None or ".." in relative.split("/") \
            or relative.startswith("/"):
        raise CheckpointError(f"{where} is a statesnap pointer with a malformed target {relative!r}")
    return relative


def write_atomically(fs, path: str, data: bytes) -> None:
    """Replace the file at ``path``: a local file by rename after fsync (a reader sees the old
    content or the new), an object by one PUT."""
    if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        fs.pipe_file(path, data)
        return
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def fsync_directory(path: str) -> None:
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
