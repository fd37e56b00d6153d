"""Multi-head latent attention under context parallelism at cp 4 (8 CPU host devices): K and
V travel at their own head dims through the casts and the reduces of their gradients;
forward and gradients through dispatch -> magi_attention -> undispatch against the float64
reference (docs/design.md §5), with a batch, sinks and max logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import (
    assert_matches_reference,
    assert_rows_match_reference,
    random_inputs,
)

MASK = mj.AttnMask.varlen([0, 50, 51, 160], causal=True)


@functools.lru_cache(maxsize=None)
def _key(overlap_degree):
    mesh = jax.make_mesh(
        (4,), ("cp",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
    )
    return mj.make_flex_key(MASK, mesh, "cp", ffa_backend="xla", overlap_degree=overlap_degree)


def _attn(key, seq_axis=0, **kw):
    def fwd(q, k, v):
        res = mj.magi_attention(*(mj.dispatch(x, key, seq_axis) for x in (q, k, v)), key, **kw)
        return tuple(mj.undispatch(x, key, seq_axis) for x in res[:2]) + tuple(res[2:])

    return fwd


# The default degree is 0 (one stage) for this mask; 2 adds two remote stages.
@pytest.mark.parametrize("overlap_degree", [None, 2])
@pytest.mark.parametrize("dqk,dv", [(192, 128), (128, 64)])
def test_forward_and_gradients(dqk, dv, overlap_degree):
    key = _key(overlap_degree)
    assert any(stage.cast is not None for stage in key.stages)  # KV does travel
    q, k, v, dout, dlse = random_inputs(jax.random.key(0), MASK, 4, 2, dqk, jnp.float32, dv=dv)

    @jax.jit
    def run(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(_attn(key), q, k, v)
        dq, dk, dv_ = vjp((dout, dlse))
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv_)

    res = run(q, k, v, dout, dlse)
    assert res["out"].shape == (160, 4, dv) and res["dv"].shape == (160, 2, dv)
    assert_matches_reference(res, q, k, v, MASK, dout, dlse)


def test_batch_sinks_and_max_logits():
    key = _key(None)
    dqk, dv = 192, 128
    q, k, v, dout, dlse = random_inputs(
        jax.random.key(1), MASK, 2, 1, dqk, jnp.float32, batch=2, dv=dv
    )
    sink = jax.random.normal(jax.random.key(2), (1, 2), jnp.float32)
    attn = _attn(key, seq_axis=1, sink=sink, return_max_logits=True)
    out, lse, peak = jax.jit(attn)(q, k, v)
    assert out.shape == (2, 160, 2, dv) and peak.shape == (2, 2)

    def loss(q, k, v):
        o, l, _ = attn(q, k, v)
        return (o * dout).sum() + (l * dlse).sum()

    dq, dk, dv_ = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv_)
    assert_rows_match_reference(res, q, k, v, MASK, dout, dlse, sink=sink)
    peak, q, k, v = jax.device_get((peak, q, k, v))
    for b in range(2):
        plain = mj.flex_flash_attention(q[b], k[b], v[b], MASK, return_max_logits=True)[2]
        np.testing.assert_allclose(peak[b], plain, rtol=1e-6)
