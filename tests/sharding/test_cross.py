"""Cross attention under context parallelism (``total_q != total_k``): the key-layout rule,
the keys' own dispatch and the plans on the host, then dispatch -> magi_attention ->
undispatch on 8 CPU host devices against the float64 reference (forward, dq, dk, dv) for
both key layouts, and the errors at the boundary."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_jax.ffa.testing import assert_matches_reference, fwd_bwd, random_inputs
from magi_jax.mask import AttnMask
from magi_jax.planning.capacity import PlanCapacity
from magi_jax.planning.solver import auto_kv_layout, solve_dispatch, solve_kv_dispatch
from magi_jax.planning.stages import REPLICATED_KV, build_dist_plan, resolve_kv
from magi_jax.sharding import (
    dispatch,
    magi_attention,
    magi_attention_local,
    make_flex_key,
    position_ids,
    undispatch,
)


@functools.lru_cache(maxsize=None)
def _mesh(cp, explicit=False):
    types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto,)
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp], axis_types=types)


def _pairs(q_lens, k_lens, types):
    """Query document ``i`` attends to key document ``i`` (``types[i]``)."""
    qc, kc = np.cumsum([0] + list(q_lens)), np.cumsum([0] + list(k_lens))
    return AttnMask.from_ranges(
        np.stack([qc[:-1], qc[1:]], 1),
        np.stack([kc[:-1], kc[1:]], 1),
        list(types),
        total_q=int(qc[-1]),
        total_k=int(kc[-1]),
    )


# 41 x 19: lengths that divide nothing, so both sequences are padded for every cp > 1; one
# size for every mask, so the reference compiles once.
PAIRS = _pairs([9, 21, 11], [5, 1, 13], ["full", "causal", "full"])
MASKS = {
    "full": AttnMask.full(41, 19),
    "pairs": PAIRS,
    # CAUSAL with total_q != total_k is bottom-right aligned: the last query sees every key
    # and the first 22 see none.
    "causal": AttnMask.causal(41, 19),
}


@st.composite
def cross_masks(draw, max_docs=4):
    """Random document pairs: per pair a query and a key length (either may be the longer)
    and a type; every length >= 1."""
    n = draw(st.integers(1, max_docs))
    q = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    k = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    types = draw(
        st.lists(st.sampled_from(["full", "causal", "inv_causal"]), min_size=n, max_size=n)
    )
    return _pairs(q, k, types)


# ---- host: the rule, the keys' dispatch, the plan ----------------------------------------


def test_auto_layout_rule():
    # Replicated up to one rank's share of the queries, dispatched beyond.
    assert auto_kv_layout(1000, 125, 8) == "replicated"
    assert auto_kv_layout(1000, 126, 8) == "dispatched"
    assert auto_kv_layout(1001, 126, 8) == "replicated"  # ceil(1001 / 8) = 126
    mesh = _mesh(4)
    assert make_flex_key(AttnMask.full(40, 10), mesh).kv_layout == "replicated"
    assert make_flex_key(AttnMask.full(40, 11), mesh).kv_layout == "dispatched"
    assert (
        make_flex_key(AttnMask.full(40, 10), mesh, kv_layout="dispatched").kv_layout == "dispatched"
    )
    assert (
        make_flex_key(AttnMask.full(40, 11), mesh, kv_layout="replicated").kv_layout == "replicated"
    )


def test_self_attention_keys_unchanged():
    mask = AttnMask.varlen([0, 5, 17, 30])
    key = make_flex_key(mask, _mesh(4))
    assert key.kv_layout == "shared" and not key.cross
    assert (key.total_k, key.kv_padded_total, key.kv_local_len) == (
        key.total,
        key.padded_total,
        key.local_len,
    )
    # Leaves: chunk_order, chunk_inverse, stage arrays, no key leaves (None), plan id.
    assert key.kv_order is None and key.tree_flatten()[0][3:5] == (None, None)
    assert key.plan.kv_layout == "shared" and key.plan.kv_meta is None
    assert resolve_kv(mask, key.plan.meta) is None
    # Explicit layouts on a square mask (cross attention between two sequences of equal
    # length) plan the keys apart.
    assert make_flex_key(mask, _mesh(4), kv_layout="dispatched").cross


def test_kv_dispatch_follows_the_queries():
    # Contiguous query documents on 4 ranks, each seeing its own key document: the keys'
    # dispatch puts every key document with its queries, so nothing is fetched.
    mask = _pairs([8] * 4, [4] * 4, ["full"] * 4)
    meta = solve_dispatch(mask, 4, 4, "contiguous")
    kv = solve_kv_dispatch(mask, meta, 2)
    assert kv.algorithm == "affinity" and kv.total == 16 and kv.chunks_per_rank == 2
    np.testing.assert_array_equal(kv.rank_chunks, [[0, 1], [2, 3], [4, 5], [6, 7]])
    plan = build_dist_plan(mask, meta, 1, 8, 8, "xla", kv=kv)
    assert plan.kv_layout == "dispatched" and not plan.remote_tokens.any()
    assert len(plan.stages) == 1 and plan.stages[0].cast is None


@given(cross_masks(), st.sampled_from([2, 3, 4]), st.integers(0, 2))
@settings(max_examples=10)
def test_plans_cover_the_mask(mask, cp, degree):
    """Both layouts: the stages' areas add up to the mask's, the keys' dispatch is a
    permutation with equal chunks per rank, and each rank fetches exactly the keys its
    queries see that it does not own."""
    meta = solve_dispatch(mask, cp)
    assert meta.total == mask.total_q
    np.testing.assert_array_equal(np.sort(meta.rank_chunks.reshape(-1)), np.arange(meta.num_chunks))
    dense = mask.to_dense()
    for kv in (REPLICATED_KV, solve_kv_dispatch(mask, meta)):
        plan = build_dist_plan(mask, meta, degree, 8, 8, "xla", kv=kv)
        assert sum(int(st_.area.sum()) for st_ in plan.stages) == mask.area
        for r in range(cp):
            rows = meta.positions[r]
            seen = dense[rows[rows < mask.total_q]].any(axis=0)
            got = np.zeros(mask.total_k, bool)
            for a, b in plan.needed[r]:
                got[a:b] = True
            np.testing.assert_array_equal(got, seen)
            if isinstance(kv, str):
                continue
            owned = np.zeros(kv.padded_total, bool)
            owned[kv.positions[r]] = True
            assert plan.remote_tokens[r] == (seen & ~owned[: mask.total_k]).sum()
        if isinstance(kv, str):
            assert plan.kv_layout == "replicated" and len(plan.stages) == 1
            assert plan.stages[0].kv_len == mask.total_k and plan.stages[0].cast is None
        else:
            np.testing.assert_array_equal(
                np.sort(kv.rank_chunks.reshape(-1)), np.arange(kv.num_chunks)
            )


# ---- devices: forward and gradients against the float64 reference ------------------------


@functools.lru_cache(maxsize=None)
def _end_to_end(key, seq_axis=0):
    def fwd(q, k, v):
        o, l = magi_attention(
            dispatch(q, key, seq_axis),
            dispatch(k, key, seq_axis, role="kv"),
            dispatch(v, key, seq_axis, role="kv"),
            key,
        )
        return undispatch(o, key, seq_axis), undispatch(l, key, seq_axis)

    return fwd_bwd(fwd)


def _check(key, mask, batch=None, seed=0):
    q, k, v, dout, dlse = random_inputs(
        jax.random.key(seed), mask, 2, 1, 8, jnp.float32, batch=batch
    )
    with jax.set_mesh(key.mesh):
        res = _end_to_end(key, 0 if batch is None else 1)(q, k, v, dout, dlse)
    assert_matches_reference(res, q, k, v, mask, dout, dlse)


@pytest.mark.parametrize(
    "name, cp, layout, options",
    [
        # replicated (19 <= ceil(41 / 2)); rows before the bottom-right diagonal see no key;
        # [B, T, H, D] inputs; a mesh with Explicit axes.
        ("causal", 2, "auto", dict(batch=2, explicit=True)),
        ("pairs", 4, "dispatched", dict(overlap_degree=1)),  # host + remote stage
        ("full", 8, "auto", {}),  # dispatched: 19 > 6
    ],
)
def test_matches_reference(name, cp, layout, options):
    options = dict(options)
    batch, explicit = options.pop("batch", None), options.pop("explicit", False)
    mask = MASKS[name]
    key = make_flex_key(mask, _mesh(cp, explicit), "cp", kv_layout=layout, **options)
    assert key.cross and key.total == mask.total_q and key.total_k == mask.total_k
    if key.kv_layout == "replicated":
        assert key.kv_padded_total == key.kv_local_len == mask.total_k
        assert len(key.stages) == 1 and key.stages[0].cast is None
    else:
        assert key.kv_padded_total == cp * key.kv_local_len >= mask.total_k
        assert any(s.cast is not None for s in key.stages)
    _check(key, mask, batch)


def test_masks_as_data_compile_once():
    """Two pairings of documents at one capacity: one static part, one compilation, both
    exact (keys dispatched: the capacity bounds the remote KV and the casts)."""
    masks = [PAIRS, _pairs([20, 7, 14], [9, 6, 4], ["causal", "full", "inv_causal"])]
    cap = PlanCapacity.from_masks(masks, mesh_size=4)
    assert (cap.total_q, cap.total_k) == (41, 19)
    keys = [make_flex_key(m, _mesh(4), "cp", capacity=cap) for m in masks]
    assert keys[0].kv_layout == "dispatched" and keys[0].static == keys[1].static

    def fwd(q, k, v, key):
        o, l = magi_attention(
            dispatch(q, key), dispatch(k, key, role="kv"), dispatch(v, key, role="kv"), key
        )
        return undispatch(o, key), undispatch(l, key)

    @jax.jit
    def step(q, k, v, dout, dlse, key):
        (out, lse), vjp = jax.vjp(lambda *x: fwd(*x, key), q, k, v)
        dq, dk, dv = vjp((dout, dlse))
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    for seed, (mask, key) in enumerate(zip(masks, keys)):
        q, k, v, dout, dlse = random_inputs(jax.random.key(seed), mask, 2, 1, 8, jnp.float32)
        assert_matches_reference(step(q, k, v, dout, dlse, key), q, k, v, mask, dout, dlse)
    assert step._cache_size() == 1


def test_layouts_of_dispatch():
    """dispatch / undispatch / position_ids with role="kv" lay out keys as the key chose."""
    mesh = _mesh(4)
    x = jnp.arange(19.0)[:, None]
    rep = make_flex_key(PAIRS, mesh, kv_layout="replicated")
    assert rep.kv_layout == "replicated"
    np.testing.assert_array_equal(np.asarray(dispatch(x, rep, role="kv")), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(position_ids(rep, role="kv")), np.arange(19))
    dis = make_flex_key(PAIRS, mesh, kv_layout="dispatched")
    y = dispatch(x, dis, role="kv")
    assert y.shape == (dis.kv_padded_total, 1)
    pos = np.asarray(position_ids(dis, role="kv"))
    real = pos < 19
    np.testing.assert_array_equal(np.asarray(y)[real, 0], pos[real])
    assert not np.asarray(y)[~real].any()  # padding rows are zero
    np.testing.assert_array_equal(np.asarray(undispatch(y, dis, role="kv")), np.asarray(x))
    # Queries keep the queries' layout.
    assert dispatch(jnp.zeros((41, 1)), dis).shape == (dis.padded_total, 1)
    # A cross key may share a self-attention key's query dispatch (a video model's self-
    # and cross-attention layers over one token order).
    self_key = make_flex_key(AttnMask.causal(41), mesh)
    shared = make_flex_key(PAIRS, mesh, dispatch_from=self_key)
    np.testing.assert_array_equal(shared.plan.meta.rank_chunks, self_key.plan.meta.rank_chunks)


def test_local_body_in_own_shard_map():
    """magi_attention_local with replicated keys unmapped (P()) in the caller's shard_map:
    shard_map's transpose sums their gradients over the ranks."""
    from jax.sharding import PartitionSpec as P

    mask = MASKS["full"]
    key = make_flex_key(mask, _mesh(4), "cp")
    assert key.kv_layout == "dispatched"  # 19 > ceil(41 / 4): replicate by hand
    key = make_flex_key(mask, _mesh(4), "cp", kv_layout="replicated")
    q, k, v, dout, dlse = random_inputs(jax.random.key(3), mask, 2, 1, 8, jnp.float32)
    body = jax.shard_map(
        lambda q, k, v: magi_attention_local(q, k, v, key),
        mesh=key.mesh,
        in_specs=(P("cp"), P(), P()),
        out_specs=(P("cp"), P("cp")),
        check_vma=False,
    )

    def fwd(q, k, v):
        o, l = body(dispatch(q, key), dispatch(k, key, role="kv"), dispatch(v, key, role="kv"))
        return undispatch(o, key), undispatch(l, key)

    assert_matches_reference(fwd_bwd(fwd)(q, k, v, dout, dlse), q, k, v, mask, dout, dlse)


# ---- errors at the boundary --------------------------------------------------------------


def test_errors_name_argument_value_and_fix():
    mesh = _mesh(4)
    with pytest.raises(ValueError, match="kv_layout='ring' is not one of"):
        make_flex_key(PAIRS, mesh, kv_layout="ring")
    with pytest.raises(ValueError, match="comm_backend='native' does not take cross"):
        make_flex_key(PAIRS, mesh, comm_backend="native")
    with pytest.raises(ValueError, match="check_dispatch=True is for self-attention"):
        make_flex_key(PAIRS, mesh, check_dispatch=True)
    with pytest.raises(ValueError, match="total_k=20 but the mask has total_q=41, total_k=19"):
        make_flex_key(PAIRS, mesh, capacity=PlanCapacity(41, 20))
    with pytest.raises(ValueError, match="the mask is cross attention"):
        build_dist_plan(PAIRS, solve_dispatch(PAIRS, 4), 0, 8, 8)
    key = make_flex_key(PAIRS, mesh, kv_layout="dispatched")
    with pytest.raises(ValueError, match="role='kv'"):
        dispatch(jnp.zeros((19, 2)), key)  # keys laid out as queries
    with pytest.raises(ValueError, match="role='q'"):
        dispatch(jnp.zeros((41, 2)), key, role="kv")  # queries laid out as keys
    with pytest.raises(ValueError, match="role='key' is not one of"):
        dispatch(jnp.zeros((19, 2)), key, role="key")
    q = dispatch(jnp.zeros((41, 2, 8)), key)
    k = jnp.zeros((19, 1, 8))
    with pytest.raises(ValueError, match="natural-order keys.*dispatch first.*role='kv'"):
        magi_attention(q, k, k, key)
    with pytest.raises(ValueError, match="dispatched queries"):
        magi_attention(q, q, q, key)
