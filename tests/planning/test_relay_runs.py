"""Two-hop tables planned by runs: entry for entry those of the row-by-row planner
(:func:`~magi_jax.planning.hierarchy.build_relay_table`), on random casts and on the casts of
zoo masks, with and without a capacity's widths (host NumPy only)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_jax.planning import solver as S
from magi_jax.planning import stages as D
from magi_jax.planning.capacity import CapacityError
from magi_jax.planning.cast_table import build_cast_table, cast_moves, expand_runs
from magi_jax.planning.hierarchy import NodeLayout, build_relay_table
from magi_jax.planning.relay_runs import build_relay_runs, move_runs
from tests.zoo import ZOO


def _meta(cp, chunk, per_rank):
    return S.DispatchMeta(
        total=cp * per_rank * chunk,
        cp=cp,
        chunk_size=chunk,
        rank_chunks=np.arange(cp * per_rank).reshape(cp, per_rank),
        algorithm="contiguous",
        chunk_area=np.zeros(cp * per_rank, np.int64),
    )


def _random_table(rng, cp, chunk, per_rank, runs):
    """A flat cast of random runs of tokens owned elsewhere, in a shuffled buffer order."""
    meta = _meta(cp, chunk, per_rank)
    t_loc = chunk * per_rank
    remote = []
    for r in range(cp):
        wanted = rng.random(meta.padded_total) < rng.uniform(0, 0.8)
        wanted[r * t_loc : (r + 1) * t_loc] = False
        g = np.nonzero(wanted)[0]
        if runs:  # consecutive tokens of one chunk as one piece
            cut = np.ones(len(g), bool)
            cut[1:] = (g[1:] != g[:-1] + 1) | (g[1:] % chunk == 0)
            starts = np.nonzero(cut)[0]
            ends = np.append(starts[1:], len(g))
            pieces = [(g[a], g[b - 1] + 1) for a, b in zip(starts, ends)]
        else:
            pieces = [(x, x + 1) for x in g]
        perm = rng.permutation(len(pieces))
        lens = np.array([b - a for a, b in pieces], np.int64)
        off = np.zeros(len(pieces), np.int64)
        off[perm] = np.cumsum(lens[perm]) - lens[perm]
        remote.append(
            np.array(
                [[a, b, a // t_loc, 0, o] for (a, b), o in zip(pieces, off)], np.int64
            ).reshape(-1, 5)
        )
    blen = max(1, max(int((p[:, 1] - p[:, 0]).sum()) for p in remote))
    return build_cast_table(meta, remote, blen)


def _same(flat, layout, fixed):
    widths = dict(inter_width=flat.slot_len, intra_width=flat.buffer_len) if fixed else {}
    want = build_relay_table(flat, layout, **widths)
    got = build_relay_runs(flat, layout, **widths)
    dense = got.dense()
    for f in ("inter_shifts", "inter_widths", "intra_shifts", "intra_widths"):
        assert getattr(dense, f) == getattr(want, f), f
    for f in ("inter_send", "intra_send", "recv_index"):
        np.testing.assert_array_equal(getattr(dense, f), getattr(want, f), err_msg=f)
    assert got.inter_node_rows() == want.inter_node_rows()
    return got


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from([(2, 4), (4, 2), (1, 8), (8, 1), (2, 3)]),
    st.booleans(),
    st.booleans(),
)
def test_random_casts_give_the_row_planners_tables(seed, shape, fixed, runs):
    rng = np.random.default_rng(seed)
    layout = NodeLayout(*shape)
    _same(_random_table(rng, layout.cp, 4, 3, runs), layout, fixed)


def test_move_runs_are_the_moves():
    rng = np.random.default_rng(3)
    flat = _random_table(rng, 8, 4, 3, True)
    dst, b, src, x, length = move_runs(flat)
    rows = set()
    for d, bb, s, xx, n in zip(dst, b, src, x, length):
        rows |= {(d, bb + i, s, xx + i) for i in range(n)}
    assert rows == set(zip(*cast_moves(flat)))


@pytest.mark.parametrize("name", ["doc-causal", "sliding-window", "shared-question"])
@pytest.mark.parametrize("fixed", [False, True])
def test_zoo_casts_give_the_row_planners_tables(name, fixed):
    mask = ZOO[name]
    meta = S.solve_dispatch(mask, 8, 2, "magi")
    plan = D.build_dist_plan(mask, meta, 2, 8, 8)
    for st_ in plan.stages:
        if st_.cast is not None:
            for shape in ((2, 4), (4, 2)):
                _same(st_.cast, NodeLayout(*shape), fixed)


def test_errors():
    flat = _random_table(np.random.default_rng(1), 8, 4, 3, True)
    with pytest.raises(CapacityError, match="inter-node block"):
        build_relay_runs(flat, NodeLayout(2, 4), inter_width=1, intra_width=flat.buffer_len)
    with pytest.raises(ValueError, match="both inter_width and intra_width"):
        build_relay_runs(flat, NodeLayout(2, 4), inter_width=4)
    with pytest.raises(ValueError, match="layout 2 x 2 = 4 ranks"):
        build_relay_runs(flat, NodeLayout(2, 2))


def test_runs_padded_to_the_capacity_bounds():
    from magi_jax.planning.capacity import PlanCapacity
    from magi_jax.planning.relay_runs import pad_runs, relay_run_bounds
    from magi_jax.planning.work_list import default_block_sizes
    from tests.dynamic_masks import varlen_packings

    layout = NodeLayout(2, 4)
    masks = list(varlen_packings(256, 6, seed=2))
    cap = PlanCapacity.from_masks(masks, mesh_size=8)
    for mask in masks:
        meta = S.solve_dispatch(mask, 8, cap.chunk_size, "magi")
        bq, bk = default_block_sizes(meta.local_len, meta.local_len)
        plan = D.build_dist_plan(mask, meta, cap.overlap_degree, bq, bk, capacity=cap)
        for st_ in plan.stages:
            if st_.cast is None:
                continue
            c = st_.cast
            rt = build_relay_runs(c, layout, inter_width=c.slot_len, intra_width=c.buffer_len)
            bounds = relay_run_bounds(
                layout, c.slot_len, c.buffer_len, cap.send_runs, cap.recv_runs
            )
            for runs, size in zip((rt.inter_runs, rt.intra_runs, rt.recv_runs), bounds):
                padded = pad_runs(runs, size, "test")
                assert padded.shape == (8, size, 2)
                n = max(runs.shape[1], 1)
                np.testing.assert_array_equal(
                    expand_runs(padded, 64 * n), expand_runs(runs, 64 * n)
                )
    with pytest.raises(CapacityError, match="two-hop receive table needs"):
        pad_runs(rt.recv_runs, 0, "receive")
