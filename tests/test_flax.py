"""Flax integration: the attention_fn adapters (linen and NNX) and the NNX SelfAttention layer
give the same outputs and gradients as the plain API, on one device and context parallel on 8
CPU host devices; mistakes in the layer's inputs are rejected with a clear message."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import magi_jax as mj
from magi_jax.nn import SelfAttention, apply_rope, make_attention_fn

LENS = [13, 1, 22, 9, 19]  # 64 tokens, odd documents
CU = np.cumsum([0] + LENS)
T = int(CU[-1])
MASK = mj.AttnMask.varlen(CU, causal=True)  # every row sees itself: dense flax agrees
TOL = dict(rtol=2e-5, atol=2e-5)


@functools.lru_cache(maxsize=None)
def _key(cp=8, degree=None):
    mesh = jax.make_mesh(
        (cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,)
    )
    return mj.make_flex_key(MASK, mesh, "cp", overlap_degree=degree)


def _close(a, b, what):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), **TOL, err_msg=f"{what} {jax.tree_util.keystr(path)}"
        )


def _host_x(shape, seed=0):
    """Unit-normal float32 in NumPy (a jax.random draw compiles a program per shape)."""
    return np.random.default_rng(seed).standard_normal(shape, np.float32)


def _x(shape, seed=0):
    return jax.device_put(_host_x(shape, seed))


# ---- linen ------------------------------------------------------------------------------------


def test_linen_single_device_matches_flax_dense_attention():
    x = _x((2, T, 32))
    ours = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=make_attention_fn(MASK))
    dense = nn.MultiHeadDotProductAttention(num_heads=4)
    params = ours.init(jax.random.key(1), x)
    dmask = jax.device_put(MASK.to_dense()[None, None])
    w = _x((2, T, 32), 2)
    f_ours = lambda p, x: (ours.apply(p, x) * w).sum()
    f_dense = lambda p, x: (dense.apply(p, x, mask=dmask) * w).sum()
    np.testing.assert_allclose(
        jax.jit(ours.apply)(params, x), dense.apply(params, x, mask=dmask), **TOL
    )
    _close(
        jax.jit(jax.grad(f_ours, (0, 1)))(params, x), jax.grad(f_dense, (0, 1))(params, x), "grad"
    )


def test_linen_context_parallel_matches_single_device():
    key = _key(8, 2)
    x = _x((2, T, 32))
    cp_layer = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=make_attention_fn(key))
    one = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=make_attention_fn(MASK))
    params = one.init(jax.random.key(1), x)
    w = _x((2, T, 32), 2)

    @jax.jit
    def f_cp(p, x):
        y = cp_layer.apply(p, mj.dispatch(x, key, seq_axis=1))
        return (mj.undispatch(y, key, seq_axis=1) * w).sum()

    f_one = lambda p, x: (one.apply(p, x) * w).sum()
    np.testing.assert_allclose(f_cp(params, x), f_one(params, x), rtol=1e-5)
    _close(
        jax.jit(jax.grad(f_cp, (0, 1)))(params, x),
        jax.jit(jax.grad(f_one, (0, 1)))(params, x),
        "grad",
    )


# ---- NNX MultiHeadAttention -----------------------------------------------------------------


def test_nnx_multihead_adapter_single_and_context_parallel():
    key = _key(8)
    x = _x((T, 32))
    kw = dict(num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kw, attention_fn=make_attention_fn(MASK))
    cp_layer = nnx.MultiHeadAttention(**kw, attention_fn=make_attention_fn(key))
    dense = nnx.MultiHeadAttention(**kw)
    nnx.update(cp_layer, nnx.state(ours))
    nnx.update(dense, nnx.state(ours))
    dmask = jax.device_put(MASK.to_dense()[None])
    g_ours, state = nnx.split(ours)
    g_cp = nnx.graphdef(cp_layer)
    one = lambda st, x: nnx.merge(g_ours, st)(x)
    par = lambda st, x: mj.undispatch(nnx.merge(g_cp, st)(mj.dispatch(x, key)), key)
    y = jax.jit(one)(state, x)
    np.testing.assert_allclose(y, dense(x, mask=dmask), **TOL)
    np.testing.assert_allclose(jax.jit(par)(state, x), y, **TOL)
    # Gradients with respect to the layer's parameters and input, CP vs one device.
    w = _x((T, 32), 3)
    grad = lambda f: jax.jit(jax.grad(lambda st, x: (f(st, x) * w).sum(), (0, 1)))
    _close(grad(par)(state, x), grad(one)(state, x), "grad")


# ---- NNX SelfAttention (GQA + RoPE) -----------------------------------------------------------


def _dense_self_attention(layer: SelfAttention, x, positions):
    """Plain-JAX GQA + RoPE attention with the dense mask: the obviously-right version."""
    hd, hq, hkv = layer.head_dim, layer.num_heads, layer.num_kv_heads
    q = layer.q_proj(x).reshape(T, hq, hd)
    k = layer.k_proj(x).reshape(T, hkv, hd)
    v = layer.v_proj(x).reshape(T, hkv, hd)
    q, k = apply_rope(q, positions), apply_rope(k, positions)
    k, v = jnp.repeat(k, hq // hkv, axis=1), jnp.repeat(v, hq // hkv, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) * hd**-0.5
    s = jnp.where(jnp.asarray(MASK.to_dense())[None], s, -jnp.inf)
    out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v)
    return layer.o_proj(out.reshape(T, hq * hd))


def test_self_attention_single_device_matches_dense_reference():
    layer = SelfAttention(32, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
    x = _x((T, 32))
    graphdef, state = nnx.split(layer)
    # The reference as one compiled program (eagerly it compiles op by op).
    dense = jax.jit(lambda st, x: _dense_self_attention(nnx.merge(graphdef, st), x, jnp.arange(T)))
    np.testing.assert_allclose(layer(x, MASK), dense(state, x), **TOL)


def test_self_attention_context_parallel_matches_single_device():
    key = _key(8)
    layer = SelfAttention(32, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
    x = _x((T, 32))
    w = _x((T, 32), 4)
    graphdef, params = nnx.split(layer)

    def f_one(params, x):
        return (nnx.merge(graphdef, params)(x, MASK) * w).sum()

    @jax.jit
    def f_cp(params, x):
        y = nnx.merge(graphdef, params)(mj.dispatch(x, key), key)  # RoPE from position_ids
        return (mj.undispatch(y, key) * w).sum()

    np.testing.assert_allclose(f_cp(params, x), jax.jit(f_one)(params, x), rtol=1e-5)
    _close(
        jax.jit(jax.grad(f_cp, (0, 1)))(params, x),
        jax.jit(jax.grad(f_one, (0, 1)))(params, x),
        "grad",
    )


def test_self_attention_batch_axis_folds_into_heads():
    key = _key(4)
    layer = SelfAttention(32, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
    x_host = _host_x((3, T, 32))
    x = jax.device_put(x_host)
    graphdef, state = nnx.split(layer)
    run = jax.jit(lambda st, x, k: nnx.merge(graphdef, st)(x, k))
    one = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, MASK))
    y_cp = mj.undispatch(run(state, mj.dispatch(x, key, seq_axis=1), key), key, seq_axis=1)
    y_one = np.asarray(one(state, x))
    np.testing.assert_allclose(y_cp, y_one, **TOL)
    np.testing.assert_allclose(y_one[1], one(state, jax.device_put(x_host[1])), **TOL)


# ---- errors -----------------------------------------------------------------------------------


def test_errors_name_the_mistake():
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    key = mj.make_flex_key(MASK, mesh, "cp", chunk_size=3)  # 64 tokens + 8 padding
    assert (key.total, key.padded_total, key.local_len) == (64, 72, 9)
    fn_key, fn_mask = make_attention_fn(key), make_attention_fn(MASK)
    q = jnp.zeros((T, 4, 8))
    with pytest.raises(ValueError, match="natural-order tokens: dispatch"):
        fn_key(q, q, q)
    with pytest.raises(ValueError, match="one rank's tokens.*local=True"):
        z = jnp.zeros((key.local_len, 4, 8))
        fn_key(z, z, z)
    with pytest.raises(ValueError, match="token axis must be third from last"):
        z = jnp.zeros((T, 2, 4, 8))
        fn_mask(z, z, z)
    with pytest.raises(ValueError, match="mask comes from the AttnMask"):
        fn_mask(q, q, q, mask=jnp.ones((1, 1, T, T), bool))
    with pytest.raises(NotImplementedError, match="dropout"):
        fn_mask(q, q, q, dropout_rate=0.1, deterministic=False)
    with pytest.raises(ValueError, match="is_causal"):
        fn_mask(q, q, q, is_causal=True)
    with pytest.raises(TypeError, match="an AttnMask, an AttnPlan .* or a MagiKey"):
        make_attention_fn(np.ones((T, T), bool))
    with pytest.raises(ValueError, match="SelfAttention|multiple of"):
        SelfAttention(32, 4, num_kv_heads=3, rngs=nnx.Rngs(0))
    # Inputs sharded over other devices than the key's mesh.
    key4 = _key(4)
    other = jax.make_mesh(
        (4,), ("cp",), devices=jax.devices()[4:8], axis_types=(jax.sharding.AxisType.Auto,)
    )
    z = jax.device_put(jnp.zeros((key4.padded_total, 4, 8)), NamedSharding(other, P("cp")))
    with pytest.raises(ValueError, match="not the key's mesh"):
        make_attention_fn(key4)(z, z, z)


def test_adapter_local_inside_user_shard_map():
    key = _key(4)
    fn = make_attention_fn(key, local=True)
    q = _x((T, 4, 8), 5)
    k, v = _x((T, 2, 8), 6), _x((T, 2, 8), 7)
    body = jax.shard_map(
        lambda q, k, v: fn(q, k, v),
        mesh=key.mesh,
        in_specs=(P("cp"),) * 3,
        out_specs=P("cp"),
        check_vma=False,
    )
    run = jax.jit(
        lambda q, k, v: mj.undispatch(body(*(mj.dispatch(x, key) for x in (q, k, v))), key)
    )
    np.testing.assert_allclose(run(q, k, v), mj.flex_flash_attention(q, k, v, MASK)[0], **TOL)
