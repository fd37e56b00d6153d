"""group_cast / group_reduce on 8 CPU host devices vs the NumPy model of the tables."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from magi_jax.planning import solver as S
from magi_jax.planning.cast_table import (
    build_cast_table,
    cast_model,
    index_runs,
    reduce_model,
)
from magi_jax.planning.cast_table import (
    expand_runs as host_expand_runs,
)
from magi_jax.sharding.collectives import (
    CastArrays,
    CastRuns,
    CastSpec,
    expand_runs,
    expand_tables,
    group_cast,
    group_reduce,
)


def _mesh(cp):
    return jax.make_mesh(
        (cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,)
    )


@functools.lru_cache(maxsize=None)
def _runner(cp, spec, num_rows, op):
    """Jitted shard_map running group_cast ('cast'), group_reduce ('reduce') or the VJP of
    the cast ('cast_vjp') over stacked tables."""
    mesh = _mesh(cp)

    def body(x, send, recv):
        tables = (CastRuns if spec.slot_len else CastArrays)(send[0], recv[0])
        if op == "cast":
            return group_cast(x[0], tables, spec)[None]
        if op == "reduce":
            return group_reduce(x[0], tables, spec, num_rows)[None]
        _, vjp = jax.vjp(
            lambda a: group_cast(a, tables, spec), jnp.zeros((num_rows,) + x.shape[2:], x.dtype)
        )
        return vjp(x[0])[0][None]

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("cp"),) * 3, out_specs=P("cp"), check_vma=False)
    )


def _run(op, x, table, num_rows, transport, runs=False, pieces=1):
    """``runs``: pass the tables as the key does (CastRuns, expanded on the device);
    ``pieces``: gated ppermute slots (keys at a capacity)."""
    spec = CastSpec(
        "cp",
        table.cp,
        table.shifts,
        table.widths,
        transport,
        slot_len=table.slot_len if runs else 0,
        buffer_len=table.buffer_len if runs else 0,
        pieces=pieces,
    )
    tables = (table.send_runs, table.recv_runs) if runs else (table.send_index, table.recv_index)
    # Placed as the shard_map reads them: a one-device array would be sliced by a program of
    # its own, compiled per shape.
    put = lambda a: jax.device_put(a, NamedSharding(_mesh(table.cp), P("cp")))
    return np.asarray(_runner(table.cp, spec, num_rows, op)(put(x), *map(put, tables)))


def _meta(cp, chunk, per_rank):
    rank_chunks = np.arange(cp * per_rank).reshape(cp, per_rank)
    return S.DispatchMeta(
        total=cp * per_rank * chunk,
        cp=cp,
        chunk_size=chunk,
        rank_chunks=rank_chunks,
        algorithm="contiguous",
        chunk_area=np.zeros(cp * per_rank, np.int64),
    )


def test_hand_checked_table():
    # 2 ranks x 4 tokens (chunk 2): rank 0 owns globals 0-3, rank 1 owns 4-7.
    # Rank 0 needs globals 5, 6 (rank 1's local rows 1, 2) into buffer rows 0, 1;
    # rank 1 needs global 0 (rank 0's row 0) into buffer row 2.
    meta = _meta(2, 2, 2)
    remote = [np.array([[5, 7, 1, 0, 0]]), np.array([[0, 1, 0, 0, 2]])]
    t = build_cast_table(meta, remote, 3)
    assert t.shifts == (1,) and t.widths == (2,)
    np.testing.assert_array_equal(t.send_index, [[[0, -1]], [[1, 2]]])
    np.testing.assert_array_equal(t.recv_index, [[0, 1, -1], [-1, -1, 0]])
    x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    out = _run("cast", x, t, 4, "ppermute")
    np.testing.assert_array_equal(out[0], np.stack([x[1, 1], x[1, 2], 0 * x[0, 0]]))
    np.testing.assert_array_equal(out[1], np.stack([0 * x[0, 0], 0 * x[0, 0], x[0, 0]]))
    y = np.ones((2, 3, 3), np.float32)
    back = _run("reduce", y, t, 4, "all_to_all")
    np.testing.assert_array_equal(back[..., 0], [[1, 0, 0, 0], [0, 1, 1, 0]])


def _random_table(rng, cp, chunk, per_rank, buffer_extra, width=None, density=0.6):
    meta = _meta(cp, chunk, per_rank)
    t_loc = chunk * per_rank
    remote = []
    for r in range(cp):
        # Random disjoint global intervals owned by other ranks, cut at chunk boundaries.
        wanted = rng.random(meta.padded_total) < rng.uniform(0, density)
        wanted[r * t_loc : (r + 1) * t_loc] = False
        g = np.nonzero(wanted)[0]
        pieces, off = [], 0
        for x in g:
            pieces.append([x, x + 1, x // t_loc, 0, off])
            off += 1
        remote.append(np.array(pieces, np.int64).reshape(-1, 5))
    blen = max(1, max(len(p) for p in remote) + buffer_extra)
    return build_cast_table(meta, remote, blen, width), t_loc


@settings(max_examples=5, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([4, 8]), st.sampled_from([2, 3, 5]))
def test_gated_slots_match_numpy_model(seed, cp, pieces):
    """Slots of a capacity's width (most of it padding) cut into gated pieces: the pieces no
    rank fills stay home, and every rank still receives (and sends back) exactly the rows of
    the model; the wire counted for them follows the fill, not the width."""
    from magi_jax.planning.wire import cast_wire

    rng = np.random.default_rng(seed)
    table, t_loc = _random_table(rng, cp, 3, 2, 1, width=6, density=0.3)
    assert set(table.widths) == {6} and len(table.shifts) == cp - 1
    x = rng.standard_normal((cp, t_loc, 2, 4)).astype(np.float32)
    y = rng.standard_normal((cp, table.buffer_len, 2, 4)).astype(np.float32)
    want = reduce_model(y, table, t_loc)
    np.testing.assert_array_equal(
        _run("cast", x, table, t_loc, "ppermute", True, pieces), cast_model(x, table)
    )
    np.testing.assert_allclose(
        _run("reduce", y, table, t_loc, "ppermute", True, pieces), want, rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        _run("cast_vjp", y, table, t_loc, "ppermute", True, pieces), want, rtol=1e-6, atol=1e-6
    )
    gated = cast_wire(table, "ppermute", pieces=pieces)
    whole = cast_wire(table, "ppermute")
    assert (gated.real <= gated.wire).all() and (gated.wire <= whole.wire).all()


def test_gated_slots_skip_empty_slots():
    """A capacity table whose slots are all empty: nothing moves, the buffer is zeros."""
    meta = _meta(4, 2, 2)
    table = build_cast_table(meta, [np.zeros((0, 5), np.int64)] * 4, 3, width=4)
    x = np.ones((4, 4, 2), np.float32)
    np.testing.assert_array_equal(_run("cast", x, table, 4, "ppermute", True, 2), 0)
    with pytest.raises(ValueError, match="pieces"):
        CastSpec("cp", 4, (1,), (4,), pieces=0)


def test_gated_slot_moves_its_live_pieces_only():
    """Hand-checked: 4 ranks x 4 rows (chunks of 2), slots 4 wide in 2 pieces of 2; rank 2
    needs global 2 (rank 0's row 2) and global 7 (rank 1's row 3): shift 2 carries 1 row,
    shift 1 one row, shift 3 none. Each moves one piece of 2 rows, or nothing."""
    from magi_jax.planning.wire import cast_wire

    meta = _meta(4, 2, 2)
    empty = np.zeros((0, 5), np.int64)
    remote = [empty, empty, np.array([[2, 3, 0, 0, 0], [7, 8, 1, 0, 1]]), empty]
    table = build_cast_table(meta, remote, 2, width=4)
    assert table.widths == (4, 4, 4)
    np.testing.assert_array_equal(cast_wire(table, "ppermute", pieces=2).wire, [4] * 4)
    np.testing.assert_array_equal(cast_wire(table, "ppermute").wire, [12] * 4)
    x = np.arange(4 * 4 * 2, dtype=np.float32).reshape(4, 4, 2)
    out = _run("cast", x, table, 4, "ppermute", True, 2)
    np.testing.assert_array_equal(out, cast_model(x, table))
    np.testing.assert_array_equal(out[2], np.stack([x[0, 2], x[1, 3]]))


@settings(max_examples=6)
@given(
    st.integers(0, 10_000), st.sampled_from([2, 4, 8]), st.sampled_from(["ppermute", "all_to_all"])
)
def test_random_tables_match_numpy_model(seed, cp, transport):
    rng = np.random.default_rng(seed)
    table, t_loc = _random_table(rng, cp, 3, 2, int(rng.integers(0, 3)))
    x = rng.standard_normal((cp, t_loc, 2, 4)).astype(np.float32)
    y = rng.standard_normal((cp, table.buffer_len, 2, 4)).astype(np.float32)
    want = reduce_model(y, table, t_loc)
    for runs in (False, True):
        np.testing.assert_array_equal(
            _run("cast", x, table, t_loc, transport, runs), cast_model(x, table)
        )
        np.testing.assert_allclose(
            _run("reduce", y, table, t_loc, transport, runs), want, rtol=1e-6, atol=1e-6
        )
        # The cast's VJP is the reduce.
        np.testing.assert_allclose(
            _run("cast_vjp", y, table, t_loc, transport, runs), want, rtol=1e-6, atol=1e-6
        )


@pytest.mark.parametrize("transport", ["ppermute", "all_to_all"])
@pytest.mark.parametrize("gather_max_slots", [0, 64])
def test_reduce_by_gathers_and_by_scatter_add_agree(monkeypatch, transport, gather_max_slots):
    """The reduce sums per-slot gathers while slots are few, else one scatter-add: force each
    path on a table where every rank talks to every other (7 slots, shared rows)."""
    from magi_jax.sharding import collectives

    monkeypatch.setattr(collectives, "_GATHER_MAX_SLOTS", gather_max_slots)
    _runner.cache_clear()
    rng = np.random.default_rng(7)
    table, t_loc = _random_table(rng, 8, 3, 2, 1)
    assert len(table.shifts) > 4
    y = rng.standard_normal((8, table.buffer_len, 2, 4)).astype(np.float32)
    np.testing.assert_allclose(
        _run("reduce", y, table, t_loc, transport),
        reduce_model(y, table, t_loc),
        rtol=1e-6,
        atol=1e-6,
    )
    _runner.cache_clear()


@pytest.mark.parametrize("transport", ["ppermute", "all_to_all"])
def test_pytrees_move_like_their_leaves(transport):
    """``(k, v)`` pairs (different tails and dtypes) move in one call, leaf by leaf as alone."""
    rng = np.random.default_rng(3)
    table, t_loc = _random_table(rng, 4, 3, 2, 1)
    spec = CastSpec("cp", 4, table.shifts, table.widths, transport)
    a = rng.standard_normal((4, t_loc, 2, 4)).astype(np.float32)
    b = rng.standard_normal((4, t_loc, 3)).astype(np.float16)

    def body(a, b, send, recv):
        tables = CastArrays(send[0], recv[0])
        got = group_cast((a[0], b[0]), tables, spec)
        red = group_reduce(got, tables, spec, t_loc)
        return tuple(x[None] for x in (*got, *red))

    fn = jax.jit(
        jax.shard_map(
            body, mesh=_mesh(4), in_specs=(P("cp"),) * 4, out_specs=P("cp"), check_vma=False
        )
    )
    ga, gb, ra, rb = fn(a, b, table.send_index, table.recv_index)
    np.testing.assert_array_equal(ga, cast_model(a, table))
    np.testing.assert_array_equal(gb, cast_model(b, table))
    assert ra.dtype == rb.dtype == np.float32
    np.testing.assert_allclose(ra, reduce_model(cast_model(a, table), table, t_loc), rtol=1e-6)
    np.testing.assert_allclose(
        rb, reduce_model(cast_model(b, table).astype(np.float32), table, t_loc), rtol=1e-3
    )


def test_reduce_sums_in_float32():
    # Rank 0's row 0 is fetched by ranks 1, 2, 3; their bf16 partials are summed in float32:
    # 3 · (1 + 2^-7) = 3.0234375 is exact in float32, but not in bfloat16 (-> 3.03125).
    meta = _meta(4, 1, 1)
    remote = [np.zeros((0, 5), np.int64)] + [np.array([[0, 1, 0, 0, 0]])] * 3
    table = build_cast_table(meta, remote, 1)
    y = np.full((4, 1, 1), 1.0 + 2**-7, jnp.bfloat16)
    out = _run("reduce", y, table, 1, "ppermute")
    assert out.dtype == np.float32 and out[0, 0, 0] == 3.0234375
    assert float(jnp.bfloat16(3.0234375)) != 3.0234375


def test_spec_rejects_unknown_transport():
    with pytest.raises(ValueError, match="transport='ragged'"):
        CastSpec("cp", 2, (1,), (1,), "ragged")


# ---- tables as runs: the device expansion gives the host tables exactly --------------------

_expand = jax.jit(expand_runs, static_argnums=1)


def _random_index(rng, cp, n, slot):
    """Random index rows: stretches of consecutive values and of padding (-1), cut at slot
    boundaries or not."""
    idx = np.full((cp, n), -1, np.int64)
    for r in range(cp):
        p = 0
        while p < n:
            ln = int(rng.integers(1, 7))
            if rng.random() < 0.6:
                v = int(rng.integers(0, 50))
                idx[r, p : p + ln] = np.arange(v, v + ln)[: n - p]
            p += ln
    return idx


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 9))
def test_random_index_tables_expand_exactly(seed, cp, slot):
    n = 60  # one size: the device expansion compiles once
    rng = np.random.default_rng(seed)
    idx = _random_index(rng, cp, n, slot)
    for split, value_split in ((None, None), (slot, None), (None, slot)):
        runs = index_runs(idx, split=split, value_split=value_split)
        assert runs.dtype == np.int32 and runs.shape[:1] == (cp,)
        np.testing.assert_array_equal(host_expand_runs(runs, n), idx)
        # Room for more runs than needed (padding runs) changes nothing.
        padded = index_runs(idx, split=split, value_split=value_split, num_runs=n)
        np.testing.assert_array_equal(host_expand_runs(padded, n), idx)
        for r in range(cp):
            got = np.asarray(_expand(jnp.asarray(padded[r]), n))
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, idx[r])


def _stage_tables(mask, cp, capacity):
    from magi_jax.planning.stages import build_dist_plan
    from magi_jax.planning.work_list import default_block_sizes

    meta = S.solve_dispatch(mask, cp, capacity and capacity.chunk_size)
    degree = 2 if capacity is None else capacity.overlap_degree
    blocks = default_block_sizes(meta.local_len, meta.local_len)
    plan = build_dist_plan(mask, meta, degree, *blocks, "xla", capacity)
    return [st_.cast for st_ in plan.stages if st_.cast is not None]


@pytest.mark.parametrize("cp", [2, 8])
def test_zoo_stage_tables_expand_exactly(cp):
    """Every stage's cast of the zoo masks at a capacity (and of a few of them without one):
    the tables the device expands from the runs, as the collectives do, are the host's, and
    at a capacity every mask's runs have the capacity's shapes."""
    from magi_jax.planning.capacity import PlanCapacity
    from tests.zoo import ZOO

    masks = list(ZOO.values())
    cap = PlanCapacity.from_masks(masks, mesh_size=cp, overlap_degree=2)
    shapes = set()
    for i, mask in enumerate(masks):
        for capacity in (cap, None) if i < 3 else (cap,):
            for table in _stage_tables(mask, cp, capacity):
                spec = CastSpec(
                    "cp",
                    cp,
                    table.shifts,
                    table.widths,
                    "ppermute",
                    slot_len=table.slot_len,
                    buffer_len=table.buffer_len,
                )
                if capacity is not None:
                    shapes.add((table.send_runs.shape, table.recv_runs.shape, spec))
                got = _expand_ranks(CastRuns(table.send_runs, table.recv_runs), spec)
                assert isinstance(got, CastArrays)
                np.testing.assert_array_equal(np.asarray(got.send_index), table.send_index)
                np.testing.assert_array_equal(np.asarray(got.recv_index), table.recv_index)
    assert len(shapes) == 1
    # The runs are far smaller than the tables they stand for.
    table = _stage_tables(ZOO["doc-causal"], cp, cap)[0]
    assert table.nbytes < table.send_index.nbytes + table.recv_index.nbytes


@functools.partial(jax.jit, static_argnums=1)
def _expand_ranks(runs, spec):
    return jax.vmap(lambda t: expand_tables(t, spec))(runs)
