"""Masks as data in the Flax layers: SelfAttention and the attention_fn adapters (linen and
NNX) take segment ids and AttnPlans (and capacity keys) as arguments of a jitted step, so a
new packing every step compiles once; forward and gradients against a float64 reference.
Segment ids read the same on every entry point (positive: documents, 0 and negative:
padding), and the mistakes are named."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import magi_jax as mj
from magi_jax.nn import SelfAttention, make_attention_fn

F, HQ, HKV, HD = 32, 2, 1, 16
THETA = 10000.0
TOL = dict(rtol=2e-4, atol=2e-5)


def _packing(rng, b, t, pad=(0, -1), pad_prob=0.3):
    """Random packed rows: documents of 1..t/2 tokens with positive ids, some padding runs
    of 0 or -1 between them and at the ends."""
    ids = np.zeros((b, t), np.int32)
    for r in range(b):
        pos, doc = 0, 1
        while pos < t:
            n = int(rng.integers(1, t // 2 + 1))
            pad_run = rng.random() < pad_prob
            ids[r, pos : pos + n] = rng.choice(pad) if pad_run else doc
            doc += 0 if pad_run else 1
            pos += n
    return ids


def _dense_mask(ids, causal, left, right):
    """jax.nn's rule with this library's padding: same positive id, then the window."""
    i, j = np.arange(ids.shape[-1])[:, None], np.arange(ids.shape[-1])[None, :]
    m = (ids[..., :, None] == ids[..., None, :]) & (ids[..., :, None] > 0)
    if causal:
        m &= j <= i
    if left is not None:
        m &= j >= i - left
    if right is not None:
        m &= j <= i + right
    return m


def _rope64(x, theta=THETA):
    d, t = x.shape[-1], x.shape[-3]
    freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float64) * 2.0 / d)
    ang = jnp.arange(t, dtype=jnp.float64)[:, None] * freq
    sin, cos = jnp.sin(ang)[:, None, :], jnp.cos(ang)[:, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _reference_layer(p, x, dense):
    """SelfAttention in float64, written out: projections, RoPE, GQA, the dense boolean mask,
    sinks in the denominator, rows that see no key give 0."""
    b, t = x.shape[:2]
    q = (x @ p["q_proj"]["kernel"]).reshape(b, t, HQ, HD)
    k = (x @ p["k_proj"]["kernel"]).reshape(b, t, HKV, HD)
    v = (x @ p["v_proj"]["kernel"]).reshape(b, t, HKV, HD)
    q, k = _rope64(q), _rope64(k)
    k, v = jnp.repeat(k, HQ // HKV, axis=2), jnp.repeat(v, HQ // HKV, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * HD**-0.5
    m = jnp.asarray(dense)[:, None]
    s = jnp.where(m, s, -jnp.inf)
    sink = p.get("sink")
    top = jnp.max(s, axis=-1, keepdims=True)
    if sink is not None:
        top = jnp.maximum(top, jnp.max(sink, axis=0)[None, :, None, None])
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(m, jnp.exp(s - top), 0.0)
    denom = e.sum(-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink.T[None, :, None, :] - top).sum(-1, keepdims=True)
    w = e / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, HQ * HD)
    return out @ p["o_proj"]["kernel"]


@jax.jit
def _reference_step(p, x, dense, w):
    loss = lambda p, x: (_reference_layer(p, x, dense) * w).sum()
    return _reference_layer(p, x, dense), jax.grad(loss, (0, 1))(p, x)


def _reference(state, x, dense, w):
    """Forward and gradients (params, x) of the float64 reference (one compiled program per
    shape: eagerly it would compile op by op)."""
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
        y, g = _reference_step(jax.tree.map(f64, state), f64(x), jnp.asarray(dense), f64(w))
        return np.asarray(y), jax.tree.map(np.asarray, g)


def _close(ours, ref, what):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ours)[0], jax.tree.leaves(ref)):
        np.testing.assert_allclose(
            np.asarray(a), b, **TOL, err_msg=f"{what} {jax.tree_util.keystr(path)}"
        )


def _layer(num_sinks=1):
    layer = SelfAttention(
        F,
        HQ,
        num_kv_heads=HKV,
        head_dim=HD,
        num_sinks=num_sinks,
        sink_init=nnx.initializers.normal(1.0),
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(layer)
    return graphdef, state


def _pure(state):
    return nnx.to_pure_dict(state)


def test_self_attention_segment_ids_ten_packings_one_compilation():
    b, t = 2, 40
    graphdef, state = _layer(num_sinks=1)
    traces = []

    @jax.jit
    def step(state, x, ids, w):
        traces.append(1)

        def loss(state, x):
            y = nnx.merge(graphdef, state)(x, segment_ids=ids)
            return (y * w).sum(), y

        (_, y), g = jax.value_and_grad(loss, (0, 1), has_aux=True)(state, x)
        return y, g

    rng = np.random.default_rng(0)
    for i in range(10):
        ids = _packing(rng, b, t)
        x = rng.standard_normal((b, t, F), np.float32)
        w = rng.standard_normal((b, t, F), np.float32)
        y, (gs, gx) = step(state, x, ids, w)
        ry, (rgs, rgx) = _reference(_pure(state), x, _dense_mask(ids, True, None, 0), w)
        np.testing.assert_allclose(np.asarray(y), ry, **TOL, err_msg=f"packing {i}")
        np.testing.assert_allclose(np.asarray(gx), rgx, **TOL, err_msg=f"packing {i} dx")
        _close(_pure(gs), rgs, f"packing {i} dparams")
        assert np.all(np.asarray(y)[ids <= 0] == 0)  # padding rows: 0 (o_proj has no bias)
    assert len(traces) == 1 and step._cache_size() == 1


def test_self_attention_plan_ten_packings_one_compilation():
    t = 48
    graphdef, state = _layer(num_sinks=0)
    capacity = mj.PlanCapacity(t)
    traces = []

    @jax.jit
    def step(state, x, plan, w):
        traces.append(1)

        def loss(state, x):
            y = nnx.merge(graphdef, state)(x, plan)
            return (y * w).sum(), y

        (_, y), g = jax.value_and_grad(loss, (0, 1), has_aux=True)(state, x)
        return y, g

    rng = np.random.default_rng(1)
    for i in range(10):
        ids = _packing(rng, 1, t)
        # Sliding windows inside the documents: the plan carries any mask of the capacity.
        window = (int(rng.integers(2, 9)), 0)
        plan = mj.plan_attention(
            mj.AttnMask.from_segment_ids(ids[0], causal=True, window=window), capacity
        )
        x = rng.standard_normal((1, t, F), np.float32)
        w = rng.standard_normal((1, t, F), np.float32)
        y, (gs, gx) = step(state, x, plan, w)
        dense = _dense_mask(ids, True, window[0], 0)
        ry, (rgs, rgx) = _reference(_pure(state), x, dense, w)
        np.testing.assert_allclose(np.asarray(y), ry, **TOL, err_msg=f"packing {i}")
        np.testing.assert_allclose(np.asarray(gx), rgx, **TOL, err_msg=f"packing {i} dx")
        _close(_pure(gs), rgs, f"packing {i} dparams")
    assert len(traces) == 1 and step._cache_size() == 1


def test_self_attention_segment_ids_window_bidirectional():
    """Windows and non-causal documents from segment ids, traced ids broadcast from [T]."""
    t = 32
    graphdef, state = _layer(num_sinks=2)
    rng = np.random.default_rng(2)
    ids = _packing(rng, 1, t)[0]
    x = rng.standard_normal((3, t, F), np.float32)
    w = rng.standard_normal((3, t, F), np.float32)

    run = jax.jit(
        lambda state, x, ids: nnx.merge(graphdef, state)(
            x, segment_ids=ids, causal=False, window=(3, 5)
        )
    )
    dense = np.broadcast_to(_dense_mask(ids, False, 3, 5), (3, t, t))
    ry, _ = _reference(_pure(state), x, dense, w)
    np.testing.assert_allclose(np.asarray(run(state, x, ids)), ry, **TOL)


def test_stock_flax_layers_take_the_mask_per_call():
    """``make_attention_fn()`` with no mask: linen's and NNX's own multi-head layers take
    segment ids or a plan through ``mask=``, one compilation over packings."""
    t, b = 32, 2
    rng = np.random.default_rng(3)
    packings = [_packing(rng, b, t, pad_prob=0) for _ in range(3)]  # no padding: flax agrees
    x = rng.standard_normal((b, t, F), np.float32)

    ours = nn.MultiHeadDotProductAttention(num_heads=HQ, attention_fn=make_attention_fn())
    dense = nn.MultiHeadDotProductAttention(num_heads=HQ)
    params = ours.init(jax.random.key(0), x, mask=packings[0])
    traces = []

    @jax.jit
    def run(params, x, ids):
        traces.append(1)
        return jax.value_and_grad(lambda p: (ours.apply(p, x, mask=ids) ** 2).sum())(params)

    @jax.jit
    def run_dense(params, x, m):
        return jax.value_and_grad(lambda p: (dense.apply(p, x, mask=m) ** 2).sum())(params)

    for ids in packings:
        m = jnp.asarray(_dense_mask(ids, True, None, 0))[:, None]
        (lo, go), (ld, gd) = run(params, x, ids), run_dense(params, x, m)
        np.testing.assert_allclose(lo, ld, rtol=2e-5)
        for a, b_ in zip(jax.tree.leaves(go), jax.tree.leaves(gd)):
            np.testing.assert_allclose(a, b_, rtol=2e-4, atol=2e-5)
    assert len(traces) == 1

    # NNX's MultiHeadAttention with an AttnPlan per call.
    kw = dict(num_heads=HQ, in_features=F, decode=False, rngs=nnx.Rngs(0))
    mha = nnx.MultiHeadAttention(**kw, attention_fn=make_attention_fn())
    ref = nnx.MultiHeadAttention(**kw)
    graphdef, state = nnx.split(mha)
    capacity = mj.PlanCapacity(t)
    traces.clear()

    @jax.jit
    def nnx_run(state, x, plan):
        traces.append(1)
        return nnx.merge(graphdef, state)(x, mask=plan)

    ref_run = jax.jit(lambda state, x, m: nnx.merge(nnx.graphdef(ref), state)(x, mask=m))
    for ids in packings:
        mask = mj.AttnMask.from_segment_ids(ids[0], causal=True)
        y = nnx_run(state, x[:1], mj.plan_attention(mask, capacity))
        want = ref_run(state, x[:1], jnp.asarray(mask.to_dense())[None, None])
        np.testing.assert_allclose(y, want, rtol=2e-4, atol=2e-5)
    assert len(traces) == 1


def test_capacity_key_on_one_device():
    """A MagiKey at a PlanCapacity on a one-device mesh is data too: new packings, one
    compilation (the tokens dispatched, as under context parallelism)."""
    t = 48
    graphdef, state = _layer(num_sinks=0)
    mesh = jax.make_mesh((1,), ("cp",), devices=jax.devices()[:1])
    capacity = mj.PlanCapacity(t)
    traces = []

    @jax.jit
    def run(state, x, key):
        traces.append(1)
        y = nnx.merge(graphdef, state)(mj.dispatch(x, key, seq_axis=1), key)
        return mj.undispatch(y, key, seq_axis=1)

    rng = np.random.default_rng(4)
    for i in range(3):
        ids = _packing(rng, 1, t)
        key = mj.make_flex_key(
            mj.AttnMask.from_segment_ids(ids[0], causal=True), mesh, capacity=capacity
        )
        x = rng.standard_normal((1, t, F), np.float32)
        ry, _ = _reference(_pure(state), x, _dense_mask(ids, True, None, 0), np.ones_like(x))
        np.testing.assert_allclose(np.asarray(run(state, x, key)), ry, **TOL, err_msg=str(i))
    assert len(traces) == 1


def test_masks_as_data_errors_name_the_mistake():
    layer = SelfAttention(F, HQ, num_kv_heads=HKV, head_dim=HD, rngs=nnx.Rngs(0))
    x = np.zeros((2, 16, F), np.float32)
    ids = np.ones((2, 16), np.int32)
    mask = mj.AttnMask.causal(16)
    with pytest.raises(ValueError, match=r"SelfAttention needs its mask as one of .*got neither"):
        layer(x)
    with pytest.raises(ValueError, match=r"segment_ids=; got both"):
        layer(x, mask, segment_ids=ids)
    with pytest.raises(TypeError, match=r"integer per-token ids go in segment_ids="):
        layer(x, ids)
    with pytest.raises(
        ValueError, match=r"SelfAttention: segment_ids must be \[\.\.\., T\] = \(2, 16\)"
    ):
        layer(x, segment_ids=np.ones((2, 15), np.int32))
    with pytest.raises(ValueError, match=r"segment_ids must be integers \(positive: documents"):
        layer(x, segment_ids=ids.astype(np.float32))
    with pytest.raises(ValueError, match=r"window right extent 2 contradicts causal=True"):
        layer(x, segment_ids=ids, window=(4, 2))
    with pytest.raises(ValueError, match=r"the plan's capacity has total_q=32 tokens"):
        layer(x, mj.plan_attention(mj.AttnMask.causal(32)))
    q = np.zeros((2, 16, HQ, HD), np.float32)
    with pytest.raises(ValueError, match=r"local=True needs a MagiKey.*got segment_ids"):
        make_attention_fn(segment_ids=ids, local=True)
    with pytest.raises(ValueError, match=r"got both mask_or_key \(AttnMask\) and segment_ids="):
        make_attention_fn(mask, segment_ids=ids)
    per_call = make_attention_fn()
    with pytest.raises(ValueError, match=r"no mask; this attention_fn .* takes it per call"):
        per_call(q, q, q)
    with pytest.raises(ValueError, match=r"a dense boolean mask needs the \[T, S\] scores"):
        per_call(q, q, q, mask=np.ones((2, 1, 16, 16), bool))
    with pytest.raises(ValueError, match=r"got mask= \(ndarray\); the mask comes from the"):
        make_attention_fn(segment_ids=ids)(q, q, q, mask=ids)
    with pytest.raises(ValueError, match="bias="):
        per_call(q, q, q, bias=np.zeros((2, 1, 16, 16), np.float32))
    # is_causal from the layer makes segment-id documents causal (and is refused for masks).
    both = make_attention_fn(segment_ids=ids, causal=False)
    qs = np.random.default_rng(0).standard_normal((2, 16, HQ, HD), np.float32)
    np.testing.assert_allclose(
        both(qs, qs, qs, is_causal=True),
        make_attention_fn(segment_ids=ids, causal=True)(qs, qs, qs),
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="is_causal=True; the mask comes from"):
        make_attention_fn(mask)(q, q, q, is_causal=True)
