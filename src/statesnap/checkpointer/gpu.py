"""The GPU path, kept apart because it cannot run on CPU-only machines.

At ``save()`` an event is recorded on each device's current (compute) stream; a side copy
stream waits on it, so the device-to-host copies see exactly the values of the moment of
``save()`` even though kernels queued before it may still be running. Copies go into the pinned
arena with ``non_blocking=True``. The stager queues every batch's copies as soon as the batch
has arena space and records one event after them; only the worker that hands the batch to the
flusher waits for that event, so the copy engine always has the next batches queued behind the
one it is running (one synchronisation per batch, none per tensor).
"""
from __future__ import annotations

import threading

import torch

from ..format.dtypes import flat_bytes
from .staging import in_order_part


def mark_devices(tensors) -> dict[int, "torch.cuda.Event"]:
    """One event per CUDA device in use, recorded on its current stream (call on the training thread)."""
    events = {}
    for t in tensors:
        if t.device.type == "cuda" and t.device.index not in events:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            events[t.device.index] = event
    return events


class CudaCopier:
    """Device-to-host copies on one side stream per device, ordered after the save() events."""

    def __init__(self):
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device.index not in self._streams:
                self._streams[device.index] = torch.cuda.Stream(device)
            return self._streams[device.index]

    def synchronize(self) -> None:
        """Wait for every copy queued so far, on every device."""
        with self._lock:
            streams = list(self._streams.items())
        for index, stream in streams:
            with torch.cuda.device(index):
                stream.synchronize()

    def enqueue(self, copies, ready: dict[int, "torch.cuda.Event"]) -> list[tuple[int, "torch.cuda.Event"]]:
        """Queue ``copies`` ((arena view, source, byte offset) each) without waiting for them; return
        (device index, event) per device used, the event recorded after its last copy: a batch is
        complete once they are (:func:`wait_for`). Each call runs under its device's guard: these
        threads' current device is 0, and a stream context left on it would make GPU 0 a context
        in every rank of a node of several GPUs."""
        done = {}
        for dst, src, offset in copies:
            stream = self._stream(src.device)
            with torch.cuda.device(src.device), torch.cuda.stream(stream):
                if src.device.index not in done:
                    stream.wait_event(ready[src.device.index])
                if src.is_conj() or src.is_neg():  # (its memory does not hold its values: resolved on this stream)
                    part = in_order_part(src, offset, dst.numel()) if src.is_contiguous() else src
                    src, offset = part.resolve_conj().resolve_neg(), 0
                if src.is_contiguous():
                    dst.copy_(flat_bytes(src)[offset:offset + dst.numel()], non_blocking=True)
                else:  # strided sources are copied whole (their items are never split)
                    dst.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
            done[src.device.index] = stream
        return [(index, _recorded(index, stream)) for index, stream in done.items()]


def _recorded(index: int, stream: "torch.cuda.Stream") -> "torch.cuda.Event":
    """An event recorded on ``stream`` now. Blocking: a worker waiting for a batch's copies sleeps
    rather than spin a CPU core through the whole device-to-host transfer."""
    with torch.cuda.device(index):
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
    return event


def wait_for(events: list[tuple[int, "torch.cuda.Event"]]) -> None:
    """Wait for the events :meth:`CudaCopier.enqueue` returned, each under its device's guard."""
    for index, event in events:
        with torch.cuda.device(index):
            event.synchronize()
