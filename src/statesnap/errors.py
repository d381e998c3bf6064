"""Every error statesnap raises derives from :class:`CheckpointError`.

Messages say what is wrong, where (checkpoint, file, tensor) and what to do, because the person
reading them is usually looking at a failed job at 3 a.m. and needs the next action, not a trace.
"""
from __future__ import annotations

import errno
import math
import numbers

import numpy as np

_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # the writes' errors a person fixes by making room


def remedy(error: BaseException) -> str:
    """What to do about ``error``, as the end of a message (" (...)"), where it is known; else ""."""
    if isinstance(error, OSError) and error.errno in _FULL:
        return (" (the storage is full or over its quota: free space there, keep fewer checkpoints, or save "
                "elsewhere; checkpoints committed before are untouched)")
    return ""


def explained(error: BaseException) -> str:
    """``error`` as a message says it, with what to do where its remedy is known: a full file
    system or quota said only "[Errno 28] No space left on device"."""
    return str(error) + remedy(error)


def described(error: BaseException | None) -> str | None:
    """``error`` as one line that names its type, for a message of statesnap's that wraps it or
    for another rank to read; every such site says a known remedy through this one function.
    A :class:`CheckpointError`'s own words pass through as they are: they are written for the
    user already, and name the file and tensor."""
    if error is None:
        return None
    if isinstance(error, CheckpointError):
        return str(error)
    return f"{type(error).__name__}: {explained(error)}"


def refuse_non_switches(where: str, **switches) -> None:
    """Refuse a setting that is on or off given as anything but True or False (or 1, 0): "no"
    and "false" are true to Python, so ``allow_pickle="no"`` unpickled and ``durable="false"``
    synced, without a word."""
    for name, value in switches.items():
        if not (isinstance(value, (numbers.Integral, np.bool_)) and value in (0, 1)):
            raise CheckpointError(f"{where}: {name} must be True or False, not {value!r}")


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _real(value) -> bool:  # (NaN fails every comparison below)
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


# setting -> (whether a value is one, what it must be)
_SETTINGS = {
    "threads": (lambda v: v is None or (_whole(v) and v >= 1), "None or a whole number of at least 1"),
    "timeout_s": (lambda v: _real(v) and 0 < v <= 1e9, "a number of seconds above 0 (at most 1e9)"),
    "block_bytes": (lambda v: _whole(v) and 1 <= v < 2 ** 63, "a whole number of bytes from 1 to 2**63 - 1"),
    "replica_check_mb": (lambda v: _real(v) and 0 <= v < math.inf, "a finite number of MiB, 0 or more"),
    "progress": (lambda v: v is None or v is True or v is False, "None, True or False"),
    "shared_reads": (lambda v: v is None or v is True or v is False, "None, True or False"),
}


def refuse_bad_settings(where: str, **settings) -> None:
    """Refuse a numeric or three-way setting (``_SETTINGS``) out of its range, named: a negative
    ``block_bytes`` made a save's checksums loop forever, one of 2**63 committed a checkpoint no
    reader takes, ``threads=-2`` or ``timeout_s=nan`` raised bare errors from deep inside."""
    for name, value in settings.items():
        fits, wanted = _SETTINGS[name]
        if not fits(value):
            raise CheckpointError(f"{where}: {name} must be {wanted}, not {value!r}")


def printable(text: str) -> str:
    """``text`` for a terminal, each non-printable character as its Python escape (``\\n``,
    ``\\x1b``): names come from manifests, which anyone may write, and a newline or an escape
    sequence in one would forge lines of the output or drive the terminal."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class CheckpointError(Exception):
    """Base class of all statesnap errors. Its message is :func:`printable`: it names tensors and
    files as a checkpoint's manifest spells them, and a traceback or a log line printing a
    hostile name's newline or escape sequence would forge lines or drive the terminal."""

    def __init__(self, *args):
        super().__init__(*(printable(a) if isinstance(a, str) else a for a in args))


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match their checksum, or a data file is truncated."""

    tensor: str | None = None  # the tensor whose bytes failed their checksum, where one did


class ReadFailedError(CorruptCheckpointError):
    """The storage failed to read a data file (an I/O error such as ``EIO`` from a mount that
    stopped answering). Unlike a checksum mismatch, the stored bytes may be intact and a retry may
    succeed, so a restart does not give up the checkpoint for an older one over it."""


class MissingFileError(CheckpointError):
    """A file the manifest refers to is not there."""


class NotInCheckpointError(CheckpointError, KeyError):
    """A name the checkpoint does not hold (``Reader.read``, ``Reader.info``); also a KeyError,
    as a lookup by a missing key is."""

    __str__ = Exception.__str__  # (KeyError's would print the message's repr: quoted, escapes doubled)


class RegionOutOfRangeError(CheckpointError, IndexError):
    """An index of a region read (``Reader.read(fqn, index)``) past a dimension's size; also an
    IndexError, as indexing a tensor so is."""


class ManifestError(CheckpointError):
    """The manifest is unreadable, from a future format version, or unsafe (paths escape)."""


class NotACheckpointError(ManifestError):
    """The path holds no manifest: something other than a checkpoint (a file, a Checkpointer's
    root, the manifest itself), or a save interrupted before its commit."""


class NewerFormatError(ManifestError):
    """The checkpoint was written in a newer format version than this statesnap reads: it is
    whole, and an upgraded statesnap loads it."""


class StateMismatchError(CheckpointError):
    """Strict load found missing or unexpected keys, or shape/dtype mismatches. ``advice`` ends
    the message apart from the rest: what the reader can do depends on the API that loaded."""

    def __init__(self, message: str, missing=(), unexpected=(), mismatched=(), advice: str = ""):
        super().__init__(f"{message} {advice}" if advice else message)
        self.problem, self.advice = message, advice
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)

    def advised(self, advice: str) -> StateMismatchError:
        """The same error with ``advice`` instead of its own: for an API (a trainer integration)
        that does not offer what the load's own advice names (``strict=False``, ``cast=True``)."""
        return StateMismatchError(self.problem, self.missing, self.unexpected, self.mismatched, advice)


class CheckpointExistsError(CheckpointError):
    """Saving onto an existing checkpoint without ``overwrite=True``."""


class UnsafeCheckpointError(CheckpointError):
    """Loading would need pickle, and the caller did not allow it."""


class ConsistencyError(CheckpointError):
    """A tensor changed in place before its snapshot copy finished."""


class NotDurableYetError(CheckpointError, TimeoutError):
    """``SaveHandle.wait(timeout)`` ran out of time: the checkpoint is still being written (not
    failed), so it is a ``TimeoutError`` too; wait again or let ``close()`` finish it."""


class ReshardError(CheckpointError):
    """The saved state cannot be mapped onto the requested layout (e.g. per-rank state)."""
