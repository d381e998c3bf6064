"""The members of a ``torch.save`` archive: stored as they are, and intact.

``torch.save`` writes a zip archive whose members are stored uncompressed, each with the CRC-32
of its bytes in the archive's directory. ``torch.load(mmap=True)`` reads a tensor's bytes straight
from its member's place in the file and checks neither: a compressed member loads as its
compressed bytes, a damaged one as damaged values. A conversion would then write them with fresh
checksums of statesnap's own, into a checkpoint that verifies as good. So both are refused here,
naming the file, the member and the tensors whose bytes it holds.
"""
from __future__ import annotations

import contextlib
import os
import re
import struct
import zipfile
import zlib
from typing import Any, Iterator

import torch

from ..errors import CorruptCheckpointError
from ..storage.local import open_source

LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # the zip local file header before the name
CHECK_CHUNK_BYTES = 8 << 20  # read at a time while a member's CRC-32 is computed
_STORAGE_MEMBER = re.compile(r"(?:.*/)?data/\d+")  # where torch.save keeps each storage's bytes
_MS_DOS_DIRECTORY = 0x10  # the external attribute bit that marks a directory entry


def looks_like_zip(source) -> bool:
    """``zipfile.is_zipfile`` of a path or file object, except that an end record it raises on (a
    flipped byte can make one claim several disks) counts as an archive: a damaged one, which
    the reads after it name."""
    try:
        return zipfile.is_zipfile(source)
    except zipfile.BadZipFile:
        return True


def member_data_start(f, archive_start: int, info: zipfile.ZipInfo) -> int:
    """Where the bytes of member ``info`` of the archive at ``archive_start`` of ``f`` begin (a
    ``zipfile.BadZipFile`` where its local header is not where the directory says)."""
    if archive_start + info.header_offset < 0:
        raise zipfile.BadZipFile(f"the local file header of {info.filename} would lie before the archive")
    f.seek(archive_start + info.header_offset)
    header = f.read(LOCAL_HEADER.size)
    if len(header) != LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"no local file header for {info.filename}")
    name_len, extra_len = LOCAL_HEADER.unpack(header)[-2:]
    return archive_start + info.header_offset + LOCAL_HEADER.size + name_len + extra_len


@contextlib.contextmanager
def _members(source):
    """(the open file, its archive's members), or None where ``source`` is no readable zip archive
    (left to ``torch.load``, which names what is wrong). ``source``: a path or a file object,
    left where it was."""
    with contextlib.ExitStack() as stack:
        if isinstance(source, (str, os.PathLike)):
            source = stack.enter_context(open_source(source))
        start = source.tell()
        stack.callback(source.seek, start)
        try:
            members = zipfile.ZipFile(source).infolist() if zipfile.is_zipfile(source) else None
        except (zipfile.BadZipFile, ValueError, OSError):
            members = None
        yield (source, members) if members is not None else None


def refuse_compressed_members(source, where: str) -> None:
    """Raise :class:`CorruptCheckpointError` naming the first compressed member of a
    ``torch.save`` archive (a path or a file object; anything else passes): ``torch.load(mmap=True)``
    would load a compressed member as its compressed bytes (an archive repacked by ``zip``), wrong
    values without a word, and without ``mmap`` inflate it to whatever size it declares: 1 MB of
    zlib'd zeros is 1 GB. Asked before anything is loaded."""
    with _members(source) as found:
        packed = next((info for info in found[1] if info.compress_type != zipfile.ZIP_STORED), None) if found else None
    if packed is not None:
        raise CorruptCheckpointError(
            f"{where}: its archive member {packed.filename!r} is compressed (zip method {packed.compress_type}), "
            "which torch.save never writes and torch.load would read as raw tensor bytes; re-save the "
            "file with torch.save")


def check_member_crcs(source, where: str, loaded: Any) -> None:
    """Raise :class:`CorruptCheckpointError` naming the first member of a ``torch.save`` archive
    whose bytes differ from the CRC-32 the archive records for them, and the tensors of
    ``loaded`` (what ``torch.load`` made of it) that hold those bytes, where it can tell."""
    with _members(source) as found:
        if not found:
            return
        f, members = found
        folder = next((info for info in members if info.external_attr & _MS_DOS_DIRECTORY), None)
        if folder is not None:  # (PyTorch's zip reader reads nothing into such a member's tensor)
            raise CorruptCheckpointError(f"{where} is damaged: its archive member {folder.filename!r} is marked as a "
                                         "directory, which torch.save never writes; restore the file from another copy")
        if not crcs_recorded(members):
            return
        buffer = bytearray(min(CHECK_CHUNK_BYTES, max(info.file_size for info in members)))
        for info in members:
            try:
                start = member_data_start(f, 0, info)
            except (zipfile.BadZipFile, OSError, ValueError) as exc:
                raise CorruptCheckpointError(f"{where} is damaged: {exc}") from None
            if running_crc(f, start, info.file_size, buffer) != info.CRC:
                holders = _tensors_at(loaded, _data_starts(f, members), start)
                held = f" (the bytes of {', '.join(map(repr, holders))})" if holders else ""
                raise CorruptCheckpointError(
                    f"{where} is damaged: the bytes of its archive member {info.filename!r}{held} differ from the "
                    "CRC-32 the archive records for them; restore the file from another copy")


def crcs_recorded(members: list[zipfile.ZipInfo]) -> bool:
    """Whether an archive records its members' CRC-32s: one written after
    ``torch.serialization.set_crc32_options(False)`` records 0 for each, and has none to check."""
    return any(info.CRC for info in members if info.file_size)


class MemberDamaged(zipfile.BadZipFile):
    """A member's bytes differ from the CRC-32 its archive records."""


def read_member(f, archive_start: int, info: zipfile.ZipInfo, check: bool) -> bytes:
    """The bytes of the stored member ``info`` of the archive at ``archive_start`` of ``f``, read
    as they lie (zipfile's own reader refuses a member whose CRC-32 the archive did not record),
    and compared with its CRC-32 where ``check``: :class:`MemberDamaged` where they differ, a
    ``zipfile.BadZipFile`` where the file ends first."""
    f.seek(member_data_start(f, archive_start, info))
    data = f.read(info.file_size)
    if len(data) != info.file_size:
        raise zipfile.BadZipFile(f"{info.filename} runs past the end of the file")
    if check and zlib.crc32(data) != info.CRC:
        raise MemberDamaged(f"the bytes of {info.filename} differ from the CRC-32 the archive records")
    return data


def running_crc(f, start: int, nbytes: int, buffer: bytearray) -> int:
    """The CRC-32 of ``nbytes`` of ``f`` from ``start`` (a file that ends first: of what it holds)."""
    f.seek(start)
    view, crc = memoryview(buffer), 0
    while nbytes > 0:
        got = f.readinto(view[:min(nbytes, len(view))])
        if not got:
            break
        crc = zlib.crc32(view[:got], crc)
        nbytes -= got
    return crc


def _data_starts(f, members: list[zipfile.ZipInfo]) -> dict[str, int]:
    """Where each storage's bytes begin in the file."""
    return {info.filename: member_data_start(f, 0, info) for info in members
            if _STORAGE_MEMBER.fullmatch(info.filename)}


def _tensors_at(loaded: Any, starts: dict[str, int], start: int) -> list[str]:
    """The names (paths of keys and indices) of the tensors of ``loaded`` whose storage begins at
    byte ``start`` of the file. Loaded with ``mmap``, every storage lies in one mapping of the
    file at the distance its member lies from the file's start; the mapping's address is found
    from the lowest of both. Without ``mmap`` (or where they do not line up): none."""
    tensors = [(name, t) for name, t in _tensors_in(loaded, "") if t.layout == torch.strided]  # (storage or none)
    storage_starts = list(starts.values())
    if not tensors or not storage_starts:
        return []
    pointers = {name: t.untyped_storage().data_ptr() for name, t in tensors}
    base = min(pointers.values()) - min(storage_starts)
    if not {p - base for p in pointers.values()} <= set(storage_starts):
        return []
    return [name for name, pointer in pointers.items() if pointer - base == start]


def _tensors_in(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors_in(item, f"{path}.{index}" if path else str(index))
