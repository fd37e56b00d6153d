"""Masks from segment ids: the host mask (AttnMask.from_segment_ids), the device-built work
lists (equal to the host's, array for array) and dot_product_attention (jax.nn's interface)
against jax.nn.dot_product_attention with the same mask as a boolean array."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.ffa import dpa
from magi_jax.ffa import segments as seg
from magi_jax.mask import AttnMask, AttnMaskType
from magi_jax.planning.tiling import EMPTY_ITEM
from magi_jax.planning.work_list import build_work_list

# ---- host mask ----------------------------------------------------------------------------


def _dense_from_ids(ids, causal, left=None, right=None):
    """jax.nn's rule on a [T] row (runs are distinct ids here): same nonzero id, window."""
    ids = np.asarray(ids)
    i, j = np.arange(len(ids))[:, None], np.arange(len(ids))[None, :]
    m = (ids[:, None] == ids[None, :]) & (ids[:, None] != 0)
    if causal:
        m &= j <= i
    if left is not None:
        m &= j >= i - left
    if right is not None:
        m &= j <= i + right
    return m


def test_from_segment_ids_dense_and_rows():
    ids = np.array([0, 1, 1, 1, 2, 3, 3, 0, 0, 4, 4, 4, 4, 0])
    for causal, window, lr in [
        (True, None, (None, None)),
        (False, None, (None, None)),
        (True, 1, (1, None)),
        (False, 1, (1, 1)),
        (False, (2, 0), (2, 0)),
        (True, (0, 0), (0, None)),
    ]:
        mask = AttnMask.from_segment_ids(ids, causal=causal, window=window)
        np.testing.assert_array_equal(mask.to_dense(), _dense_from_ids(ids, causal, *lr))
    # [B, T]: rows packed, documents never cross rows (row 0 ends and row 1 starts with id 5).
    rows = np.array([[1, 1, 5, 5], [5, 5, 0, 2]])
    mask = AttnMask.from_segment_ids(rows)
    assert mask.total_q == mask.total_k == 8
    want = np.zeros((8, 8), bool)
    want[:4, :4] = _dense_from_ids(rows[0], True)
    want[4:, 4:] = _dense_from_ids(rows[1], True)
    np.testing.assert_array_equal(mask.to_dense(), want)
    assert AttnMask.from_segment_ids(np.zeros((3, 5), np.int32)).area == 0
    assert mask.types.tolist() == [AttnMaskType.CAUSAL] * 4


def test_from_segment_ids_rejects_split_ids():
    with pytest.raises(
        ValueError,
        match=r"segment id 7 .*positions \[1, 3\) and \[4, 5\).*"
        "contiguous runs",
    ):
        AttnMask.from_segment_ids([0, 7, 7, 2, 7])
    with pytest.raises(ValueError, match="row 1"):
        AttnMask.from_segment_ids([[1, 2, 3], [3, 0, 3]])
    with pytest.raises(ValueError, match="contradicts causal"):
        AttnMask.from_segment_ids([1, 1], causal=True, window=(1, 1))
    AttnMask.from_segment_ids([[1, 2, 3], [3, 2, 1]])  # the same id in two rows is fine


def test_pack_rows_round_trip():
    x = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    p = seg.pack_rows(x)
    assert p.shape == (6, 4) and (p[3] == x[1, 0]).all()
    np.testing.assert_array_equal(seg.unpack_rows(p, 2), x)
    assert seg.pack_rows(jnp.asarray(x)).shape == (6, 4)


# ---- device-built work lists against the host ---------------------------------------------


def _random_ids(rng, t):
    """Packed documents with padding: runs of length 1, zeros at the start/middle/end,
    all-padding and single-document rows, ids arbitrary distinct ints."""
    kind = rng.integers(8)
    if kind == 0:
        return np.zeros(t, np.int32)
    if kind == 1:
        return np.full(t, 3, np.int32)
    if kind == 2:  # many runs of length 1 and 2
        lens = rng.integers(1, 3, size=t)
    else:
        n = int(rng.integers(1, 9))
        cuts = np.sort(rng.integers(0, t + 1, size=n))
        lens = np.diff(np.concatenate([[0], cuts, [t]]))
    lens = lens[np.cumsum(lens) <= t]
    lens = np.concatenate([lens, [t - lens.sum()]])
    vals = rng.choice(1 << 30, size=len(lens), replace=False) + 1
    vals = np.where(rng.random(len(lens)) < 0.3, 0, vals)
    return np.repeat(vals, lens).astype(np.int32)


def _random_window(rng, t):
    causal = bool(rng.integers(2))
    w = int(rng.integers(0, 40)) if rng.random() < 0.8 else t + int(rng.integers(0, 5))
    choice = rng.integers(4)
    if choice == 0:
        return causal, None
    if choice == 1:
        return causal, w
    if choice == 2:
        return causal, (w, 0)
    return False, (w, int(rng.integers(0, 40)))


def _host_list(ids, causal, window, bq, bk, by):
    mask = AttnMask.from_segment_ids(ids, causal=causal, window=window)
    return build_work_list(mask.shapes, mask.total_q, mask.total_q, bq, bk, by)


def _assert_equal_lists(dev, host, cap):
    order, offsets, items, needed = (np.asarray(a) for a in dev)
    w = len(host.items)
    assert int(needed) == w and items.shape == (cap, 8)
    np.testing.assert_array_equal(order, host.order)
    np.testing.assert_array_equal(offsets, host.offsets)
    np.testing.assert_array_equal(items[:w], host.items)
    assert (items[w:] == EMPTY_ITEM).all()


@functools.lru_cache(maxsize=None)
def _mapped_builder(t, bq, bk, by, cap):
    """One compilation per (T, blocks, list side, capacity): maps the builder over a batch of
    (ids, left, right) — the window is traced in the core."""
    core = functools.partial(
        seg._work_lists, row_len=t, block_q=bq, block_k=bk, by=by, capacity_items=cap
    )
    return jax.jit(lambda ids, l, r: jax.lax.map(lambda a: core(*a), (ids, l, r)))


@pytest.mark.parametrize(
    "t,bq,bk,by",
    [
        (700, 16, 16, "q"),
        (700, 16, 16, "k"),
        (513, 64, 128, "q"),
        (513, 64, 128, "k"),
        (300, 128, 128, "q"),
        (300, 128, 128, "k"),
        (1, 16, 16, "q"),
        (130, 128, 128, "k"),
    ],
)
def test_device_lists_equal_host(t, bq, bk, by):
    rng = np.random.default_rng(t * 7 + bq + (by == "k"))
    n = 40
    ids = np.stack([_random_ids(rng, t) for _ in range(n)])
    windows = [_random_window(rng, t) for _ in range(n)]
    lr = np.array([seg._resolve_window(w, c, t) for c, w in windows], np.int32)
    nq, nk = -(-t // bq), -(-t // bk)
    cap = 3 * (nq * nk + t)
    out = _mapped_builder(t, bq, bk, by, cap)(ids, lr[:, 0], lr[:, 1])
    for i, (causal, window) in enumerate(windows):
        host = _host_list(ids[i], causal, window, bq, bk, by)
        _assert_equal_lists([a[i] for a in out], host, cap)
        assert len(host.items) <= seg.segment_items_bound(t, bq, bk, causal, window)


@pytest.mark.parametrize(
    "b,t,s,bq,bk,by",
    [
        (3, 40, 64, 16, 16, "q"),
        (3, 40, 64, 16, 32, "k"),
        (2, 70, 30, 32, 16, "q"),
        (4, 33, 33, 16, 16, "k"),
    ],
)
def test_length_lists_equal_host(b, t, s, bq, bk, by):
    """Packed rows cut by per-row lengths (jax.nn's query/key_value_seq_lengths), T != S,
    under windows: the device list equals the host's for the same mask, and the default
    capacity bounds it."""
    from magi_jax.ffa.dpa import _host_mask

    rng = np.random.default_rng(b * t + s + bq + (by == "k"))
    cap = 3 * b * (-(-t // bq) + 1) * (-(-b * s // bk) + 1)
    build = jax.jit(
        lambda ql, kl, l, r: seg._table_work_lists(
            seg._length_slices(ql, kl, t, s, l, r),
            b * t,
            b * s,
            block_q=bq,
            block_k=bk,
            by=by,
            capacity_items=cap,
        )
    )
    for _ in range(12):
        ql = rng.integers(-2, t + 3, size=b).astype(np.int32)
        kl = rng.integers(0, s + 3, size=b).astype(np.int32)
        left = None if rng.random() < 0.4 else int(rng.integers(0, 20))
        right = [None, 0, int(rng.integers(0, 9))][int(rng.integers(3))]
        big = b * (t + s)
        lr = [big if w is None else w for w in (left, right)]
        mask = _host_mask(None, ql, kl, b, t, s, left, right)
        host = build_work_list(mask.shapes, b * t, b * s, bq, bk, by)
        _assert_equal_lists(build(ql, kl, *lr), host, cap)
        if by == "q":
            assert len(host.items) <= seg.length_items_bound(b, t, s, bq, bk, (left, right))


def test_segment_ids_cut_by_lengths_equal_host():
    """Documents of segment ids cut at each row's query and key lengths."""
    from magi_jax.mask import shape_to_slices

    rng = np.random.default_rng(11)
    b, t, bq, bk = 3, 50, 16, 16
    cap = 3 * (-(-b * t // bq)) * (-(-b * t // bk) + 1)
    build = jax.jit(
        lambda ids, ql, kl, l, r: seg._work_lists(
            ids,
            l,
            r,
            row_len=t,
            block_q=bq,
            block_k=bk,
            by="q",
            capacity_items=cap,
            q_lengths=ql,
            kv_lengths=kl,
        )
    )
    for _ in range(8):
        ids = np.stack([_random_ids(rng, t) for _ in range(b)])
        ql = rng.integers(0, t + 1, size=b).astype(np.int32)
        kl = rng.integers(0, t + 1, size=b).astype(np.int32)
        causal, window = _random_window(rng, t)
        left, right = seg._resolve_window(window, causal, b * t)
        slices = []
        for r in range(b):
            row = ids[r]
            starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
            for s0, e0 in zip(starts, np.r_[starts[1:], t]):
                if row[s0] == 0:
                    continue
                q0, k0 = r * t + s0, r * t + s0
                slices += shape_to_slices(
                    q0, r * t + min(e0, ql[r]), k0, r * t + min(e0, kl[r]), -left, right
                )
        mask = AttnMask._from_list(slices, b * t, b * t)
        host = build_work_list(mask.shapes, b * t, b * t, bq, bk, "q")
        _assert_equal_lists(build(ids.reshape(-1), ql, kl, left, right), host, cap)


def test_public_builder_batch_rows_and_static_windows():
    """segment_work_lists itself (the window static), on [B, T] rows whose ids run on across
    a row boundary (they must not merge), under jit."""
    rows = np.array(
        [[4, 4, 4, 9, 9, 9, 9, 9], [9, 9, 0, 0, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7, 0]], np.int32
    )
    for causal, window, (bq, bk), by in [
        (True, None, (8, 8), "q"),
        (False, 2, (4, 8), "k"),
        (True, (3, 0), (8, 4), "q"),
        (False, (1, 2), (16, 16), "k"),
    ]:
        host = _host_list(rows, causal, window, bq, bk, by)
        cap = len(host.items) + 5
        f = jax.jit(
            functools.partial(
                seg.segment_work_lists,
                causal=causal,
                window=window,
                block_q=bq,
                block_k=bk,
                by=by,
                capacity_items=cap,
            )
        )
        _assert_equal_lists(f(rows), host, cap)


def test_overflow_reports_needed_and_contiguity_check():
    ids = np.arange(1, 65, dtype=np.int32)  # 64 documents of one token: 64 items
    build = jax.jit(
        functools.partial(seg.segment_work_lists, block_q=64, block_k=64, by="q", capacity_items=8)
    )
    *_, needed = build(ids)
    assert int(needed) == 64
    bad, i, a, b = jax.jit(seg.noncontiguous_ids)(np.array([[1, 1, 2, 2], [3, 0, 0, 3]]))
    assert bool(bad) and (int(i), int(a), int(b)) == (3, 4, 7)
    bad = jax.jit(seg.noncontiguous_ids)(np.array([[1, 1, 2, 2], [2, 0, 0, 1]]))[0]
    assert not bool(bad)


# ---- the pallas kernels (interpret mode) on device-built lists ----------------------------


def test_pallas_interpret_on_device_lists():
    """The Mosaic GPU kernels in interpret mode, driven by lists built in the same jit from
    traced segment ids (forward and backward), against the reference by docs/design.md §5."""
    from magi_jax.ffa.testing import assert_matches_reference, random_inputs
    from magi_jax.pallas import ffa_pallas
    from magi_jax.planning.work_list import (
        DKV_BLOCK_K,
        DKV_BLOCK_Q,
        FWD_BLOCK_K,
        FWD_BLOCK_Q,
        FFAPlanArrays,
    )

    ids = np.repeat(np.array([0, 5, 6, 0, 8], np.int32), [7, 60, 1, 12, 80])
    mask = AttnMask.from_segment_ids(ids, causal=True, window=70)
    q, k, v, dout, dlse = random_inputs(jax.random.key(0), mask, 2, 1, 64, jnp.bfloat16)

    @jax.jit
    def run(ids, q, k, v, dout, dlse):
        lists = functools.partial(seg.segment_work_lists, ids, causal=True, window=70)
        *fwd, _ = lists(block_q=FWD_BLOCK_Q, block_k=FWD_BLOCK_K, by="q", capacity_items=16)
        *bwd, _ = lists(block_q=DKV_BLOCK_Q, block_k=DKV_BLOCK_K, by="k", capacity_items=32)
        plan = FFAPlanArrays(*fwd, *bwd)
        f = lambda q, k, v: ffa_pallas(q, k, v, plan, softmax_scale=64**-0.5, interpret=True)
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *vjp((dout, dlse)))))

    res = run(ids, q, k, v, dout, dlse)
    assert_matches_reference(res, q, k, v, mask, dout, dlse)
    assert (np.asarray(res["out"], np.float32)[:7] == 0).all()


# ---- dot_product_attention against jax.nn -------------------------------------------------


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """float32 comparisons at float32 matmul precision (GPUs default to TF32)."""
    with jax.default_matmul_precision("highest"):
        yield


def _nn_mask(ids, is_causal, window):
    """jax.nn's boolean mask [B, 1, T, T] for packed rows of distinct-run ids."""
    left, right = dpa._window_of(is_causal, window)
    return np.stack([_dense_from_ids(r, is_causal, left, right) for r in ids])[:, None]


def _random_packing(rng, b, t):
    ids = np.stack([_random_ids(rng, t) for _ in range(b)])
    ids[0, -3:] = 0  # always some padding
    return ids


def _inputs(seed, b, t, n, kv, h):
    """Unit-normal float32 q, k, v, drawn on the host (a jax.random draw compiles a program
    per shape)."""
    rng = np.random.default_rng(seed)
    shapes = [(b, t, n, h), (b, t, kv, h), (b, t, kv, h)]
    return tuple(jax.device_put(rng.standard_normal(shape, np.float32)) for shape in shapes)


def _ref(q, k, v, mask, scale=None, where=jnp.where):
    """jax.nn's output; ``where=np.where`` zeroes the fully masked rows on the host, for a
    result that is compared but not differentiated."""
    out = jax.nn.dot_product_attention(
        q, k, v, mask=jnp.asarray(mask), scale=scale, implementation="xla"
    )
    # Fully masked rows: jax.nn averages the values there; ours are 0.
    seen = np.asarray(mask).any(-1)[:, 0][..., None, None]
    return where(seen, out, 0)


@pytest.mark.parametrize("is_causal,window", [(True, None), (False, (3, 5)), (True, 6)])
def test_matches_jax_nn_forward_and_grads(is_causal, window):
    rng = np.random.default_rng(1)
    b, t, n, kv, h = 2, 24, 4, 2, 8
    q, k, v = _inputs(2, b, t, n, kv, h)
    ids = _random_packing(rng, b, t)
    mask = _nn_mask(ids, is_causal, window)
    ours = lambda q, k, v: (
        dpa.dot_product_attention(
            q, k, v, segment_ids=ids, is_causal=is_causal, local_window_size=window, backend="xla"
        )
        ** 2
    ).sum()
    ref = lambda q, k, v: (_ref(q, k, v, mask) ** 2).sum()
    (lo, go), (lr, gr) = (jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v) for f in (ours, ref))
    np.testing.assert_allclose(lo, lr, rtol=1e-5)
    for a, r in zip(go, gr):
        np.testing.assert_allclose(a, r, atol=2e-5, rtol=2e-5)


def test_compiles_once_over_packings_and_padding_is_zero():
    rng = np.random.default_rng(3)
    b, t, n, kv, h = 2, 32, 2, 1, 8
    step = jax.jit(
        lambda q, k, v, ids: dpa.dot_product_attention(
            q, k, v, segment_ids=ids, is_causal=True, scale=0.3, backend="xla"
        )
    )
    for i in range(4):
        q, k, v = _inputs(10 + i, b, t, n, kv, h)
        ids = _random_packing(rng, b, t)
        out = step(q, k, v, ids)
        np.testing.assert_allclose(
            out,
            _ref(q, k, v, _nn_mask(ids, True, None), scale=0.3, where=np.where),
            atol=2e-5,
            rtol=2e-5,
        )
        assert (np.asarray(out)[ids == 0] == 0).all()
    assert step._cache_size() == 1


def test_without_segment_ids_and_cross_lengths():
    q, _, _ = _inputs(4, 2, 12, 2, 2, 8)
    _, k, v = _inputs(5, 2, 20, 2, 2, 8)
    for is_causal, window in [(True, None), (False, None), (False, (2, 3))]:
        out = dpa.dot_product_attention(
            q, k, v, is_causal=is_causal, local_window_size=window, backend="xla"
        )
        ref = jax.nn.dot_product_attention(
            q, k, v, is_causal=is_causal, local_window_size=window, implementation="xla"
        )
        np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="T == S"):
        dpa.dot_product_attention(q, k, v, segment_ids=np.ones((2, 12), np.int32))


def test_over_capacity_and_split_ids_raise_or_give_nan():
    from jax.experimental import checkify

    from magi_jax.planning.capacity import CapacityError

    b, t = 1, 64
    q, k, v = _inputs(6, b, t, 1, 1, 8)
    ids = np.arange(1, t + 1, dtype=np.int32)[None]  # 64 one-token documents: 64 items
    split = np.ones((1, t), np.int32)
    split[0, 10:20] = 2
    good = np.repeat(np.array([[1, 2]], np.int32), t // 2, axis=1)
    checked = lambda q, k, v, ids: dpa.dot_product_attention(
        q, k, v, segment_ids=ids, capacity=8, backend="xla", check_segment_ids=True
    )
    # Concrete ids: a plain ValueError at the call, eagerly and under a jit closing over them.
    with pytest.raises(CapacityError, match=r"PlanCapacity.items=64"):
        checked(q, k, v, ids)
    with pytest.raises(
        ValueError,
        match="segment id 1 appears in two separate runs of row 0 "
        r"\(positions 0 and 20\)",
    ):
        jax.jit(lambda q, k, v: checked(q, k, v, split))(q, k, v)
    # Traced ids: checkify's error, a ValueError carrying the message.
    step = jax.jit(checkify.checkify(checked))
    err, _ = step(q, k, v, ids)
    with pytest.raises(ValueError, match=r"need PlanCapacity.items=64, but the capacity holds 8"):
        err.throw()
    err, _ = step(q, k, v, split)
    with pytest.raises(ValueError, match=r"segment id 1 appears .* \(positions 0 and 20\)"):
        err.throw()
    err, out_checked = step(q, k, v, good)
    err.throw()
    # Staged without checkify, JAX says to use it.
    with pytest.raises(ValueError, match="checkify"):
        jax.jit(checked)(q, k, v, good)
    # Without the check: never a wrong finite answer, all NaN instead.
    fast = jax.jit(
        lambda q, k, v, ids: dpa.dot_product_attention(
            q, k, v, segment_ids=ids, capacity=8, backend="xla"
        )
    )
    assert np.isnan(np.asarray(fast(q, k, v, ids))).all()
    assert np.isnan(np.asarray(fast(q, k, v, split))).all()
    out = np.asarray(fast(q, k, v, good))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(out_checked), rtol=0, atol=0)
    np.testing.assert_allclose(out, np.asarray(checked(q, k, v, good)), rtol=0, atol=0)
    assert "callback" not in jax.jit(fast).lower(q, k, v, good).as_text()


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an sm90 GPU")
@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_gpu_backends_against_reference(backend):
    """On a GPU: both backends from device-built lists, one compilation over packings, judged
    by docs/design.md §5 against the dense reference of the same packed mask."""
    from magi_jax.ffa.testing import assert_matches_reference
    from magi_jax.pallas import device_supported

    if backend == "pallas" and not device_supported()[0]:
        pytest.skip(device_supported()[1])
    rng = np.random.default_rng(8)
    b, t, n, kv, h = 2, 640, 4, 2, 64
    step = jax.jit(
        lambda q, k, v, ids, do: jax.vjp(
            lambda q, k, v: dpa.dot_product_attention(
                q, k, v, segment_ids=ids, is_causal=True, backend=backend
            ),
            q,
            k,
            v,
        )[1](do)
    )
    fwd = jax.jit(
        lambda q, k, v, ids: dpa.dot_product_attention(
            q, k, v, segment_ids=ids, is_causal=True, backend=backend
        )
    )
    for i in range(3):
        q, k, v, do = (
            x.astype(jnp.bfloat16)
            for x in (
                *_inputs(20 + i, b, t, n, kv, h),
                jax.random.normal(jax.random.key(30 + i), (b, t, n, h)),
            )
        )
        ids = _random_packing(rng, b, t)
        mask = AttnMask.from_segment_ids(ids, causal=True)
        out = fwd(q, k, v, ids)
        dq, dk, dv = step(q, k, v, ids, do)
        res = {name: seg.pack_rows(x) for name, x in dict(out=out, dq=dq, dk=dk, dv=dv).items()}
        assert_matches_reference(
            res, *(seg.pack_rows(x) for x in (q, k, v)), mask, seg.pack_rows(do)
        )
        assert (np.asarray(out, np.float32)[ids == 0] == 0).all()
    assert fwd._cache_size() == 1 and step._cache_size() == 1
