"""``return_max_logits`` on the pallas forward kernel: in Mosaic GPU interpret mode on the
CPU at tiny shapes, and on an sm90 GPU at realistic sizes, against the float64 reference by
docs/design.md §5. The kernel writes every row's max logit beside its lse (poisoned buffers
in interpret mode: a row it forgets fails the NaN check); with a softcap it keeps the raw
running max, so out and lse are checked along with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask
from magi_jax.pallas import device_supported, flex_flash_attention_pallas

# Rows [190, 200) see no key, lengths are not multiples of the 128-row tiles, and the
# second q-tile holds boundary items of every kind.
IRREGULAR = AttnMask.from_ranges(
    [[0, 100], [100, 190], [100, 190]],
    [[0, 100], [0, 60], [100, 200]],
    ["causal", "full", "causal"],
    200,
    200,
)
GAIN = 3.0  # logits well past the softcap


def _run(mask, dtype, hq, hkv, d, batch=None, softcap=0.0, grads=False, seed=0, **tuning):
    q, k, v, dout, dlse = random_inputs(jax.random.key(seed), mask, hq, hkv, d, dtype, batch)
    q = (q.astype(jnp.float32) * GAIN).astype(dtype)
    fn = lambda a, b, c: flex_flash_attention_pallas(
        a, b, c, mask, softcap=softcap, return_max_logits=True, **tuning
    )
    if grads:
        (out, lse, ml), vjp = jax.vjp(fn, q, k, v)
        dq, dk, dv = vjp((dout, dlse, jnp.ones_like(ml)))
        res = dict(out=out, lse=lse, max_logits=ml, dq=dq, dk=dk, dv=dv)
    else:
        out, lse, ml = jax.jit(fn)(q, k, v)
        res = dict(out=out, lse=lse, max_logits=ml)
    assert ml.dtype == jnp.float32 and ml.shape == q.shape[:-3] + q.shape[-2:-1]
    assert_matches_reference(res, q, k, v, mask, dout, dlse, softcap=softcap)
    return np.asarray(ml)


@pytest.mark.parametrize("softcap,hq,batch", [(0.0, 2, None), (4.0, 1, 2)])
def test_interpret(softcap, hq, batch):
    """GQA without softcap (the max from the softmax's running max); a batch with a softcap
    (the raw running max, its tanh the softmax's)."""
    ml = _run(
        IRREGULAR, jnp.bfloat16, hq=hq, hkv=1, d=64, batch=batch, softcap=softcap, interpret=True
    )
    assert np.isfinite(ml).all() and (ml > 4.0).all()  # past the cap, as intended


@pytest.mark.gpu
@pytest.mark.skipif(not device_supported()[0], reason="needs an sm90 GPU")
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_gpu_realistic_sizes(softcap):
    """Documents of 3274 tokens, GQA, D = 128, the default (persistent) forward and the
    backward beside it (the max logits add no gradient); one program per unit too."""
    docs = [704, 537, 435, 256, 281, 77, 102, 51, 179, 652]
    mask = AttnMask.varlen(np.cumsum([0] + docs), causal=True)
    _run(mask, jnp.bfloat16, hq=8, hkv=2, d=128, batch=2, softcap=softcap, grads=True)
    _run(mask, jnp.float16, hq=4, hkv=4, d=64, softcap=softcap, persistent=0)
