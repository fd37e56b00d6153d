"""The overlap probe's pieces recompose magi_attention exactly (4 CPU host devices)."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.probe import measure_overlap, nocomm_attention, overlap_probe, time_ms
from magi_jax.ffa.testing import random_inputs
from magi_jax.sharding import dispatch, magi_attention, make_flex_key
from tests.zoo import ZOO


def test_comm_then_compute_equals_both():
    mask = ZOO["shared-question"]
    mesh = jax.make_mesh(
        (4,), ("cp",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
    )
    key = make_flex_key(mask, mesh, "cp", overlap_degree=2, chunk_size=3)
    q, k, v, _, _ = random_inputs(jax.random.key(0), mask, 2, 1, 8, jnp.float32)
    q, k, v = (dispatch(x, key) for x in (q, k, v))
    fns = overlap_probe(key, q, k, v)
    bufs = fns["comm"](k, v)
    assert len(bufs) == 2
    for a, b in zip(fns["compute"](q, k, v, bufs), fns["both"](q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert time_ms(fns["both"], q, k, v, warmup=1, iters=2) > 0
    m = measure_overlap(key, q, k, v, iters=2)
    assert m["both_ms"] > 0 and m["comm_ms"] > 0 and m["tflops_per_device"] > 0
    assert m["max_rank_area"] == key.plan.meta.rank_area().max()


def test_nocomm_probe_is_magi_without_remote_kv():
    """With each document inside one rank's tokens there is nothing to fetch: the probe is
    then magi_attention itself, forward and backward; with remote KV (two stages) it still
    runs both and stays finite."""
    from magi_jax.mask import AttnMask

    mesh = jax.make_mesh(
        (2,), ("cp",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,)
    )

    def value_and_grads(fn, key, q, k, v):
        def loss(q, k, v):
            out, lse = fn(q, k, v, key)
            return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return jax.tree.leaves(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v))

    cases = (
        (AttnMask.varlen([0, 16, 32], causal=True), 0, True),
        (ZOO["shared-question"], 1, False),
    )
    for mask, degree, local_only in cases:
        key = make_flex_key(
            mask, mesh, "cp", overlap_degree=degree, chunk_size=4, dispatch_algorithm="contiguous"
        )
        assert (int(key.plan.remote_tokens.max()) == 0) == local_only
        q, k, v, _, _ = random_inputs(jax.random.key(1), mask, 2, 1, 8, jnp.float32)
        q, k, v = (dispatch(x, key) for x in (q, k, v))
        got = value_and_grads(nocomm_attention, key, q, k, v)
        assert all(np.isfinite(np.asarray(x)).all() for x in got)
        if local_only:
            for a, b in zip(got, value_and_grads(magi_attention, key, q, k, v)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
