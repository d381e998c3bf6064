"""Pausing Python's cyclic garbage collector around bursts of allocation that make no garbage.

Parsing a manifest or planning the reads of a thousand tensors makes tens of thousands of small
objects that all live on. Each burst of allocations triggers the collector, and its older
generations walk the caller's whole heap (a training job's, millions of objects): that was most
of a load of many small tensors, measured. Only CPU-bound stretches are wrapped, never a wait
for I/O or another rank, so the caller's other threads are held back from collecting briefly.
A ``gc.enable()`` or ``gc.disable()`` the caller makes while a pause is on does not outlast it:
the collector ends as the first pause found it.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0  # pauses in progress, over all threads
_was_enabled = False  # the collector's state when the first of them began


@contextlib.contextmanager
def collector_paused():
    """Pause the collector for the block. Pauses on several threads (or nested) overlap into one:
    the collector comes back, as the first found it, when the last ends."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
