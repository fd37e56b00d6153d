"""Multi-head latent attention on one device: a value head dim ``Dv`` of its own (q, k
``[T, H, Dqk]``, v ``[T, Hkv, Dv]``, out ``[T, Hq, Dv]``) at 192/128 and 128/64, through
``flex_flash_attention`` (masks and plans), ``dot_product_attention``, sinks and max logits,
forward and gradients against the float64 reference (docs/design.md §5); for the pairs the
pallas kernels do not take, the backend choice falls back to ``xla`` with the reason."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import (
    assert_matches_reference,
    fwd_bwd,
    random_inputs,
    reference_vjp_float64,
)

DIMS = [(192, 128), (128, 64)]
MASK = mj.AttnMask.varlen([0, 37, 90, 130], causal=True, window=(40, 0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dqk,dv", DIMS)
def test_front_door_forward_and_gradients(dqk, dv, dtype):
    q, k, v, dout, dlse = random_inputs(jax.random.key(0), MASK, 4, 2, dqk, dtype, dv=dv)
    assert v.shape == (130, 2, dv)
    run = fwd_bwd(lambda q, k, v: mj.flex_flash_attention(q, k, v, MASK))
    res = run(q, k, v, dout, dlse)
    assert res["out"].shape == (130, 4, dv) and res["dv"].shape == v.shape
    assert res["dq"].shape == q.shape and res["dk"].shape == k.shape
    assert_matches_reference(res, q, k, v, MASK, dout, dlse)


@pytest.mark.parametrize("dqk,dv", DIMS)
def test_batched_plans_sinks_and_max_logits(dqk, dv):
    mask = mj.AttnMask.causal(64)
    q, k, v, dout, dlse = random_inputs(
        jax.random.key(1), mask, 2, 1, dqk, jnp.float32, batch=2, dv=dv
    )
    # A plan (the mask as data) and a batch.
    plan = mj.plan_attention(mask, mj.PlanCapacity(64), backend="xla")
    step = jax.jit(lambda q, k, v, p: mj.flex_flash_attention(q, k, v, p, return_max_logits=True))
    out, lse, peak = (np.asarray(x) for x in step(q, k, v, plan))
    assert out.shape == (2, 64, 2, dv)
    # Per-row slices on the host (eager indexing of a jax array compiles a program).
    host = [np.asarray(x) for x in (q, k, v, dout, dlse)]
    for b in range(2):
        res = dict(out=out[b], lse=lse[b], max_logits=peak[b])
        assert_matches_reference(res, *(x[b] for x in host[:3]), mask)
    # Sinks, differentiated.
    sink = jax.device_put(np.random.default_rng(2).standard_normal((2, 2), np.float32))
    run = jax.jit(
        lambda q, k, v, s: jax.vjp(
            lambda q, k, v, s: mj.flex_flash_attention(q, k, v, mask, sink=s), q, k, v, s
        )[1]((dout[0], dlse[0]))
    )
    q0, k0, v0, dout0, dlse0 = (jax.device_put(x[0]) for x in host)
    dq, dk, dv_, dsink = run(q0, k0, v0, sink)
    out, lse = mj.flex_flash_attention(q0, k0, v0, mask, sink=sink)
    res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv_, dsink=dsink)
    assert_matches_reference(res, q0, k0, v0, mask, dout0, dlse0, sink=sink)


@pytest.mark.parametrize("dqk,dv", DIMS)
def test_dot_product_attention(dqk, dv):
    """jax.nn's interface (which itself takes no Dv of its own) with segment ids, lengths and
    a concrete mask, against the dense float64 reference of the same cells."""
    b, t, n, kh = 2, 40, 4, 2
    rng = np.random.default_rng(3)
    host = [rng.standard_normal(shape, np.float32) for shape in [(b, t, n, dqk), (b, t, kh, dqk)]]
    host.append(rng.standard_normal((b, t, kh, dv), np.float32))
    q, k, v = (jax.device_put(x) for x in host)
    ids = np.ones((b, t), np.int32)
    ids[:, 17:] = 2
    ids[1, 30:] = 0
    lengths = np.array([33, 21], np.int32)
    mask = np.random.default_rng(4).random((t, t)) < 0.7
    causal = np.tril(np.ones((t, t), bool))
    cases = [
        (
            dict(segment_ids=ids),
            causal & (ids[:, :, None] == ids[:, None, :]) & (ids != 0)[:, None],
        ),
        (dict(query_seq_lengths=lengths), causal & (np.arange(t) < lengths[:, None])[:, :, None]),
        (dict(mask=mask), causal & mask),
    ]
    for kw, cells in cases:
        cells = np.broadcast_to(cells, (b, t, t))
        out = mj.dot_product_attention(q, k, v, is_causal=True, **kw)
        assert out.shape == (b, t, n, dv)
        out = np.asarray(out)
        for r in range(b):
            # The dense reference in NumPy float64 (its eager JAX twin compiles op by op).
            want = reference_vjp_float64(
                *(x[r] for x in host), cells[r], np.zeros((t, n, dv)), None, dqk**-0.5
            )[0]
            np.testing.assert_allclose(out[r], want, atol=3e-5)


def test_backend_choice_falls_back_with_the_reason():
    """The (Dqk, Dv) pairs the pallas kernels do not take run on xla, with the head dims as
    the reason (those they take: tests/pallas/test_mla_pallas.py)."""
    q, k, v, *_ = random_inputs(jax.random.key(5), MASK, 2, 2, 192, jnp.bfloat16, dv=64)
    name, why = mj.select_backend("auto", q, k, v, MASK)
    assert name == "xla" and "Dv=64" in why and "D=192" in why
    with pytest.raises(NotImplementedError, match="Dv=64 differs"):
        mj.flex_flash_attention(q, k, v, MASK, backend="pallas")
    plan = mj.plan_attention(MASK, backend="pallas")
    with pytest.raises(ValueError, match="Dv=64 differs"):
        mj.flex_flash_attention(q, k, v, plan)


def test_value_shapes_are_checked():
    q, k, v, *_ = random_inputs(jax.random.key(6), MASK, 2, 2, 64, jnp.float32, dv=32)
    with pytest.raises(ValueError, match="Dv \\(v's head dim\\)=12 is not supported"):
        mj.flex_flash_attention(q, k, v[..., :12], MASK)
    with pytest.raises(ValueError, match="same shape up to the head dim"):
        mj.flex_flash_attention(q, k, v[:, :1], MASK)
    with pytest.raises(ValueError, match="q has D=64, k has D=32"):
        mj.flex_flash_attention(q, k[..., :32], v, MASK)
