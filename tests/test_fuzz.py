"""A fuzz suite at the public boundary: random valid and invalid masks, shapes, dtypes and
options thrown at the ``AttnMask`` constructors, ``flex_flash_attention``,
``dot_product_attention`` and ``make_flex_key`` + ``dispatch`` + ``magi_attention``.

Every example draws at most one *fault* (a bad argument of a known kind) and then arguments
consistent with it. A faulty call must raise ``ValueError``/``TypeError`` (an explicit
``backend="pallas"`` without an sm90 GPU: ``NotImplementedError``) whose message names the
offending argument; a call without a fault must succeed and match the float64 dense
reference by the rule of docs/design.md §5 (masks: their cells match a NumPy statement of the
constructor). Faults are drawn more often than valid calls, which cost a compilation each.

The default hypothesis profile (``ci``) runs a handful of examples per test; for many more:

    HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest -p no:xdist -q tests/test_fuzz.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import magi_jax as mj
from magi_jax.ffa.reference import dense_attention
from magi_jax.ffa.testing import assert_matches_reference
from magi_jax.mask import AttnMask
from tests.strategies import slice_masks
from tests.zoo import self_attention_masks

BAD_NUMBERS = [float("nan"), float("inf"), -1.0, "1", None]


def np_inputs(seed, tq, tk, hq, hkv, d, dtype, batch=None):
    """Random ``q [(B,) tq, hq, d]``, ``k``, ``v [(B,) tk, hkv, d]`` as NumPy arrays of
    ``dtype`` (NumPy, not ``jax.random``: a new shape then costs no compilation)."""
    rng = np.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    return tuple(
        rng.standard_normal(lead + (t, h, d), np.float32).astype(dtype)
        for t, h in ((tq, hq), (tk, hkv), (tk, hkv))
    )


def valid_examples(share: int) -> int:
    """Examples for a test of valid calls: a ``share``-th of the profile's (each costs a
    compilation; bad inputs cost none)."""
    return max(1, settings().max_examples // share)


def check_forward(out, lse, q, k, v, mask: AttnMask, **kw):
    """``out`` (and ``lse`` unless ``None``) by the correctness rule, against forward-only
    references: the float64 one and the one in the inputs' precision."""
    dense = mask.to_dense()

    def run(q_, k_, v_):
        o, l = _dense_forward(q_, k_, v_, dense, **kw)
        return {"out": np.asarray(o, np.float64), "lse": np.asarray(l, np.float64)}

    with jax.enable_x64(True):
        ref64 = run(*(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)))
    results = dict(out=out) if lse is None else dict(out=out, lse=lse)
    assert_matches_reference(results, q, k, v, mask, ref64=ref64, ref_lp=run(q, k, v), **kw)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "softcap"))
def _dense_forward(q, k, v, dense, *, softmax_scale=None, softcap=0.0):
    """The dense reference's ``out`` (float32 unless float64) and ``lse``, jitted with the mask
    as an argument: one compilation per shape, not one per eager op."""
    o, l = dense_attention(q, k, v, dense, softmax_scale=softmax_scale, softcap=softcap)
    return (o if o.dtype == jnp.float64 else o.astype(jnp.float32)), l


def raises_naming(call, names, error=(ValueError, TypeError)):
    """Runs ``call``; it must raise ``error`` with a message holding one of ``names``."""
    with pytest.raises(error) as info:
        call()
    msg = str(info.value)
    assert any(n in msg for n in names), (
        f"{type(info.value).__name__}: {msg!r} names none of {names}"
    )
    return msg


# ---- 1. AttnMask constructors ---------------------------------------------------------------


def _dense_of_lengths(lens, causal, left=None, right=None):
    """Packed documents of ``lens`` (NumPy, as docs/masks.md states it)."""
    total = int(sum(lens))
    doc = np.repeat(np.arange(len(lens)), lens)
    q, k = np.arange(total)[:, None], np.arange(total)[None, :]
    cells = doc[:, None] == doc[None, :]
    if causal:
        cells &= k <= q
    if left is not None:
        cells &= k >= q - left
    if right is not None:
        cells &= k <= q + right
    return cells


# A length argument: a valid value, or (bad value).
_LENGTH = st.integers(0, 40)
_BAD_LENGTH = st.sampled_from([-1, -7, 2.5, "8", None, True])
_CTORS = [
    "full",
    "causal",
    "varlen",
    "sliding_window",
    "global_sliding_window",
    "block_causal",
    "prefix_lm",
    "from_segment_ids",
]


@given(st.data())
def test_mask_constructors(data):
    ctor = data.draw(st.sampled_from(_CTORS), label="constructor")
    args = {}

    def arg(name, good, bad):
        """Draws argument ``name`` good or bad; returns the value."""
        if data.draw(st.integers(0, 3), label=f"{name} bad?") == 0:
            args[name] = data.draw(bad, label=name)
            bad_names.append(name)
        else:
            args[name] = data.draw(good, label=name)
        return args[name]

    bad_names = []
    if ctor in ("full", "causal"):
        tq, tk = arg("total_q", _LENGTH, _BAD_LENGTH), arg("total_k", _LENGTH, _BAD_LENGTH)
        call = lambda: getattr(AttnMask, ctor)(tq, tk)
        q, k = np.arange(40)[:, None], np.arange(40)[None, :]
        expect = lambda: (
            np.ones((tq, tk), bool) if ctor == "full" else (k[:, :tk] - tk <= q[:tq] - tq)
        )  # bottom-right aligned
    elif ctor == "varlen":
        lens = data.draw(st.lists(st.integers(0, 9), max_size=4), label="lens")
        cu = np.cumsum([0] + lens).tolist()
        if data.draw(st.integers(0, 3), label="cu bad?") == 0:
            cu = data.draw(
                st.sampled_from([[1, 4], [0, 5, 3], [[0, 4], [0, 4]], [0, 2.5], "abc"]),
                label="cu_seqlens",
            )
            bad_names.append("cu_seqlens")
        causal = arg("causal", st.booleans(), st.sampled_from(["yes", 1, None]))
        window = arg(
            "window",
            st.one_of(st.none(), st.integers(0, 5)),
            st.sampled_from([-1, 2.5, "w", (1, -2), (1, 2, 3)]),
        )
        call = lambda: AttnMask.varlen(cu, causal=causal, window=window)
        expect = lambda: _dense_of_lengths(
            lens, causal, window, None if window is None or causal else window
        )
    elif ctor == "sliding_window":
        t = arg("total", _LENGTH, _BAD_LENGTH)
        left, right = arg("left", _LENGTH, _BAD_LENGTH), arg("right", _LENGTH, _BAD_LENGTH)
        call = lambda: AttnMask.sliding_window(t, left, right)
        expect = lambda: _dense_of_lengths([t], False, left, right)
    elif ctor == "global_sliding_window":
        t = arg("total", _LENGTH, _BAD_LENGTH)
        w, g = arg("window", _LENGTH, _BAD_LENGTH), arg("num_global", _LENGTH, _BAD_LENGTH)
        call = lambda: AttnMask.global_sliding_window(t, w, g)
        expect = lambda: (
            _dense_of_lengths([t], True, w)
            | (_dense_of_lengths([t], True) & (np.arange(t)[None, :] < g))
        )
    elif ctor == "block_causal":
        lens = arg(
            "doc_lens",
            st.lists(st.integers(0, 9), min_size=1, max_size=3),
            st.sampled_from([[-1, 4], [2.5], ["a"]]),
        )
        size = arg("block_size", st.integers(1, 5), st.sampled_from([0, -2, 1.5, "2", None]))

        def expect():
            doc = np.repeat(np.arange(len(lens)), lens)
            pos = np.concatenate([np.arange(n) for n in lens]) if sum(lens) else np.zeros(0)
            blk = pos // size
            return (doc[:, None] == doc[None, :]) & (blk[None, :] <= blk[:, None])

        call = lambda: AttnMask.block_causal(lens, size)
    elif ctor == "prefix_lm":
        lens = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=3), label="lens")
        prefix = arg(
            "prefix_lens",
            st.one_of(st.just([n // 2 for n in lens]), st.just(min(lens))),
            st.sampled_from([[1] * (len(lens) + 1), [100] * len(lens), "p", [0.5]]),
        )

        def expect():
            pre = np.broadcast_to(np.asarray(prefix), (len(lens),))
            doc = np.repeat(np.arange(len(lens)), lens)
            pos = np.concatenate([np.arange(n) for n in lens]) if sum(lens) else np.zeros(0)
            in_prefix = pos < pre[doc]
            return (doc[:, None] == doc[None, :]) & (
                (pos[None, :] <= pos[:, None]) | (in_prefix[:, None] & in_prefix[None, :])
            )

        call = lambda: AttnMask.prefix_lm(lens, prefix)
    else:  # from_segment_ids
        lens = data.draw(st.lists(st.integers(1, 6), max_size=4), label="lens")
        ids = np.repeat(np.arange(1, len(lens) + 1), lens)
        if data.draw(st.integers(0, 3), label="ids bad?") == 0:
            ids = data.draw(
                st.sampled_from([ids.astype(float) + 0.5, ids[None, None], np.array([1, 2, 1])]),
                label="segment_ids",
            )
            bad_names.append("segment")
        causal = arg("causal", st.booleans(), st.sampled_from(["no", None]))
        call = lambda: AttnMask.from_segment_ids(ids, causal=causal)
        expect = lambda: _dense_of_lengths(lens, causal)
    if bad_names:
        raises_naming(call, bad_names)
        return
    mask = call()
    dense = mask.to_dense()
    np.testing.assert_array_equal(dense, expect(), err_msg=f"{ctor}({args})")
    assert mask.area == int(dense.sum())


_RANGE_FAULTS = [
    None,
    "reversed",
    "past_total",
    "negative",
    "overlap",
    "fractional",
    "columns",
    "count",
    "type_name",
    "type_value",
    "types_len",
    "total",
]


@given(slice_masks(max_len=24, max_cuts=3), st.sampled_from(_RANGE_FAULTS), st.data())
def test_from_ranges(mask, fault, data):
    """Slices of a valid random mask, then one fault put into them."""
    qr, kr = mask.q_ranges.tolist(), mask.k_ranges.tolist()
    types = [int(t) for t in mask.types]
    totals = dict(total_q=mask.total_q, total_k=mask.total_k)
    if fault is not None and not qr:
        qr, kr, types = [[0, mask.total_q]], [[0, mask.total_k]], [0]
    i = data.draw(st.integers(0, max(len(qr) - 1, 0)), label="slice")
    side, side_name = data.draw(st.sampled_from([(qr, "q_ranges"), (kr, "k_ranges")]), label="side")
    names = [side_name]
    if fault == "reversed":
        side[i] = [side[i][1] + 1, side[i][0]]
    elif fault == "past_total":
        side[i][1] = totals["total_q" if side is qr else "total_k"] + 1
        names.append("total_q" if side is qr else "total_k")
    elif fault == "negative":
        side[i][0] = -1
    elif fault == "overlap":  # a FULL slice over everything, twice
        full_q, full_k = [0, mask.total_q], [0, mask.total_k]
        at = data.draw(st.integers(0, len(qr)), label="at")
        qr = qr[:at] + [full_q] + qr[at:] + [full_q]
        kr = kr[:at] + [full_k] + kr[at:] + [full_k]
        types = types[:at] + [0] + types[at:] + [0]
        names = ["overlap"]
    elif fault == "fractional":
        side[i] = [side[i][0] + 0.5, side[i][1]]
    elif fault == "columns":
        wide = [r + [0] for r in side]
        qr, kr = (wide, kr) if side_name == "q_ranges" else (qr, wide)
    elif fault == "count":
        qr, kr = (qr + [[0, 0]], kr) if side_name == "q_ranges" else (qr, kr + [[0, 0]])
        names = ["q_ranges has", "k_ranges has"]
    elif fault in ("type_name", "type_value"):
        types[i] = (
            "diagonal"
            if fault == "type_name"
            else data.draw(st.sampled_from([7, -1, 1.5, None, True]), label="type")
        )
        names = ["types", "mask type"]
    elif fault == "types_len":
        types = types + [0]
        names = ["types has"]
    elif fault == "total":
        name = data.draw(st.sampled_from(["total_q", "total_k"]), label="total")
        totals[name] = data.draw(st.sampled_from([-1, -3, 2.5, "9"]), label="value")
        names = [name]
    build = lambda: AttnMask.from_ranges(qr, kr, types, **totals)
    if fault is None:
        assert build() == mask
    else:
        raises_naming(build, names)


# ---- 2. flex_flash_attention ---------------------------------------------------------------

_FFA_FAULTS = [
    None,
    "tq",
    "tk",
    "heads",
    "head_dim",
    "rank",
    "dtype",
    "mixed_dtype",
    "kv_shape",
    "not_array",
    "mask",
    "softcap",
    "scale",
    "block",
    "backend",
    "empty",
]
_FFA_NAMES = {
    "tq": ["total_q"],
    "tk": ["total_k"],
    "heads": ["heads"],
    "head_dim": ["head dim D="],
    "rank": ["q must be", "must all be"],
    "dtype": ["dtype"],
    "mixed_dtype": ["dtypes differ"],
    "kv_shape": ["same shape"],
    "not_array": ["q must be an array"],
    "mask": ["mask must be"],
    "softcap": ["softcap="],
    "scale": ["softmax_scale="],
    "block": ["block_q=", "block_k="],
    "backend": ["backend="],
    "empty": ["T = 0"],
}
_FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16]


@functools.lru_cache(maxsize=None)
def _forward(mask, softcap, scale, block_q, block_k):
    return jax.jit(
        lambda q, k, v: mj.flex_flash_attention(
            q,
            k,
            v,
            mask,
            softcap=softcap,
            softmax_scale=scale,
            block_q=block_q,
            block_k=block_k,
            backend="xla",
        )
    )


@given(slice_masks(max_len=20, max_cuts=3), st.sampled_from(_FFA_FAULTS[1:]), st.data())
def test_flex_flash_attention_bad_inputs(mask, fault, data):
    _fuzz_ffa(mask, fault, data)


@settings(max_examples=valid_examples(4))
@given(slice_masks(max_len=20, max_cuts=3), st.data())
def test_flex_flash_attention_matches_reference(mask, data):
    _fuzz_ffa(mask, None, data)


def _fuzz_ffa(mask, fault, data):
    draw = lambda s, label: data.draw(s, label=label)
    dtype = draw(st.sampled_from(_FLOATS), "dtype")
    hkv = draw(st.sampled_from([1, 2]), "hkv")
    hq = hkv * draw(st.sampled_from([1, 2]), "group")
    d = draw(st.sampled_from([8, 16]), "d")
    batch = draw(st.sampled_from([None, 2]), "batch")
    opts = dict(
        softcap=draw(st.sampled_from([0.0, 4.0]), "softcap"),
        softmax_scale=draw(st.sampled_from([None, 0.3]), "softmax_scale"),
        block_q=draw(st.sampled_from([None, 8]), "block_q"),
        block_k=draw(st.sampled_from([None, 16]), "block_k"),
        backend="xla",
    )
    q, k, v = np_inputs(
        draw(st.integers(0, 9), "seed"), mask.total_q, mask.total_k, hq, hkv, d, dtype, batch
    )
    ax = 0 if batch is None else 1
    call_mask = mask
    if fault == "tq":
        q = np.concatenate([q, q], axis=ax)
    elif fault == "tk":
        k, v = np.concatenate([k, k], axis=ax), np.concatenate([v, v], axis=ax)
    elif fault == "heads":  # 3 query heads over 2, or 1-2 over 3
        if hkv == 2:
            q = np.concatenate([q] * 3, axis=-2)[..., :3, :]
        else:
            k, v = np.concatenate([k] * 3, axis=-2), np.concatenate([v] * 3, axis=-2)
    elif fault == "head_dim":
        dd = draw(st.sampled_from([4, 12, 264]), "bad d")
        q, k, v = (np.ones(x.shape[:-1] + (dd,), dtype) for x in (q, k, v))
    elif fault == "rank":
        q = q[..., 0, :] if draw(st.booleans(), "drop") else q[None, None]
    elif fault == "dtype":
        bad = draw(st.sampled_from([jnp.int32, jnp.bool_, jnp.complex64, jnp.uint8]), "bad")
        q, k, v = (x.astype(bad) for x in (q, k, v))
    elif fault == "mixed_dtype":
        other = draw(st.sampled_from([t for t in _FLOATS + [np.float64] if t != dtype]), "other")
        which = draw(st.sampled_from(["q", "k", "v"]), "which")
        q, k, v = (x.astype(other) if n == which else x for n, x in zip("qkv", (q, k, v)))
    elif fault == "kv_shape":  # v's head dim may differ (MLA), its tokens may not
        v = v[..., :-1, :, :]
    elif fault == "not_array":
        q = q.tolist()
    elif fault == "empty":  # no tokens: a mask over total_q = 0
        call_mask = AttnMask.from_ranges([], [], [], total_q=0, total_k=mask.total_k)
        q = q[..., :0, :, :]
    elif fault == "mask":
        call_mask = draw(st.sampled_from(["causal", None, mask.to_dense()]), "bad mask")
    elif fault == "softcap":
        opts["softcap"] = draw(st.sampled_from(BAD_NUMBERS), "bad softcap")
        if opts["softcap"] is None:
            opts["softcap"] = -0.5
    elif fault == "scale":
        opts["softmax_scale"] = draw(
            st.sampled_from([float("nan"), float("inf"), "0.3", [0.3]]), "bad scale"
        )
    elif fault == "block":
        name = draw(st.sampled_from(["block_q", "block_k"]), "block")
        opts[name] = draw(st.sampled_from([0, -8, 2.5, "8", True]), "bad block")
    elif fault == "backend":
        opts["backend"] = draw(st.sampled_from(["cuda", None, "XLA", "pallas"]), "bad backend")
        if opts["backend"] == "pallas":
            from magi_jax import pallas

            if pallas.device_supported()[0]:
                return  # pallas can run here: not a bad input
            raises_naming(
                lambda: mj.flex_flash_attention(q, k, v, mask, **opts),
                ["backend='pallas'"],
                NotImplementedError,
            )
            return
    if fault is not None:
        raises_naming(
            lambda: mj.flex_flash_attention(q, k, v, call_mask, **opts), _FFA_NAMES[fault]
        )
        return
    opts.pop("backend")
    out, lse = _forward(
        mask, opts["softcap"], opts["softmax_scale"], opts["block_q"], opts["block_k"]
    )(q, k, v)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    check_forward(
        out, lse, q, k, v, mask, softcap=opts["softcap"], softmax_scale=opts["softmax_scale"]
    )


# ---- 3. dot_product_attention --------------------------------------------------------------

_DPA_FAULTS = [
    None,
    "rank",
    "heads",
    "segment_dtype",
    "segment_shape",
    "t_ne_s",
    "window",
    "scale",
    "softcap",
    "capacity",
    "backend",
    "dtype",
]
_DPA_NAMES = {
    "rank": ["query, key and value must be"],
    "heads": ["heads"],
    "segment_dtype": ["segment_ids"],
    "segment_shape": ["segment_ids"],
    "t_ne_s": ["segment_ids", "T == S"],
    "window": ["local_window_size"],
    "scale": ["scale="],
    "softcap": ["softcap="],
    "capacity": ["capacity", "PlanCapacity"],
    "backend": ["backend="],
    "dtype": ["dtype"],
}


@given(st.sampled_from(_DPA_FAULTS[1:]), st.data())
def test_dot_product_attention_bad_inputs(fault, data):
    _fuzz_dpa(fault, data)


@settings(max_examples=valid_examples(4))
@given(st.data())
def test_dot_product_attention_matches_reference(data):
    _fuzz_dpa(None, data)


def _fuzz_dpa(fault, data):
    draw = lambda s, label: data.draw(s, label=label)
    b, t, k_heads = draw(st.integers(1, 2), "B"), draw(st.integers(1, 20), "T"), 1
    n = k_heads * draw(st.sampled_from([1, 2]), "group")
    dtype = draw(st.sampled_from(_FLOATS), "dtype")
    use_ids = draw(st.booleans(), "segment ids")
    rows = [
        np.repeat(np.arange(len(ls)), ls)[:t]
        for ls in draw(
            st.lists(
                st.lists(st.integers(1, 8), min_size=1, max_size=6).filter(lambda ls: sum(ls) >= t),
                min_size=b,
                max_size=b,
            ),
            "docs",
        )
    ]
    ids = np.stack(rows).astype(np.int32) if use_ids else None
    is_causal = draw(st.booleans(), "is_causal")
    window = draw(st.sampled_from([None, 2, (1, 3)]), "local_window_size")
    opts = dict(
        is_causal=is_causal, local_window_size=window, scale=None, softcap=0.0, backend="xla"
    )
    q, k, v = np_inputs(draw(st.integers(0, 9), "seed"), t, t, n, k_heads, 8, dtype, b)
    if fault == "rank":  # [T, N, H] is jax.nn's unbatched form; five axes are nothing
        q, k, v = q[None], k[None], v[None]
    elif fault == "heads":
        q = np.ones((b, t, 3, 8), dtype)
        k = v = np.ones((b, t, 2, 8), dtype)
    elif fault == "segment_dtype":
        ids = np.ones((b, t), np.float32)
    elif fault == "segment_shape":
        ids = np.ones((b, t + 1), np.int32)
    elif fault == "t_ne_s":
        ids = np.ones((b, t), np.int32)
        k, v = np.concatenate([k, k], 1), np.concatenate([v, v], 1)
    elif fault == "window":
        opts["local_window_size"] = draw(st.sampled_from([-1, "w", (1, -1), 1.5]), "bad")
    elif fault == "scale":
        opts["scale"] = draw(st.sampled_from([float("nan"), float("inf"), "s"]), "bad")
    elif fault == "softcap":
        opts["softcap"] = draw(st.sampled_from([-1.0, float("nan"), float("inf")]), "bad")
    elif fault == "capacity":
        ids = np.ones((b, t), np.int32)
        opts["capacity"] = draw(st.sampled_from([-1, "big", 2.5]), "bad")
    elif fault == "backend":
        opts["backend"] = draw(st.sampled_from(["cuda", None]), "bad")
    elif fault == "dtype":
        q, k, v = (x.astype(np.int32) for x in (q, k, v))
    call = lambda: mj.dot_product_attention(q, k, v, segment_ids=ids, **opts)
    if fault is not None:
        raises_naming(call, _DPA_NAMES[fault])
        return
    out = call()
    assert out.shape == q.shape and out.dtype == dtype
    # The cells as jax.nn states them, row by row: same nonzero segment, j - i within the
    # window, j <= i if causal.
    left, right = (
        (None, None)
        if window is None
        else ((window, window) if isinstance(window, int) else window)
    )
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    seg = np.ones((b, t), np.int32) if ids is None else ids  # 0: padding
    cells = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
    if is_causal:
        cells &= j <= i
    if left is not None:
        cells &= (j >= i - left) & (j <= i + right)
    packed = AttnMask.from_segment_ids(
        seg, causal=is_causal, window=None if left is None else (left, 0 if is_causal else right)
    )
    want = np.zeros((b * t, b * t), bool)
    for r in range(b):
        want[r * t : (r + 1) * t, r * t : (r + 1) * t] = cells[r]
    np.testing.assert_array_equal(packed.to_dense(), want)
    pack = lambda x: x.reshape((b * t,) + x.shape[2:])
    check_forward(
        pack(out),
        None,
        pack(q),
        pack(k),
        pack(v),
        packed,
        softmax_scale=opts["scale"],
        softcap=opts["softcap"],
    )


# ---- 4. context parallelism ----------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _mesh(cp, name="cp"):
    return jax.make_mesh(
        (cp,), (name,), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,)
    )


_KEY_FAULTS = [
    "mask",
    "mesh",
    "cp_axis",
    "chunk_size",
    "overlap_degree",
    "comm_backend",
    "ffa_backend",
    "dispatch_algorithm",
    "block_q",
    "capacity",
]
_CALL_FAULTS = [
    "not_dispatched",
    "heads",
    "dtype",
    "mixed_dtype",
    "softcap",
    "softmax_scale",
    "key",
    "rank",
]
_KEY_NAMES = {
    "mask": ["mask must be"],
    "mesh": ["mesh"],
    "cp_axis": ["cp_axis"],
    "chunk_size": ["chunk_size"],
    "overlap_degree": ["overlap_degree"],
    "comm_backend": ["comm_backend"],
    "ffa_backend": ["ffa_backend"],
    "dispatch_algorithm": ["dispatch_algorithm"],
    "block_q": ["block_q"],
    "capacity": ["capacity"],
}
_CALL_NAMES = {
    "not_dispatched": ["dispatch"],
    "heads": ["heads"],
    "dtype": ["dtype"],
    "mixed_dtype": ["dtypes differ"],
    "softcap": ["softcap="],
    "softmax_scale": ["softmax_scale="],
    "key": ["key must be"],
    "rank": ["must be [padded_total, H, D]"],
}


@functools.lru_cache(maxsize=None)
def _cp_forward(key, softcap):
    def fwd(q, k, v):
        o, l = mj.magi_attention(
            mj.dispatch(q, key), mj.dispatch(k, key), mj.dispatch(v, key), key, softcap=softcap
        )
        return mj.undispatch(o, key), mj.undispatch(l, key)

    return jax.jit(fwd)


@given(
    self_attention_masks(min_len=9, max_len=40, max_cuts=3),
    st.sampled_from(_KEY_FAULTS + _CALL_FAULTS),
    st.data(),
)
def test_context_parallel_bad_inputs(mask, fault, data):
    _fuzz_cp(mask, fault, data)


@settings(max_examples=valid_examples(12))
@given(self_attention_masks(min_len=9, max_len=40, max_cuts=3), st.data())
def test_context_parallel_matches_reference(mask, data):
    _fuzz_cp(mask, None, data)


def _fuzz_cp(mask, fault, data):
    draw = lambda s, label: data.draw(s, label=label)
    key_fault = fault if fault in _KEY_FAULTS else None
    call_fault = fault if fault in _CALL_FAULTS else None
    cp = draw(st.sampled_from([2, 4]), "cp")
    opts = dict(
        chunk_size=draw(st.sampled_from([None, 4, 8]), "chunk_size"),
        overlap_degree=draw(st.sampled_from([None, 0, 1, 2]), "overlap_degree"),
        comm_backend=draw(
            st.sampled_from(["auto", "xla", "ppermute", "all_to_all"]), "comm_backend"
        ),
        ffa_backend=draw(st.sampled_from(["auto", "xla"]), "ffa_backend"),
        dispatch_algorithm=draw(
            st.sampled_from(["magi", "zigzag", "striped"]), "dispatch_algorithm"
        ),
    )
    key_mask, mesh, axis = mask, _mesh(cp), "cp"
    if key_fault == "mask":
        key_mask = draw(st.sampled_from(["causal", mask.to_dense(), None]), "bad mask")
    elif key_fault == "mesh":
        mesh = draw(st.sampled_from([None, "cp", jax.devices()[:cp]]), "bad mesh")
    elif key_fault == "cp_axis":
        axis = draw(st.sampled_from(["tp", 0, None]), "bad axis")
    elif key_fault == "chunk_size":
        opts["chunk_size"] = draw(st.sampled_from([0, -4, 1.5, "8"]), "bad")
    elif key_fault == "overlap_degree":
        opts["overlap_degree"] = draw(st.sampled_from([-1, 9, 100, 1.5, True, "2"]), "bad")
    elif key_fault == "comm_backend":
        opts["comm_backend"] = draw(st.sampled_from(["nccl", None, "XLA"]), "bad")
    elif key_fault == "ffa_backend":
        opts["ffa_backend"] = draw(st.sampled_from(["cuda", None, "triton"]), "bad")
    elif key_fault == "dispatch_algorithm":
        opts["dispatch_algorithm"] = draw(st.sampled_from(["ring", None]), "bad")
    elif key_fault == "block_q":
        opts["block_q"] = draw(st.sampled_from([0, -1, 2.5]), "bad")
    elif key_fault == "capacity":
        opts["capacity"] = draw(
            st.sampled_from([4096, "big", mj.PlanCapacity(total_q=mask.total_q + 1)]), "bad"
        )
    make = lambda: mj.make_flex_key(key_mask, mesh, axis, **opts)
    if key_fault is not None:
        raises_naming(make, _KEY_NAMES[key_fault])
        return
    key = make()
    dtype = draw(st.sampled_from(_FLOATS), "dtype")
    hkv = draw(st.sampled_from([1, 2]), "hkv")
    q, k, v = np_inputs(
        draw(st.integers(0, 9), "seed"), mask.total_q, mask.total_k, 2 * hkv, hkv, 8, dtype
    )
    softcap, scale = 0.0, None
    qd, kd, vd = (mj.dispatch(x, key) for x in (q, k, v))
    call_key = key
    if call_fault == "not_dispatched":
        qd = q if key.padded_total != key.total else np.concatenate([q, q[:1]])
    elif call_fault == "heads":
        qd = mj.dispatch(jnp.ones((mask.total_q, 3, 8), dtype), key)
        kd = vd = mj.dispatch(jnp.ones((mask.total_q, 2, 8), dtype), key)
    elif call_fault == "dtype":
        qd, kd, vd = (x.astype(jnp.int32) for x in (qd, kd, vd))
    elif call_fault == "mixed_dtype":
        kd = kd.astype(draw(st.sampled_from([t for t in _FLOATS if t != dtype]), "other"))
    elif call_fault == "softcap":
        softcap = draw(st.sampled_from([-1.0, float("nan"), float("inf"), "4"]), "bad")
    elif call_fault == "softmax_scale":
        scale = draw(st.sampled_from([float("nan"), float("inf"), "x"]), "bad")
    elif call_fault == "key":
        call_key = draw(st.sampled_from([mask, None, "key"]), "bad key")
    elif call_fault == "rank":
        qd = qd[:, 0]
    if call_fault is not None:
        raises_naming(
            lambda: mj.magi_attention(qd, kd, vd, call_key, softcap=softcap, softmax_scale=scale),
            _CALL_NAMES[call_fault],
        )
        return
    softcap = draw(st.sampled_from([0.0, 5.0]), "softcap")
    out, lse = _cp_forward(key, softcap)(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    check_forward(out, lse, q, k, v, mask, softcap=softcap)
