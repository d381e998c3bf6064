"""What a restart does when a copy of a checkpoint fails to restore: the next copy of the same
step, and older steps only past damage.

``Checkpointer.load_latest`` tries the copies it knows newest step first, fastest level first,
and every rank moves on together. Whether it may go past a step to an older one depends on what
failed, as every rank saw it. Damage of the copies themselves (a checksum that does not match, a
truncated or missing file, an unreadable manifest, seen by any rank) may be given up for an
older step: nothing will make those copies whole. So may a node-local copy that cannot be read
(an I/O error: a failing node disk must not stop the job while durable copies are there), and
a snapshot in host memory that fails whatever the reason (nothing is deleted for it, and the
stored copies of its step give their own verdict). A node-local copy that fails otherwise is
kept: it is deleted when given up, and an error that every copy would meet (a value the state
cannot take, a setting) must not delete steps only that level holds. Anything else is raised
once no copy of the step is left: an I/O error of shared storage may pass with a retry, a newer
format loads with an upgraded statesnap, and a setting (pickle not allowed, per-rank values on
another world size) would refuse every older step too. Going back past any of these would give
up a good checkpoint without need, and the resumed run would later save over it. A state that does not
match the checkpoint is raised at once: every copy would refuse it.
"""
from __future__ import annotations

import logging
import warnings

from ..engine.dist import Comm, RemoteFailure
from ..errors import (
    CheckpointError, CorruptCheckpointError, ManifestError, MissingFileError, NewerFormatError, ReadFailedError,
    StateMismatchError,
)

log = logging.getLogger("statesnap")

MISMATCH, DAMAGE, IO, OTHER, REMOTE = "mismatch", "damage", "io", "other", "remote"


def failure_kind(error: CheckpointError) -> str:
    """What this rank's own failure says about the copy (REMOTE: another rank's failure)."""
    if isinstance(error, StateMismatchError):
        return MISMATCH
    if isinstance(error, RemoteFailure):
        return REMOTE
    if isinstance(error, ReadFailedError):
        return IO
    if isinstance(error, (CorruptCheckpointError, MissingFileError, ManifestError)) and not isinstance(
            error, NewerFormatError):
        return DAMAGE
    return OTHER


class Fallback:
    """The failures of one ``load_latest`` over ``choices``, ``(step, order, level name)`` in
    the order they are tried."""

    def __init__(self, comm: Comm, choices: list[tuple[int, int, str]]):
        self._comm, self._choices = comm, choices
        self._kept: dict[int, CheckpointError] = {}  # step -> its first failure that was not damage
        self._mismatch = False
        self._given_up: list[str] = []  # what failed in each copy given up, as warned
        self._all_damaged = True  # whether every copy given up was given up for damage
        self.damaged: list[tuple[int, str]] = []  # (step, level name) of the copies found damaged

    def record(self, error: CheckpointError, index: int) -> bool:
        """Note the failure of copy ``index``, as every rank saw it (collective); return whether
        the copy is given up (see the module's docstring)."""
        step, _, name = self._choices[index]
        kinds = set(self._comm.all_gather(failure_kind(error)))
        self._mismatch = MISMATCH in kinds
        damaged = DAMAGE in kinds  # (what else failed beside it, on other ranks, does not make it whole)
        if damaged:
            self.damaged.append((step, name))
        given_up = (damaged or (name == "local" and IO in kinds)
                    or (name == "memory" and not self._mismatch))
        if given_up:
            self._given_up.append(f"step {step} from {_where(name)}: {error}")
            self._all_damaged = self._all_damaged and damaged
        else:
            self._kept.setdefault(step, error)
        return given_up

    def go_on_or_raise(self, error: CheckpointError, index: int) -> None:
        """After :meth:`record`: raise what ends the restore, or warn of the copy tried next."""
        step, _, name = self._choices[index]
        if self._mismatch:
            raise error
        if index + 1 == len(self._choices):
            if step in self._kept:
                raise self._kept[step]
            if len(self._given_up) > 1 and self._all_damaged:  # the last error alone names only the oldest step
                raise CorruptCheckpointError(
                    f"no checkpoint could be restored: every copy of every step is damaged "
                    f"({'; '.join(self._given_up)})") from error
            raise error  # (an I/O error or a failure in memory among them: its own kind, to retry)
        next_step = self._choices[index + 1][0]
        if next_step != step and step in self._kept:
            raise self._kept[step]
        then = "the next level" if next_step == step else f"step {next_step}, the newest before it"
        message = f"statesnap: step {step} could not be restored from {_where(name)} ({error}); trying {then}"
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _where(name: str) -> str:
    return "the node-local level and peer replicas" if name == "local" else f"the {name} level"
