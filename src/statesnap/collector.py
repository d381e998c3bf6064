"""Pausing Python's cyclic garbage collector around bursts of allocation that make no garbage.

Parsing a manifest or planning the reads of a thousand tensors makes tens of thousands of small
objects that all live on. Each burst of allocations triggers the collector, and its older
generations walk the caller's whole heap (a training job's, millions of objects): that was most
of a load of many small tensors, measured. Only CPU-bound stretches are wrapped, never a wait
for I/O or another rank, so the caller's other threads are held back from collecting briefly.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:  # a caller that had it off keeps it off
            gc.enable()
