"""The NNX SelfAttention layer with multi-head latent attention's shapes (``head_dim`` for
queries and keys, ``v_head_dim`` for values and the attention output) at 192/128 and 128/64:
forward and gradients on one device against a plain dense version of the layer, and context
parallel (cp 4) against one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import magi_jax as mj
from magi_jax.nn import SelfAttention, apply_rope

CU = np.array([0, 21, 22, 48])
T = int(CU[-1])
MASK = mj.AttnMask.varlen(CU, causal=True)
TOL = dict(rtol=2e-5, atol=2e-5)
DIMS = [(192, 128), (128, 64)]


@functools.lru_cache(maxsize=None)
def _key():
    mesh = jax.make_mesh(
        (4,), ("cp",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
    )
    return mj.make_flex_key(MASK, mesh, "cp", ffa_backend="xla")


def _dense(layer: SelfAttention, x):
    """Plain-JAX GQA + RoPE attention with the dense mask and a value head dim of its own."""
    hd, hv, hq, hkv = layer.head_dim, layer.v_head_dim, layer.num_heads, layer.num_kv_heads
    q = layer.q_proj(x).reshape(T, hq, hd)
    k = layer.k_proj(x).reshape(T, hkv, hd)
    v = layer.v_proj(x).reshape(T, hkv, hv)
    q, k = apply_rope(q, jnp.arange(T)), apply_rope(k, jnp.arange(T))
    k, v = jnp.repeat(k, hq // hkv, axis=1), jnp.repeat(v, hq // hkv, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) * hd**-0.5
    s = jnp.where(jnp.asarray(MASK.to_dense())[None], s, -jnp.inf)
    out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v)
    return layer.o_proj(out.reshape(T, hq * hv))


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)


@pytest.mark.parametrize("hd,hv", DIMS)
def test_self_attention_mla_one_device_and_context_parallel(hd, hv):
    layer = SelfAttention(32, 4, num_kv_heads=2, head_dim=hd, v_head_dim=hv, rngs=nnx.Rngs(0))
    assert layer.v_proj.kernel.shape == (32, 2 * hv)
    assert layer.o_proj.kernel.shape == (4 * hv, 32)
    x = jax.random.normal(jax.random.key(1), (T, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (T, 32), jnp.float32)
    graphdef, params = nnx.split(layer)
    key = _key()

    def loss(fn):
        return jax.jit(lambda p, x: (fn(nnx.merge(graphdef, p), x) * w).sum())

    one = loss(lambda m, x: m(x, MASK))
    dense = loss(_dense)
    cp = loss(lambda m, x: mj.undispatch(m(mj.dispatch(x, key), key), key))
    np.testing.assert_allclose(one(params, x), dense(params, x), rtol=1e-5)
    np.testing.assert_allclose(cp(params, x), one(params, x), rtol=1e-5)
    grad = lambda f: jax.jit(jax.grad(f, (0, 1)))(params, x)
    g_one = grad(one)
    _close(g_one, grad(dense))
    _close(grad(cp), g_one)
