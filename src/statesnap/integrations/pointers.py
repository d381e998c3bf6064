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
import threading
import uuid

import fsspec
import fsspec.implementations.local
import xxhash

from ..checkpointer.levels import parse_step
from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.local import open_source

POINTER_MAX_BYTES = 1 << 20  # a pointer may carry a trainer's own small state (see ``pointer_bytes``)
POINTER_NAME = "statesnap.json"  # the pointer inside a checkpoint directory a trainer names (Hugging Face's)


def step_of(name: str) -> int | None:
    """N for a path ending in ``step-N``, else None."""
    return parse_step(name.rstrip("/").rsplit("/", 1)[-1])


def pointer_bytes(fmt: str, relative: str, own_state: str | None = None) -> bytes:
    """A pointer to ``relative``. ``own_state``: text that replaces what the checkpoint stores
    besides tensors, for a save that shares another's tensors (stored with its checksum)."""
    pointer = {"format": fmt, "checkpoint": relative}
    if own_state is not None:
        pointer.update(own_state=own_state, own_state_xxh3=xxhash.xxh3_64_hexdigest(own_state.encode()))
    return json.dumps(pointer).encode()


def parse_pointer(raw: bytes, fmt: str, where: str, verify: bool = True) -> tuple[str, str | None] | None:
    """(the relative path a pointer of format ``fmt`` names, its own state or None); None if
    ``raw`` is no such pointer. A pointer that names something other than a ``step-N`` beside it,
    or (``verify``) whose own state does not match its checksum, is refused."""
    try:
        pointer = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply, as no pointer is
        return None
    if not isinstance(pointer, dict) or pointer.get("format") != fmt:
        return None
    relative = pointer.get("checkpoint")
    if not _names_a_step_beside(relative):
        raise CheckpointError(f"{where} is a statesnap pointer with a malformed target {relative!r}")
    own_state = pointer.get("own_state")
    if verify and own_state is not None and (not isinstance(own_state, str) or pointer.get("own_state_xxh3")
                                             != xxhash.xxh3_64_hexdigest(own_state.encode())):
        raise CheckpointError(f"{where} is a statesnap pointer whose own state is damaged (checksum mismatch)")
    return relative, own_state


def pointed_checkpoint(raw: bytes) -> str | None:
    """The path, relative to the pointer, that a pointer of any integration names; None if
    ``raw`` is no pointer. Only for telling a user who names a pointer where its checkpoint is:
    loading through a pointer is :func:`parse_pointer`'s, which checks what it names."""
    try:
        pointer = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if isinstance(pointer, dict) and str(pointer.get("format")).startswith("statesnap-") \
            and _names_a_step_beside(pointer.get("checkpoint")):
        return pointer["checkpoint"]
    return None


def _names_a_step_beside(relative) -> bool:
    """Whether a pointer's target is a ``step-N`` below the pointer's directory, as written."""
    return (isinstance(relative, str) and step_of(relative) is not None and ".." not in relative.split("/")
            and not relative.startswith("/"))


def read_pointer_file(path: str) -> bytes:
    """The bytes of the local pointer file at ``path``, read as a checkpoint's own files are: a
    FIFO in its place is refused rather than waited on, a device (a link to ``/dev/zero``) rather
    than read forever, and a file larger than any pointer (:data:`POINTER_MAX_BYTES`) is read no
    further than that. Raises ``FileNotFoundError`` where there is none."""
    try:
        with open_source(path) as f:
            raw = f.read(POINTER_MAX_BYTES + 1)
    except CorruptCheckpointError as exc:  # (it names the path)
        raise CheckpointError(f"a damaged statesnap pointer: {exc}") from None
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(path) from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from None
    if len(raw) > POINTER_MAX_BYTES:
        raise CheckpointError(f"{path} is damaged: it is larger than any statesnap pointer "
                              f"({POINTER_MAX_BYTES} bytes at most)")
    return raw


def write_atomically(fs, path: str, data: bytes, durable: bool = True, exclusive: bool = False) -> None:
    """Replace the file at ``path``: a local file by rename (after fsync, where ``durable``: a
    reader sees the old content or the new), an object by one PUT. ``exclusive``: a local file
    is only created (by a hard link), never written over: a pointer written meanwhile stays."""
    if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        fs.pipe_file(path, data)
        return
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(temporary, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    if exclusive:
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
    else:
        os.replace(temporary, path)
    if durable:
        fsync_directory(os.path.dirname(os.path.abspath(path)))


def fsync_directory(path: str) -> None:
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class PointerFailures:
    """Pointers that could not be written after their step committed. They fail in the
    Checkpointer's flush thread (its ``on_commit``, whose errors it only logs), so each
    integration raises them on the training thread at its next call, the first one first."""

    def __init__(self):
        self._lock = threading.Lock()
        self._errors: list[CheckpointError] = []

    def add(self, error: CheckpointError) -> None:
        with self._lock:
            self._errors.append(error)

    def raise_first(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]
