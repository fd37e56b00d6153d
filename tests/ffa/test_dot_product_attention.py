"""``mj.dot_product_attention`` against ``jax.nn.dot_product_attention(implementation="xla")``
on the cases of JAX's own ``dot_product_attention`` tests (their parameterisations: dtypes,
GQA groups, vmap over the batch, the mask modes causal / padding / custom / sliding window
and their combinations; our own test code), then the arguments beyond them: 3-D inputs,
traced sequence lengths, cross lengths, masks of every broadcastable shape, the residual,
``implementation`` and the errors of what is not supported.

Rows that see no key differ by definition (``jax.nn`` averages the values there, ours are 0),
so outputs are compared on the rows that see a key and gradients with a cotangent that is
zero elsewhere.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.dense_mask import dense_rectangles
from tests.xla_options import OPTIMIZED

B, S, T, N, H = 2, 128, 128, 4, 32  # jax's test sizes
_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 1e-2}


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _host_inputs(seed, b, t, s, n, kh, h, dtype, hv=None):
    """Unit-normal q, k, v and a cotangent g as NumPy arrays in ``dtype``, drawn on the host
    (a jax.random draw compiles a program per shape and dtype)."""
    rng = np.random.default_rng(seed)
    shapes = [(b, t, n, h), (b, s, kh, h), (b, s, kh, hv or h), (b, t, n, hv or h)]
    return [rng.standard_normal(shape, np.float32).astype(dtype) for shape in shapes]


def _inputs(seed, b, t, s, n, kh, h, dtype, hv=None):
    # device_put, not jnp.asarray: the latter compiles a copy program per shape and dtype.
    return tuple(jax.device_put(x) for x in _host_inputs(seed, b, t, s, n, kh, h, dtype, hv))


def _cells(b, t, s, mask=None, is_causal=False, window=None, q_len=None, kv_len=None):
    """The cells that take part, bool [B, T, S], as jax.nn combines its arguments."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    cells = np.ones((b, t, s), bool)
    if mask is not None:
        m = np.asarray(mask)
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        cells &= np.broadcast_to(m, (b, m.shape[1], t, s))[:, 0]
    if is_causal:
        cells &= j <= i
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        cells &= (i - left <= j) & (j <= i + right)
    if q_len is not None:
        cells &= np.arange(t)[None, :, None] < np.asarray(q_len)[:, None, None]
    if kv_len is not None:
        cells &= np.arange(s)[None, None, :] < np.asarray(kv_len)[:, None, None]
    return cells


def _compare(ours, ref, q, k, v, g, cells, dtype, residual=False, optimized=False):
    """Forward on the rows that see a key, and the VJP of a cotangent zero elsewhere;
    ``optimized``: both compiled at the default optimisation level (tests/xla_options.py)."""
    seen = cells.any(-1)[..., None, None]  # [B, T, 1, 1]
    g_host = np.asarray(g)
    gz = jax.device_put(np.where(seen, g_host, np.zeros((), g_host.dtype)))

    def run(f):  # one compiled program (eager VJPs compile op by op)
        def fwd_bwd(q, k, v, gz):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(gz)

        return jax.jit(fwd_bwd, compiler_options=OPTIMIZED if optimized else None)(q, k, v, gz)

    if dtype == jnp.float16:
        # jax.nn's float16 path asks for F16_F16_F32 dots, which XLA:CPU refuses under jit
        # (its fallback works only eagerly): the reference runs in float32 instead.
        up = lambda f: lambda *x: f(*(a.astype(jnp.float32) for a in x)).astype(dtype)
        ref = up(ref)
    (o, grads_o), (r, grads_r) = run(ours), run(ref)
    tol = _TOL[dtype]
    o, r = np.asarray(o, np.float32), np.asarray(r, np.float32)
    np.testing.assert_allclose(np.where(seen, o, 0), np.where(seen, r, 0), atol=tol, rtol=tol)
    # Rows that see no key are exactly 0 here.
    assert not np.where(seen, 0, o).any()
    for a, want in zip(grads_o, grads_r):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(want, np.float32), atol=2 * tol, rtol=2 * tol
        )


# ---- jax's testDotProductAttention: dtypes x GQA groups x vmap --------------------------------


@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("group_num", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_gqa_and_vmap(dtype, group_num, use_vmap):
    q, k, v, g = _inputs(0, B, T, S, N, N // group_num, H, dtype)
    ours = functools.partial(mj.dot_product_attention, implementation="xla")
    ref = functools.partial(jax.nn.dot_product_attention, implementation="xla")
    if use_vmap:  # jax's test: vmap over the batch, so each call sees [T, N, H]
        ours = jax.vmap(ours, in_axes=(0, 0, 0))
        ref = jax.vmap(ref, in_axes=(0, 0, 0))
    _compare(ours, ref, q, k, v, g, _cells(B, T, S), dtype)


# ---- jax's testDotProductAttentionMask: mask modes -----------------------------------------

_MODES = [
    "causal",
    "padding",
    "custom",
    ("causal", "padding"),
    ("custom", "padding"),
    ("causal", "sliding_window"),
]


def _mode_args(mode):
    mode = (mode,) if isinstance(mode, str) else mode
    kw = dict(is_causal="causal" in mode)
    if "padding" in mode:
        kw["query_seq_lengths"] = jnp.array([T // 2, T // 4], jnp.int32)
        kw["key_value_seq_lengths"] = jnp.array([S // 4, S // 2], jnp.int32)
    if "custom" in mode:
        kw["mask"] = np.tril(np.ones((T, S), bool))[None, None]
    if "sliding_window" in mode:
        kw["local_window_size"] = (3, 2) if kw["is_causal"] else (3, 0)
    return kw


@pytest.mark.parametrize("mode", _MODES, ids=str)
def test_mask_modes(mode):
    dtype = jnp.bfloat16  # jax's test dtype
    q, k, v, g = _inputs(1, B, T, S, N, N, H, dtype)
    kw = _mode_args(mode)
    cells = _cells(
        B,
        T,
        S,
        kw.get("mask"),
        kw["is_causal"],
        kw.get("local_window_size"),
        kw.get("query_seq_lengths"),
        kw.get("key_value_seq_lengths"),
    )
    ours = lambda q, k, v: mj.dot_product_attention(q, k, v, implementation="xla", **kw)
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
    _compare(ours, ref, q, k, v, g, cells, dtype)


def test_bias_modes_are_rejected():
    """jax's 'bias' and ('bias', 'causal') modes: additive biases are not supported."""
    q, k, v, _ = _inputs(2, B, T, S, N, N, H, jnp.bfloat16)
    bias = jax.device_put(
        np.random.default_rng(3).standard_normal((1, N, T, S), np.float32).astype(jnp.bfloat16)
    )
    for causal in (False, True):
        with pytest.raises(NotImplementedError, match="bias: an additive bias"):
            mj.dot_product_attention(q, k, v, bias, is_causal=causal)


# ---- beyond jax's cases ----------------------------------------------------------------------


@pytest.mark.parametrize("is_causal,window", [(False, None), (True, None), (False, (4, 2))])
def test_traced_lengths_compile_once_and_cross_lengths(is_causal, window):
    """Lengths as traced arguments (one compilation over values, zeros and over-long ones
    included), with T != S; float32 against jax.nn, residual included."""
    b, t, s = 3, 24, 40
    q, k, v, g = _inputs(4, b, t, s, 4, 2, 16, jnp.float32)
    kw = dict(is_causal=is_causal, local_window_size=window, implementation="xla")
    ours = jax.jit(
        lambda q, k, v, ql, kl: mj.dot_product_attention(
            q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, return_residual=True, **kw
        )
    )
    values = [([24, 5, 0], [40, 13, 7]), ([30, 24, 1], [0, 3, 99]), ([7, 7, 7], [9, 9, 9])]
    for i, (ql, kl) in enumerate(values):
        ql, kl = (jax.device_put(np.asarray(x, np.int32)) for x in (ql, kl))
        cells = _cells(b, t, s, None, is_causal, window, ql, kl)
        out, lse = ours(q, k, v, ql, kl)
        ref, ref_lse = jax.nn.dot_product_attention(
            q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, return_residual=True, **kw
        )
        seen = cells.any(-1)
        np.testing.assert_allclose(
            np.where(seen[..., None, None], out, 0),
            np.where(seen[..., None, None], ref, 0),
            atol=2e-5,
            rtol=2e-5,
        )
        np.testing.assert_allclose(
            np.where(seen[..., None], lse, 0), np.where(seen[..., None], ref_lse, 0), rtol=1e-5
        )
        assert np.isneginf(np.asarray(lse)[~seen]).all()
        if i != 1:
            continue
        # Gradients once (eager VJPs compile op by op).
        step = lambda q, k, v: ours(q, k, v, ql, kl)[0]
        _compare(
            step,
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, **kw
            ),
            q,
            k,
            v,
            g,
            cells,
            jnp.float32,
        )
    assert ours._cache_size() == 1


_DIMS = ["S", "1S", "TS", "11TS", "B1TS", "BNTS", "111S", "B11S"]


@pytest.mark.parametrize("dims", _DIMS + ["1T1"])
def test_concrete_masks_of_every_broadcastable_shape(dims):
    """Random boolean masks of each shape jax.nn broadcasts to [B, N, T, S] (the same for
    every head), with causal, a window and concrete lengths folded in."""
    b, t, s = B, 48, 40
    size = dict(B=b, N=N, T=t, S=s, **{"1": 1})
    rng = np.random.default_rng(len(dims))
    shape = tuple(size[d] for d in dims)
    mask = rng.random(tuple(1 if d == "N" else n for d, n in zip(dims, shape))) < 0.6
    mask = np.broadcast_to(mask, shape)  # a head axis repeats one mask
    q, k, v, g = _inputs(5, b, t, s, N, 2, 16, jnp.float32)
    options = [
        dict(),
        dict(is_causal=True),
        dict(local_window_size=(5, 3), query_seq_lengths=np.array([40, 9], np.int32)),
        dict(key_value_seq_lengths=np.array([17, 40], np.int32), is_causal=True),
    ]
    first = (_DIMS + ["1T1"]).index(dims) % len(options)
    for kw in (options[first], options[(first + 1) % len(options)]):  # each option 4 times
        cells = _cells(
            b,
            t,
            s,
            mask,
            kw.get("is_causal", False),
            kw.get("local_window_size"),
            kw.get("query_seq_lengths"),
            kw.get("key_value_seq_lengths"),
        )
        ours = lambda q, k, v: mj.dot_product_attention(q, k, v, mask=mask, **kw)
        ref = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=jnp.asarray(mask), implementation="xla", **kw
        )
        # A random mask over queries and keys is thousands of slices: its programs run long
        # enough at -O0 to be worth optimising.
        _compare(ours, ref, q, k, v, g, cells, jnp.float32, optimized="T" in dims and "S" in dims)


def test_segment_ids_with_lengths():
    """Documents of segment ids cut at each row's query / key lengths (traced), against
    jax.nn with the same cells as a mask."""
    b, t = 2, 40
    q, k, v, g = _inputs(10, b, t, t, 2, 1, 16, jnp.float32)
    ids = np.repeat(np.array([[1, 2, 3, 0], [5, 5, 6, 7]], np.int32), 10, axis=1)
    ql, kl = np.array([35, 22], np.int32), np.array([25, 40], np.int32)
    same = (ids[:, :, None] == ids[:, None, :]) & (ids != 0)[:, :, None]
    cells = same & _cells(b, t, t, None, True, None, ql, kl)
    ours = jax.jit(
        lambda q, k, v, ids, ql, kl: mj.dot_product_attention(
            q,
            k,
            v,
            segment_ids=ids,
            is_causal=True,
            query_seq_lengths=ql,
            key_value_seq_lengths=kl,
        )
    )
    ref = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=jnp.asarray(cells)[:, None], implementation="xla"
    )
    _compare(lambda q, k, v: ours(q, k, v, ids, ql, kl), ref, q, k, v, g, cells, jnp.float32)


def test_three_d_inputs_and_residual():
    t, s = 33, 50
    q, k, v, g = (jax.device_put(x[0]) for x in _host_inputs(6, 1, t, s, 4, 1, 16, jnp.float32))
    for kw in [dict(), dict(is_causal=True), dict(local_window_size=3, scale=0.2)]:
        out, lse = mj.dot_product_attention(q, k, v, return_residual=True, **kw)
        ref, ref_lse = jax.jit(  # one program, not one per op
            functools.partial(
                jax.nn.dot_product_attention, return_residual=True, implementation="xla", **kw
            )
        )(q, k, v)
        assert out.shape == q.shape and lse.shape == q.shape[:2] and lse.dtype == k.dtype
        np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=2e-5)
    # jax.nn's residual carries no gradient; neither does ours.
    grad = jax.grad(lambda q: mj.dot_product_attention(q, k, v, return_residual=True)[1].sum())
    assert not np.asarray(grad(q)).any()
    cells = _cells(1, t, s, is_causal=True)[0]
    _compare(
        lambda q, k, v: mj.dot_product_attention(q, k, v, is_causal=True),
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
        q,
        k,
        v,
        g,
        cells,
        jnp.float32,
    )


def test_residual_in_bfloat16_is_in_the_key_dtype():
    q, k, v, _ = _inputs(7, B, 32, 32, 2, 2, 16, jnp.bfloat16)
    out, lse = mj.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    ref, ref_lse = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, return_residual=True, implementation="xla"
    )
    assert lse.dtype == jnp.bfloat16 and lse.shape == (B, 32, 2)
    np.testing.assert_allclose(
        np.asarray(lse, np.float32), np.asarray(ref_lse, np.float32), rtol=1e-2
    )


def test_implementation_maps_to_backends():
    q, k, v, _ = _inputs(8, 1, 16, 16, 2, 2, 16, jnp.float32)
    a = mj.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    b = mj.dot_product_attention(q, k, v, is_causal=True, backend="xla")
    c = mj.dot_product_attention(q, k, v, is_causal=True, implementation=None)
    np.testing.assert_array_equal(a, b)
    if jax.devices()[0].platform != "gpu":
        np.testing.assert_array_equal(a, c)  # auto is xla off sm90 GPUs
        with pytest.raises(NotImplementedError, match="backend='pallas'"):
            mj.dot_product_attention(q, k, v, implementation="cudnn")
    with pytest.raises(ValueError, match="implementation='xla' means backend='xla'"):
        mj.dot_product_attention(q, k, v, implementation="xla", backend="pallas")
    with pytest.raises(ValueError, match="implementation='flash'"):
        mj.dot_product_attention(q, k, v, implementation="flash")


def test_unsupported_arguments_name_the_alternatives():
    q, k, v, _ = _inputs(9, B, 16, 16, 2, 2, 16, jnp.float32)
    mask = np.tril(np.ones((16, 16), bool))
    with pytest.raises(NotImplementedError, match="traced boolean mask.*segment_ids="):
        jax.jit(lambda m: mj.dot_product_attention(q, k, v, mask=m))(mask)
    per_head = np.stack([mask, ~mask])[None]
    with pytest.raises(NotImplementedError, match="differs between heads"):
        mj.dot_product_attention(q, k, v, mask=per_head)
    with pytest.raises(NotImplementedError, match="traced query_seq_lengths"):
        jax.jit(lambda ql: mj.dot_product_attention(q, k, v, mask=mask, query_seq_lengths=ql))(
            jnp.array([3, 4], jnp.int32)
        )
    with pytest.raises(NotImplementedError, match="mask and segment_ids"):
        mj.dot_product_attention(q, k, v, mask=mask, segment_ids=np.ones((B, 16), np.int32))
    with pytest.raises(ValueError, match="mask must be boolean"):
        mj.dot_product_attention(q, k, v, mask=mask.astype(np.float32))
    with pytest.raises(ValueError, match="does not broadcast"):
        mj.dot_product_attention(q, k, v, mask=np.ones((3, 16, 16), bool))
    with pytest.raises(ValueError, match="query_seq_lengths must be an int32 \\[B\\]"):
        mj.dot_product_attention(q, k, v, query_seq_lengths=np.array([1, 2, 3], np.int32))


def test_dense_rectangles_cover_the_mask_exactly():
    rng = np.random.default_rng(0)
    for density in (0.0, 0.3, 0.9, 1.0):
        dense = rng.random((23, 31)) < density
        dense[5:9, 4:20] = density > 0  # a block that merges over rows
        rects = dense_rectangles(dense)
        cover = np.zeros(dense.shape, np.int32)
        for q0, q1, k0, k1 in rects:
            cover[q0:q1, k0:k1] += 1
        np.testing.assert_array_equal(cover, dense.astype(np.int32))  # exact and disjoint
    block = np.zeros((64, 64), bool)
    block[8:40, 16:48] = True
    assert dense_rectangles(block).tolist() == [[8, 40, 16, 48]]


def test_vmap_over_rows_with_segment_ids():
    """jax's vmap pattern with our segment ids: [T, N, H] and [T] ids per call, mapped over
    the batch, equal to the batched call."""
    b, t = 2, 24
    q, k, v, _ = _inputs(11, b, t, t, 2, 2, 16, jnp.float32)
    ids = np.repeat(np.array([[1, 2, 3, 0], [4, 4, 5, 6]], np.int32), 6, axis=1)
    call = lambda q, k, v, i: mj.dot_product_attention(q, k, v, segment_ids=i, is_causal=True)
    mapped = jax.jit(jax.vmap(call))(q, k, v, jax.device_put(ids))
    np.testing.assert_allclose(mapped, call(q, k, v, ids), atol=1e-6)
