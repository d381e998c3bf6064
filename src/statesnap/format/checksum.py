"""Block checksums: xxh3-64 over fixed-size blocks of each stored piece.

Checksumming blocks rather than whole pieces lets a resharded load, which reads only part of a
piece, still verify what it read: it widens its read to block boundaries and checks those blocks.
xxhash releases the GIL, so checksums computed in worker threads run in parallel with training.
"""
from __future__ import annotations

from typing import Sequence

import xxhash

DEFAULT_BLOCK_BYTES = 16 << 20
NO_BYTES_CHECKSUM = xxhash.xxh3_64_intdigest(b"")  # an empty piece's one checksum


def checksum_blocks(views: Sequence[memoryview], block_bytes: int) -> list[int]:
    """Checksums of consecutive ``block_bytes`` blocks of the concatenation of ``views``."""
    if len(views) == 1 and views[0].nbytes <= block_bytes:  # the commonest: one small piece, one call
        return [xxhash.xxh3_64_intdigest(views[0])]
    sums: list[int] = []
    hasher = xxhash.xxh3_64()
    filled = 0
    for view in views:
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        pos = 0
        while pos < len(view):
            take = min(block_bytes - filled, len(view) - pos)
            hasher.update(view[pos:pos + take])
            filled += take
            pos += take
            if filled == block_bytes:
                sums.append(hasher.intdigest())
                hasher.reset()
                filled = 0
    if filled or not sums:
        sums.append(hasher.intdigest())
    return sums


HEAD_BYTES = 4096  # of each block: the sample that replicas too large to hash whole are compared by


def block_heads(view: memoryview, block_bytes: int) -> list[int]:
    """The xxh3-64 of the first ``HEAD_BYTES`` of each ``block_bytes`` block of ``view``: a
    sample of a 4,096th of the default block, cheap enough to take of every large replica at
    every save (engine/replicas.py)."""
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    return [xxhash.xxh3_64_intdigest(view[pos:pos + HEAD_BYTES]) for pos in range(0, max(len(view), 1), block_bytes)]


def checksum_whole(view: memoryview) -> int:
    """One xxh3-64 over all of ``view``: how pickled values are checked, whatever their size (for
    a value within one block it equals that block's checksum)."""
    return xxhash.xxh3_64_intdigest(view)


def piece_blocks(nbytes: int, block_bytes: int) -> int:
    """Number of checksum blocks a piece of ``nbytes`` has (at least one, for empty pieces)."""
    return max(1, -(-nbytes // block_bytes))
