"""Numerical edges of exact attention, forward and gradients, against the float64 reference
(docs/design.md §5), on the ``xla`` backend (CPU here; ``tests/pallas/test_numerics_gpu.py``
runs the same cases on the Mosaic GPU kernels):

- logits far from unit scale: ``q`` scaled by 100 in float16 and bfloat16, softcap on and off;
- one long row: a single query over 2**20 keys (``Tq != Tk``, ``D = 8``), the longest row that
  stays cheap on a CPU, where the log-sum-exp has to add up a million terms;
- rows that see exactly one key (the output is that key's value, exactly);
- rows that see no key and an all-masked batch: ``out = 0``, ``lse = -inf``, gradients exactly
  0, even with a nonzero ``lse`` cotangent on those rows;
- the same edges under context parallelism on 4 CPU host devices.

Every result is also checked to hold no NaN and no infinity (``lse`` is ``-inf`` exactly on
the rows that see no key, finite elsewhere).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, fwd_bwd
from magi_jax.mask import AttnMask
from tests.xla_options import OPTIMIZED

LONG_ROW = 2**20


def edge_mask(unit: int = 8) -> AttnMask:
    """A self-attention mask over ``8 * unit`` tokens holding every edge at once: rows
    ``[0, 3u)`` causal, rows ``[3u, 5u)`` see exactly one key (their own: the diagonal of a
    BI_CAUSAL square), rows ``[5u, 6u)`` see nothing, rows ``[6u, 8u)`` see keys
    ``[7u, 8u)`` fully; keys ``[5u, 7u)`` are seen by no query."""
    u = unit
    return AttnMask.from_ranges(
        [[0, 3 * u], [3 * u, 5 * u], [6 * u, 8 * u]],
        [[0, 3 * u], [3 * u, 5 * u], [7 * u, 8 * u]],
        ["causal", "bi_causal", "full"],
        8 * u,
        8 * u,
    )


def single_key_rows(mask: AttnMask) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, keys)``: the query rows that see exactly one key, and that key."""
    dense = mask.to_dense()
    rows = np.flatnonzero(dense.sum(1) == 1)
    return rows, dense[rows].argmax(1)


def scaled_inputs(mask, dtype, *, hq, hkv, d, q_scale=1.0, batch=None, seed=0):
    """Random ``q, k, v, dout`` (unit normal, ``q`` times ``q_scale``, in ``dtype``) and
    ``dlse`` (float32) for ``mask``; drawn by NumPy, so a new shape costs no compilation."""
    rng = np.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    normal = lambda t, h, scale=1.0: jax.device_put(
        (rng.standard_normal(lead + (t, h, d), np.float32) * scale).astype(dtype)
    )
    q = normal(mask.total_q, hq, q_scale)
    k, v = normal(mask.total_k, hkv), normal(mask.total_k, hkv)
    dout = normal(mask.total_q, hq)
    dlse = jax.device_put(rng.standard_normal(lead + (mask.total_q, hq), np.float32))
    return q, k, v, dout, dlse


def check_edges(res, mask, q, k, v, dout, dlse, **kw) -> dict:
    """The correctness rule, plus: nothing NaN or infinite (``lse`` is ``-inf`` exactly where
    a row sees no key), gradients exactly 0 on rows that see no key and on keys no query
    sees, and rows that see one key output exactly that key's value."""
    res = {n: np.asarray(x).astype(np.float32) for n, x in res.items()}  # on the host
    dense = mask.to_dense()
    empty_rows, unseen_keys = ~dense.any(1), ~dense.any(0)
    for name, x in res.items():
        if name == "lse":  # [(B,) Tq, Hq]
            assert np.array_equal(np.isneginf(x), np.broadcast_to(empty_rows[:, None], x.shape)), (
                "lse: -inf rows differ from the rows that see no key"
            )
            assert not np.isnan(x).any() and not np.isposinf(x).any(), "lse: NaN or +inf"
        else:
            assert np.isfinite(x).all(), f"{name}: {int((~np.isfinite(x)).sum())} NaN/inf"
    rows_of = lambda x, sel: x[:, sel] if x.ndim == 4 else x[sel]  # the sequence axis
    assert (rows_of(res["out"], empty_rows) == 0).all()
    if "dq" in res:
        assert (rows_of(res["dq"], empty_rows) == 0).all(), "dq: rows that see no key"
        assert (rows_of(res["dk"], unseen_keys) == 0).all(), "dk: keys no query sees"
        assert (rows_of(res["dv"], unseen_keys) == 0).all(), "dv: keys no query sees"
    rows, keys = single_key_rows(mask)
    if rows.size:
        group = q.shape[-2] // k.shape[-2]
        v_rep = np.repeat(np.asarray(v).astype(np.float32), group, axis=-2)
        np.testing.assert_array_equal(
            rows_of(res["out"], rows),
            rows_of(v_rep, keys),
            err_msg="a row that sees one key outputs its value",
        )
    return assert_matches_reference(res, q, k, v, mask, dout, dlse, **kw)


@functools.lru_cache(maxsize=None)
def _ffa_vjp(mask, backend, softcap, block_k=None, optimized=False):
    fn = lambda a, b, c: mj.flex_flash_attention(
        a, b, c, mask, softcap=softcap, backend=backend, block_k=block_k
    )
    step = fwd_bwd(fn)
    return jax.jit(step, compiler_options=OPTIMIZED) if optimized else step


def run_ffa(
    mask, q, k, v, dout, dlse, *, backend="xla", softcap=0.0, block_k=None, optimized=False
):
    """Forward and gradients of ``flex_flash_attention`` (jitted, one compilation per mask,
    backend and softcap; ``optimized``: at the default CPU optimisation, for programs that
    run long, tests/xla_options.py)."""
    return _ffa_vjp(mask, backend, float(softcap), block_k, optimized)(q, k, v, dout, dlse)


# ---- 1. large logits, single-key rows, empty rows ---------------------------------------------

# Each case is one compilation, which is most of its cost on a CPU: softcap off and on are
# spread over the two low-precision dtypes rather than crossed with them.
LARGE_LOGITS = [
    dict(dtype=jnp.float16, softcap=0.0, hq=4, hkv=2, batch=2),
    dict(dtype=jnp.bfloat16, softcap=30.0, hq=2, hkv=1, batch=None),
]


@pytest.mark.parametrize(
    "case", LARGE_LOGITS, ids=lambda c: f"{c['dtype'].__name__}-softcap{c['softcap']:g}"
)
def test_large_logits_single_key_and_empty_rows(case):
    """q x 100: scores in the hundreds, so a softmax without the running max overflows, and
    the low-precision reference loses most of its digits (the bound follows it); the mask
    holds single-key rows, empty rows and keys nobody sees."""
    mask = edge_mask()
    inputs = scaled_inputs(
        mask,
        case["dtype"],
        hq=case["hq"],
        hkv=case["hkv"],
        d=16,
        q_scale=100.0,
        batch=case["batch"],
    )
    res = run_ffa(mask, *inputs, softcap=case["softcap"])
    check_edges(res, mask, *inputs, softcap=case["softcap"])


def test_all_masked_batch():
    """A mask with no slice at all, large logits, a nonzero lse cotangent: every row is
    empty."""
    mask = AttnMask.from_ranges([], [], [], total_q=24, total_k=40)
    dtype = jnp.bfloat16
    q, k, v, dout, dlse = scaled_inputs(mask, dtype, hq=2, hkv=2, d=8, q_scale=100.0, batch=2)
    res = run_ffa(mask, q, k, v, dout, dlse)
    assert res["out"].dtype == dtype and res["lse"].dtype == jnp.float32
    assert np.isneginf(np.asarray(res["lse"])).all()
    for name in ("out", "dq", "dk", "dv"):
        x = np.asarray(res[name]).astype(np.float32)
        assert x.shape == (q if name in ("out", "dq") else k).shape
        assert (x == 0).all(), f"{name} of an all-masked batch is not exactly 0"
    check_edges(res, mask, q, k, v, dout, dlse)


def test_float64_inputs_keep_float64_precision():
    """float64 inputs (``jax_enable_x64``) are judged in float64: floor 1e-9, not float32's."""
    mask = edge_mask(unit=2)
    with jax.enable_x64(True):
        q, k, v, dout, dlse = scaled_inputs(mask, jnp.float64, hq=2, hkv=1, d=8, seed=6)
        out, lse = mj.flex_flash_attention(q, k, v, mask, backend="xla")
        assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
        assert_matches_reference(dict(out=out, lse=lse), q, k, v, mask, dout, dlse)


# ---- 2. one long row -------------------------------------------------------------------------


def test_long_row_matches_reference():
    """One query over 2**20 keys: the forward and the gradients by the rule (float32)."""
    mask = AttnMask.full(1, LONG_ROW)
    inputs = scaled_inputs(mask, jnp.float32, hq=1, hkv=1, d=8, seed=2)
    check_edges(run_ffa(mask, *inputs, block_k=4096, optimized=True), mask, *inputs)


def test_long_row_lse_is_exact_for_equal_logits():
    """Every key equal: each of the 2**20 logits is ``s``, so ``lse = s + log 2**20``, the
    output is the mean of ``v`` and ``dv = dout / 2**20`` on every key, all known in float64
    without a reference run (same shapes as above: no new compilation)."""
    mask = AttnMask.full(1, LONG_ROW)
    rng = np.random.default_rng(3)
    q = jax.device_put(rng.standard_normal((1, 1, 8), np.float32) * 4)
    k = jax.device_put(
        np.broadcast_to(np.linspace(-1.0, 1.0, 8, dtype=np.float32), (LONG_ROW, 1, 8))
    )
    v = jax.device_put(rng.standard_normal((LONG_ROW, 1, 8), np.float32))
    dout = jax.device_put(rng.standard_normal((1, 1, 8), np.float32))
    res = run_ffa(
        mask,
        q,
        k,
        v,
        dout,
        jax.device_put(np.zeros((1, 1), np.float32)),
        block_k=4096,
        optimized=True,
    )
    s = float(np.asarray(q, np.float64)[0, 0] @ np.asarray(k)[0, 0].astype(np.float64)) * 8**-0.5
    want_lse = s + np.log(LONG_ROW)
    assert abs(float(np.asarray(res["lse"])[0, 0]) - want_lse) <= 2e-5 * max(1.0, abs(want_lse))
    np.testing.assert_allclose(
        np.asarray(res["out"], np.float64)[0], np.asarray(v, np.float64).mean(0), rtol=0, atol=2e-5
    )
    want_dv = np.broadcast_to(np.asarray(dout, np.float64) / LONG_ROW, v.shape)
    np.testing.assert_allclose(np.asarray(res["dv"], np.float64), want_dv, rtol=1e-4, atol=1e-12)


# ---- 3. under context parallelism ----------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _mesh(cp):
    return jax.make_mesh(
        (cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,)
    )


@functools.lru_cache(maxsize=None)
def _cp_vjp(key, softcap):
    def fwd(q, k, v):
        o, l = mj.magi_attention(
            mj.dispatch(q, key), mj.dispatch(k, key), mj.dispatch(v, key), key, softcap=softcap
        )
        return mj.undispatch(o, key), mj.undispatch(l, key)

    return fwd_bwd(fwd)


def test_cp_large_logits_single_key_and_empty_rows():
    """The edge mask over 4 ranks with remote stages, float16 and q x 100 under a softcap
    (chunks of 8 tokens spread the rows over the ranks, so the empty and single-key rows
    meet remote KV and padding)."""
    mask = edge_mask(unit=7)  # 56 tokens: padded to 64
    dtype, softcap = jnp.float16, 30.0
    key = mj.make_flex_key(mask, _mesh(4), "cp", chunk_size=8, overlap_degree=1)
    assert key.padded_total > mask.total_q and key.overlap_degree == 1
    inputs = scaled_inputs(mask, dtype, hq=2, hkv=1, d=8, q_scale=100.0, seed=4)
    check_edges(_cp_vjp(key, softcap)(*inputs), mask, *inputs, softcap=softcap)


def test_cp_all_masked():
    mask = AttnMask.from_ranges([], [], [], total_q=30, total_k=30)
    key = mj.make_flex_key(mask, _mesh(2), "cp", chunk_size=4)
    inputs = scaled_inputs(mask, jnp.float32, hq=2, hkv=2, d=8, seed=5)
    res = _cp_vjp(key, 0.0)(*inputs)
    assert np.isneginf(np.asarray(res["lse"])).all()
    for name in ("out", "dq", "dk", "dv"):
        assert (np.asarray(res[name]) == 0).all(), f"{name} of an all-masked sequence"
    check_edges(res, mask, *inputs)
