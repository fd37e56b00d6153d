"""The exponential on the FMA pipes (``exp2_fma``) and the column split that uses it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.pallas.common import check_fma_cols, exp2_cols, exp2_fma


@pytest.mark.parametrize("jit", [False, True])
def test_exp2_fma_accuracy_and_flush(jit):
    """Relative error under 1e-4 (below half an fp16 ulp) over the softmax's range, exactly
    0 below -126 and at -inf (masked cells, empty rows), also when XLA fuses it (it would
    simplify the rounding away without the barrier)."""
    x = np.concatenate([np.linspace(-130.0, 0.25, 200_001), [-np.inf, -1e30, -126.5]])
    f = jax.jit(exp2_fma) if jit else exp2_fma
    got = np.asarray(f(jnp.asarray(x, jnp.float32)), np.float64)
    ref = np.exp2(np.asarray(x, np.float32).astype(np.float64))
    normal = x >= -125.0
    assert np.abs(got[normal] / ref[normal] - 1).max() < 1e-4
    assert (got[x < -126.0] == 0).all()
    assert np.isfinite(got).all()


def test_exp2_cols_splits_the_last_columns():
    x = -jnp.abs(jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)) * 20
    split = np.asarray(exp2_cols(x, 16))
    np.testing.assert_array_equal(split[:, :112], np.asarray(jnp.exp2(x[:, :112])))
    np.testing.assert_array_equal(split[:, 112:], np.asarray(exp2_fma(x[:, 112:])))
    np.testing.assert_array_equal(np.asarray(exp2_cols(x, 0)), np.asarray(jnp.exp2(x)))


def test_fma_cols_checked():
    check_fma_cols(16, 128, "blocks")
    with pytest.raises(ValueError, match="fma_exp_cols=12 must be a multiple of 8"):
        check_fma_cols(12)
    with pytest.raises(
        ValueError,
        match="fma_exp_cols=64 must be below the 64 columns of the dK/dV kernel's score blocks",
    ):
        check_fma_cols(64, 64, "the dK/dV kernel's score blocks")
