"""One rule for segment ids on every entry point: positive ids are documents, 0 and negative
ids are padding (pipelines pad with 0 or -1). The host mask, the device-built lists,
dot_product_attention (concrete and traced ids) and the Flax layer agree; ids the plan
cannot represent raise where they can be seen, and give NaN (never a finite wrong answer)
where they cannot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from magi_jax.ffa import dpa
from magi_jax.ffa import segments as seg
from magi_jax.masks import AttnMask
from magi_jax.nn import SelfAttention
from magi_jax.planning.work_list import build_work_list

IDS = np.array([[-1, -1, 3, 3, 3, 0, 7, 7, -2, 5], [1, 1, 1, 1, -1, -1, 2, 2, 2, 0]], np.int32)
ZEROED = np.where(IDS > 0, IDS, 0)


def _qkv(b=2, t=10, h=2, d=8, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, t, h, d), np.float32) for _ in range(3))


def test_host_mask_reads_negative_ids_as_padding():
    for causal in (True, False):
        neg = AttnMask.from_segment_ids(IDS, causal=causal)
        zero = AttnMask.from_segment_ids(ZEROED, causal=causal)
        assert neg == zero
        dense = neg.to_dense()
        pad = (IDS <= 0).reshape(-1)
        assert not dense[pad].any() and not dense[:, pad].any()
    # A positive id in two runs is still an error; two runs of -1 are two padding runs.
    with pytest.raises(ValueError, match="segment id 4 appears in two separate runs"):
        AttnMask.from_segment_ids([4, 4, -1, 4])
    assert AttnMask.from_segment_ids([-1, 2, -1]).area == 1


def test_device_lists_equal_the_hosts_with_negative_ids():
    host = AttnMask.from_segment_ids(IDS, causal=True)
    t = host.total_q
    for by in ("q", "k"):
        order, offsets, items, needed = (
            np.asarray(a)
            for a in jax.jit(
                lambda ids, by=by: seg.segment_work_lists(
                    ids, causal=True, block_q=4, block_k=4, by=by, capacity_items=64
                )
            )(IDS)
        )
        want = build_work_list(host.shapes, t, t, 4, 4, by)
        n = int(needed)
        assert n == len(want.items)
        np.testing.assert_array_equal(items[:n], want.items)
        np.testing.assert_array_equal(offsets, want.offsets)
        np.testing.assert_array_equal(order, want.order)
    bad = seg.noncontiguous_ids(jnp.asarray([[-1, 2, -1, -1, 2]]))
    assert bool(bad[0]) and int(bad[1]) == 2
    assert not bool(seg.noncontiguous_ids(jnp.asarray([[-1, 2, 2, 0, -1]]))[0])


def test_dot_product_attention_and_the_layer_read_negative_ids_as_padding():
    q, k, v = _qkv()
    traced = jax.jit(lambda q, k, v, ids: dpa.dot_product_attention(q, k, v, segment_ids=ids))
    want = np.asarray(traced(q, k, v, ZEROED))
    for out in (
        traced(q, k, v, IDS),
        # Concrete ids closed over by a jit: checked on the host, then one compiled program.
        jax.jit(
            lambda q, k, v: dpa.dot_product_attention(
                q, k, v, segment_ids=IDS, check_segment_ids=True
            )
        )(q, k, v),
    ):
        np.testing.assert_array_equal(np.asarray(out), want)
    assert np.all(want[IDS <= 0] == 0)
    layer = SelfAttention(16, 2, rngs=nnx.Rngs(0))
    x = np.random.default_rng(1).standard_normal((2, 10, 16), np.float32)
    run = jax.jit(lambda x, ids: layer(x, segment_ids=ids, check_segment_ids=False))
    np.testing.assert_array_equal(np.asarray(run(x, IDS)), np.asarray(run(x, ZEROED)))


def test_bad_ids_raise_where_seen_and_give_nan_where_not():
    q, k, v = _qkv()
    split = IDS.copy()
    split[0, 9] = 3  # id 3 again after other runs
    with pytest.raises(ValueError, match=r"segment id 3 appears in two separate runs of row 0"):
        dpa.dot_product_attention(q, k, v, segment_ids=split, check_segment_ids=True)
    layer = SelfAttention(16, 2, rngs=nnx.Rngs(0))
    x = np.random.default_rng(1).standard_normal((2, 10, 16), np.float32)
    with pytest.raises(ValueError, match=r"segment id 3 appears in two separate runs of row 0"):
        layer(x, segment_ids=split, check_segment_ids=True)
    # Traced: the whole output NaN, in dot_product_attention and in the layer.
    out = jax.jit(lambda q, k, v, ids: dpa.dot_product_attention(q, k, v, segment_ids=ids))(
        q, k, v, split
    )
    assert np.isnan(np.asarray(out)).all()
    y = jax.jit(lambda x, ids: layer(x, segment_ids=ids))(x, split)
    assert np.isnan(np.asarray(y)).all()
    # Traced with the check on but no checkify: JAX refuses when it compiles, naming checkify.
    with pytest.raises(ValueError, match=r"functionalizing it through `checkify.checkify`"):
        jax.jit(lambda x, ids: layer(x, segment_ids=ids, check_segment_ids=True))(x, IDS)
    # With checkify, the layer's traced ids raise the message of the concrete ones.
    from jax.experimental import checkify

    err, _ = jax.jit(
        checkify.checkify(lambda x, ids: layer(x, segment_ids=ids, check_segment_ids=True))
    )(x, split)
    with pytest.raises(ValueError, match=r"segment id 3 appears in two separate runs of row 0"):
        err.throw()
    with pytest.raises(ValueError, match=r"segment_ids must be integers \(positive: documents"):
        dpa.dot_product_attention(q, k, v, segment_ids=IDS.astype(np.float32))
