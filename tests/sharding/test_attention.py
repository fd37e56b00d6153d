"""magi_attention through dispatch/undispatch on 8 CPU host devices vs the single-device
float64 reference, by the correctness rule of docs/design.md §5 (forward and gradients): cp
sizes, overlap degrees, random masks, transports, the key and the local API. The mask zoo at
cp 8 and batches are in tests/test_conformance.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask
from magi_jax.sharding import (
    dispatch,
    magi_attention,
    magi_attention_local,
    make_flex_key,
    make_varlen_key,
    position_ids,
    undispatch,
)
from tests.zoo import CU, ZOO, T, self_attention_masks


@functools.lru_cache(maxsize=None)
def _mesh(cp):
    """Auto-sharded meshes, except cp = 2: jax.make_mesh's default (Explicit) axis type."""
    if cp == 2:
        return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    return jax.make_mesh(
        (cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,)
    )


@functools.lru_cache(maxsize=None)
def _end_to_end(key, softcap=0.0, softmax_scale=None):
    """Jitted natural-order forward + VJP through dispatch -> magi_attention -> undispatch."""

    def fwd(q, k, v):
        o, l = magi_attention(
            dispatch(q, key),
            dispatch(k, key),
            dispatch(v, key),
            key,
            softcap=softcap,
            softmax_scale=softmax_scale,
        )
        return undispatch(o, key), undispatch(l, key)

    @jax.jit
    def run(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(fwd, q, k, v)
        dq, dk, dv = vjp((dout, dlse))
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    return run


def _check(mask, cp, degree=None, dtype=jnp.float32, hq=2, hkv=1, d=8, seed=0, **kw):
    key = make_flex_key(
        mask,
        _mesh(cp),
        "cp",
        overlap_degree=degree,
        **{
            k: kw.pop(k)
            for k in ("chunk_size", "dispatch_algorithm", "comm_backend", "backward_refetch")
            if k in kw
        },
    )
    q, k, v, dout, dlse = random_inputs(jax.random.key(seed), mask, hq, hkv, d, dtype)
    res = _end_to_end(key, **kw)(q, k, v, dout, dlse)
    assert res["out"].dtype == dtype and res["lse"].dtype == jnp.float32
    assert_matches_reference(res, q, k, v, mask, dout, dlse, **kw)
    return key, res


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_sizes_doc_causal(cp):
    _check(ZOO["doc-causal"], cp, hq=4, hkv=2)


def test_overlap_degrees_agree():
    results = {}
    for degree in (0, 1, 3):
        # degree 1 keeps the fetched KV for the backward; 0 and 3 re-fetch it (default).
        key, results[degree] = _check(
            ZOO["shared-question"], 4, degree, chunk_size=3, backward_refetch=degree != 1
        )
        assert key.overlap_degree == degree
        assert len(key.stages) == (1 if degree == 0 else degree + 1)
    for degree in (1, 3):
        for n in results[0]:
            np.testing.assert_allclose(
                np.asarray(results[degree][n]),
                np.asarray(results[0][n]),
                rtol=2e-5,
                atol=2e-5,
                err_msg=f"{n}, degree {degree}",
            )


@settings(max_examples=3)
@given(
    self_attention_masks(min_len=5, max_len=40),
    st.sampled_from([2, 4, 8]),
    st.sampled_from([0, 1, 3]),
)
def test_random_masks(mask, cp, degree):
    _check(mask, cp, degree)


def test_bfloat16_gqa_softcap_all_to_all():
    _check(
        ZOO["block-causal"],
        4,
        1,
        jnp.bfloat16,
        hq=4,
        hkv=2,
        d=16,
        softcap=4.0,
        comm_backend="all_to_all",
    )


def test_dispatch_undispatch_positions_and_shared_dispatch():
    mesh = _mesh(4)
    key = make_varlen_key(CU, mesh, "cp", causal=True, chunk_size=3)
    assert key.padded_total == 72 and key.total == T
    x = jnp.arange(T, dtype=jnp.float32)[:, None] * jnp.ones((1, 3))
    xd = dispatch(x, key)
    assert xd.shape == (72, 3) and xd.sharding.spec[0] == "cp"
    pos = np.asarray(position_ids(key))
    real = pos < T
    np.testing.assert_array_equal(np.asarray(xd)[real, 0], pos[real])
    np.testing.assert_array_equal(np.asarray(xd)[~real], 0)
    np.testing.assert_array_equal(np.asarray(undispatch(xd, key)), np.asarray(x))
    # VJP of dispatch is undispatch of the cotangent (and drops padding).
    w = jax.random.normal(jax.random.key(1), (72, 3))
    g = jax.grad(lambda a: (dispatch(a, key) * w).sum())(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(undispatch(w, key)))
    # A second mask over the same tokens reuses the dispatch.
    key2 = make_flex_key(AttnMask.sliding_window(T, 4, 0), mesh, "cp", dispatch_from=key)
    np.testing.assert_array_equal(np.asarray(position_ids(key2)), pos)
    assert key2.plan.meta is key.plan.meta
    q, k, v, dout, dlse = random_inputs(jax.random.key(2), key2.mask, 2, 1, 8, jnp.float32)
    assert_matches_reference(_end_to_end(key2)(q, k, v, dout, dlse), q, k, v, key2.mask, dout, dlse)


def test_local_api_inside_user_shard_map():
    from jax.sharding import PartitionSpec as P

    mask = ZOO["prefix-lm"]
    key = make_flex_key(mask, _mesh(4), "cp", overlap_degree=1)
    q, k, v, _, _ = random_inputs(jax.random.key(3), mask, 2, 1, 8, jnp.float32)
    body = lambda q_, k_, v_: magi_attention_local(q_, k_, v_, key)
    f = jax.jit(
        jax.shard_map(
            body,
            mesh=key.mesh,
            in_specs=(P("cp"),) * 3,
            out_specs=(P("cp"), P("cp")),
            check_vma=False,
        )
    )
    out, lse = f(dispatch(q, key), dispatch(k, key), dispatch(v, key))
    assert_matches_reference(
        dict(out=undispatch(out, key), lse=undispatch(lse, key)), q, k, v, mask
    )


def test_key_is_cached_and_a_pytree():
    mesh = _mesh(2)
    a = make_flex_key(ZOO["causal"], mesh, "cp", overlap_degree=1)
    assert make_flex_key(ZOO["causal"], mesh, "cp", overlap_degree=1) is a
    leaves, tree = jax.tree.flatten(a)
    assert all(np.asarray(x).dtype == np.int32 for x in leaves)
    rebuilt = jax.tree.unflatten(tree, leaves)
    # The static part travels; the host plan does not (it is mask data, not part of the
    # compiled function's identity).
    assert rebuilt.static == a.static and rebuilt.plan is None


def test_errors_name_argument_value_and_fix():
    mesh = _mesh(2)
    key = make_flex_key(ZOO["causal"], mesh, "cp")
    with pytest.raises(ValueError, match="cp_axis='sp'.*axes"):
        make_flex_key(ZOO["causal"], mesh, "sp")
    with pytest.raises(ValueError, match="kv_layout='ring'"):
        make_flex_key(AttnMask.full(4, 6), mesh, "cp", kv_layout="ring")
    with pytest.raises(ValueError, match="comm_backend='ragged'"):
        make_flex_key(ZOO["causal"], mesh, "cp", comm_backend="ragged")
    q = jnp.zeros((key.padded_total - 1, 2, 8))
    with pytest.raises(ValueError, match="dispatch first"):
        magi_attention(q, q, q, key)
    with pytest.raises(ValueError, match="dispatch: x has shape"):
        dispatch(jnp.zeros((T + 1, 2)), key)
    with pytest.raises(ValueError, match="dispatch_from was made for"):
        make_flex_key(AttnMask.causal(T + 1), mesh, "cp", dispatch_from=key)


def test_public_names():
    for name in (
        "make_flex_key",
        "make_varlen_key",
        "dispatch",
        "undispatch",
        "magi_attention",
        "position_ids",
    ):
        assert getattr(mj, name) is getattr(__import__("magi_jax.sharding").sharding, name)


def test_key_passes_through_jit_as_an_argument():
    mask = ZOO["doc-window"]
    key = make_flex_key(mask, _mesh(2), "cp", overlap_degree=1)
    q, k, v, _, _ = random_inputs(jax.random.key(4), mask, 2, 1, 8, jnp.float32)
    f = jax.jit(lambda q_, k_, v_, key_: magi_attention(q_, k_, v_, key_))
    out, lse = f(dispatch(q, key), dispatch(k, key), dispatch(v, key), key)
    assert_matches_reference(
        dict(out=undispatch(out, key), lse=undispatch(lse, key)), q, k, v, mask
    )


def test_two_dimensional_mesh_replicates_over_the_other_axis():
    mask = ZOO["prefix-lm"]
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    key = make_flex_key(mask, mesh, "cp", overlap_degree=1)
    q, k, v, _, _ = random_inputs(jax.random.key(6), mask, 2, 1, 8, jnp.float32)

    @jax.jit
    def fwd(q_, k_, v_):
        o, l = magi_attention(dispatch(q_, key), dispatch(k_, key), dispatch(v_, key), key)
        return undispatch(o, key), undispatch(l, key)

    out, lse = fwd(q, k, v)
    assert_matches_reference(dict(out=out, lse=lse), q, k, v, mask)


@pytest.mark.parametrize("cast_gating", ["auto", "slot"])
def test_eager_calls_compile_once_and_match_the_reference(cast_gating):
    """``magi_attention`` called eagerly (no ``jit`` of the caller's) runs as one program:
    compiled at the first call, not again at the second, with the same result; on the
    default pair-by-pair casts of a key of one mask and on whole slots."""
    compiles = []

    def listen(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    mask = AttnMask.varlen(CU, causal=True)
    key = mj.make_flex_key(mask, _mesh(4), "cp", ffa_backend="xla", cast_gating=cast_gating)
    q, k, v, _, _ = random_inputs(jax.random.key(5), mask, 2, 1, 8, jnp.float32)
    qd, kd, vd = (mj.dispatch(x, key) for x in (q, k, v))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first = jax.block_until_ready(mj.magi_attention(qd, kd, vd, key))
        before = len(compiles)
        again = jax.block_until_ready(mj.magi_attention(qd, kd, vd, key))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(compiles) == before, f"{len(compiles) - before} compilations at the second call"
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out, lse = (mj.undispatch(x, key) for x in first)
    assert_matches_reference(dict(out=out, lse=lse), q, k, v, mask)
