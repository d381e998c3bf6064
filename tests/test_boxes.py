"""Exact tiling checks (format/boxes.py): overlaps and holes found by box arithmetic, never by counts."""
import itertools
import re

import numpy as np
import pytest

from statesnap.format import boxes
from statesnap.format.boxes import first_outside, tiling_problem
from statesnap.state.placement import chunk_bounds


def rows(values, dims):
    return np.asarray(values, dtype=np.int64).reshape(len(values), dims)


def check(shape, starts, sizes):
    return tiling_problem(shape, rows(starts, len(shape)), rows(sizes, len(shape)), lambda i: f"piece {i}")


@pytest.fixture(params=["fast", "corners"])
def path(request, monkeypatch):
    """Run a test through the chain/grid fast paths, and again with everything sent to corners."""
    if request.param == "corners":
        monkeypatch.setattr(boxes, "MIN_CELLS", 0)
        monkeypatch.setattr(boxes, "CELLS_PER_PIECE", 0)
    return request.param


def test_rows_0_to_5_and_4_to_9_of_12_overlap_even_though_48_elements_are_stored(path):
    assert check((12, 4), [(0, 0), (4, 0)], [(6, 4), (6, 4)]) == "piece 0 and piece 1 overlap in [4:6, 0:4]"


def test_a_hole_is_named_by_its_region(path):
    assert check((12, 4), [(0, 0), (6, 0)], [(6, 4), (4, 4)]) == "[10:12, 0:4] is in no piece"
    assert check((12, 4), [(0, 0), (0, 2), (6, 0)], [(6, 2), (6, 2), (6, 3)]) == "[6:12, 3:4] is in no piece"
    assert check((12, 4), [], []) == "[0:12, 0:4] is in no piece"


def test_flat_ranges_overlap_or_leave_holes(path):
    assert check((100,), [(0,), (40,)], [(50,), (60,)]) == "piece 0 and piece 1 overlap in [40:50]"
    assert check((100,), [(0,), (60,)], [(50,), (40,)]) == "[50:60] is in no piece"
    assert check((100,), [(10,), (50,)], [(40,), (50,)]) == "[0:10] is in no piece"
    assert check((100,), [(0,), (50,)], [(50,), (49,)]) == "[99:100] is in no piece"
    assert check((100,), [(50,), (0,), (25,)], [(50,), (25,), (25,)]) is None  # any order


def test_three_d_boxes(path):
    shape = (4, 6, 2)
    grid = [(a, b, c) for a, b, c in itertools.product((0, 2), (0, 3), (0, 1))]
    sizes = [(2, 3, 1)] * len(grid)
    assert check(shape, grid, sizes) is None
    assert check(shape, grid, [(2, 3, 1)] * 7 + [(2, 3, 0)]) == "[2:4, 3:6, 1:2] is in no piece"
    assert check(shape, grid + [(1, 2, 0)], sizes + [(2, 2, 1)]) == "piece 0 and piece 8 overlap in [1:2, 2:3, 0:1]"
    # a brick wall: the second layer is cut elsewhere than the first, so the cells are no product grid
    assert check(shape, [(0, 0, 0), (0, 4, 0), (0, 0, 1), (0, 1, 1), (2, 0, 0)],
                 [(2, 4, 1), (2, 2, 1), (2, 1, 1), (2, 5, 1), (2, 6, 2)]) is None


def test_legitimate_layouts_pass(path):
    # FSDP splits 10 rows over 4 ranks as 3, 3, 3, 1 and 2 rows as 1, 1, 0, 0: empty ranks hold zero-size pieces
    for n in (10, 2):
        bounds = [chunk_bounds(n, 4, r) for r in range(4)]
        assert check((n, 5), [(s, 0) for s, _ in bounds], [(k, 5) for _, k in bounds]) is None
    tp_fsdp = [((chunk_bounds(13, 3, d)[0], 2 * t), (chunk_bounds(13, 3, d)[1], 2)) for d in range(3) for t in range(4)]
    assert check((13, 8), *zip(*tp_fsdp)) is None
    assert check((), [()], [()]) is None  # a scalar, stored once
    assert check((0, 4), [], []) is None and check((0, 4), [(0, 0), (0, 0)], [(0, 4), (0, 4)]) is None
    assert check((12, 4), [(12, 0), (0, 0), (3, 4)], [(0, 4), (12, 4), (0, 0)]) is None  # zero-size anywhere


def test_scalars(path):
    assert check((), [(), ()], [(), ()]) == "piece 0 and piece 1 overlap in []"
    assert check((), [], []) == "[] is in no piece"


def test_whole_tensor_pieces_that_repeat_overlap(path):
    assert check((12, 4), [(0, 0), (0, 0)], [(12, 4), (12, 4)]) == "piece 0 and piece 1 overlap in [0:12, 0:4]"


def test_large_layouts_take_the_fast_paths(monkeypatch):
    """A TP 8 x FSDP 512 grid and a 4096-way row split are decided by bincount and by a sort."""
    monkeypatch.setattr(boxes, "_corners", lambda *a: pytest.fail("fell back to corners"))
    grid = [((chunk_bounds(8192, 512, d)[0], 3584 * t), (chunk_bounds(8192, 512, d)[1], 3584))
            for d in range(512) for t in range(8)]
    assert check((8192, 28672), *zip(*grid)) is None
    split = [((chunk_bounds(1024, 4096, r)[0], 0), (chunk_bounds(1024, 4096, r)[1], 8192)) for r in range(4096)]
    assert check((1024, 8192), *zip(*split)) is None


def test_too_many_corners_is_refused_not_trusted(monkeypatch):
    monkeypatch.setattr(boxes, "MIN_CELLS", 0)
    monkeypatch.setattr(boxes, "CELLS_PER_PIECE", 0)
    monkeypatch.setattr(boxes, "MAX_CORNERS", 16)
    problem = check((4, 4), [(0, 0), (0, 2), (2, 0), (2, 2)], [(2, 2)] * 4)
    assert "too many corners" in problem


def _coverage(shape, starts, sizes):
    count = np.zeros(shape, dtype=np.int64)
    for a, s in zip(starts, sizes):
        count[tuple(slice(x, x + y) for x, y in zip(a, s))] += 1
    return count


def _box(text):
    return [tuple(int(v) for v in part.split(":")) for part in text.split(", ") if part]


@pytest.mark.parametrize("seed", range(4))
def test_random_layouts_agree_with_counting_every_element(path, seed):
    """Random tilings, some damaged: the answer matches a dense count, and what an error names is
    true (the two pieces overlap in the region named; the region named is in no piece)."""
    rng = np.random.default_rng(seed)
    for _ in range(150):
        shape = tuple(int(s) for s in rng.integers(1, 6, rng.integers(1, 4)))
        cuts = [sorted({0, s, *rng.integers(0, s + 1, 2).tolist()}) for s in shape]
        cells = list(itertools.product(*[range(len(c) - 1) for c in cuts]))
        starts = [[c[i] for c, i in zip(cuts, cell)] for cell in cells]
        sizes = [[c[i + 1] - c[i] for c, i in zip(cuts, cell)] for cell in cells]
        damage = rng.integers(0, 4)
        if damage == 1:
            del starts[0], sizes[0]
        elif damage >= 2:
            extra = [int(rng.integers(0, s)) for s in shape]
            starts.append(extra)
            sizes.append([int(rng.integers(0, s - x + 1)) for s, x in zip(shape, extra)])
        count = _coverage(shape, starts, sizes)
        problem = check(shape, starts, sizes)
        assert (problem is None) == bool((count == 1).all()), (shape, starts, sizes, problem)
        if problem is None:
            continue
        found = re.fullmatch(r"piece (\d+) and piece (\d+) overlap in \[(.*)\]", problem)
        if found:
            i, j = int(found[1]), int(found[2])
            where = tuple(slice(a, b) for a, b in _box(found[3]))
            assert count[where].size and (count[where] >= 2).all()
            assert (_coverage(shape, [starts[i], starts[j]], [sizes[i], sizes[j]])[where] == 2).all()
        else:
            where = tuple(slice(a, b) for a, b in _box(re.fullmatch(r"\[(.*)\] is in no piece", problem)[1]))
            assert count[where].size and (count[where] == 0).all()


def test_first_outside_never_overflows():
    big = 1 << 62
    start = rows([(0, 0), (big, 0), (-1, 0), (0, 5)], 2)
    size = rows([(big, 4), (big, 4), (1, 4), (1, 0)], 2)
    assert first_outside(start, size, (big, 4)) == 1  # big + big wraps to a negative int64
    assert first_outside(start[2:], size[2:], (big, 4)) == 0
    assert first_outside(start[3:], size[3:], (big, 4)) == 0  # start 5 > 4 although the piece is empty
    assert first_outside(start[:1], size[:1], (big, 4)) == -1
    assert first_outside(rows([], 2), rows([], 2), (3, 3)) == -1
