"""What ``Checkpointer.save`` returns, and the checks of what the training thread hands it."""
from __future__ import annotations

import numbers
import os
from concurrent.futures import Future

from ..errors import CheckpointError, NotDurableYetError
from .pipeline import Snapshot


class SaveHandle:
    """What ``save`` returns: ``staged`` completes when the snapshot is in host memory (its
    result is the step), ``durable`` when it is committed on the persistent level (its result
    is the checkpoint's path, or None for a step kept in memory only)."""

    def __init__(self, step: int, staged: Future, durable: Future, snap: Snapshot | None = None):
        self.step, self.staged, self.durable, self._snap = step, staged, durable, snap
        self._pid = os.getpid()

    def __reduce__(self):
        raise not_sent(self)

    def wait(self, timeout: float | None = None):
        """Wait until durable; raise the checkpoint's error (then it is not raised again later)."""
        if os.getpid() != self._pid:  # the threads that finish it are the parent's
            raise CheckpointError(f"step {self.step} is saved by process {self._pid}; a forked child cannot wait "
                                  "for it")
        try:
            path = self.durable.result(timeout)
            if path is None and self._snap is not None and self._snap.release() is not None:
                # kept in memory only: no commit looked at its counters a last time, and a change
                # in place made right after save() may have ended after its copy's own check
                raise self._snap.error
            return path
        except CheckpointError:
            if self._snap is not None:
                self._snap.reported = True
            raise
        except TimeoutError:
            if self.durable.done():  # (the save's own error, not the wait's)
                raise
            # not marked reported: a failure after this wait is still raised at the next call or close()
            raise NotDurableYetError(
                f"step {self.step} is not durable after {timeout} s: it is still being written; call wait() again, "
                "or close() the Checkpointer, which waits for it") from None


def step_number(step) -> int:
    """``step`` as the integer of its ``step-N``; a CheckpointError for anything else ("-1" or 8.9
    would be saved where no restart looks, and removed from no level)."""
    if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be a non-negative integer, not {step!r}")
    return int(step)  # a numpy integer would reach the events file and the manifest's meta as itself


def not_sent(obj) -> CheckpointError:
    """What pickling a Checkpointer or a handle raises: its threads, locks and memory live in this
    process (pickle's own error, "cannot pickle '_thread.lock' object", named neither)."""
    return CheckpointError(f"a {type(obj).__name__} cannot be sent to another process or copied: its background "
                           "work lives in the process that made it; make a Checkpointer in each process instead")
