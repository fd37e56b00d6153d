"""How many cells the FFA pallas kernels compute for a mask, against its area: the cells of
its work-list items (the forward / dQ q-tile list of 128 x 128 items, the dK/dV list of
64-row x 128-key items) and of the tiles it touches at finer grains, and what that caps its
rate at, relative to causal attention of the same length. Host only (NumPy), no GPU.

    python benchmarks/tile_area.py --masks causal,doc_causal,many_docs_128 --lengths 8192,32768

The ceiling (``cap``) is the rate a mask would reach, as a fraction of causal's, if every
computed cell cost what it costs on causal: the ratio of the two masks' computed cells per
mask cell, weighted as fwd+bwd runs them (forward 2 matmuls and dQ 3 on the q-tile list,
dK/dV 4 on the k-tile list).
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks import harness
from benchmarks.kernel_bench import make_mask  # noqa: E402
from magi_jax.mask import AttnMask  # noqa: E402
from magi_jax.planning.work_list import (
    DKV_BLOCK_K,
    DKV_BLOCK_Q,
    FWD_BLOCK_K,  # noqa: E402
    FWD_BLOCK_Q,
    plan_for_mask,
)

# Tile grains (query rows x keys) at which touched tiles are counted: the forward's tile,
# one consumer warpgroup's rows of it, and 64 x 64.
GRAINS = ((128, 128), (64, 128), (64, 64))
# Matmuls per computed cell: forward and dQ walk the q-tile list, dK/dV the k-tile list.
_FWD_MATMULS, _DQ_MATMULS, _DKV_MATMULS = 2, 3, 4


def touched_tiles(mask: AttnMask, bq: int, bk: int) -> int:
    """Tiles of ``bq`` rows x ``bk`` keys holding at least one cell of the mask. On a
    slice's rows the visible keys run from ``lo(q)`` to ``hi(q)``, both non-decreasing by at
    most one a row, so the keys a block of rows sees are one interval."""
    sh = mask.shapes
    grid = np.zeros((-(-mask.total_q // bq), -(-mask.total_k // bk)), bool)
    for s in np.nonzero(sh.nonempty)[0]:
        q0, q1 = int(sh.q0[s]), int(sh.q1[s])
        for t in range(q0 // bq, (q1 - 1) // bq + 1):
            first, last = max(q0, t * bq), min(q1, (t + 1) * bq) - 1
            grid[t, int(sh.lo(first, s)) // bk : int(sh.hi(last, s)) // bk + 1] = True
    return int(grid.sum())


def cell_counts(mask: AttnMask) -> dict:
    """Computed cells of the two work lists and touched cells per grain, each as a multiple
    of the mask's area, and the items a q-tile walks."""
    plan = plan_for_mask(mask, "pallas")
    fwd_items = int(plan.q_offsets[-1])
    dkv_items = int(plan.k_offsets[-1])
    area = float(mask.area)
    row = dict(
        area=int(mask.area),
        fwd_list=fwd_items * FWD_BLOCK_Q * FWD_BLOCK_K / area,
        dkv_list=dkv_items * DKV_BLOCK_Q * DKV_BLOCK_K / area,
        items_per_q_tile=fwd_items / max(1, int((np.diff(plan.q_offsets) > 0).sum())),
    )
    for bq, bk in GRAINS:
        row[f"touched_{bq}x{bk}"] = touched_tiles(mask, bq, bk) * bq * bk / area
    return row


def fwd_bwd_cells(row: dict) -> float:
    """Matmul-weighted computed cells of one fwd+bwd per mask cell."""
    return ((_FWD_MATMULS + _DQ_MATMULS) * row["fwd_list"] + _DKV_MATMULS * row["dkv_list"]) / (
        _FWD_MATMULS + _DQ_MATMULS + _DKV_MATMULS
    )


def markdown(rows, meta) -> str:
    shown = [
        dict(r, **{f"t{bq}x{bk}": f"{r[f'touched_{bq}x{bk}']:.2f}x" for bq, bk in GRAINS})
        | dict(items=f"{r['items_per_q_tile']:.1f}", q=f"{r['fwd_list']:.2f}x")
        | dict(k=f"{r['dkv_list']:.2f}x", c=f"{r['cap']:.2f}")
        for r in rows
    ]
    columns = [("mask", "mask"), ("length", "length"), ("items / q-tile", "items")]
    columns += [("q-tile list", "q"), ("k-tile list", "k")]
    columns += [(f"touched {bq}x{bk}", f"t{bq}x{bk}") for bq, bk in GRAINS]
    head = [f"# Tile area, {harness.describe(meta)}", ""]
    return "\n".join(head + harness.table(shown, columns + [("cap vs causal", "c")])) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--masks", default="causal,doc_causal,many_docs_128,swa_causal_1024,prefix_lm")
    p.add_argument("--lengths", default="8192,16384,32768")
    p.add_argument("--out", default=None, help="also write tile_area_<stamp>.{json,md} here")
    a = p.parse_args(argv)
    rows = []
    for t in (int(x) for x in a.lengths.split(",")):
        causal = fwd_bwd_cells(cell_counts(make_mask("causal", t)))
        for name in a.masks.split(","):
            row = dict(mask=name, length=t, **cell_counts(make_mask(name, t)))
            rows.append(dict(row, cap=causal / fwd_bwd_cells(row)))
    meta = harness.environment(argv, grains=GRAINS)
    print(markdown(rows, meta))
    if a.out:
        harness.Run("tile_area", a.out, meta, markdown).add(*rows)
    return rows


if __name__ == "__main__":
    main()
