"""The overlap probe's pieces recompose magi_attention exactly (4 CPU host devices)."""

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.sharding import dispatch, make_flex_key
from magi_jax.sharding.probe import measure_overlap, overlap_probe, time_ms
from magi_jax.testing import random_inputs
from tests.sharding.masks import ZOO


def test_comm_then_compute_equals_both():
    mask = ZOO["shared_question"]
    mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,))
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
