"""``return_max_logits``: each head's largest scaled logit (before the softcap, over the
mask's cells) from the forward, on the ``xla`` backend and under context parallelism, against
the float64 dense reference by the rule of docs/design.md §5: zoo masks, softcap, GQA,
batches, plans as data, heads that see no cell, sinks (not counted), and no gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import magi_jax as mj
from magi_jax.ffa.reference import dense_attention
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask_zoo import zoo

T = 96
ZOO = zoo(T)
# Logits well past the softcaps used here, so a max taken after the cap (or in the wrong
# units) misses the reference by far more than the bound.
GAIN = 3.0
CAP = 2.0


def _inputs(mask, dtype=jnp.float32, hq=4, hkv=2, d=16, batch=None, seed=0):
    q, k, v, _, _ = random_inputs(jax.random.key(seed), mask, hq, hkv, d, dtype, batch)
    return (q.astype(jnp.float32) * GAIN).astype(dtype), k, v


@functools.partial(jax.jit, static_argnames="softcap")
def _dense(q, k, v, dense, softcap):
    return dense_attention(q, k, v, dense, softcap=softcap, return_max_logits=True)


def _check(res, q, k, v, mask, softcap):
    """out, lse and max_logits against the forward of the reference (float64 and the
    inputs' precision; the mask is an argument, so masks of one size share a compilation)."""
    out, lse, max_logits = res
    assert max_logits.dtype == jnp.float32
    assert max_logits.shape == q.shape[:-3] + q.shape[-2:-1]
    dense = mask.to_dense()
    names = ("out", "lse", "max_logits")
    with jax.enable_x64(True):
        x64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        ref64 = {n: np.asarray(r) for n, r in zip(names, _dense(*x64, dense, softcap))}
    ref_lp = {
        n: np.asarray(jnp.asarray(r, jnp.float32), np.float64)
        for n, r in zip(names, _dense(q, k, v, dense, softcap))
    }
    assert_matches_reference(
        dict(out=out, lse=lse, max_logits=max_logits),
        q,
        k,
        v,
        mask,
        softcap=softcap,
        ref64=ref64,
        ref_lp=ref_lp,
    )
    return np.asarray(max_logits)


def _ffa(q, k, v, mask, softcap, **kw):
    return mj.flex_flash_attention(
        q, k, v, mask, softcap=softcap, backend="xla", return_max_logits=True, **kw
    )


# Plans as data: every mask through one compilation.
_planned = jax.jit(lambda q, k, v, plan: _ffa(q, k, v, plan, CAP))


def test_zoo_softcap_gqa_and_empty_heads():
    """Every zoo mask with a softcap well below the logits, GQA; plus a mask without any
    cell (every head's max is -inf, out = 0, lse = -inf) and one whose rows [40, 60) see
    nothing (they neither pull the max to -inf nor add to it)."""
    masks = dict(
        ZOO,
        empty=mj.AttnMask.from_ranges([], [], [], total_q=T, total_k=T),
        holes=mj.AttnMask.from_ranges(
            [[0, 40], [60, 96]], [[0, 50], [10, 96]], ["causal", "full"], total_q=T, total_k=T
        ),
    )
    cap = mj.PlanCapacity(T)
    q, k, v = _inputs(ZOO["causal"])
    for name, mask in masks.items():
        res = _planned(q, k, v, mj.plan_attention(mask, cap, backend="xla"))
        try:
            ml = _check(res, q, k, v, mask, CAP)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        assert np.isneginf(ml).all() if name == "empty" else np.isfinite(ml).all(), name


def test_no_gradient_and_sinks_not_counted():
    """A mask object without softcap (the max is the forward's running row max)."""
    mask = ZOO["shared-question"]
    q, k, v = _inputs(mask)
    sink = jnp.full((2, 4), 50.0)  # far above every logit

    @jax.jit
    def run(q, k, v, sink):
        res, vjp = jax.vjp(lambda *x: _ffa(*x, mask, 0.0), q, k, v)
        zero = lambda x: jnp.zeros_like(x)
        grads = vjp((zero(res[0]), zero(res[1]), jnp.ones_like(res[2])))
        return grads, res, _ffa(q, k, v, mask, 0.0, sink=sink)[2]

    grads, res, ml_sink = run(q, k, v, sink)
    ml = _check(res, q, k, v, mask, 0.0)
    for g in grads:  # a statistic: no gradient
        assert not np.asarray(g).any()
    # Sinks join the softmax but are no key's logit: the max is the sink-free one.
    np.testing.assert_array_equal(ml_sink, ml)
    assert (ml < 50.0).all()


def test_context_parallel_equals_one_device():
    """4 CPU devices, 3 stages per rank, bfloat16, a batch, one key head and a sink:
    per-rank maxima over the stages, then pmax over the ranks; replicated, equal to the
    single-device result, which matches the reference."""
    mask = ZOO["doc-causal"]
    mesh = jax.make_mesh(
        (4,), ("cp",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
    )
    key = mj.make_flex_key(mask, mesh, "cp", ffa_backend="xla", overlap_degree=2)
    assert len(key.stages) == 3
    q, k, v = _inputs(mask, jnp.bfloat16, hkv=1, batch=2, seed=3)
    sink = jnp.ones((1, 4))

    @jax.jit
    def both(q, k, v, sink):
        out, _, ml = mj.magi_attention(
            *(mj.dispatch(x, key, seq_axis=1) for x in (q, k, v)),
            key,
            sink=sink,
            return_max_logits=True,
        )
        return (
            mj.undispatch(out, key, seq_axis=1),
            ml,
            _ffa(q, k, v, mask, 0.0, sink=sink),
            _ffa(q, k, v, mask, 0.0),
        )

    out, ml, one_sink, one = both(q, k, v, sink)
    assert ml.shape == (2, 4) and ml.sharding.is_fully_replicated
    np.testing.assert_allclose(ml, one_sink[2], rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(one_sink[0], np.float32), atol=1.6e-2
    )
    ml1 = _check(one, q, k, v, mask, 0.0)
    assert not np.array_equal(ml1[0], ml1[1])  # each batch row its own
