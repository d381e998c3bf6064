"""Pausing Python's cyclic garbage collector around bursts of allocation that make no garbage.

Parsing a manifest or planning the reads of a thousand tensors makes tens of thousands of small
objects that live until the load ends. Each burst of allocations triggers the collector, and its
older generations walk the caller's whole heap (a training job's, millions of objects): that was
most of a load of many small tensors, measured. A pause that ends while they live only defers
the work: the first allocation after it collects them all. So ``ss.load`` pauses the collector
from its start to its end, when its objects have been freed by their reference counts and the
collector has nothing of them left to walk (before this, a load of 1,000 small tensors took 84 ms
with the collector on and 68 ms with it off, alternating in one process). The pause spans the
load's reads and its waits for other ranks (each bounded by its timeout), during which the
caller's other threads allocate without collecting; cyclic garbage they make meanwhile is
collected once the load returns.

Only the main thread pauses, where the training's own loads run. The collector is one switch for
the process, and a pause cannot tell its own ``gc.disable()`` from the caller's: a pause on
statesnap's background threads (the further level parses manifests) ended by switching the
collector back on under a training that had switched it off meanwhile. Nested pauses end with
the collector as the outermost found it.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_depth = 0  # pauses in progress (on the main thread)
_was_enabled = False  # the collector's state when the outermost began


@contextlib.contextmanager
def collector_paused():
    """Pause the collector for the block, on the main thread (elsewhere: nothing)."""
    global _depth, _was_enabled
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        _was_enabled = gc.isenabled()
        gc.disable()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _was_enabled:
            gc.enable()
