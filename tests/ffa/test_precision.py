"""float64 inputs are computed in float64 on the ``xla`` backend, end to end: the front door
(forward and gradients), sinks, ``dot_product_attention`` (host and device plans) — judged in
float64 (floor 1e-9, docs/design.md §5), where float32 arithmetic would miss by ~1e-7."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, fwd_bwd, random_inputs


def _numpy_attention(q, k, v, allowed, scale):
    """Row by row in NumPy float64: [B, T, N, H] inputs (N == K), allowed [T, S]."""
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return np.einsum("bnts,bsnh->btnh", e / e.sum(-1, keepdims=True), v)


def test_front_door_forward_and_gradients_in_float64():
    mask = mj.AttnMask.varlen([0, 13, 40], causal=True, window=(5, 0))
    with jax.enable_x64(True):
        q, k, v, dout, dlse = random_inputs(jax.random.key(0), mask, 4, 2, 16, jnp.float64)
        dlse = jax.device_put(np.asarray(dlse, np.float64))
        run = fwd_bwd(lambda q, k, v: mj.flex_flash_attention(q, k, v, mask, backend="xla"))
        res = run(q, k, v, dout, dlse)
        assert all(x.dtype == jnp.float64 for x in res.values())
        table = assert_matches_reference(res, q, k, v, mask, dout, dlse)
    # The bound is float64's (the floor): float32 arithmetic would miss it by far.
    assert all(err <= 1e-9 for err, _ in table.values()), table


def test_sinks_in_float64():
    mask = mj.AttnMask.causal(24)
    with jax.enable_x64(True):
        q, k, v, dout, dlse = random_inputs(jax.random.key(1), mask, 2, 2, 8, jnp.float64)
        sink = jax.device_put(np.random.default_rng(2).standard_normal((2, 2)))
        out, lse = mj.flex_flash_attention(q, k, v, mask, sink=sink, backend="xla")
        assert out.dtype == lse.dtype == jnp.float64
        table = assert_matches_reference(dict(out=out, lse=lse), q, k, v, mask, sink=sink)
    assert all(err <= 1e-9 for err, _ in table.values()), table


@pytest.mark.parametrize("with_ids", [False, True])
def test_dot_product_attention_in_float64(with_ids):
    """Against NumPy float64; jax.nn itself runs its softmax in float32 (its own comment:
    "Softmax ... is always carried out in fp32"), so it is no float64 oracle."""
    rng = np.random.default_rng(3)
    b, t, n, h = 2, 20, 2, 8
    q, k, v = (rng.standard_normal((b, t, n, h)) for _ in range(3))
    ids = np.ones((b, t), np.int32)
    ids[:, 9:] = 2
    allowed = np.tril(np.ones((t, t), bool))
    if with_ids:
        allowed = allowed[None] & (ids[:, :, None] == ids[:, None, :])
        allowed = allowed[:, None]
    with jax.enable_x64(True):
        out = mj.dot_product_attention(
            jax.device_put(q),
            jax.device_put(k),
            jax.device_put(v),
            segment_ids=ids if with_ids else None,
            is_causal=True,
            backend="xla",
        )
    want = _numpy_attention(q, k, v, allowed, h**-0.5)
    assert out.dtype == jnp.float64
    assert np.abs(np.asarray(out) - want).max() <= 1e-12
