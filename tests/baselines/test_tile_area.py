"""The tile counts of benchmarks/tile_area.py against counts over the dense mask."""

import numpy as np

from benchmarks import tile_area as ta
from magi_jax.mask import AttnMask


def _touched_dense(mask, bq, bk):
    dense = mask.to_dense()
    tq, tk = dense.shape
    padded = np.zeros((-(-tq // bq) * bq, -(-tk // bk) * bk), bool)
    padded[:tq, :tk] = dense
    tiles = padded.reshape(padded.shape[0] // bq, bq, padded.shape[1] // bk, bk)
    return int(tiles.any(axis=(1, 3)).sum())


def test_touched_tiles_match_a_dense_count():
    masks = [
        AttnMask.causal(256),  # 3 tiles of 128 x 128
        AttnMask.varlen([0, 100, 290, 300, 520], causal=True),  # cut documents
        AttnMask.varlen([0, 700], causal=True, window=150),  # a band
        AttnMask.from_ranges(
            [[0, 300], [300, 520]], [[0, 520], [40, 400]], ["inv_causal", "bi_causal"], 520, 520
        ),
    ]
    assert ta.touched_tiles(masks[0], 128, 128) == 3
    for mask in masks:
        for bq, bk in ta.GRAINS:
            assert ta.touched_tiles(mask, bq, bk) == _touched_dense(mask, bq, bk), (mask, bq, bk)


def test_cell_counts_of_causal():
    row = ta.cell_counts(AttnMask.causal(256))
    area = 256 * 257 // 2
    assert row["area"] == area
    assert row["fwd_list"] == 3 * 128 * 128 / area  # the diagonal tiles and one full one
    assert row["touched_64x64"] == 10 * 64 * 64 / area
    # dK/dV: k-tile 0 meets 4 q-steps of 64 rows, k-tile 1 two: 6 items of 64 x 128.
    assert row["dkv_list"] == 6 * 64 * 128 / area
    assert np.isclose(ta.fwd_bwd_cells(row), 3 * 128 * 128 / area)
