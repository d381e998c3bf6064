"""Files a restore is still receiving, readable while their bytes arrive.

A rank that receives the files its state is loaded from need not wait for their last byte
before it starts filling: the fill reads through :meth:`Arrivals.backend`, whose readers of those
files wait until each range they read has been written, and fail if the transfer fails or ends
before it, while the receiving goes on beside them (``recovery.LocalRecovery._fetch``).
"""
from __future__ import annotations

import threading
from typing import Sequence

from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.base import FileReader, StorageBackend


class Arrivals:
    """How far each file this rank receives has been written, and where."""

    def __init__(self, names):
        self._changed = threading.Condition()
        self._written = {name: 0 for name in names}
        self._paths: dict[str, str] = {}
        self._ended: dict[str, str | None] = {}  # name -> None (received whole) or what went wrong

    @property
    def names(self) -> list[str]:
        return list(self._written)

    def recorded(self, name: str, path: str, write):
        """``write(offset, tensor)`` into ``name`` at ``path``, recording how far it has got
        (chunks come in file order)."""
        with self._changed:
            self._paths[name] = path

        def write_and_record(offset: int, view) -> None:
            write(offset, view)
            with self._changed:
                self._written[name] = max(self._written[name], offset + view.numel())
                self._changed.notify_all()
        return write_and_record

    def ended(self, name: str, problem: str | None = None) -> None:
        """Nothing more comes for ``name``; ``problem`` says why its bytes cannot be trusted."""
        with self._changed:
            self._ended.setdefault(name, problem)
            self._changed.notify_all()

    def end_all(self, problem: str) -> None:
        """The transfers stopped: a reader still waiting for a file fails instead of waiting on."""
        for name in self._written:
            self.ended(name, problem)

    def wait(self, name: str, end: int | None = None) -> str:
        """Wait until bytes up to ``end`` of ``name`` are written (None: all of it); return its path."""
        with self._changed:
            self._changed.wait_for(lambda: name in self._ended or end is not None and self._written[name] >= end)
            problem = self._ended.get(name)
            if problem is None and (end is None or self._written[name] >= end):
                return self._paths[name]
            if problem is None:  # the sender's copy ends early: damage, which a restart may go back past
                raise CorruptCheckpointError(f"{name} fetched from another node is truncated: its transfer ended at "
                                             f"byte {self._written[name]}, before {end}")
            raise CheckpointError(f"{name} could not be fetched from another node: {problem}")

    def backend(self, backend: StorageBackend, directory: str) -> "StorageBackend":
        """``backend`` for a load of ``directory`` that reads the files still arriving as they do."""
        return _ArrivingBackend(backend, {backend.join(directory, name): name for name in self._written}, self)


class _ArrivingBackend:
    """A storage backend whose readers of the arriving files wait for their bytes; everything else
    goes to the real one."""

    def __init__(self, backend: StorageBackend, names: dict[str, str], arrivals: Arrivals):
        self._backend, self._names, self._arrivals = backend, names, arrivals

    def open_read(self, path: str) -> FileReader:
        name = self._names.get(path)
        return self._backend.open_read(path) if name is None else _ArrivingReader(self._backend, name, self._arrivals)

    def __getattr__(self, attr: str):
        return getattr(self._backend, attr)


class _ArrivingReader(FileReader):
    """Reads a file being received: each read waits for its range, then reads what was written
    (the file is opened at the first read, when the receiver has created it)."""

    def __init__(self, backend: StorageBackend, name: str, arrivals: Arrivals):
        self._backend, self._name, self._arrivals = backend, name, arrivals
        self._reader: FileReader | None = None
        self._opening = threading.Lock()  # the read threads of a load share this reader

    def readinto(self, offset: int, views: Sequence[memoryview]) -> int:
        return self._opened(offset + sum(len(v) for v in views)).readinto(offset, views)

    def size(self) -> int:
        return self._opened(None).size()

    def stream(self) -> FileReader:
        """A reader of the same file for one read thread: its own descriptor, its own readahead."""
        return _ArrivingReader(self._backend, self._name, self._arrivals)

    def _opened(self, end: int | None) -> FileReader:
        path = self._arrivals.wait(self._name, end)
        with self._opening:
            if self._reader is None:
                self._reader = self._backend.open_read(path)
            return self._reader

    def close(self) -> None:
        with self._opening:
            if self._reader is not None:
                self._reader.close()
