"""Packed manifest columns: large tensors' piece tables round-trip exactly and fail loudly when damaged."""
import json

import numpy as np
import pytest
import torch

import statesnap as ss
from statesnap.format.columns import PACK_MIN_PIECES, pack, unpack
from statesnap.format.manifest import Manifest, TensorEntry


def _entry(pieces: int, multi_block: bool = False) -> TensorEntry:
    rows = 4
    per_piece = [[(i * 2654435761 + k) % (1 << 64) for k in range(3 if multi_block and i % 7 == 0 else 1)]
                 for i in range(pieces)]
    nbytes = np.full(pieces, rows * 8 * 4, np.int64)
    if multi_block:
        nbytes = np.where([len(c) == 3 for c in per_piece], 3 * 64, 64).astype(np.int64)
        per_piece = [[(i * 31 + k) % (1 << 64) for k in range(len(c))] for i, c in enumerate(per_piece)]
        sizes = nbytes // 4
        start = np.cumsum(np.concatenate([[0], sizes[:-1]]))[:, None]
        size = sizes[:, None]
        checksum, bounds = TensorEntry.pack_checksums(per_piece)
        return TensorEntry(torch.float32, (int(sizes.sum()),), "flat", np.arange(pieces) % 3,
                           np.arange(pieces, dtype=np.int64) * 256, nbytes, start.astype(np.int64),
                           size.astype(np.int64), checksum, bounds)
    start = np.stack([np.arange(pieces) * rows, np.zeros(pieces, np.int64)], axis=1)
    size = np.tile([rows, 8], (pieces, 1))
    checksum, bounds = TensorEntry.pack_checksums(per_piece)
    return TensorEntry(torch.float32, (pieces * rows, 8), "box", np.arange(pieces) % 3,
                       np.arange(pieces, dtype=np.int64) * 256, nbytes, start, size, checksum, bounds)


def _manifest(entry: TensorEntry, block_bytes: int = 1 << 20) -> Manifest:
    return Manifest(files=["a.bin", "b.bin", "c.bin"], file_sizes=[1 << 30] * 3, tensors={"w": entry},
                    objects={}, block_bytes=block_bytes)


@pytest.mark.parametrize("pieces", [1, PACK_MIN_PIECES - 1, PACK_MIN_PIECES, 1000])
def test_piece_tables_round_trip_plain_and_packed(pieces):
    entry = _entry(pieces)
    raw = _manifest(entry).to_bytes()
    packed = isinstance(json.loads(raw)["tensors"]["w"]["offset"], dict)
    assert packed == (pieces >= PACK_MIN_PIECES)
    back = Manifest.from_bytes(raw).tensors["w"]
    for column in ("file", "offset", "nbytes", "start", "size", "checksum", "checksum_bounds"):
        assert np.array_equal(getattr(back, column), getattr(entry, column)), column
    assert back.piece_checksums(pieces - 1) == entry.piece_checksums(pieces - 1)


def test_multi_block_checksums_round_trip_packed():
    entry = _entry(200, multi_block=True)
    back = Manifest.from_bytes(_manifest(entry, block_bytes=64).to_bytes()).tensors["w"]
    assert [back.piece_checksums(i) for i in range(200)] == [entry.piece_checksums(i) for i in range(200)]


def test_packed_column_survives_full_uint64_range():
    values = np.array([0, 1, (1 << 64) - 1, 1 << 63], dtype=np.uint64)
    assert np.array_equal(unpack(pack(values, "u8", compress=False), "u8", (4,), "t"), values)
    offsets = np.array([0, 4096, 8192, 1 << 40], dtype=np.int64)
    assert np.array_equal(unpack(pack(offsets, delta=True), "i8", (4,), "t"), offsets)


@pytest.mark.parametrize("damage", [
    lambda col: col.update(data="!!not base64!!"),
    lambda col: col.update(data=col["data"][:-8]),
    lambda col: col.update(packed="f4"),
    lambda col: col.update(shape=[5]),
])
def test_damaged_packed_column_is_a_manifest_error(damage):
    doc = json.loads(_manifest(_entry(100)).to_bytes())
    damage(doc["tensors"]["w"]["offset"])
    with pytest.raises(ss.ManifestError, match="'w'"):
        Manifest.from_bytes(json.dumps(doc).encode())
