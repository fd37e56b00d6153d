"""The xla backend of flex_flash_attention: random slice masks at several tile sizes, the
default tiles, jit/grad/vmap, the program's size and the front door's errors. The mask zoo,
dtypes, head dims, softcap, batches and empty rows are in tests/test_conformance.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask
from tests.strategies import slice_masks
from tests.zoo import ZOO


def _run(mask, q, k, v, dout, dlse, **kw):
    @jax.jit
    def run(q, k, v, dout, dlse):
        fn = lambda q_, k_, v_: mj.flex_flash_attention(q_, k_, v_, mask, backend="xla", **kw)
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        dq, dk, dv = vjp((dout, dlse))
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    return run(q, k, v, dout, dlse)


def _check(
    mask,
    dtype=jnp.float32,
    hq=4,
    hkv=2,
    d=16,
    batch=None,
    seed=0,
    softcap=0.0,
    softmax_scale=None,
    **kw,
):
    q, k, v, dout, dlse = random_inputs(jax.random.key(seed), mask, hq, hkv, d, dtype, batch)
    res = _run(mask, q, k, v, dout, dlse, softcap=softcap, softmax_scale=softmax_scale, **kw)
    assert res["out"].dtype == dtype and res["lse"].dtype == jnp.float32
    assert res["dq"].dtype == dtype and res["dk"].dtype == dtype
    return assert_matches_reference(
        res, q, k, v, mask, dout, dlse, softcap=softcap, softmax_scale=softmax_scale
    )


@given(
    slice_masks(max_len=40),
    st.sampled_from([(2, 2), (4, 1), (3, 3)]),
    st.sampled_from([(8, 8), (16, 8), (4, 16)]),
)
def test_random_slices(mask, heads, blocks):
    _check(mask, jnp.float32, hq=heads[0], hkv=heads[1], d=8, block_q=blocks[0], block_k=blocks[1])


def test_default_blocks_and_long_rows():
    # Default tile size (power of two >= T, capped at 128) and a row that sees 300 keys.
    _check(AttnMask.causal_blockwise([100, 100, 100]), jnp.float32, hq=2, hkv=1, d=8)


def test_jit_grad_vmap():
    mask = ZOO["doc-causal"]
    q, k, v, _, _ = random_inputs(jax.random.key(1), mask, 2, 2, 8, jnp.float32, batch=3)

    def loss(q_, k_, v_):
        out, lse = mj.flex_flash_attention(q_, k_, v_, mask, block_q=8, block_k=8)
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    g_batched = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    g_vmapped = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g_batched, g_vmapped):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # vmap of the forward equals the batched forward.
    fwd = functools.partial(mj.flex_flash_attention, mask=mask, block_q=8, block_k=8)
    out_v, lse_v = jax.vmap(fwd)(q, k, v)
    out_b, lse_b = fwd(q, k, v)
    np.testing.assert_allclose(np.asarray(out_v), np.asarray(out_b), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.isfinite(lse_v), np.isfinite(lse_b))


def test_no_dense_matrix_in_the_program():
    """Nothing of size Tq·Tk: the largest array in the jitted forward+backward is far below
    Tq·Tk·H elements for a long document mask."""
    lens = [700, 300, 1000, 1048]
    mask = AttnMask.varlen(np.cumsum([0] + lens), causal=True)
    t = mask.total_q
    q = jax.ShapeDtypeStruct((t, 2, 16), jnp.float32)

    def loss(q_, k_, v_):
        out, _ = mj.flex_flash_attention(q_, k_, v_, mask, block_q=64, block_k=64)
        return out.sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).as_text()
    import re

    sizes = [
        np.prod([int(x) for x in dims.split("x") if x.isdigit()] or [1])
        for dims in re.findall(r"tensor<([0-9x]+)x(?:f|i|bf)\d+>", text)
    ]
    assert max(sizes) < t * t / 4, max(sizes)


def test_backend_choice_and_errors():
    assert mj.select_backend("auto")[0] == "xla"
    mask = AttnMask.causal(8)
    q = jnp.zeros((8, 2, 8))
    with pytest.raises(NotImplementedError, match="Mosaic GPU.*not available"):
        mj.flex_flash_attention(q, q, q, mask, backend="pallas")
    with pytest.raises(ValueError, match="backend='triton'"):
        mj.flex_flash_attention(q, q, q, mask, backend="triton")
    with pytest.raises(ValueError, match="total_q=8"):
        mj.flex_flash_attention(jnp.zeros((9, 2, 8)), q, q, mask)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        mj.flex_flash_attention(jnp.zeros((8, 3, 8)), q, q, mask)
    with pytest.raises(ValueError, match="head dim D=12"):
        z = jnp.zeros((8, 2, 12))
        mj.flex_flash_attention(z, z, z, mask)
    with pytest.raises(TypeError, match="dtypes differ"):
        mj.flex_flash_attention(q.astype(jnp.bfloat16), q, q, mask)
    with pytest.raises(TypeError, match="must be an AttnMask"):
        mj.flex_flash_attention(q, q, q, "causal")
