"""The cudnn engine on a real GPU (cuDNN's packed layout, sm90 or later) against the float64
reference: forward and gradients, GQA, batches, rows that see no key. Skipped elsewhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax import pallas
from magi_jax.ffa.cudnn import device_problem
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.masks import AttnMask
from magi_jax.masks.packings import sample_doc_lens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(device_problem()), reason="needs a GPU of sm90 or later"),
]

DOCS = [704, 537, 435, 256, 281, 77, 102, 51, 179, 652]  # 3274 tokens, unaligned
CU = np.cumsum([0] + DOCS)
T = int(CU[-1])
WEB = np.concatenate([[0], np.cumsum(sample_doc_lens(4096, 11))])
MASKS = {
    "full": AttnMask.full(2048),
    "causal": AttnMask.causal(2048),
    "window": AttnMask.varlen([0, 2048], window=(299, 0)),
    "doc_causal": AttnMask.varlen(CU, causal=True),
    "doc_full": AttnMask.varlen(CU, causal=False),
    "doc_window": AttnMask.varlen(CU, causal=True, window=(127, 0)),
    "web_4k": AttnMask.varlen(WEB, causal=True),
    # Padding rows between documents and keys no query sees.
    "gaps": AttnMask.from_ranges(
        [[0, 300], [340, 1000], [1000, 1001], [1100, 1800]],
        [[0, 300], [340, 1000], [1000, 1001], [1100, 1800]],
        "causal",
        1900,
        1900,
    ),
    # Documents whose keys sit elsewhere than their queries (full blocks, rectangles).
    "cross_full": AttnMask.from_ranges(
        [[0, 500], [600, 1400]], [[0, 700], [800, 1000]], "full", 1500, 1200
    ),
}


def _run(mask, dtype=jnp.bfloat16, hq=4, hkv=4, d=128, batch=None, seed=0):
    q, k, v, dout, dlse = random_inputs(jax.random.key(seed), mask, hq, hkv, d, dtype, batch)
    fn = lambda a, b, c: mj.flex_flash_attention(a, b, c, mask, backend="cudnn")
    (out, lse), vjp = jax.vjp(jax.jit(fn), q, k, v)
    dq, dk, dv = vjp((dout, dlse))
    res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    assert_matches_reference(res, q, k, v, mask, dout, dlse)
    # A loss on out alone: cuDNN's backward by itself.
    loss = lambda a, b, c: jnp.sum(fn(a, b, c)[0].astype(jnp.float32) * dout)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert_matches_reference(dict(zip(("dq", "dk", "dv"), grads)), q, k, v, mask, dout, None)
    return res


@pytest.mark.parametrize("name", list(MASKS))
def test_masks_bf16(name):
    _run(MASKS[name])


@pytest.mark.parametrize(
    "name,dtype,hq,hkv,d,batch",
    [
        ("doc_causal", jnp.float16, 8, 2, 128, None),
        ("doc_full", jnp.bfloat16, 8, 1, 64, None),
        ("gaps", jnp.bfloat16, 6, 2, 64, 2),
        ("causal", jnp.float16, 4, 2, 256, 2),
        ("doc_window", jnp.bfloat16, 4, 2, 128, 2),
    ],
)
def test_gqa_dtypes_head_dims_batches(name, dtype, hq, hkv, d, batch):
    _run(MASKS[name], dtype, hq, hkv, d, batch)


def test_rows_that_see_no_key():
    mask = MASKS["gaps"]
    res = _run(mask, hq=2, hkv=2, d=64)
    empty = np.r_[300:340, 1001:1100, 1800:1900]
    out, lse, dq = (np.asarray(res[n], np.float32) for n in ("out", "lse", "dq"))
    assert np.all(out[empty] == 0) and np.all(np.isneginf(lse[empty])) and np.all(dq[empty] == 0)
    for name in ("dk", "dv"):  # keys no query sees
        assert np.all(np.asarray(res[name], np.float32)[empty] == 0)


def test_auto_follows_the_table_here():
    from magi_jax.ffa.engine_table import choose

    q = jax.ShapeDtypeStruct((16384, 8, 128), jnp.bfloat16)
    mask = AttnMask.causal(16384)
    name, why = mj.select_backend("auto", q, q, q, mask)
    if pallas.device_supported()[0]:
        assert (name, why) == choose(mask), why
    else:  # no FFA kernels here: cudnn for what it expresses, saying why not pallas
        assert name == "cudnn" and "pallas" in why, why
    # Sinks are not cuDNN's: auto leaves it out and says so.
    name, why = mj.select_backend("auto", q, q, q, mask, sink=True)
    assert name != "cudnn" and "sinks" in why
