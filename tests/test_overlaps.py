"""Load targets that share memory: tied weights, views of one buffer, aliases of one array
(engine/overlaps.py). Each target must hold its stored values once the load is done, or the
load is refused naming the targets; what needs no second look gets none."""
import copy
import importlib
import pickle

import numpy as np
import pytest
import torch
import torch.nn as nn

import statesnap as ss
from statesnap.engine import overlaps
from statesnap.state.flatten import address_range
from statesnap.state.items import TensorItem

LOAD = importlib.import_module("statesnap.engine.load")  # (statesnap.engine.load is also a function's name)


def test_views_of_one_buffer_in_a_list_are_each_filled(tmp_path):
    """Views that do not overlap are filled in place, each with its stored value."""
    ss.save({"halves": [torch.ones(2), torch.full((2,), 2.0)]}, tmp_path / "c")
    base = torch.zeros(4)
    target = {"halves": [base[:2], base[2:]]}
    ss.load(target, tmp_path / "c")
    assert base.tolist() == [1.0, 1.0, 2.0, 2.0]


class _Tied(nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.emb, self.head = nn.Embedding(300, 64), nn.Linear(64, 300, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_weights_tied_in_the_state_but_not_in_the_checkpoint_are_named(tmp_path):
    """A model with tied weights loading a checkpoint saved untied: both stored values went
    into one tensor, the second over the first, which then loaded wrong or failed its checksum
    ("damaged; restore from another copy" of an intact checkpoint). Now both names are given,
    before anything is read. Tied in both loads, as does a view overlapping another view."""
    torch.manual_seed(0)
    ss.save({"model": _Tied(tie=False)}, tmp_path / "untied")
    torch.manual_seed(0)
    tied = _Tied(tie=True)
    ss.save({"model": tied}, tmp_path / "tied")
    with pytest.raises(ss.StateMismatchError, match=r"'model.emb.weight' and 'model.head.weight' share memory"):
        ss.load({"model": _Tied(tie=True)}, tmp_path / "untied")
    loaded = _Tied(tie=True)
    ss.load({"model": loaded}, tmp_path / "tied")
    assert torch.equal(loaded.head.weight, tied.emb.weight)

    ss.save({"a": torch.ones(1 << 19), "b": torch.full((1 << 19,), 2.0)}, tmp_path / "views")
    base = torch.zeros(3 << 18)
    with pytest.raises(ss.StateMismatchError, match=r"'a' and 'b' share memory"):
        ss.load({"a": base[:1 << 19], "b": base[1 << 18:]}, tmp_path / "views")


def test_a_tied_weight_stored_once_loads_strictly(tmp_path):
    """Hugging Face's save_pretrained stores a tied weight once (no ``lm_head.weight``): the
    tied model's strict load refused it as missing, and strict=False listed it in ``missing``,
    although filling the embedding fills it. A name whose tensor is another's it loads is neither."""
    torch.manual_seed(0)
    source = _Tied(tie=True)
    ss.save({"model": {"emb.weight": source.emb.weight}}, tmp_path / "once")
    for strict in (True, False):
        loaded = _Tied(tie=True)
        info = ss.load({"model": loaded}, tmp_path / "once", strict=strict)
        assert info.missing == [] and torch.equal(loaded.head.weight, source.emb.weight)
    with pytest.raises(ss.StateMismatchError, match=r"missing in checkpoint \(1\): model.head.weight"):
        ss.load({"model": _Tied(tie=False)}, tmp_path / "once")  # (untied: nothing fills it)


@pytest.mark.parametrize("views", ["read apart", "transposed"])
def test_views_that_overwrite_each_other_are_named_however_they_are_read(tmp_path, views):
    """Overlapping views were caught only when the second write broke the first's checksum
    check: one read in the same request. Read apart (another tensor between them in the file)
    or through a host copy (a transposed view), the load returned, ``a`` holding ``b``'s values."""
    a, b, m = torch.randn(64, 64), torch.randn(64, 64), torch.zeros(4 << 20)  # 16 MiB: a and z in two requests
    ss.save({"a": a, "m": m, "z": b}, tmp_path / "c")
    if views == "read apart":
        base = torch.zeros(96 * 64)
        target = {"a": base[:64 * 64].view(64, 64), "m": m, "z": base[32 * 64:].view(64, 64)}
    else:
        base = torch.zeros(64, 64)
        target = {"a": base, "m": m, "z": base.t()}
    with pytest.raises(ss.StateMismatchError, match=r"'a' and 'z' share memory"):
        ss.load(target, tmp_path / "c", threads=1)

    ss.save({"a": a, "m": m, "z": a.t() if views == "transposed" else a}, tmp_path / "alike")
    if views == "transposed":  # stored as the views they load into: each holds its own
        ss.load(target, tmp_path / "alike")
        assert torch.equal(target["a"], a) and torch.equal(target["z"], a.t())


def test_aliases_of_one_array_from_two_storages_are_named(tmp_path):
    """``torch.from_numpy`` of two views of one array gives two storages over one memory: a
    check grouping targets by storage alone let a column view overwrite the matrix without a
    word, and a row view's overwrite was reported as damage of an intact checkpoint."""
    ss.save({"x": torch.randn(4, 3), "r": torch.randn(3), "c": torch.randn(4)}, tmp_path / "c")
    for view in (lambda a: a[1], lambda a: a[:, 1]):
        arr = np.zeros((4, 3), np.float32)
        target = {"x": torch.from_numpy(arr), "r": torch.zeros(3), "c": torch.zeros(4)}
        target["r" if view(arr).ndim and view(arr).shape == (3,) else "c"] = torch.from_numpy(view(arr))
        with pytest.raises(ss.StateMismatchError, match="share memory in the state"):
            ss.load(target, tmp_path / "c")


def test_the_error_names_the_overwritten_tensor_with_every_view_that_shares_it(tmp_path):
    """'x' and its column 0 are stored alike, column 1 is not: the error named 'c0' and 'x',
    the pair that is fine; it names 'x', which no longer holds its values, and both columns."""
    x = torch.randn(4, 3)
    ss.save({"x": x, "c0": x[:, 0].clone(), "c1": torch.randn(4)}, tmp_path / "c")
    u = torch.zeros(4, 3)
    with pytest.raises(ss.StateMismatchError, match=r"'x', 'c0' and 'c1' share memory"):
        ss.load({"x": u, "c0": u[:, 0], "c1": u[:, 1]}, tmp_path / "c")


def test_tied_views_alike_are_refused_before_reading_when_stored_apart(tmp_path, monkeypatch):
    """Two views alike (FSDP2's ``to_local`` gives a new one for each name of a tied weight) are
    one tensor under two names: stored untied, the load is refused before any byte is read."""
    ss.save({"a": torch.randn(8, 8), "b": torch.randn(8, 8)}, tmp_path / "c")
    w = torch.zeros(8, 8)
    monkeypatch.setattr(LOAD, "fill_tensors", lambda *args, **kwargs: pytest.fail("read before refusing"))
    with pytest.raises(ss.StateMismatchError, match=r"'a' and 'b' share memory"):
        ss.load({"a": w[:], "b": w[:]}, tmp_path / "c")


def test_column_blocks_of_one_matrix_share_no_element_and_are_not_read_again(tmp_path, monkeypatch):
    """Column blocks interleave in memory without sharing an element: they load, each with its
    values, and none is read a second time."""
    blocks = [torch.randn(16, 4) for _ in range(4)]
    ss.save({f"e{i}": b for i, b in enumerate(blocks)}, tmp_path / "c")
    w = torch.zeros(16, 16)
    target = {f"e{i}": w[:, 4 * i:4 * (i + 1)] for i in range(4)}
    assert overlaps.overlapping_pairs(TensorItem(name, t) for name, t in target.items()) == []
    monkeypatch.setattr(LOAD, "_read_stored", lambda *args: pytest.fail("read again"))
    ss.load(target, tmp_path / "c")
    assert torch.equal(w, torch.cat(blocks, dim=1))


@pytest.mark.parametrize("x, y", [
    ((16, 16), ((slice(None), slice(0, 4)), (slice(None), slice(4, 8)))),
    ((16, 16), ((slice(None), slice(0, 5)), (slice(None), slice(4, 8)))),
    ((8, 100), ((slice(0, 4), slice(0, 5)), (slice(1, 5), slice(97, 100)))),
    ((8, 100), ((slice(0, 4), slice(0, 5)), (slice(0, 4), slice(95, 100)))),
    ((6,), ((slice(0, 3),), (slice(3, 6),))),
    ((6,), ((slice(0, 4),), (slice(3, 6),))),
], ids=["blocks apart", "blocks sharing a column", "next row's first columns", "same rows, far columns",
        "halves", "halves sharing one"])
def test_views_with_one_stride_share_an_element_exactly_when_they_do(x, y):
    """The stride arithmetic (``_disjoint_kinds``) against a brute force over the elements."""
    base = torch.zeros(x)
    a, b = base[y[0]], base[y[1]]
    marks = torch.zeros(base.numel(), dtype=torch.int64)
    flat = marks.view(x)
    flat[y[0]] += 1
    flat[y[1]] += 1
    assert _disjoint_views(a, b) == bool((marks < 2).all())


def test_plain_lists_of_aliases_of_one_array_are_not_filled_over_each_other(tmp_path):
    """Tensors in a plain list are filled in place unless their memory overlaps one filled
    before; two ``torch.from_numpy`` views of one array are two storages over one memory, and
    the second was filled over the first."""
    ss.save({"lst": [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])]}, tmp_path / "c")
    arr = np.zeros(4, np.float32)
    target = {"lst": [torch.from_numpy(arr[0:3]), torch.from_numpy(arr[1:4])]}
    ss.load(target, tmp_path / "c")
    assert [t.tolist() for t in target["lst"]] == [[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]]


def test_damage_under_views_that_load_alike_is_damage(tmp_path):
    """A tensor and a view of its row, stored consistently, load; a flipped byte in the tensor's
    row 3 was then blamed on the two sharing memory ("no damage of the checkpoint"), so a
    Checkpointer did not fall back to the step before. The tensor read again alone fails its
    checksum too: damage."""
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    ss.save({"t": t, "row": t[0].clone()}, tmp_path / "c")
    u = torch.zeros(8, 8)
    ss.load({"t": u, "row": u[0]}, tmp_path / "c")
    assert torch.equal(u, t)
    data = next(p for p in (tmp_path / "c").iterdir() if p.name != "manifest.json")
    raw = bytearray(data.read_bytes())
    at = raw.find(t[3].numpy().tobytes())
    assert at >= 0
    raw[at] ^= 0xFF
    data.write_bytes(bytes(raw))
    u = torch.zeros(8, 8)
    with pytest.raises(ss.CorruptCheckpointError, match="tensor 't'"):
        ss.load({"t": u, "row": u[0]}, tmp_path / "c")


def test_a_target_whose_own_elements_overlap_is_refused_by_name(tmp_path):
    """``as_strided`` with strides smaller than its sizes puts two elements at one place: the
    load wrote both stored values there, the second over the first, and returned without a word.
    It is refused before anything is read; the other targets are left as they were."""
    ss.save({"ok": torch.ones(2), "odd": torch.arange(9.0).reshape(3, 3)}, tmp_path / "c")
    ok = torch.zeros(2)
    odd = torch.zeros(5).as_strided((3, 3), (1, 1))
    with pytest.raises(ss.CheckpointError, match=r"tensor 'odd' .*overlap in memory .*strides \(1, 1\)"):
        ss.load({"ok": ok, "odd": odd}, tmp_path / "c")
    assert not ok.any()


def test_an_unusual_layout_that_does_not_overlap_loads_exactly(tmp_path):
    """Strides out of torch's usual order that still give each element its own place (offsets
    0, 3, 6 and 4, 7, 10) load bit exact, element by element."""
    value = torch.randn(2, 3)
    ss.save({"t": value}, tmp_path / "c")
    base = torch.zeros(11)
    target = base.as_strided((2, 3), (4, 3))
    ss.load({"t": target}, tmp_path / "c")
    assert torch.equal(target, value)
    assert base[[1, 2, 5, 8, 9]].eq(0).all()


def test_a_layout_too_large_to_check_is_refused_not_guessed(tmp_path, monkeypatch):
    monkeypatch.setattr("statesnap.state.items._LARGEST_CHECKED", 4)
    ss.save({"t": torch.randn(2, 3)}, tmp_path / "c")
    with pytest.raises(ss.CheckpointError, match="tensor 't' .*may put two elements at one place .*too large"):
        ss.load({"t": torch.zeros(11).as_strided((2, 3), (4, 3))}, tmp_path / "c")


def test_the_quick_layout_test_never_passes_a_layout_that_overlaps():
    """``_strides_apart`` against the list of addresses, over random small layouts."""
    from statesnap.state.items import _addresses_repeat, _strides_apart
    rng = np.random.default_rng(0)
    for _ in range(3000):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(v) for v in rng.integers(1, 5, ndim))
        strides = tuple(int(v) for v in rng.integers(1, 13, ndim))
        t = torch.zeros(200).as_strided(shape, strides)
        repeats = _addresses_repeat(t)
        assert repeats == (len(set(torch.arange(200).as_strided(shape, strides).flatten().tolist())) != t.numel())
        if _strides_apart(t):
            assert not repeats, (shape, strides)


@pytest.mark.parametrize("pairs_at_once", [1 << 20, 5])
def test_the_pairs_found_are_every_pair_that_shares_an_element(monkeypatch, pairs_at_once):
    """Random views of one buffer (blocks, strided rows, repeats of one view): the pairs found
    are those whose address ranges overlap less those the stride arithmetic shows apart, pair by
    pair, and they include every pair sharing an element (against each view's addresses). Small
    rounds of candidates (5) give the same pairs as one round."""
    monkeypatch.setattr(overlaps, "_PAIRS_AT_ONCE", pairs_at_once)
    rng = np.random.default_rng(1)
    base = torch.zeros(12, 20)
    for _ in range(40):
        items = []
        for n in range(int(rng.integers(2, 12))):
            rows, cols = sorted(rng.integers(0, 13, 2)), sorted(rng.integers(0, 21, 2))
            view = base[rows[0]:rows[1] + 1:int(rng.integers(1, 3)), cols[0]:cols[1] + 1]
            items.append(TensorItem(f"v{n}", view))
        found = {frozenset((a.fqn, b.fqn)) for a, b in overlaps.overlapping_pairs(items)}
        expected = set()
        for i, a in enumerate(items):
            for b in items[i + 1:]:
                x, y = sorted((a.local, b.local), key=lambda t: t.data_ptr())
                (x_start, x_end), (y_start, y_end) = address_range(x), address_range(y)
                if x_start < y_end and y_start < x_end and not _disjoint_views(x, y):
                    expected.add(frozenset((a.fqn, b.fqn)))
                if set(_addresses(a.local)) & set(_addresses(b.local)):
                    assert frozenset((a.fqn, b.fqn)) in found
        assert found == expected


def _disjoint_views(x, y):
    x_layout, y_layout = overlaps._layout(x), overlaps._layout(y)
    return overlaps._disjoint_kinds(x_layout[1:], y_layout[1:], y_layout[0] - x_layout[0])


def _addresses(t):
    return (t.storage_offset() + sum(i * s for i, s in zip(index, t.stride())) for index in np.ndindex(*t.shape))


def test_no_pair_sharing_a_byte_is_missed_across_dtypes_and_arbitrary_strides(monkeypatch):
    """The array search against the bytes each view covers, over layouts the block views above
    do not make: ``as_strided`` of any strides (repeats and interleavings), dtypes of 1 to 8
    bytes over one buffer, storages of their own over it at any byte (``torch.from_numpy``,
    distances not a multiple of the element size), one view's layout repeated at other places,
    and rounds of 3 candidates. A pair missed is a load that hands back another tensor's values
    without a word."""
    monkeypatch.setattr(overlaps, "_PAIRS_AT_ONCE", 3)
    rng = np.random.default_rng(2)
    dtypes = [torch.uint8, torch.int16, torch.float32, torch.float64, torch.complex64]
    for _ in range(400):
        memory = np.zeros(128, dtype=np.uint8)
        shared = torch.from_numpy(memory)
        items = []
        for n in range(int(rng.integers(2, 9))):
            dtype = dtypes[int(rng.integers(0, len(dtypes)))]
            if rng.random() < 0.5:  # the one storage, viewed as another dtype
                typed = shared.view(dtype)
            else:  # a storage of its own from any byte on, as from_numpy of a view gives
                first = int(rng.integers(0, 64))
                typed = torch.from_numpy(memory[first:]).view(torch.uint8)[:64].view(dtype)
            if items and rng.random() < 0.3 and items[-1].local.dtype == typed.dtype:
                shape, strides = tuple(items[-1].local.shape), items[-1].local.stride()
            else:
                shape = tuple(int(v) for v in rng.integers(1, 5, int(rng.integers(1, 4))))
                strides = tuple(int(v) for v in rng.integers(1, 9, len(shape)))
            reach = sum((size - 1) * stride for size, stride in zip(shape, strides)) + 1
            if reach <= typed.numel():
                offset = int(rng.integers(0, typed.numel() - reach + 1))
                items.append(TensorItem(f"v{n}", typed.as_strided(shape, strides, offset)))
        found = {frozenset((a.fqn, b.fqn)) for a, b in overlaps.overlapping_pairs(items)}
        covered = {item.fqn: _bytes(item.local) for item in items}
        for i, a in enumerate(items):
            for b in items[i + 1:]:
                if covered[a.fqn] & covered[b.fqn]:
                    assert frozenset((a.fqn, b.fqn)) in found, (a.local.stride(), b.local.stride())


def _bytes(t):
    size = t.element_size()
    return {t.data_ptr() + size * sum(i * s for i, s in zip(index, t.stride())) + byte
            for index in np.ndindex(*t.shape) for byte in range(size)}


def test_a_tied_weight_stored_once_restores_from_host_memory_too(tmp_path):
    """load_latest of the step still in host memory refused the tied weight that a load from
    storage takes (missing model.head.weight)."""
    torch.manual_seed(0)
    source = _Tied(tie=True)
    with ss.Checkpointer(tmp_path, host_memory_gb=0.01) as ckpt:
        ckpt.save(1, {"model": {"emb.weight": source.emb.weight}}).wait()
        loaded = _Tied(tie=True)
        assert ckpt.load_latest({"model": loaded}) == 1 and ckpt.loaded_from == "memory"
    assert torch.equal(loaded.head.weight, source.emb.weight)


def test_a_mismatched_name_with_a_space_is_left_as_it_was(tmp_path):
    """A name cut at its first space ('my' of 'my model.w'): strict=False skipped no target, and
    the one that did not match was filled with what the stored bytes covered of it."""
    ss.save({"my model": {"w": torch.ones(3, 4)}}, tmp_path / "c")
    target = {"my model": {"w": torch.zeros(4, 4)}}
    with pytest.warns(UserWarning, match="shape/dtype mismatch"):
        info = ss.load(target, tmp_path / "c", strict=False)
    assert info.mismatched == ["my model.w"] and not target["my model"]["w"].any()
    with pytest.raises(ss.StateMismatchError) as raised:  # and the error of a strict load travels whole
        ss.load(target, tmp_path / "c")
    for again in (pickle.loads(pickle.dumps(raised.value)), copy.deepcopy(raised.value)):
        assert again.mismatched == raised.value.mismatched and again.mismatched[0].name == "my model.w"
