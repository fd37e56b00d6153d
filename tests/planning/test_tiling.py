import numpy as np
import pytest
from hypothesis import given, strategies as st

from magi_jax.mask import AttnMask
from magi_jax.mask_zoo import DOC_LENGTHS
from magi_jax.planning.tiling import EMPTY_ITEM, ITEM_FIELDS, LanePlan, lane_plan, tile_items
from tests.strategies import slice_masks


def _item_cells(mask, items, n):
    """Cells of item n (slice ∩ tile), as a bool [Tq, Tk] array."""
    sh = mask.shapes
    s = items.slice_id[n]
    q, k = np.arange(mask.total_q)[:, None], np.arange(mask.total_k)[None, :]
    tile = ((q // items.block_q == items.q_tile[n]) & (k // items.block_k == items.k_tile[n]))
    inside = ((q >= sh.q0[s]) & (q < sh.q1[s]) & (k >= sh.k0[s]) & (k < sh.k1[s])
              & (k - q >= sh.dlo[s]) & (k - q <= sh.dhi[s]))
    return tile & inside, tile


@given(slice_masks(max_len=40), st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 3, 8, 16]))
def test_every_cell_visited_exactly_once(mask, bq, bk):
    items = tile_items(mask.shapes, mask.total_q, mask.total_k, bq, bk)
    count = np.zeros((mask.total_q, mask.total_k), np.int64)
    for n in range(len(items)):
        cells, tile = _item_cells(mask, items, n)
        assert cells.any(), "an empty tile was visited"
        # full <=> the whole (in-bounds, full-size) tile belongs to the slice.
        whole = cells.sum() == bq * bk
        assert bool(items.full[n]) == bool(whole), (n, items.full[n], cells.sum())
        count += cells
    np.testing.assert_array_equal(count, mask.to_dense().astype(np.int64))


@given(slice_masks(max_len=40), st.sampled_from([2, 8]), st.sampled_from([4, 8]),
       st.sampled_from([None, 1, 3]))
def test_lanes_hold_every_item_once(mask, bq, bk, lane_len):
    items = tile_items(mask.shapes, mask.total_q, mask.total_k, bq, bk)
    for by, own, other in (("q", items.q_tile, items.k_tile), ("k", items.k_tile, items.q_tile)):
        plan = lane_plan(items, mask.shapes, by, lane_len=lane_len)
        assert plan.items.dtype == np.int32 and plan.lane_tile.dtype == np.int32
        real = plan.items[..., ITEM_FIELDS.index("q1")] > plan.items[..., ITEM_FIELDS.index("q0")]
        got = sorted((int(plan.lane_tile[v]), int(plan.items[v, l, 0]),
                      int(plan.items[v, l, 1]), int(plan.items[v, l, 3]))
                     for v, l in zip(*np.nonzero(real)))
        sh = mask.shapes
        want = sorted((int(o), int(x), int(sh.q0[s]), int(sh.k0[s]))
                      for o, x, s in zip(own, other, items.slice_id))
        assert got == want
        # Padding slots are the canonical empty item.
        assert (plan.items[~real] == EMPTY_ITEM).all()


def test_hand_checked_causal():
    m = AttnMask.causal(4)
    items = tile_items(m.shapes, 4, 4, 2, 2)
    assert list(zip(items.q_tile, items.k_tile, items.full)) == [(0, 0, False), (1, 0, True),
                                                                 (1, 1, False)]
    plan = lane_plan(items, m.shapes, "q", lane_len=2)
    assert plan.lane_tile.tolist() == [0, 1]
    assert plan.items[:, :, 0].tolist() == [[0, 0], [0, 1]]
    assert plan.items[1, :, ITEM_FIELDS.index("full")].tolist() == [1, 0]
    kplan = lane_plan(items, m.shapes, "k", lane_len=2)
    assert kplan.lane_tile.tolist() == [0, 1]
    assert kplan.items[:, :, 0].tolist() == [[0, 1], [1, 0]]


def test_lanes_split_long_rows():
    # The last document sees the whole prefix: its q-tiles hold many more items than others.
    m = AttnMask.causal_blockwise([64] * 15 + [64])
    items = tile_items(m.shapes, m.total_q, m.total_k, 16, 16)
    plan = lane_plan(items, m.shapes, "q")
    counts = np.bincount(items.q_tile)
    assert plan.lane_len < counts.max()
    # Padded work stays close to the real work.
    assert plan.num_lanes * plan.lane_len <= 1.6 * len(items)


@pytest.mark.parametrize("block", [64, 128])
def test_cost_follows_area_32k_document_mask(block):
    """A 32k document-causal mask: the plan visits the tiles that hold cells, no more —
    at most area/(bq·bk) full tiles plus the boundary tiles — not (Tq/bq)·(Tk/bk)."""
    lens = list(DOC_LENGTHS)   # PERF.md documents
    m = AttnMask.varlen(np.cumsum([0] + lens), causal=True)
    items = tile_items(m.shapes, m.total_q, m.total_k, block, block)
    nt = -(-m.total_q // block)
    # Independent tile census: per (q-tile, k-tile), the number of attended cells, from the
    # document ids and positions of each row and column.
    doc = np.repeat(np.arange(len(lens)), lens)
    cells = np.zeros((nt, nt), np.int64)
    for qt in range(nt):
        rows = np.arange(qt * block, min((qt + 1) * block, m.total_q))
        cols = np.arange(m.total_k)
        ok = (doc[rows][:, None] == doc[None, :]) & (cols[None, :] <= rows[:, None])
        cells[qt] = ok.reshape(len(rows), nt, block).sum(axis=(0, 2))
    touched = cells > 0
    full = cells == block * block
    visited = np.zeros((nt, nt), bool)
    visited[items.q_tile, items.k_tile] = True
    assert len(items) == touched.sum()                   # one item per touched tile here
    np.testing.assert_array_equal(visited, touched)
    assert items.full.sum() == full.sum()
    boundary = touched.sum() - full.sum()
    assert len(items) <= m.area / block**2 + boundary
    assert len(items) < 0.15 * nt * nt


def test_stacked_plans_share_one_lane_length():
    """Stacking re-packs every plan with one lane length: a plan with a few very long rows
    next to a plan of many short rows stays small, and every item survives."""
    from magi_jax.planning.tiling import unpack_lanes
    from magi_jax.planning.lanes import build_xla_plan, stack_plans
    masks = [AttnMask.from_ranges([[496, 512]], [[0, 512]], "full", total_q=512),
             AttnMask.varlen(np.arange(0, 513, 16))]
    plans = [build_xla_plan(m.shapes, m.total_q, m.total_k, 16, 16).arrays() for m in masks]
    stacked = stack_plans(plans)
    for field in ("q", "k"):
        tiles, items = getattr(stacked, f"{field}_lane_tile"), getattr(stacked, f"{field}_items")
        naive = (max(getattr(p, f"{field}_items").shape[0] for p in plans)
                 * max(getattr(p, f"{field}_items").shape[1] for p in plans))
        assert items.shape[1] * items.shape[2] <= naive
        if field == "q":       # the long rows are q rows here
            assert items.shape[1] * items.shape[2] < naive / 2
        for r, p in enumerate(plans):
            want = unpack_lanes(LanePlan(getattr(p, f"{field}_lane_tile"), getattr(p, f"{field}_items")))
            got = unpack_lanes(LanePlan(tiles[r], items[r]))
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
