"""Attention sinks and max logits in the NNX ``SelfAttention`` layer: the layer with
``num_sinks`` matches a dense GQA + RoPE reference with the sinks in its denominator, its
sink parameter receives the reference's gradient, context parallelism (4 CPU devices, a
batch folded into the heads) gives the same outputs and gradients, and the max logits it
returns are the reference's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import magi_jax as mj
from magi_jax.nn import SelfAttention, apply_rope

LENS = [13, 1, 22, 9, 19]
T = sum(LENS)
MASK = mj.AttnMask.varlen(np.cumsum([0] + LENS), causal=True)
TOL = dict(rtol=2e-5, atol=2e-5)


def _layer(**kw):
    return SelfAttention(
        32,
        4,
        num_kv_heads=2,
        num_sinks=2,
        sink_init=nnx.initializers.normal(1.0),
        rngs=nnx.Rngs(0),
        **kw,
    )


def _normal(shape, seed):
    """Unit-normal float32, drawn on the host (a jax.random draw compiles a program per
    shape)."""
    return jax.device_put(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _dense(params, graphdef, x):
    """The layer's math by hand with the dense reference (sinks in the denominator):
    output and per-head max logits."""
    layer = nnx.merge(graphdef, params)
    hd, hq, hkv = layer.head_dim, layer.num_heads, layer.num_kv_heads
    split = lambda y, h: y.reshape(y.shape[:-1] + (h, hd))
    q, k, v = (
        split(p(x), h) for p, h in ((layer.q_proj, hq), (layer.k_proj, hkv), (layer.v_proj, hkv))
    )
    pos = jnp.arange(T)
    out, _, ml = mj.reference_attention(
        apply_rope(q, pos),
        apply_rope(k, pos),
        v,
        MASK,
        sink=layer.sink[...],
        return_max_logits=True,
    )
    return layer.o_proj(out.reshape(out.shape[:-2] + (-1,))), ml


def _run(params, graphdef, x, mask_or_key):
    """Output and max logits of the layer."""
    return nnx.merge(graphdef, params)(x, mask_or_key, return_max_logits=True)


def test_layer_matches_reference_and_sink_gets_gradients():
    graphdef, params = nnx.split(_layer(), nnx.Param)
    assert params["sink"][...].shape == (2, 4) and params["sink"][...].dtype == jnp.float32
    x, w = _normal((T, 32), 1), _normal((T, 32), 2)
    loss = lambda f: lambda p: (f(p, graphdef, x)[0] * w).sum()

    @jax.jit
    def both(p):
        return (
            _run(p, graphdef, x, MASK),
            _dense(p, graphdef, x),
            jax.grad(loss(lambda *a: _run(*a, MASK)))(p),
            jax.grad(loss(_dense))(p),
        )

    (y, ml), (y_ref, ml_ref), g, g_ref = both(params)
    np.testing.assert_allclose(y, y_ref, **TOL)
    np.testing.assert_allclose(ml, ml_ref, **TOL)
    assert np.abs(np.asarray(g["sink"][...])).min() > 0  # every sink logit learns
    for path, a in jax.tree_util.tree_flatten_with_path(g)[0]:
        b = dict(jax.tree_util.tree_flatten_with_path(g_ref)[0])[path]
        np.testing.assert_allclose(a, b, **TOL, err_msg=jax.tree_util.keystr(path))


def test_context_parallel_with_batch_matches_one_device():
    mesh = jax.make_mesh(
        (4,), ("cp",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
    )
    key = mj.make_flex_key(MASK, mesh, "cp")
    graphdef, params = nnx.split(_layer(), nnx.Param)
    x, w = _normal((2, T, 32), 3), _normal((2, T, 32), 4)

    def cp(p, x):
        y, ml = _run(p, graphdef, mj.dispatch(x, key, seq_axis=1), key)
        return mj.undispatch(y, key, seq_axis=1), ml

    one = lambda p, x: _run(p, graphdef, x, MASK)

    @jax.jit
    def both(p, x):
        grad = lambda f: jax.grad(lambda p: (f(p, x)[0] * w).sum())(p)
        return cp(p, x), one(p, x), grad(cp), grad(one)

    (y, ml), (y1, ml1), g, g1 = both(params, x)
    np.testing.assert_allclose(y, y1, **TOL)
    assert ml.shape == (2, 4)
    np.testing.assert_allclose(ml, ml1, **TOL)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, **TOL, err_msg=jax.tree_util.keystr(path))


def test_defaults_and_errors():
    layer = SelfAttention(32, 4, num_sinks=1, rngs=nnx.Rngs(0))
    assert not np.asarray(layer.sink[...]).any()  # zeros by default
    assert SelfAttention(32, 4, rngs=nnx.Rngs(0)).sink is None
    with pytest.raises(ValueError, match=r"num_sinks=9 must be an int in \[0, 8\]"):
        SelfAttention(32, 4, num_sinks=9, rngs=nnx.Rngs(0))
