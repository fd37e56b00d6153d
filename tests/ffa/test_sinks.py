"""Attention sinks on one device and under context parallelism against the float64 dense
reference with the sinks in its denominator: out, lse and the gradients of q, k, v and the
sink logits; rows that see no key get out = 0 and lse = logsumexp(sink)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import random_inputs, reference_vjp_float64

T = 96


def _grads(attn, q, k, v, sink, dout):
    def loss(q, k, v, sink):
        out, lse = attn(q, k, v, sink)
        return (out.astype(jnp.float32) * dout).sum() + lse.sum()

    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sink)


def _check(attn, mask, atol):
    q, k, v, dout, _ = random_inputs(jax.random.key(0), mask, 4, 2, 16, jnp.float32)
    sink = jax.device_put(np.random.default_rng(1).standard_normal((2, 4), np.float32))
    out, lse = jax.jit(attn)(q, k, v, sink)
    g = jax.jit(lambda *a: _grads(attn, *a))(q, k, v, sink, dout)
    # The float64 reference in NumPy (no program to compile per mask), its gradients for
    # _grads' loss: cotangents dout and 1 for every lse.
    q64, k64, v64, sink64, dout64 = (np.asarray(a, np.float64) for a in (q, k, v, sink, dout))
    dense = mask.to_dense()
    rout, rlse, *rg, _, rdsink = reference_vjp_float64(
        q64, k64, v64, dense, dout64, np.ones(lse.shape), q.shape[-1] ** -0.5, 0.0, sink64
    )
    np.testing.assert_allclose(out, rout, atol=atol)
    np.testing.assert_allclose(lse, rlse, atol=atol)
    for a, b in zip(g, rg + [rdsink]):
        np.testing.assert_allclose(a, b, atol=atol * max(1.0, float(np.abs(b).max())))
    empty = ~dense.any(axis=1)
    if empty.any():
        assert (np.asarray(out)[empty] == 0).all()
        np.testing.assert_allclose(
            np.asarray(lse)[empty],
            np.broadcast_to(np.logaddexp.reduce(sink64, axis=0), (int(empty.sum()), 4)),
            atol=1e-5,
        )


MASKS = {
    "doc_causal": mj.AttnMask.varlen([0, 30, 31, 96], causal=True),
    "holes": mj.AttnMask.from_ranges(
        [[0, 40], [60, 96]], [[0, 50], [10, 96]], ["causal", "full"], total_q=T, total_k=T
    ),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_one_device(name):
    attn = lambda q, k, v, s: mj.flex_flash_attention(q, k, v, MASKS[name], sink=s, backend="xla")
    _check(attn, MASKS[name], 2e-5)


@pytest.mark.parametrize("name", list(MASKS))
def test_context_parallel(name):
    mesh = jax.make_mesh(
        (4,), ("cp",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
    )
    key = mj.make_flex_key(MASKS[name], mesh, "cp", ffa_backend="xla")

    def attn(q, k, v, s):
        out, lse = mj.magi_attention(*(mj.dispatch(x, key) for x in (q, k, v)), key, sink=s)
        return mj.undispatch(out, key), mj.undispatch(lse, key)

    _check(attn, MASKS[name], 2e-5)


def test_bad_sink_names_the_shape():
    mask = MASKS["doc_causal"]
    x = jnp.zeros((T, 4, 16))
    with pytest.raises(ValueError, match=r"\[S, Hq\].*Hq = 4"):
        mj.flex_flash_attention(x, x, x, mask, sink=jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="1 <= S <= 8"):
        mj.flex_flash_attention(x, x, x, mask, sink=jnp.zeros((9, 4)))
