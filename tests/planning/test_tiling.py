import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from magi_jax.mask import AttnMask
from magi_jax.mask_zoo import DOC_LENGTHS
from magi_jax.planning.tiling import count_items, tile_items
from tests.strategies import slice_masks


def _item_cells(mask, items, n):
    """Cells of item n (slice ∩ tile), as a bool [Tq, Tk] array."""
    sh = mask.shapes
    s = items.slice_id[n]
    q, k = np.arange(mask.total_q)[:, None], np.arange(mask.total_k)[None, :]
    tile = (q // items.block_q == items.q_tile[n]) & (k // items.block_k == items.k_tile[n])
    inside = (
        (q >= sh.q0[s])
        & (q < sh.q1[s])
        & (k >= sh.k0[s])
        & (k < sh.k1[s])
        & (k - q >= sh.dlo[s])
        & (k - q <= sh.dhi[s])
    )
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


def test_hand_checked_causal():
    m = AttnMask.causal(4)
    items = tile_items(m.shapes, 4, 4, 2, 2)
    assert list(zip(items.q_tile, items.k_tile, items.full)) == [
        (0, 0, False),
        (1, 0, True),
        (1, 1, False),
    ]
    assert count_items(m.shapes, 4, 4, 2, 2) == 3


@pytest.mark.parametrize("block", [64, 128])
def test_cost_follows_area_32k_document_mask(block):
    """A 32k document-causal mask: the plan visits the tiles that hold cells, no more —
    at most area/(bq·bk) full tiles plus the boundary tiles — not (Tq/bq)·(Tk/bk)."""
    lens = list(DOC_LENGTHS)  # the benchmark documents
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
    assert len(items) == touched.sum()  # one item per touched tile here
    np.testing.assert_array_equal(visited, touched)
    assert items.full.sum() == full.sum()
    boundary = touched.sum() - full.sum()
    assert len(items) <= m.area / block**2 + boundary
    assert len(items) < 0.15 * nt * nt
