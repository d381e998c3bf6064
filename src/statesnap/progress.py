"""Progress bars (in bytes) for long blocking work: ``convert``, ``export``, ``verify``, ``ss.save``
and ``ss.load``.

Converting or checking a 70B-parameter checkpoint takes minutes; without a bar a user cannot tell
a slow disk from a hang. A bar belongs on a terminal only: in a training job's log or a CI
capture it is noise (carriage returns and partial lines), so by default it is shown only when
``sys.stderr`` is a terminal and only once the work has taken :data:`AUTO_DELAY_S`;
``progress=True``/``False`` forces it on (at once) or off.
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator


# Shown by default (on a terminal) only once an operation has run this long: a quick save or load
# draws nothing, a long one shows it is alive.
AUTO_DELAY_S = 3.0


def wanted(progress: bool | None) -> bool:
    """Whether to show a bar: as asked, or by default only on a terminal."""
    if progress is None:
        return sys.stderr.isatty()
    return bool(progress)


@contextmanager
def bar(total_bytes: int, what: str, progress: bool | None = None) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(nbytes)``; it moves a bar on stderr, or does nothing when no bar is wanted.

    ``advance`` may be called from several threads (verify checks pieces in parallel): tqdm's
    own lock guards its display, ours the running count."""
    if not wanted(progress):
        yield lambda nbytes: None
        return
    from tqdm import tqdm  # imported only when a bar is shown

    lock = threading.Lock()
    with tqdm(total=total_bytes, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, dynamic_ncols=True, leave=True, delay=AUTO_DELAY_S if progress is None else 0) as shown:
        def advance(nbytes: int) -> None:
            with lock:
                shown.update(nbytes)

        yield advance
