"""Storage backends behind one ABC; :func:`backend_for` picks one from a path or URL."""
from __future__ import annotations

from .base import FileReader, FileWriter, StorageBackend
from .local import LocalBackend


def is_url(path: str) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


def backend_for(path, storage_options: dict | None = None) -> StorageBackend:
    path = str(path)
    if is_url(path):
        from .fsspec_backend import FsspecBackend
        return FsspecBackend(path, storage_options)
    return LocalBackend()


def normalize(path) -> str:
    path = str(path)
    return path[len("file://"):] if path.startswith("file://") else path


__all__ = ["StorageBackend", "FileReader", "FileWriter", "LocalBackend", "backend_for", "is_url", "normalize"]
