"""The ppermute transport pair by pair (magi_jax/sharding/pair_cast.py) on 8 CPU host devices:
the exact staircase of a key of one mask and the gated pieces per pair of a key at a capacity
deliver the rows of the NumPy model, and the wire counted for them is what they move."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.planning.cast_table import build_cast_table, cast_model, reduce_model
from magi_jax.planning.wire import cast_wire, pair_levels, pair_rows_moved, slot_rows
from magi_jax.sharding.collectives import CastSpec
from magi_jax.sharding.key_wire import key_wire
from tests.dynamic_masks import varlen_packings
from tests.sharding.steps import attention_step
from tests.sharding.test_collectives import _meta, _random_table, _runner


def _spec(table, gating, pieces=1):
    rows = slot_rows(table)
    return CastSpec(
        "cp",
        table.cp,
        table.shifts,
        table.widths,
        "ppermute",
        slot_len=table.slot_len,
        buffer_len=table.buffer_len,
        pieces=pieces,
        gating=gating,
        pair_rows=tuple(tuple(int(c) for c in rows[:, j]) for j in range(table.n_slots))
        if gating == "pair" and pieces == 1
        else None,
    )


def _check(table, t_loc, spec, rng):
    """Cast, reduce and the cast's VJP against the NumPy model."""
    cp = table.cp
    x = rng.standard_normal((cp, t_loc, 3)).astype(np.float32)
    y = rng.standard_normal((cp, table.buffer_len, 3)).astype(np.float32)
    tables = (table.send_runs, table.recv_runs)
    want = reduce_model(y, table, t_loc)
    np.testing.assert_array_equal(
        np.asarray(_runner(cp, spec, t_loc, "cast")(x, *tables)), cast_model(x, table)
    )
    for op in ("reduce", "cast_vjp"):
        got = np.asarray(_runner(cp, spec, t_loc, op)(y, *tables))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _uneven_table(rng, cp, width=None):
    """A random table whose pairs differ in size, with empty pairs, and one pair of slot 1
    (rank 0 -> rank 1) that fills its whole width."""
    meta = _meta(cp, 4, 3)
    t_loc = 12
    remote = []
    for r in range(cp):
        wanted = np.zeros(meta.padded_total, bool)
        for src in range(cp):
            if src == r or rng.random() < 0.3:
                continue  # an empty pair
            n = int(rng.integers(0, t_loc + 1))
            wanted[src * t_loc : src * t_loc + t_loc][rng.permutation(t_loc)[:n]] = True
        if r == 1:
            wanted[0:t_loc] = True  # the full pair
        g = np.nonzero(wanted)[0]
        remote.append(
            np.array([[x, x + 1, x // t_loc, 0, i] for i, x in enumerate(g)], np.int64).reshape(
                -1, 5
            )
        )
    blen = max(len(p) for p in remote) + 1
    return build_cast_table(meta, remote, blen, width), t_loc


@pytest.mark.parametrize("seed", [0, 1])
def test_staircase_moves_the_model_rows(seed):
    """A key of one mask: per slot a few ppermute levels over the pairs reaching them; the
    same rows as the model (and as whole slots), the wire each pair's rows up to its level."""
    rng = np.random.default_rng(seed)
    table, t_loc = _uneven_table(rng, 8)
    rows = slot_rows(table)
    assert (rows == 0).any() and rows[0, 0] == table.widths[0] == t_loc  # the full pair
    _check(table, t_loc, _spec(table, "pair"), rng)
    exact = cast_wire(table, "ppermute", gating="pair", levels=8)
    np.testing.assert_array_equal(exact.wire, exact.real)
    capped = cast_wire(table, "ppermute", gating="pair")
    whole = cast_wire(table, "ppermute")
    assert (capped.real <= capped.wire).all() and (capped.wire <= whole.wire).all()


def test_pair_gated_pieces_move_the_model_rows():
    """A key at a capacity: slots of a fixed width, each pair moving its own pieces (3
    pieces of 5 rows: the block is padded to 15; the full pair moves all three)."""
    rng = np.random.default_rng(2)
    table, t_loc = _uneven_table(rng, 4, width=14)
    assert set(table.widths) == {14}
    assert (slot_rows(table) == 0).any() and slot_rows(table)[0, 0] == t_loc
    _check(table, t_loc, _spec(table, "pair", 3), rng)


def test_pair_gated_random_sparse_table():
    rng = np.random.default_rng(5)
    table, t_loc = _random_table(rng, 4, 3, 2, 1, width=6, density=0.3)
    _check(table, t_loc, _spec(table, "pair", 4), rng)


def test_hand_checked_pair_wire():
    """4 ranks x 4 rows (chunks of 2). Rank 2 needs rank 0's rows 2, 3 and rank 1's row 3;
    rank 3 needs rank 1's rows 0-3 (global 4-7) and rank 2's row 0. Shift 1: pairs 1->2
    (1 row) and 2->3 (1 row); shift 2: pairs 0->2 (2 rows), 1->3 (4 rows)."""
    meta = _meta(4, 2, 2)
    empty = np.zeros((0, 5), np.int64)
    remote = [
        empty,
        empty,
        np.array([[2, 4, 0, 0, 0], [7, 8, 1, 0, 2]]),
        np.array([[4, 8, 1, 0, 0], [8, 9, 2, 0, 4]]),
    ]
    table = build_cast_table(meta, remote, 5)
    assert table.shifts == (1, 2) and table.widths == (1, 4)
    np.testing.assert_array_equal(slot_rows(table), [[0, 2], [1, 4], [1, 0], [0, 0]])
    # Whole slots: every rank sends 1 + 4 rows.
    np.testing.assert_array_equal(cast_wire(table, "ppermute").wire, [5] * 4)
    # Pairs: levels (2, 4) in slot 2, so rank 0 sends 2, rank 1 1 + 4, rank 2 1.
    assert pair_levels([0, 4, 0, 2], 3) == (2, 4) and pair_levels([0, 4, 0, 2], 1) == (4,)
    np.testing.assert_array_equal(cast_wire(table, "ppermute", gating="pair").wire, [2, 5, 1, 0])
    # One level a slot: rank 0's pair rounds up to 4.
    np.testing.assert_array_equal(
        cast_wire(table, "ppermute", gating="pair", levels=1).wire, [4, 5, 1, 0]
    )
    # Pieces of a 4-wide capacity slot in 2 pieces of 2 rows: each pair rounds up to 2.
    np.testing.assert_array_equal(
        pair_rows_moved(slot_rows(table), (4, 4), pieces=2), [[0, 2], [2, 4], [2, 0], [0, 0]]
    )
    x = np.arange(4 * 4 * 2, dtype=np.float32).reshape(4, 4, 2)
    run = _runner(4, _spec(table, "pair"), 4, "cast")
    out = np.asarray(run(x, table.send_runs, table.recv_runs))
    np.testing.assert_array_equal(out, cast_model(x, table))
    np.testing.assert_array_equal(out[3], np.stack([x[1, 0], x[1, 1], x[1, 2], x[1, 3], x[2, 0]]))


def test_spec_checks_pair_rows():
    with pytest.raises(ValueError, match="pair_rows"):
        CastSpec("cp", 4, (1,), (4,), gating="pair")
    with pytest.raises(ValueError, match="ppermute"):
        CastSpec("cp", 4, (1,), (4,), "all_to_all", gating="pair", pair_rows=((1, 1, 1, 1),))
    with pytest.raises(ValueError, match="gating"):
        CastSpec("cp", 4, (1,), (4,), gating="pairs")


_step = jax.jit(attention_step)


def test_pair_gated_key_matches_reference_over_packings():
    """cast_gating="pair" at a capacity on 8 CPU devices: forward and gradients of ten
    document-causal packings against the float64 reference, one compilation; the key's
    wire follows each pair (never more than its slot-gated twin's). The buffers are kept
    for the backward (backward_refetch=False: the cast and its reduce, one compilation
    fewer of the same transport)."""
    total, cp = 64, 8
    mesh = jax.make_mesh(
        (cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,)
    )
    masks = list(varlen_packings(total, 10, seed=3))
    capacity = mj.PlanCapacity.from_masks(masks, mesh_size=cp)
    size = _step._cache_size()
    for i, mask in enumerate(masks):
        opts = dict(capacity=capacity, ffa_backend="xla", backward_refetch=False)
        key = mj.make_flex_key(mask, mesh, "cp", cast_gating="pair", **opts)
        specs = [s.cast for s in key.stages if s.cast is not None]
        assert specs and all(s.gating == "pair" and s.pieces > 1 for s in specs)
        slot = mj.make_flex_key(mask, mesh, "cp", **opts)
        assert all(s.cast.gating == "slot" for s in slot.stages if s.cast is not None)
        pair_wire, slot_wire = key_wire(key), key_wire(slot)
        np.testing.assert_array_equal(pair_wire.real, slot_wire.real)
        assert (pair_wire.wire <= slot_wire.wire).all()
        q, k, v, dout, dlse = random_inputs(jax.random.key(i), mask, 2, 1, 8, jnp.float32)
        out, lse, (dq, dk, dv) = _step(q, k, v, dout, dlse, key)
        assert_matches_reference(
            dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), q, k, v, mask, dout, dlse
        )
    assert _step._cache_size() == size + 1


def test_cast_gating_is_checked():
    mesh = jax.make_mesh(
        (2,), ("cp",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,)
    )
    mask = mj.AttnMask.causal(16)
    with pytest.raises(ValueError, match="cast_gating='pairs'"):
        mj.make_flex_key(mask, mesh, "cp", cast_gating="pairs")
    with pytest.raises(ValueError, match="cast_gating='pair'.*comm_backend='xla'"):
        mj.make_flex_key(mask, mesh, "cp", cast_gating="pair", comm_backend="native")
    # A key of one mask moves each pair's exact rows by default; "slot" keeps whole slots.
    pair = mj.make_flex_key(mask, mesh, "cp", comm_backend="xla", ffa_backend="xla")
    whole = mj.make_flex_key(
        mask, mesh, "cp", comm_backend="xla", ffa_backend="xla", cast_gating="slot"
    )
    assert [s.cast.gating for s in pair.stages if s.cast is not None] in ([], ["pair"])
    assert all(s.cast.gating == "slot" for s in whole.stages if s.cast is not None)
