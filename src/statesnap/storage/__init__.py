"""Storage backends behind one ABC; :func:`backend_for` picks one from a path or URL.

Paths are local paths, ``file://`` paths, ``shm://NAME`` (the node's shared memory, a tmpfs under
``/dev/shm``: it outlives a crashed training process, not the node, and reads and writes at
memory speed, so it suits a fast checkpoint level that a restarted process on the same node can
load from), or fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...).
"""
from __future__ import annotations

import os

from .base import FileReader, FileWriter, StorageBackend
from .local import LocalBackend

SHM_SCHEME = "shm://"
SHM_ROOT = "/dev/shm"
_LOCAL_SCHEMES = ("file://", SHM_SCHEME)


def is_url(path: str) -> bool:
    """Does ``path`` name remote storage (served through fsspec)?"""
    return "://" in str(path) and not str(path).startswith(_LOCAL_SCHEMES)


def backend_for(path, storage_options: dict | None = None) -> StorageBackend:
    path = str(path)
    if is_url(path):
        from .fsspec_backend import FsspecBackend
        return FsspecBackend(path, storage_options)
    return LocalBackend()


def normalize(path) -> str:
    """The path a backend works with: local schemes become plain file-system paths."""
    path = str(path)
    if path.startswith("file://"):
        return path[len("file://"):]
    if path.startswith(SHM_SCHEME):
        return os.path.join(SHM_ROOT, path[len(SHM_SCHEME):].lstrip("/"))
    return path


__all__ = ["StorageBackend", "FileReader", "FileWriter", "LocalBackend", "backend_for", "is_url", "normalize",
           "SHM_SCHEME"]
