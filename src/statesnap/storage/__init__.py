"""Storage backends behind one ABC; :func:`backend_for` picks one from a path or URL.

Paths are local paths, ``file://`` paths, ``shm://NAME`` (the node's shared memory, a tmpfs under
``/dev/shm``: it outlives a crashed training process, not the node, and reads and writes at
memory speed, so it suits a fast checkpoint level that a restarted process on the same node can
load from), or fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import CheckpointError
from .base import FileReader, FileWriter, StorageBackend
from .local import LocalBackend

SHM_SCHEME = "shm://"
SHM_ROOT = "/dev/shm"
_LOCAL_SCHEMES = ("file://", SHM_SCHEME)


def is_url(path: str) -> bool:
    """Does ``path`` name remote storage (served through fsspec)?"""
    return "://" in str(path) and not str(path).startswith(_LOCAL_SCHEMES)


def backend_for(path, storage_options: dict | None = None) -> StorageBackend:
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise CheckpointError(f"storage_options must be a dict of the file system's options (fsspec's), not "
                              f"{type(storage_options).__name__}")
    path = str(path)
    if is_url(path):
        from .fsspec_backend import FsspecBackend
        return FsspecBackend(path, storage_options)
    return LocalBackend()


def place_of(path) -> str:
    """Where ``path`` points, for telling whether two paths name one place: a local path (or
    ``file://``, ``shm://`` URL) resolved through links and ``..``; a URL without a trailing slash."""
    path = normalize(path)
    return path.rstrip("/") if is_url(path) else os.path.realpath(path)


def path_text(path) -> str:
    """A path given as text, a ``PathLike`` or bytes, as text (``str`` of bytes made a name of
    their repr, ``b'...'``). Anything else is refused: ``str`` of it made ``None`` (an unset
    environment variable) or ``5`` a directory in the working directory, without a word."""
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    if isinstance(path, bytes):
        return os.fsdecode(path)
    if not isinstance(path, str):
        raise CheckpointError(f"a checkpoint path is a str, an os.PathLike or bytes, not {type(path).__name__} "
                              f"({path!r})")
    return path


def normalize(path) -> str:
    """The path a backend works with: local schemes become plain file-system paths. A local path
    with ``..`` in it is resolved as the save's commit resolves it, by its text (``x/new/..`` is
    ``x``): the kernel, which resolves it by the directories there, found no ``x/new`` and so
    nothing in ``x`` that a save must not replace, and an overwrite then replaced ``x`` whole.
    An empty path (the working directory, by the same route) and bytes or NUL characters, which
    no file system names, are refused."""
    path = path_text(path)
    if not path.strip():
        raise CheckpointError("the checkpoint path is empty: give the checkpoint's directory (for the working "
                              "directory itself, '.')")
    if "\0" in path:
        raise CheckpointError(f"the checkpoint path {path!r} holds a NUL character, which no file system or URL takes")
    if path.startswith("file:/"):
        path = _file_url_path(path)
    elif path.startswith(SHM_SCHEME):
        path = _shm_path(path)
    elif is_url(path):
        return path
    return os.path.normpath(path) if ".." in path.split(os.sep) else path


def _shm_path(url: str) -> str:
    """The directory below /dev/shm that ``shm://NAME`` names. A NAME that climbs out with ``..`` left
    /dev/shm (a root on the disk, under a scheme that promises memory), and an empty one made /dev/shm
    itself the root, where a Checkpointer's start-up cleanup and retention then worked among every
    other program's files: both are refused."""
    name = os.path.normpath(url[len(SHM_SCHEME):].lstrip("/") or ".")
    if name == "." or name.split(os.sep)[0] == "..":
        raise CheckpointError(f"{url} names no directory below {SHM_ROOT}: give shm://NAME, a directory of its own "
                              "there (e.g. shm://my-run)")
    return os.path.join(SHM_ROOT, name)


def _file_url_path(url: str) -> str:
    """The local path a file URL names: ``file:///p``, ``file://localhost/p`` and ``file:/p`` are
    all ``/p`` (percent escapes are left as they are, as fsspec leaves them). Only the first was
    understood: the others became the relative paths ``localhost/p`` and ``file:/p``, and a
    checkpoint went into the working directory, where no load from elsewhere finds it. A file
    URL naming another host, or no path, is refused rather than written here or at ``/``."""
    rest = url[len("file:"):]
    if rest.startswith("//"):
        host, _, tail = rest[2:].partition("/")
        if host.lower() not in ("", "localhost"):
            raise CheckpointError(f"{url} names a file on the host {host!r}; file URLs name local paths "
                                  "(file:///path): mount that storage and give its local path, or use its URL scheme")
        rest = "/" + tail
    if rest.strip("/") == "":
        raise CheckpointError(f"{url} names no path: give the checkpoint's directory (file:///path/to/ckpt)")
    return rest


__all__ = ["StorageBackend", "FileReader", "FileWriter", "LocalBackend", "backend_for", "is_url", "normalize",
           "SHM_SCHEME"]
