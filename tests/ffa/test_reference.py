import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.ffa.reference import dense_attention, reference_attention, reference_attention_vjp
from magi_jax.ffa.testing import reference_vjp_float64
from magi_jax.mask import AttnMask


def _loop_reference(q, k, v, dense, scale, softcap=0.0):
    """Row by row in NumPy float64: softmax over the keys a row may see."""
    tq, hq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros((tq, hq, d))
    lse = np.full((tq, hq), -np.inf)
    for i in range(tq):
        keys = np.nonzero(dense[i])[0]
        if not len(keys):
            continue
        for h in range(hq):
            s = k[keys, h // g] @ q[i, h] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            m = s.max()
            e = np.exp(s - m)
            out[i, h] = e @ v[keys, h // g] / e.sum()
            lse[i, h] = m + np.log(e.sum())
    return out, lse


def test_matches_row_loop_gqa_softcap():
    rng = np.random.default_rng(0)
    mask = AttnMask.from_ranges(
        [[0, 5], [5, 9], [0, 3]],
        [[0, 5], [2, 11], [7, 11]],
        ["causal", "inv_causal", "full"],
        total_q=12,
        total_k=11,
    )
    q, k, v = (rng.standard_normal(s) for s in [(12, 4, 8), (11, 2, 8), (11, 2, 8)])
    with jax.enable_x64(True):
        out, lse = reference_attention(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, softmax_scale=0.3, softcap=2.0
        )
        out, lse = np.asarray(out), np.asarray(lse)
    want_out, want_lse = _loop_reference(q, k, v, mask.to_dense(), 0.3, 2.0)
    np.testing.assert_allclose(out, want_out, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)
    assert np.isneginf(lse[9:]).all() and (out[9:] == 0).all()


def test_fully_masked_rows_zero_gradients_no_nan():
    mask = AttnMask.from_ranges([[2, 4]], [[0, 3]], ["full"], total_q=6, total_k=3)
    rng = np.random.default_rng(1)
    q, k, v, do = (
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in [(6, 2, 8), (3, 2, 8), (3, 2, 8), (6, 2, 8)]
    )
    dlse = jnp.ones((6, 2))
    out, lse, (dq, dk, dv) = reference_attention_vjp(q, k, v, mask, do, dlse)
    for x in (out, dq, dk, dv):
        assert not np.isnan(np.asarray(x)).any()
    empty = np.array([0, 1, 4, 5])
    assert (np.asarray(out)[empty] == 0).all() and np.isneginf(np.asarray(lse)[empty]).all()
    assert (np.asarray(dq)[empty] == 0).all()


def _autodiff64(q, k, v, dense, dout, dlse, scale, softcap, sink):
    """JAX's autodiff of the jnp reference in float64: the oracle of the NumPy backward."""
    with jax.enable_x64(True):
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v) + (() if sink is None else (sink,))]

        def fn(*a):
            out, lse, max_logits = dense_attention(
                *a[:3],
                dense,
                softmax_scale=scale,
                softcap=softcap,
                sink=a[3] if len(a) > 3 else None,
                return_max_logits=True,
            )
            return (out, lse), max_logits

        (out, lse), vjp, max_logits = jax.vjp(fn, *args, has_aux=True)
        grads = vjp((jnp.asarray(dout, jnp.float64), jnp.asarray(dlse, jnp.float64)))
        res = (out, lse) + grads[:3] + (max_logits,) + grads[3:]
        return [np.asarray(x) for x in res]


@pytest.mark.parametrize(
    "batch, heads, softcap, sinks",
    [((), (4, 2), 0.0, 0), ((2,), (4, 1), 2.5, 0), ((), (2, 2), 0.0, 3), ((3,), (6, 3), 4.0, 1)],
)
def test_numpy_float64_backward_equals_autodiff(batch, heads, softcap, sinks):
    """``reference_vjp_float64`` (NumPy, hand-derived backward) against JAX's autodiff of
    the jnp reference: out, lse, dq, dk, dv, max_logits (and dsink) to 1e-12, over GQA,
    batches, softcaps, sinks, a value head dim of its own, a nonzero dlse and rows and
    columns that see nothing."""
    mask = AttnMask.from_ranges(
        [[0, 5], [5, 9], [0, 3]],
        [[0, 5], [2, 11], [7, 11]],
        ["causal", "inv_causal", "full"],
        total_q=12,
        total_k=13,
    )
    rng = np.random.default_rng(len(batch) + sinks)
    hq, hkv = heads
    q, k, v, dout = (
        rng.standard_normal(batch + s)
        for s in [(12, hq, 8), (13, hkv, 8), (13, hkv, 6), (12, hq, 6)]
    )
    dlse = rng.standard_normal(batch + (12, hq))
    sink = rng.standard_normal((sinks, hq)) if sinks else None
    dense = mask.to_dense()
    got = reference_vjp_float64(q, k, v, dense, dout, dlse, 0.3, softcap, sink)
    want = _autodiff64(q, k, v, dense, dout, dlse, 0.3, softcap, sink)
    assert len(got) == len(want) == 6 + (sink is not None)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv", "max_logits", "dsink"), got, want):
        assert x.shape == y.shape, name
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-12, err_msg=name)
    if sink is None:  # rows 9-11 see no key: zero out and gradient, lse -inf
        assert np.isneginf(got[1][..., 9:, :]).all() and (got[2][..., 9:, :, :] == 0).all()
