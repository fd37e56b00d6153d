"""Work lists of the pallas kernels: hand-checked cases and properties (every unmasked cell
visited exactly once, no empty tile visited, mask kinds exact, heaviest tile first)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from magi_jax.mask import AttnMask
from magi_jax.planning.capacity import CapacityError
from magi_jax.planning.work_list import (
    BAND,
    DKV_BLOCK_K,
    DKV_BLOCK_Q,
    EMPTY_ITEM,
    FULL,
    FWD_BLOCK_K,
    FWD_BLOCK_Q,
    GENERAL,
    ITEM_FIELDS,
    NUM_FIELDS,
    build_plan_arrays,
    build_work_list,
    pad_work_list,
    persistent_schedule,
    plan_for_mask,
)
from tests.strategies import slice_masks


def _cells(items, by, block_q, block_k, owner, total_q, total_k):
    """Dense count of how many items visit each cell, and per-item cell counts."""
    count = np.zeros((total_q, total_k), np.int64)
    per_item = []
    for it in items:
        other, q0, q1, k0, k1, dlo, dhi, kind = (int(x) for x in it)
        qt, kt = (owner, other) if by == "q" else (other, owner)
        r = np.arange(qt * block_q, (qt + 1) * block_q)[:, None]
        c = np.arange(kt * block_k, (kt + 1) * block_k)[None, :]
        keep = (
            (r >= q0)
            & (r < q1)
            & (c >= k0)
            & (c < k1)
            & (c - r >= dlo)
            & (c - r <= dhi)
            & (r < total_q)
            & (c < total_k)
        )
        assert kind in (GENERAL, FULL, BAND)
        if kind == FULL:  # the whole tile is inside the slice (and inside the sequences)
            assert keep.all(), f"item {it} flagged full but holds masked cells"
        elif kind == BAND:  # the diagonal bounds alone give the predicate
            assert not keep.all(), f"item {it} is full but flagged band"
            np.testing.assert_array_equal(keep, (c - r >= dlo) & (c - r <= dhi), str(it))
        rr, cc = np.nonzero(keep)
        np.add.at(count, (rr + qt * block_q, cc + kt * block_k), 1)
        per_item.append(keep.sum())
    return count, per_item


def _check_list(mask, block_q, block_k, by):
    wl = build_work_list(mask.shapes, mask.total_q, mask.total_k, block_q, block_k, by)
    n = -(-(mask.total_q if by == "q" else mask.total_k) // (block_q if by == "q" else block_k))
    assert wl.order.dtype == wl.offsets.dtype == wl.items.dtype == np.int32
    assert wl.items.shape[1] == NUM_FIELDS == len(ITEM_FIELDS)
    assert sorted(wl.order.tolist()) == list(range(n))
    counts = wl.counts()
    assert wl.offsets[0] == 0 and wl.offsets[-1] == len(wl.items) and (counts >= 0).all()
    # Heaviest first, ties by tile index.
    launched = counts[wl.order]
    assert (np.diff(launched) <= 0).all()
    total = np.zeros((mask.total_q, mask.total_k), np.int64)
    for t in range(n):
        its = wl.items[wl.offsets[t] : wl.offsets[t + 1]]
        masked = its[:, -1] != FULL
        assert (np.diff(masked.astype(int)) >= 0).all(), "FULL items of a tile come first"
        for part in (its[~masked], its[masked]):
            assert (np.diff(part[:, 0]) >= 0).all(), "items sorted by the other tile"
        count, per_item = _cells(its, by, block_q, block_k, t, mask.total_q, mask.total_k)
        assert all(c > 0 for c in per_item), "an empty tile is visited"
        total += count
    if mask.total_q * mask.total_k:
        np.testing.assert_array_equal(total, mask.to_dense().astype(np.int64))
    return wl


def test_causal_hand_checked():
    wl = build_work_list(AttnMask.causal(256).shapes, 256, 256, 128, 128, "q")
    np.testing.assert_array_equal(wl.offsets, [0, 1, 3])
    np.testing.assert_array_equal(wl.order, [1, 0])  # the heavier tile first
    np.testing.assert_array_equal(wl.items[:, 0], [0, 0, 1])  # k-tiles
    # Only (1, 0) is full; the diagonal tiles are cut by the diagonal bound alone.
    np.testing.assert_array_equal(wl.items[:, 7], [BAND, FULL, BAND])
    kl = build_work_list(AttnMask.causal(256).shapes, 256, 256, 64, 128, "k")
    np.testing.assert_array_equal(kl.offsets, [0, 4, 6])  # k-tile 0 seen by 4 q-tiles
    # A tile's FULL items first (q-tiles 2, 3 of k-tile 0), then its masked ones.
    np.testing.assert_array_equal(kl.items[:, 0], [2, 3, 0, 1, 2, 3])
    np.testing.assert_array_equal(kl.items[:, 7], [FULL, FULL, BAND, BAND, BAND, BAND])


def test_two_slices_share_a_tile():
    # Rows [0, 100) see keys [0, 60) fully and [60, 100) causally-shifted: two items on k-tile 0.
    mask = AttnMask.from_ranges(
        [[0, 100], [0, 100]], [[0, 60], [60, 200]], ["full", "inv_causal"], 100, 200
    )
    wl = _check_list(mask, 128, 128, "q")
    assert list(wl.items[:, 0]) == [0, 0, 1]


def test_empty_mask_and_empty_tiles():
    empty = AttnMask.from_ranges([], [], [], total_q=300, total_k=200)
    wl = _check_list(empty, 128, 128, "q")
    assert len(wl.items) == 0 and wl.counts().tolist() == [0, 0, 0]
    mask = AttnMask.from_ranges([[0, 50]], [[0, 50]], ["causal"], 400, 400)
    wl = _check_list(mask, 128, 128, "k")
    assert wl.counts().tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("blocks", [(128, 128), (64, 128)])
def test_zoo_kernel_tiles(blocks):
    lens = [300, 77, 512, 129, 250]
    cu = np.cumsum([0] + lens)
    for mask in (
        AttnMask.varlen(cu, causal=True),
        AttnMask.sliding_window(1268, 100, 31),
        AttnMask.shared_question(lens),
        AttnMask.causal(200, 700),
        AttnMask.global_sliding_window(1268, 200, 40),
    ):
        for by in ("q", "k"):
            _check_list(mask, *blocks, by)


@given(
    slice_masks(max_len=40),
    st.sampled_from([(8, 8), (16, 8), (4, 16), (8, 32)]),
    st.sampled_from(["q", "k"]),
)
def test_every_cell_exactly_once(mask, blocks, by):
    _check_list(mask, *blocks, by)


def test_kernel_plan_cached_and_padded():
    mask = AttnMask.varlen([0, 100, 300], causal=True)
    arr = plan_for_mask(mask, "pallas")
    assert plan_for_mask(AttnMask.varlen([0, 100, 300], causal=True), "pallas") is arr
    padded = arr.pad_to(len(arr.q_items) + 5, len(arr.k_items) + 1)
    np.testing.assert_array_equal(padded.q_offsets, arr.q_offsets)
    np.testing.assert_array_equal(padded.q_order, arr.q_order)
    assert padded.q_items.shape == (len(arr.q_items) + 5, NUM_FIELDS)
    assert (padded.q_items[len(arr.q_items) :] == EMPTY_ITEM).all()
    with pytest.raises(CapacityError, match="PlanCapacity.items>=") as err:
        pad_work_list(arr.fwd, 1)
    assert isinstance(err.value, ValueError)
    built = build_plan_arrays(
        mask.shapes, 300, 300, (FWD_BLOCK_Q, FWD_BLOCK_K), (DKV_BLOCK_Q, DKV_BLOCK_K)
    )
    np.testing.assert_array_equal(built.fwd.items, arr.fwd.items)
    np.testing.assert_array_equal(built.bwd.items, arr.bwd.items)


def test_stack_plans():
    from magi_jax.planning.work_list import stack_plans

    a = plan_for_mask(AttnMask.causal(300), "pallas")
    b = plan_for_mask(AttnMask.varlen([0, 100, 300], causal=True), "pallas")
    st = stack_plans([a, b])
    assert st.q_items.shape == (2, max(len(a.q_items), len(b.q_items)), NUM_FIELDS)
    assert st.k_offsets.shape == (2, len(a.k_offsets))
    np.testing.assert_array_equal(st.q_offsets[1], b.q_offsets)
    np.testing.assert_array_equal(st.q_items[1, : len(b.q_items)], b.q_items)
    with pytest.raises(ValueError, match="same local Tq"):
        stack_plans([a, plan_for_mask(AttnMask.causal(100), "pallas")])


def _schedule_loads(work, groups, progs, overhead):
    offsets, units = persistent_schedule(work, groups, progs, overhead)
    counts = work.counts()[work.order]
    n = len(counts)
    assert offsets[0] == 0 and offsets[-1] == n * groups and np.all(np.diff(offsets) >= 0)
    assert sorted(units.tolist()) == list(range(n * groups))  # every unit exactly once
    loads = [
        sum(counts[u % n] + overhead for u in units[a:b]) for a, b in zip(offsets[:-1], offsets[1:])
    ]
    # Each program walks the units of all groups but the last quarter in launch order, then
    # those of the last quarter heaviest first.
    head = (groups - -(-groups // 4)) * n
    for a, b in zip(offsets[:-1], offsets[1:]):
        mine = units[a:b]
        early, late = mine[mine < head], mine[mine >= head]
        assert np.all(np.diff(early) > 0) and np.all(np.diff(counts[late % n]) <= 0)
        assert np.all(mine[: len(early)] == early)
    return offsets, units, np.array(loads)


def test_persistent_schedule_hand_checked():
    """Tiles of 3, 1 and 2 items (launch order: 3, 2, 1) over one group and two programs:
    program 0 takes the 3-item tile; program 1 the 2-item tile, then the 1-item tile."""
    work = build_work_list(
        AttnMask.from_ranges(
            [[0, 128], [128, 256], [256, 384]],
            [[0, 384], [0, 128], [0, 256]],
            ["full", "full", "full"],
            384,
            384,
        ).shapes,
        384,
        384,
        128,
        128,
        "q",
    )
    assert work.counts().tolist() == [3, 1, 2] and work.order.tolist() == [0, 2, 1]
    offsets, units, loads = _schedule_loads(work, 1, 2, 0.0)
    assert offsets.tolist() == [0, 1, 3] and units.tolist() == [0, 1, 2]
    assert loads.tolist() == [3, 3]
    # More programs than units: one unit each.
    offsets, units, _ = _schedule_loads(work, 2, 10, 1.0)
    assert offsets.tolist() == list(range(7)) and units.tolist() == list(range(6))


@given(slice_masks(), st.integers(1, 4), st.integers(1, 9))
def test_persistent_schedule_balanced(mask, groups, progs):
    """List scheduling: no program ends later than the mean load plus one unit."""
    work = plan_for_mask(mask, "pallas").fwd
    _, _, loads = _schedule_loads(work, groups, progs, 1.0)
    heaviest = work.counts().max() + 1.0
    assert loads.max() <= loads.sum() / len(loads) + heaviest + 1e-9


def _lists_as_runs(mask, fwd, bwd, num_items=None, num_runs=None):
    from magi_jax.planning.work_list import plan_runs, work_list_runs

    one = np.zeros(len(mask.shapes.q0), np.int64)
    runs = [
        work_list_runs(mask.shapes, one, 1, mask.total_q, mask.total_k, *b, by)
        for b, by in ((fwd, "q"), (bwd, "k"))
    ]
    return runs, plan_runs(*runs, num_runs)


def test_runs_hand_checked():
    """Causal 256 on 128 x 128 tiles: q-tile 1 sees k-tile 0 (FULL) and 1 (BAND): two runs
    of one item; on 64-row tiles k-tile 0 is seen FULL by q-tiles 2, 3 (one run of two)."""
    from magi_jax.planning.work_list import EMPTY_RUN, RUN_FIELDS, expand_runs

    _, plan = _lists_as_runs(AttnMask.causal(256), (128, 128), (64, 128), num_runs=(4, 5))
    assert RUN_FIELDS[-1] == "length" and plan.q_runs.shape == (1, 4, 9)
    np.testing.assert_array_equal(plan.q_runs[0, :3, 0], [0, 0, 1])  # first other tile
    np.testing.assert_array_equal(plan.q_runs[0, :3, -1], [1, 1, 1])  # lengths
    np.testing.assert_array_equal(plan.q_runs[0, 3], EMPTY_RUN)
    np.testing.assert_array_equal(plan.k_runs[0, :3, 0], [2, 0, 2])
    np.testing.assert_array_equal(plan.k_runs[0, :3, -1], [2, 2, 2])
    np.testing.assert_array_equal(plan.k_runs[0, :3, 7], [FULL, BAND, BAND])
    lists = expand_runs(plan, 5, 8)
    want = (
        *pad_work_list(build_work_list(AttnMask.causal(256).shapes, 256, 256, 128, 128, "q"), 5),
        *pad_work_list(build_work_list(AttnMask.causal(256).shapes, 256, 256, 64, 128, "k"), 8),
    )
    for x, y in zip(lists, want):
        np.testing.assert_array_equal(x[0], y)


@given(
    slice_masks(max_len=300), st.sampled_from([(128, 128, 64, 128), (16, 8, 16, 8), (8, 32, 8, 32)])
)
def test_runs_expand_to_the_item_lists(mask, blocks):
    """Runs hold every item once: expanded (host) at any width that fits they are exactly
    the item lists; fewer runs or items than needed raise naming the field."""
    from magi_jax.planning.work_list import check_runs, expand_runs

    fwd, bwd = blocks[:2], blocks[2:]
    (rq, rk), plan = _lists_as_runs(mask, fwd, bwd)
    wq = build_work_list(mask.shapes, mask.total_q, mask.total_k, *fwd, "q")
    wk = build_work_list(mask.shapes, mask.total_q, mask.total_k, *bwd, "k")
    assert plan.q_runs.shape[1] <= len(wq.items) and plan.k_runs.shape[1] <= len(wk.items)
    for extra in (0, 3):
        got = expand_runs(plan, len(wq.items) + extra, len(wk.items) + extra)
        want = (
            *pad_work_list(wq, len(wq.items) + extra),
            *pad_work_list(wk, len(wk.items) + extra),
        )
        for x, y in zip(got, want):
            assert x.dtype == np.int32 and x.shape[1:] == y.shape
            np.testing.assert_array_equal(x[0], y)
    n = plan.q_runs.shape[1]
    if n:
        with pytest.raises(CapacityError, match=rf"PlanCapacity\.q_runs>={n}"):
            check_runs(rq, n - 1, "q_runs")
    check_runs(rk, plan.k_runs.shape[1], "k_runs")


@given(
    slice_masks(max_len=300),
    st.sampled_from([(128, 128), (64, 128), (16, 8), (8, 32), (4, 4)]),
    st.sampled_from("qk"),
)
def test_lists_by_runs_match_item_by_item(mask, blocks, by):
    """Lists planned by runs (one cut for every tile of a steady stretch, runs that share a
    tile cut into items) are exactly the lists sorted item by item from every tile's items."""
    from magi_jax.planning.work_list import _build_work_list_items

    got = build_work_list(mask.shapes, mask.total_q, mask.total_k, *blocks, by)
    want = _build_work_list_items(mask.shapes, mask.total_q, mask.total_k, *blocks, by)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


def _stretches_are_steady(sh, total_k, bq, bk, by):
    """Every tile of every steady stretch has the bounds of the stretch's first tile."""
    from magi_jax.planning.intervals import ranges_incl
    from magi_jax.planning.item_runs import pair_bounds, steady_tiles

    live = np.nonzero(sh.nonempty)[0]
    if by == "q":
        first, last = sh.q0[live] // bq, (sh.q1[live] - 1) // bq
    else:
        first, last = sh.lo(sh.q0[live], live) // bk, sh.hi(sh.q1[live] - 1, live) // bk
    sa, sb, steady = steady_tiles(sh, live, first, last, total_k, bq, bk, by)
    assert ((sa[steady] >= first[steady]) & (sb[steady] <= last[steady])).all()
    owner, tile = ranges_incl(sa[steady], sb[steady])
    s = live[steady][owner]
    bounds, own_in, full_ok = pair_bounds(sh, s, tile, total_k, bq, bk, by)
    at_first = pair_bounds(sh, s, sa[steady][owner], total_k, bq, bk, by)[0]
    np.testing.assert_array_equal(bounds, at_first)
    assert own_in.all() and full_ok.all()
    return int(steady.sum())


@given(
    slice_masks(max_len=300),
    st.sampled_from([(128, 128), (16, 8), (8, 32), (4, 4), (4, 8), (1, 1)]),
    st.sampled_from("qk"),
)
def test_steady_stretches_are_steady(mask, blocks, by):
    """On every tile of a slice's steady stretch the pair's tile bounds and FULL's
    condition are those of the stretch's first tile (so its runs are too)."""
    _stretches_are_steady(mask.shapes, mask.total_k, *blocks, by)


def test_steady_stretches_of_any_geometry():
    """The same for every slice of a grid of geometries, canonical or not (diagonals that
    pass the slice's corners, rows that see no key)."""
    from magi_jax.mask_slices import SliceShapes

    grid = np.meshgrid(
        [0, 3], [7, 16], [0, 5], [8, 20], np.arange(-12, 13), np.arange(0, 25), indexing="ij"
    )
    q0, rows, k0, keys, dlo, width = (g.ravel().astype(np.int64) for g in grid)
    sh = SliceShapes(q0, q0 + rows, k0, k0 + keys, dlo, dlo + width)
    for bq, bk in ((4, 4), (4, 8), (8, 4), (1, 1)):
        for by in "qk":
            assert _stretches_are_steady(sh, 32, bq, bk, by) > 0
