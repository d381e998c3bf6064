"""Packed manifest columns: large tensors' piece tables round-trip exactly and fail loudly when
damaged, and a small manifest cannot inflate into a huge one."""
import base64
import json
import math
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

import statesnap as ss
from statesnap.format.columns import INFLATE_RATIO, PACK_MIN_PIECES, PACK_ZLIB_MAX_DIMS, InflationBudget, pack, unpack
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
    """As a save by one rank per piece would write it (a rank writes at most one piece of a tensor)."""
    return Manifest(files=["a.bin", "b.bin", "c.bin"], file_sizes=[1 << 30] * 3, tensors={"w": entry},
                    objects={}, block_bytes=block_bytes, world_size=entry.num_pieces)


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


@pytest.mark.parametrize("pieces", [1, PACK_MIN_PIECES - 1, 200])
def test_multi_block_checksums_round_trip(pieces):
    """Plain (one piece, a few) and packed tables; checksums over the whole uint64 range."""
    entry = _entry(pieces, multi_block=True)
    entry.checksum[::2] |= np.uint64(1 << 63)
    back = Manifest.from_bytes(_manifest(entry, block_bytes=64).to_bytes()).tensors["w"]
    assert [back.piece_checksums(i) for i in range(pieces)] == [entry.piece_checksums(i) for i in range(pieces)]
    assert np.array_equal(back.checksum_bounds, entry.checksum_bounds)


def test_one_piece_checksums_pack_like_many():
    for sums in ([], [5], [(1 << 64) - 1, 1 << 63, 0]):
        checksum, bounds = TensorEntry.pack_checksums([sums])
        assert checksum.dtype == np.uint64 and bounds.dtype == np.int64
        assert checksum.tolist() == sums and bounds.tolist() == [0, len(sums)]


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


# ---- zip bombs: a small manifest cannot inflate into a huge one (docs/format.md section 8, rule 3) ----
def _inflated_bytes(raw: bytes) -> int:
    """What the packed columns of a manifest inflate to: 8 bytes per value."""
    doc = json.loads(raw)
    return sum(8 * math.prod(column["shape"]) for entry in doc["tensors"].values()
               for column in entry.values() if isinstance(column, dict) and "packed" in column)


def _bomb(world_size: int, pieces: int = 1 << 24) -> bytes:
    """The reviewer's repro: 1 MB of manifest declaring 16 M empty pieces, columns of zlib'd zeros."""
    data = base64.b64encode(zlib.compress(bytes(8 * pieces), 9)).decode()
    col = lambda *shape, kind="i8": {"packed": kind, "shape": list(shape), "zlib": True, "data": data}  # noqa: E731
    doc = {"format": "statesnap", "version": 1, "files": ["d.bin"], "file_sizes": [0], "block_bytes": 4096,
           "world_size": world_size, "objects": {},
           "tensors": {"t": {"dtype": "float32", "shape": [0], "layout": "box", "file": col(pieces),
                             "offset": col(pieces), "nbytes": col(pieces), "start": col(pieces, 1),
                             "size": col(pieces, 1), "checksum": col(pieces, kind="u8")}}}
    return json.dumps(doc).encode()


@pytest.mark.parametrize("world_size, words", [
    (1, r"x/manifest.json: tensor 't' has 16777216 pieces, more than the 1 ranks that saved it"),
    (1 << 40, r"x/manifest.json: tensor 't': column 'file': its packed column of 134217728 bytes would take "
              r"the manifest's packed columns past \d+ bytes, 64 times the manifest's own size"),
])
def test_a_zip_bomb_manifest_is_refused_before_it_inflates(world_size, words):
    """It used to parse, taking seconds and 1.7 GB. The piece count is capped by the world size,
    and whatever world size the manifest claims, by the budget of all its packed columns."""
    raw = _bomb(world_size)
    assert len(raw) < 1_100_000 and _inflated_bytes(raw) > 700 * len(raw)
    tracemalloc.start()
    try:
        with pytest.raises(ss.ManifestError, match=words):
            Manifest.from_bytes(raw, where="x/manifest.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * len(raw)  # the parsed JSON and little else: nothing was inflated


def test_bytes_after_the_end_of_a_packed_columns_zlib_stream_are_refused():
    """The format says the stream must end where the column does: another reader refused what this
    one took."""
    stream = zlib.compress(np.arange(2, dtype="<i8").tobytes())
    column = {"packed": "i8", "shape": [2], "zlib": True, "data": base64.b64encode(stream).decode()}
    assert unpack(column, "i8", (2,), "w").tolist() == [0, 1]
    column["data"] = base64.b64encode(stream + b"GARBAGE").decode()
    with pytest.raises(ss.ManifestError, match="^w: malformed packed column \\(7 bytes follow the end of the zlib"):
        unpack(column, "i8", (2,), "w")


def test_the_inflation_budget_is_shared_by_all_columns_of_a_manifest():
    budget = InflationBudget(1000)
    assert budget.limit == INFLATE_RATIO * 1000
    budget.take(budget.limit - 8, "a")
    budget.take(8, "b")  # exactly the limit is allowed
    with pytest.raises(ss.ManifestError, match="^c: its packed column of 8 bytes"):
        budget.take(8, "c")
    # columns that fit their shape but together exceed the budget: the tensor that crosses it is named
    doc = json.loads(_bomb(1 << 40, pieces=1 << 16))
    doc["tensors"] = {f"t{i}": doc["tensors"]["t"] for i in range(64)}
    raw = json.dumps(doc).encode()
    assert _inflated_bytes(raw) > INFLATE_RATIO * len(raw)
    with pytest.raises(ss.ManifestError, match=r"manifest: tensor 't\d+': column '\w+': its packed column"):
        Manifest.from_bytes(raw)
    with pytest.raises(ss.ManifestError, match="more than the 65535 ranks"):
        Manifest.from_bytes(json.dumps(dict(doc, world_size=(1 << 16) - 1)).encode())


def test_a_tensor_may_have_as_many_pieces_as_ranks_and_no_more():
    entry = _entry(100)
    raw = _manifest(entry).to_bytes()
    assert Manifest.from_bytes(raw).tensors["w"].num_pieces == 100
    doc = json.loads(raw)
    doc["world_size"] = 99
    del doc["manifest_xxh3"]
    with pytest.raises(ss.ManifestError, match="tensor 'w' has 100 pieces, more than the 99 ranks"):
        Manifest.from_bytes(json.dumps(doc).encode())


@pytest.mark.parametrize("dims", [1, 2, PACK_ZLIB_MAX_DIMS, PACK_ZLIB_MAX_DIMS + 1, 64])
def test_what_statesnap_writes_stays_far_inside_the_budget(dims):
    """The bound the writer keeps (format/columns.py): with one 8-byte checksum per piece, stored
    uncompressed, at most 16.5 times; boxes of many dimensions are written uncompressed to keep it.
    Empty pieces (all checksums alike), many of them, each on its own in a rank's file."""
    n = 1024
    start = np.zeros((n, dims), np.int64)
    start[:, 0] = np.arange(n)
    size = np.ones((n, dims), np.int64)
    checksum, bounds = TensorEntry.pack_checksums([[0x2D06800538D394C2]] * n)
    entry = TensorEntry(torch.float32, (n,) + (1,) * (dims - 1), "box", np.arange(n) % 3,
                        np.zeros(n, np.int64), np.full(n, 4, np.int64), start, size, checksum, bounds)
    raw = _manifest(entry).to_bytes()
    assert _inflated_bytes(raw) <= 16.5 * len(raw) < INFLATE_RATIO * len(raw)
    assert json.loads(raw)["tensors"]["w"]["start"].get("zlib", False) == (dims <= PACK_ZLIB_MAX_DIMS)
    assert Manifest.from_bytes(raw).tensors["w"].num_pieces == n


def test_a_thousand_rank_manifest_inflates_a_few_times_its_size():
    """The planning benchmark's layout (torchtitan Llama-70B, TP 8 x FSDP 128 = 1024 ranks), with
    one layer instead of 80: the same pieces per tensor. The 80-layer manifest, 25.3 MB and 1.79 M
    pieces, inflates 4.5 times; the budget allows 64."""
    from statesnap.bench.planning import LLAMA_70B, llama_parameters, plan_save_job

    manifest, _ = plan_save_job(llama_parameters(**dict(LLAMA_70B, layers=1)), 8, 128)
    raw = manifest.to_bytes()
    assert max(e.num_pieces for e in manifest.tensors.values()) == 1024 == manifest.world_size
    assert _inflated_bytes(raw) < 6 * len(raw)
    assert Manifest.from_bytes(raw).keys() == manifest.keys()


@pytest.mark.parametrize("layout", ["box", "flat"])
def test_the_one_piece_quick_check_accepts_only_what_the_full_rules_accept(layout, monkeypatch):
    """Single whole-piece entries are accepted in plain Python before numpy's general checks: for
    every field damaged in turn, it accepts an entry only if the general checks accept it too."""
    from statesnap.format.manifest import ManifestError, TensorEntry

    shape, block = (3, 5), 32
    files, sizes = ["a", "b"], [1000, 100]
    whole = list(shape) if layout == "box" else [15]
    good = dict(file=[1], offset=[10], nbytes=[60], start=[[0] * len(whole)], size=[whole], bounds=[0, 2])
    damaged = [dict(good)] + [{**good, key: value} for key, value in [
        ("file", [2]), ("file", [-1]), ("offset", [-4]), ("offset", [41]), ("nbytes", [56]), ("nbytes", [64]),
        ("start", [[1] + [0] * (len(whole) - 1)]), ("size", [[x - 1 for x in whole]]), ("bounds", [0, 1]),
        ("bounds", [0, 3])]]

    def entry(fields):
        return TensorEntry(torch.float32, shape, layout, np.array(fields["file"]), np.array(fields["offset"]),
                           np.array(fields["nbytes"]), np.array(fields["start"]), np.array(fields["size"]),
                           np.array([7] * fields["bounds"][-1], dtype=np.uint64), np.array(fields["bounds"]))

    def general_accepts(fields):
        with monkeypatch.context() as m:
            m.setattr(TensorEntry, "_plainly_valid", lambda *a: False)
            try:
                entry(fields)._validate("x", files, sizes, block)
                return True
            except ManifestError:
                return False

    def accepts(fields):
        try:
            entry(fields)._validate("x", files, sizes, block)
            return True
        except ManifestError:
            return False

    verdicts = [entry(fields)._plainly_valid(files, sizes, block) for fields in damaged]
    assert verdicts[0] and not any(verdicts[1:])
    assert [accepts(fields) for fields in damaged] == [general_accepts(fields) for fields in damaged]
    assert accepts(damaged[0]) and not any(accepts(fields) for fields in damaged[1:])


def _tilings(layout):
    """Two-piece entries of a (4, 6) float32 tensor (flat: 24 elements): one good, and one for
    each way a tiling can be wrong or a column damaged."""
    if layout == "box":
        start, size = [[0, 0], [0, 3]], [[4, 3], [4, 3]]
        wrong = [("start", [[0, 0], [0, 2]]), ("size", [[4, 2], [4, 3]]), ("start", [[0, 0], [1, 3]]),
                 ("size", [[4, 3], [4, 4]]), ("start", [[0, 0], [0, -1]])]
    else:
        start, size = [[0], [12]], [[12], [12]]
        wrong = [("start", [[0], [11]]), ("size", [[11], [12]]), ("start", [[0], [13]]), ("start", [[0], [-1]])]
    good = {"dtype": "float32", "shape": [4, 6], "layout": layout, "file": [0, 1], "offset": [0, 64],
            "nbytes": [48, 48], "start": start, "size": size, "checksum": [[1, 2], [3, 4]]}
    wrong += [("nbytes", [48, 44]), ("offset", [0, 960]), ("file", [0, 2]), ("checksum", [[1], [3, 4]]),
              ("checksum", [[1, 2], [3, True]]), ("file", [0, 1, 1])]
    return good, [good] + [{**good, key: value} for key, value in wrong]


def _read(docs: dict, files, sizes, block, world_size=4, general=False, monkeypatch=None):
    """``TensorEntry.read_all`` of ``docs`` (after a JSON round trip), or the error it raises;
    ``general``: with the batch reading of plain entries off, every entry read one by one."""
    from statesnap.format import manifest as manifest_module
    from statesnap.format.manifest import ManifestError

    with monkeypatch.context() as m:
        if general:
            m.setattr(manifest_module, "read_plain_entries", lambda *a: {})
        try:
            return TensorEntry.read_all(json.loads(json.dumps(docs)), files, sizes, block, world_size=world_size)
        except ManifestError as exc:
            return str(exc)


def _same_entries(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for fqn in a:
        assert a[fqn].dtype == b[fqn].dtype and a[fqn].shape == b[fqn].shape and a[fqn].layout == b[fqn].layout
        for name in ("file", "offset", "nbytes", "start", "size", "checksum", "checksum_bounds"):
            x, y = getattr(a[fqn], name), getattr(b[fqn], name)
            assert x.dtype == y.dtype and x.shape == y.shape and (x == y).all(), (fqn, name)
        assert a[fqn].to_json() == b[fqn].to_json()


def _agrees_with_the_general_path(variants: list, files, sizes, block, monkeypatch,
                                  world_size=4) -> tuple[list[bool], list[bool]]:
    """Read each variant alone, and all of them in one manifest, both ways; assert the batch
    reading gives the general reading's entries or its very error; return which were accepted,
    and which of them the batch reading took (the others it left to the general one)."""
    from statesnap.format.plain_entries import read_plain_entries

    accepted = []
    for doc in variants:
        quick, general = (_read({"t": doc}, files, sizes, block, world_size, g, monkeypatch) for g in (False, True))
        if isinstance(general, str):
            assert quick == general
        else:
            _same_entries(quick, general)
        accepted.append(not isinstance(general, str))
    # together, as one manifest's entries: the good ones read alike, and with the bad ones among
    # them the first bad one's error is raised, as when each is read in turn
    together = {f"t{i}": doc for i, doc in enumerate(variants)}
    good = {k: v for (k, v), ok in zip(together.items(), accepted) if ok}
    _same_entries(_read(good, files, sizes, block, world_size, False, monkeypatch),
                  _read(good, files, sizes, block, world_size, True, monkeypatch))
    mixed = dict(reversed(together.items()))
    quick = _read(mixed, files, sizes, block, world_size, False, monkeypatch)
    assert quick == _read(mixed, files, sizes, block, world_size, True, monkeypatch)
    assert isinstance(quick, str) == (not all(accepted))
    taken = read_plain_entries(json.loads(json.dumps(together)), files, np.asarray(sizes, dtype=np.int64), block,
                               world_size, TensorEntry.in_rows)
    assert set(taken) <= set(good)
    return accepted, [key in taken for key in together]


@pytest.mark.parametrize("layout", ["box", "flat"])
def test_the_batch_reading_of_few_piece_entries_agrees_with_the_general_path(layout, monkeypatch):
    """Entries of a few pieces are checked all together, rule by rule over numpy arrays: a good
    one is read as the general path reads it, and an overlap, a hole, a piece outside the tensor
    or its file, a wrong byte count or checksum count, more pieces than ranks, each gives the
    general path's own error, alone or among other entries."""
    files, sizes = ["a", "b"], [1000, 1000]
    good, variants = _tilings(layout)
    variants.append({**good, "file": [0, 1, 1], "offset": [0, 64, 200], "nbytes": [48, 48, 0],
                     "start": good["start"] + [good["start"][0]], "size": good["size"] + [[0] * len(good["size"][0])],
                     "checksum": [[1, 2], [3, 4], 5]})  # an empty third piece: still a tiling
    accepted, taken = _agrees_with_the_general_path(variants, files, sizes, 32, monkeypatch)
    assert accepted == taken == [True] + [False] * (len(variants) - 2) + [True]
    assert _agrees_with_the_general_path([good], files, sizes, 32, monkeypatch, world_size=1) == ([False], [False])
    planned = TensorEntry.read_all({"t": good}, files, sizes, 32)["t"]
    with monkeypatch.context() as m:
        m.setattr(TensorEntry, "_plainly_valid", lambda *a: False)
        planned._validate("t", files, sizes, 32)  # the general checks accept what the batch accepted
    assert planned._plainly_valid(files, sizes, 32)


@pytest.mark.parametrize("layout", ["box", "flat"])
def test_the_batch_reading_of_one_piece_entries_agrees_with_the_general_path(layout, monkeypatch):
    """One-piece entries in JSON arrays are checked all together: whatever is damaged in them
    (values of other JSON types or beyond 64 bits, pieces outside the tensor or the file), the
    entry read (or the error raised) is the one the general path gives."""
    shape, block = [3, 5], 32
    files, sizes = ["a", "b"], [1000, 100]
    whole = shape if layout == "box" else [15]
    good = {"dtype": "float32", "shape": shape, "layout": layout, "file": [1], "offset": [10], "nbytes": [60],
            "start": [[0] * len(whole)], "size": [whole], "checksum": [[7, 2**64 - 1]]}
    variants = [good] + [{**good, key: value} for key, value in [
        ("file", [2]), ("file", [True]), ("offset", [10.0]), ("offset", [41]), ("offset", [-1]), ("nbytes", [56]),
        ("start", [[False] * len(whole)]), ("start", [[1] + [0] * (len(whole) - 1)]), ("size", [[True] * len(whole)]),
        ("size", [whole[:-1]]), ("checksum", [7]), ("checksum", [[7, 2**64]]), ("checksum", [[7, -1]]),
        ("checksum", [[7, 8, 9]]), ("checksum", [[7.0, 8]]), ("start", [[0.0] * len(whole)]),
        ("size", [[float(x) for x in whole]]), ("start", [0] * len(whole)), ("nbytes", [60.0]), ("file", [[1]]),
        ("checksum", [[]]), ("checksum", [True]), ("checksum", [[7, 2]] * 2), ("file", "1"),
        ("offset", [2**63]), ("offset", [-2**64]), ("shape", [3, 2**63]), ("shape", [0, 2**64]),
        ("dtype", ["float32"]), ("shape", "35"), ("layout", None),
        ("checksum_blocks", [2]), ("file", [1, 0])]]
    # an empty tensor with a dimension past 64 bits (a flat entry's rows never hold its dimensions)
    variants.insert(-2, {**good, "shape": [2**63, 0], "nbytes": [0], "checksum": [5],
                         "size": [[2**63, 0] if layout == "box" else [0]], "start": [[0, 0] if layout == "box" else [0]]})
    variants.append({**good, "shape": [0, 5] if layout == "box" else [0], "nbytes": [0], "checksum": [5],
                     "size": [[0, 5] if layout == "box" else [0]], "start": [[0, 0] if layout == "box" else [0]]})
    accepted, taken = _agrees_with_the_general_path(variants, files, sizes, block, monkeypatch)
    # (checksum_blocks: ignored beside a plain list by the general reading, left to it by the batch)
    assert [doc for doc, ok in zip(variants, accepted) if ok] == [good, variants[-3], variants[-1]]
    assert [doc for doc, ok in zip(variants, taken) if ok] == [good, variants[-1]]


def test_entries_read_together_keep_the_manifest_order_and_their_own_values():
    """A thousand one-piece entries and a few two-piece ones, interleaved, read together: in the
    manifest's order, each with its own values (no entry sees another's row of its group)."""
    files, sizes = ["a", "b"], [1 << 20, 1 << 20]
    docs = {}
    for i in range(1000):
        docs[f"w{i:04d}"] = {"dtype": "float32", "shape": [i % 7 + 1], "layout": "box", "file": [i % 2],
                             "offset": [64 * i], "nbytes": [4 * (i % 7 + 1)], "start": [[0]], "size": [[i % 7 + 1]],
                             "checksum": [i]}
        if i % 100 == 0:
            docs[f"s{i:04d}"] = {"dtype": "int64", "shape": [2, 4], "layout": "box", "file": [0, 1],
                                 "offset": [8 * i, 8 * i], "nbytes": [32, 32], "start": [[0, 0], [1, 0]],
                                 "size": [[1, 4], [1, 4]], "checksum": [i, i + 1]}
    entries = TensorEntry.read_all(docs, files, sizes, 1 << 16, world_size=2)
    assert list(entries) == list(docs)
    for fqn, doc in docs.items():
        assert entries[fqn].to_json() == doc


@pytest.mark.parametrize("enabled", [True, False])
def test_parsing_a_manifest_leaves_the_garbage_collector_as_it_found_it(enabled):
    import gc

    from statesnap.format.manifest import ManifestError

    raw = _manifest(_entry(3)).to_bytes()
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        assert "w" in Manifest.from_bytes(raw).tensors
        assert gc.isenabled() == enabled
        with pytest.raises(ManifestError):
            Manifest.from_bytes(b"{not json")
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()


def test_a_background_parse_never_switches_the_collector_back_on():
    """A pause on a background thread (the further level parses manifests) switched the
    collector on when it ended, though the training had switched it off meanwhile: a pause
    cannot tell its own switch from the caller's, so background threads do not pause."""
    import gc
    import threading

    from statesnap.collector import collector_paused

    was = gc.isenabled()
    gc.enable()
    inside, disabled = threading.Event(), threading.Event()

    def parse():
        with collector_paused():
            inside.set()
            disabled.wait(10)
    try:
        thread = threading.Thread(target=parse)
        thread.start()
        assert inside.wait(10)
        assert gc.isenabled()  # nothing paused it
        gc.disable()  # the training's own choice, while the background parse runs
        disabled.set()
        thread.join(20)
        assert not gc.isenabled()
        with collector_paused(), collector_paused():  # nested on the main thread: the outermost restores
            assert not gc.isenabled()
        assert not gc.isenabled()
        gc.enable()
        with collector_paused():
            with collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
    finally:
        gc.enable() if was else gc.disable()
