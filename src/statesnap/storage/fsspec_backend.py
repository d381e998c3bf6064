"""fsspec backend for object stores and remote file systems (s3://, gs://, memory://, ...).

Object stores cannot rename a directory atomically, so the manifest is the commit marker: data
files are written in place under names unique to this save, and the manifest is written last in
one PUT. A reader that finds no manifest sees no checkpoint. On overwrite the old data files stay
until the new manifest is in place and are deleted only then.
"""
from __future__ import annotations

import threading
from typing import Sequence

import fsspec

from .base import FileReader, FileWriter, StorageBackend


class _FsspecWriter(FileWriter):
    """Object stores take whole streams, so parts are buffered and uploaded in order at close."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        self.parts: dict[int, bytes] = {}
        self.lock = threading.Lock()

    def pwrite(self, offset: int, views: Sequence[memoryview]) -> None:
        data = b"".join(bytes(v) for v in views)
        with self.lock:
            self.parts[offset] = data

    def close(self, durable: bool) -> None:
        with self.fs.open(self.path, "wb") as f:
            pos = 0
            for offset in sorted(self.parts):
                if offset != pos:
                    f.write(b"\0" * (offset - pos))
                f.write(self.parts[offset])
                pos = offset + len(self.parts[offset])
        self.parts.clear()


class _FsspecReader(FileReader):
    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        self._size = fs.size(path)

    def readinto(self, offset: int, views: Sequence[memoryview]) -> int:
        total = sum(len(v) for v in views)
        end = min(offset + total, self._size)
        data = self.fs.cat_file(self.path, start=offset, end=end) if end > offset else b""
        pos = 0
        for view in views:
            chunk = data[pos:pos + len(view)]
            view[:len(chunk)] = chunk
            pos += len(chunk)
        return len(data)

    def size(self) -> int:
        return self._size

    def close(self) -> None:
        pass


class FsspecBackend(StorageBackend):
    def __init__(self, url: str, storage_options: dict | None = None):
        self.fs, _ = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.protocol = url.split("://", 1)[0]

    def _strip(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def join(self, base: str, *names: str) -> str:
        return "/".join([base.rstrip("/"), *names])

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._strip(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self._strip(path), detail=False))
        except FileNotFoundError:
            return []

    def remove(self, path: str) -> None:
        try:
            self.fs.rm(self._strip(path), recursive=True)
        except FileNotFoundError:
            pass

    def open_write(self, path: str, durable: bool = False) -> FileWriter:
        return _FsspecWriter(self.fs, self._strip(path))

    def open_read(self, path: str) -> FileReader:
        return _FsspecReader(self.fs, self._strip(path))

    def write_bytes(self, path: str, data: bytes, durable: bool) -> None:
        self.fs.pipe_file(self._strip(path), data)

    def read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(self._strip(path))

    def begin(self, final: str, token: str) -> str:
        self.fs.makedirs(self._strip(final), exist_ok=True)
        return final

    def commit(self, staging: str, final: str, overwrite: bool, durable: bool,
               keep: Sequence[str] = ()) -> None:
        # The caller wrote the manifest last into ``staging`` (== ``final``): that was the commit.
        keep = set(keep)
        for name in self.listdir(final):
            if name not in keep:
                self.remove(self.join(final, name))

    def abort(self, staging: str, final: str, written: Sequence[str] = ()) -> None:
        # Only this save's files go; their names are unique to it, so no manifest refers to them.
        for name in written:
            self.remove(self.join(staging, name))
