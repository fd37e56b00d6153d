"""Two-hop (hierarchical) group casts on 8 CPU host devices as a 2 x 4 mesh of nodes: the
host tables against the flat cast's NumPy model, the device casts and reduces against the
flat ones bit for bit, and magi_attention over ("node", "local") against the float64
reference and the flat path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from magi_jax.ffa.testing import assert_matches_reference, fwd_bwd, random_inputs
from magi_jax.planning import solver as S
from magi_jax.planning.capacity import CapacityError, PlanCapacity
from magi_jax.planning.cast_table import build_cast_table, cast_model, reduce_model
from magi_jax.planning.hierarchy import (
    NodeLayout,
    build_relay_table,
    inter_node_rows,
    inter_node_wire_rows,
    relay_cast_model,
    relay_reduce_model,
)
from magi_jax.sharding import dispatch, magi_attention, make_flex_key, undispatch
from magi_jax.sharding.collectives import (
    CastArrays,
    CastSpec,
    RelayArrays,
    RelaySpec,
    group_cast,
    group_reduce,
)
from tests.dynamic_masks import varlen_packings
from tests.sharding.steps import attention_step
from tests.xla_options import OPTIMIZED
from tests.zoo import ZOO

AXES = ("node", "local")
LAYOUT = NodeLayout(2, 4)


@functools.lru_cache(maxsize=None)
def _mesh():
    return jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)


def _meta(cp, chunk, per_rank):
    return S.DispatchMeta(
        total=cp * per_rank * chunk,
        cp=cp,
        chunk_size=chunk,
        rank_chunks=np.arange(cp * per_rank).reshape(cp, per_rank),
        algorithm="contiguous",
        chunk_area=np.zeros(cp * per_rank, np.int64),
    )


def _random_table(rng, cp=8, chunk=3, per_rank=2, density=None):
    """A flat cast where each rank fetches random single tokens owned elsewhere, in a
    shuffled buffer order (so relays and buffer rows are not in the same order)."""
    meta = _meta(cp, chunk, per_rank)
    t_loc = chunk * per_rank
    remote = []
    for r in range(cp):
        wanted = rng.random(meta.padded_total) < (
            rng.uniform(0, 0.8) if density is None else density
        )
        wanted[r * t_loc : (r + 1) * t_loc] = False
        g = np.nonzero(wanted)[0]
        off = rng.permutation(len(g))
        remote.append(
            np.array([[x, x + 1, x // t_loc, 0, o] for x, o in zip(g, off)], np.int64).reshape(
                -1, 5
            )
        )
    blen = max(1, max(len(p) for p in remote))
    return build_cast_table(meta, remote, blen), t_loc


# ---- host tables --------------------------------------------------------------------------


def test_hand_checked_relay():
    # 2 nodes x 2 ranks, 2 tokens per rank (chunk 1). Ranks 2 and 3 (node 1) both need
    # rank 0's row 1 (global 1); rank 2 also needs rank 1's row 0 (global 2) and rank 3's
    # row 0 (global 6, same node).
    meta = _meta(4, 1, 2)
    remote = [
        np.zeros((0, 5), np.int64),
        np.zeros((0, 5), np.int64),
        np.array([[1, 2, 0, 0, 0], [2, 3, 1, 0, 1], [6, 7, 3, 0, 2]]),
        np.array([[1, 2, 0, 0, 0]]),
    ]
    flat = build_cast_table(meta, remote, 3)
    lay = NodeLayout(2, 2)
    assert inter_node_rows(flat, lay) == 3  # global 1 crosses twice
    rt = build_relay_table(flat, lay)
    assert rt.inter_node_rows() == 2  # ... now once
    assert rt.intra_node_rows() == 2  # relay -> sibling, 3 -> 2
    x = np.arange(4 * 2, dtype=np.float32).reshape(4, 2, 1) + 1
    np.testing.assert_array_equal(relay_cast_model(x, rt), cast_model(x, flat))
    got = relay_cast_model(x, rt)
    np.testing.assert_array_equal(got[2, :, 0], [2, 3, 7])
    np.testing.assert_array_equal(got[3, :, 0], [2, 0, 0])


@settings(max_examples=10)
@given(st.integers(0, 10_000), st.sampled_from([(2, 4), (4, 2), (1, 8), (8, 1)]), st.booleans())
def test_relay_tables_deliver_the_flat_cast(seed, shape, fixed):
    rng = np.random.default_rng(seed)
    flat, t_loc = _random_table(rng)
    lay = NodeLayout(*shape)
    widths = dict(inter_width=flat.slot_len, intra_width=flat.buffer_len) if fixed else {}
    rt = build_relay_table(flat, lay, **widths)
    x = rng.standard_normal((8, t_loc, 2)).astype(np.float32)
    np.testing.assert_array_equal(relay_cast_model(x, rt), cast_model(x, flat))
    y = rng.integers(-8, 9, (8, flat.buffer_len, 2)).astype(np.float32)
    np.testing.assert_array_equal(relay_reduce_model(y, rt, t_loc), reduce_model(y, flat, t_loc))
    # Each (row, destination node) crosses once: the distinct pairs of the flat cast.
    from magi_jax.planning.cast_table import cast_moves

    d, _, s, row = cast_moves(flat)
    cross = d // lay.local != s // lay.local
    distinct = len({(a, b, c) for a, b, c in zip(s[cross], row[cross], d[cross] // lay.local)})
    assert rt.inter_node_rows() == distinct <= inter_node_rows(flat, lay)
    # Every relayed row is one the relay needs itself: blocks no wider than the flat ones.
    assert max(rt.inter_widths, default=0) <= flat.slot_len
    if fixed:
        assert rt.inter_send.shape == (8, (lay.nodes - 1) * lay.local, flat.slot_len)
        assert rt.intra_send.shape == (8, lay.local - 1, flat.buffer_len)


def test_relays_are_balanced_over_the_node():
    # Every rank of node 1 needs all of node 0's rows: each node-1 rank relays a quarter.
    rng = np.random.default_rng(0)
    meta = _meta(8, 8, 1)
    remote = [np.zeros((0, 5), np.int64)] * 4 + [
        np.array([[g, g + 8, g // 8, 0, g] for g in range(0, 32, 8)])
    ] * 4
    flat = build_cast_table(meta, remote, 32)
    rt = build_relay_table(flat, LAYOUT)
    received = [(rt.inter_send[s] >= 0).sum() for s in range(4)]
    assert rt.inter_node_rows() == 32 and inter_node_rows(flat, LAYOUT) == 128
    per_relay = np.zeros(8, int)
    for j, (dn, dl) in enumerate(rt.inter_shifts):
        for s in range(8):
            t = ((s // 4 + dn) % 2) * 4 + (s % 4 + dl) % 4
            per_relay[t] += (rt.inter_send[s, j] >= 0).sum()
    np.testing.assert_array_equal(per_relay, [0, 0, 0, 0, 8, 8, 8, 8])
    assert sum(received) == 32
    x = rng.standard_normal((8, 8, 1)).astype(np.float32)
    np.testing.assert_array_equal(relay_cast_model(x, rt), cast_model(x, flat))


def test_narrow_capacity_is_named():
    flat, _ = _random_table(np.random.default_rng(1), density=0.7)
    with pytest.raises(CapacityError, match="inter-node block"):
        build_relay_table(flat, LAYOUT, inter_width=1, intra_width=flat.buffer_len)
    with pytest.raises(ValueError, match="layout 2 x 2 = 4 ranks"):
        build_relay_table(flat, NodeLayout(2, 2))


# ---- device casts: the two hops give the flat cast's bits -----------------------------------


@functools.lru_cache(maxsize=None)
def _runner(spec, flat_spec, num_rows):
    """The flat and the two-hop cast, reduce and cast VJP, in one shard_map over both axes."""

    def body(x, y, a, b, c, send, recv):
        relay = RelayArrays(a[0], b[0], c[0])
        flat = CastArrays(send[0], recv[0])
        out = []
        for tb, sp in ((flat, flat_spec), (relay, spec)):
            _, vjp = jax.vjp(lambda z: group_cast(z, tb, sp), x[0])
            out += [group_cast(x[0], tb, sp), group_reduce(y[0], tb, sp, num_rows), vjp(y[0])[0]]
        return tuple(o[None] for o in out)

    return jax.jit(
        jax.shard_map(
            body, mesh=_mesh(), in_specs=(P(AXES),) * 7, out_specs=P(AXES), check_vma=False
        )
    )


def _device_check(flat, t_loc, rng, dtype=np.float32, pieces=1):
    """``pieces > 1``: the two hops' tables at a capacity's widths (most of each slot
    padding), their slots cut into gated pieces."""
    widths = {} if pieces == 1 else dict(inter_width=flat.slot_len, intra_width=flat.buffer_len)
    rt = build_relay_table(flat, LAYOUT, **widths)
    spec = RelaySpec(
        AXES,
        2,
        4,
        rt.inter_shifts,
        rt.inter_widths,
        rt.intra_shifts,
        rt.intra_widths,
        pieces=pieces,
    )
    flat_spec = CastSpec(AXES, 8, flat.shifts, flat.widths, "ppermute")
    x = rng.standard_normal((8, t_loc, 2, 3)).astype(dtype)
    # Small integers: every sum is exact, whatever the order, so reduces compare bit for bit.
    y = rng.integers(-8, 9, (8, flat.buffer_len, 2, 3)).astype(dtype)
    got = [
        np.asarray(a)
        for a in _runner(spec, flat_spec, t_loc)(
            x, y, rt.inter_send, rt.intra_send, rt.recv_index, flat.send_index, flat.recv_index
        )
    ]
    f_cast, f_red, f_vjp, h_cast, h_red, h_vjp = got
    np.testing.assert_array_equal(h_cast, f_cast)
    np.testing.assert_array_equal(h_cast, cast_model(x, flat))
    np.testing.assert_array_equal(h_red, f_red)
    np.testing.assert_array_equal(h_vjp, f_vjp)
    np.testing.assert_array_equal(h_red, reduce_model(y, flat, t_loc))
    return rt


def test_device_relay_matches_flat():
    # A random cast (single tokens, shuffled buffers) and the casts of two zoo masks.
    rng = np.random.default_rng(5)
    _device_check(*_random_table(rng), rng)
    for name in ("doc-causal", "sliding-window"):
        key = make_flex_key(ZOO[name], _mesh(), AXES, overlap_degree=1, hierarchical=False)
        (stage,) = [s for s in key.plan.stages if s.cast is not None]
        rt = _device_check(stage.cast, key.local_len, rng)
        assert rt.inter_node_rows() < inter_node_rows(stage.cast, LAYOUT)


def test_device_relay_gated_pieces_match_flat():
    """Two-hop tables at a capacity's widths with gated pieces: the same rows as the flat
    cast, and the pieces that move follow the rows, not the widths."""
    from magi_jax.planning.wire import gated_widths

    rng = np.random.default_rng(11)
    flat, t_loc = _random_table(rng, density=0.2)
    rt = _device_check(flat, t_loc, rng, pieces=3)
    live = (rt.inter_send >= 0).sum(axis=2).max(axis=0)
    assert gated_widths(rt.inter_widths, live, 3).sum() < sum(rt.inter_widths)


# ---- magi_attention over ("node", "local") ------------------------------------------------


def _end_to_end(key):
    def fwd(q, k, v):
        o, l = magi_attention(dispatch(q, key), dispatch(k, key), dispatch(v, key), key)
        return undispatch(o, key), undispatch(l, key)

    return fwd_bwd(fwd)


def test_magi_attention_two_hop_vs_reference_and_flat():
    # Degree 0: one combined stage (local KV, then the cast buffer), so the prefix cast and
    # its reduce go through the two hops; the device test above covers plain stage casts.
    mask, degree = ZOO["doc-causal"], 0
    keys = {
        h: make_flex_key(mask, _mesh(), AXES, overlap_degree=degree, hierarchical=h)
        for h in (True, False)
    }
    assert all(isinstance(s.cast, RelaySpec) for s in keys[True].stages if s.cast is not None)
    assert not any(isinstance(s.cast, RelaySpec) for s in keys[False].stages)
    q, k, v, dout, dlse = random_inputs(jax.random.key(1), mask, 2, 1, 8, jnp.float32)
    two_hop = _end_to_end(keys[True])(q, k, v, dout, dlse)
    flat = _end_to_end(keys[False])(q, k, v, dout, dlse)
    assert_matches_reference(two_hop, q, k, v, mask, dout, dlse)
    for n in ("out", "lse"):  # the same rows reach the same kernels
        np.testing.assert_array_equal(np.asarray(two_hop[n]), np.asarray(flat[n]), err_msg=n)
    for n in ("dq", "dk", "dv"):  # dK/dV partials summed in another order
        np.testing.assert_allclose(
            np.asarray(two_hop[n]), np.asarray(flat[n]), rtol=1e-5, atol=1e-6, err_msg=n
        )


def test_auto_and_options():
    mask = ZOO["doc-causal"]
    auto = make_flex_key(mask, _mesh(), AXES, overlap_degree=1, chunk_size=2)
    remote = [s for s in auto.stages if s.cast is not None]
    flat = make_flex_key(mask, _mesh(), AXES, overlap_degree=1, chunk_size=2, hierarchical=False)
    flat_cast = [s.cast for s in flat.plan.stages if s.cast is not None][0]
    # "auto" takes the two-hop cast exactly where it sends fewer rows between nodes,
    # padding of the ppermute slots included.
    fewer = build_relay_table(flat_cast, LAYOUT).inter_node_wire_rows() < inter_node_wire_rows(
        flat_cast, LAYOUT
    )
    assert isinstance(remote[0].cast, RelaySpec) == fewer
    assert fewer
    # Where padding outweighs the dedup (a sliding window's one neighbour): rank 4 (node 1)
    # needs rank 3's row 0. Flat: the shift-1 slot crosses nodes from ranks 3 and 7 only;
    # two-hop: its slot (1, 1) is all inter-node, sent by all 8 ranks.
    meta = _meta(8, 4, 1)
    remote = [np.zeros((0, 5), np.int64)] * 8
    remote[4] = np.array([[12, 13, 3, 0, 0]])
    narrow = build_cast_table(meta, remote, 1)
    rt = build_relay_table(narrow, LAYOUT)
    assert rt.inter_node_rows() == inter_node_rows(narrow, LAYOUT) == 1
    assert rt.inter_node_wire_rows() == 8 > inter_node_wire_rows(narrow, LAYOUT) == 2
    # At a capacity "auto" takes the gated two-hop casts whatever the mask (the static part
    # cannot follow it), as True does; False stays flat.
    cap = PlanCapacity(mask.total_q)
    for h in ("auto", True):
        casts = [
            s.cast
            for s in make_flex_key(mask, _mesh(), AXES, capacity=cap, hierarchical=h).stages
            if s.cast is not None
        ]
        assert casts and all(isinstance(c, RelaySpec) and c.pieces > 1 for c in casts)
    assert not any(
        isinstance(s.cast, RelaySpec)
        for s in make_flex_key(mask, _mesh(), AXES, capacity=cap, hierarchical=False).stages
    )
    with pytest.raises(ValueError, match="hierarchical=True needs cp_axis"):
        make_flex_key(mask, _mesh(), "local", hierarchical=True)
    with pytest.raises(ValueError, match="hierarchical='yes'"):
        make_flex_key(mask, _mesh(), AXES, hierarchical="yes")
    with pytest.raises(ValueError, match="comm_backend='all_to_all'"):
        make_flex_key(mask, _mesh(), AXES, hierarchical=True, comm_backend="all_to_all")
    with pytest.raises(ValueError, match="cp_axis=\\('node', 'gpu'\\)"):
        make_flex_key(mask, _mesh(), ("node", "gpu"))


# runs 10 times: worth optimising
_capacity_step = jax.jit(attention_step, compiler_options=OPTIMIZED)


def test_two_hop_at_a_capacity_compiles_once_over_ten_packings():
    """Keys at a capacity on the 2 x 4 mesh take gated two-hop casts ("auto"): one
    compilation over 10 packings, forward and gradients against the float64 reference."""
    masks = list(varlen_packings(256, 10, seed=3))
    capacity = PlanCapacity.from_masks(masks, mesh_size=8)
    size = _capacity_step._cache_size()
    for i, mask in enumerate(masks):
        key = make_flex_key(mask, _mesh(), AXES, capacity=capacity, ffa_backend="xla")
        assert all(isinstance(s.cast, RelaySpec) for s in key.stages if s.cast is not None)
        q, k, v, dout, dlse = random_inputs(jax.random.key(i), mask, 4, 2, 16, jnp.float32)
        out, lse, (dq, dk, dv) = _capacity_step(q, k, v, dout, dlse, key)
        assert_matches_reference(
            dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), q, k, v, mask, dout, dlse
        )
    assert _capacity_step._cache_size() == size + 1


def test_key_wire_counts_the_transports_the_key_runs():
    from magi_jax.planning.relay_runs import build_relay_runs
    from magi_jax.planning.wire import plan_wire
    from magi_jax.sharding.key_wire import key_wire

    mask = ZOO["doc-causal"]
    flat = make_flex_key(
        mask, _mesh(), AXES, overlap_degree=1, hierarchical=False, cast_gating="slot"
    )
    got, want = key_wire(flat), plan_wire(flat.plan, "auto", local=4)
    np.testing.assert_array_equal(got.wire, want.wire)
    np.testing.assert_array_equal(got.real_inter, want.real_inter)
    # A key of one mask moves each pair's rows by default (a few levels a slot).
    pairs = make_flex_key(mask, _mesh(), AXES, overlap_degree=1, hierarchical=False)
    got = key_wire(pairs)
    np.testing.assert_array_equal(
        got.wire, plan_wire(pairs.plan, "auto", local=4, gating="pair").wire
    )
    assert (got.wire <= want.wire).all() and got.wire.sum() < want.wire.sum()
    cap = PlanCapacity.from_masks([mask], mesh_size=8)
    capped = make_flex_key(mask, _mesh(), AXES, capacity=cap)
    specs = [s.cast for s in capped.stages if s.cast is not None]
    relays = [
        build_relay_runs(
            st.cast, LAYOUT, inter_width=st.cast.slot_len, intra_width=st.cast.buffer_len
        )
        for st in capped.plan.stages
        if st.cast is not None
    ]
    want = plan_wire(capped.plan, "ppermute", 4, relays, specs[0].pieces)
    got = key_wire(capped)
    np.testing.assert_array_equal(got.wire_inter, want.wire_inter)
    np.testing.assert_array_equal(got.wire_intra, want.wire_intra)
    # Gated pieces: far less than the capacity's whole slots between nodes.
    whole = 8 * sum(sum(s.inter_widths) for s in specs)
    assert got.wire_inter.sum() < whole
