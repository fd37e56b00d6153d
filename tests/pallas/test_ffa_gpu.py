"""The pallas kernels on a real sm90 GPU at realistic sizes, against the float64 reference
(docs/design.md §5). Skipped without a Hopper GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask

pallas = pytest.importorskip("magi_jax.pallas")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not pallas.device_supported()[0], reason="needs an sm90 GPU"),
]

DOCS = [704, 537, 435, 256, 281, 77, 102, 51, 179, 652]  # 3274 tokens, unaligned
CU = np.cumsum([0] + DOCS)
T = int(CU[-1])
ZOO = {
    "full": AttnMask.full(2048),
    "causal": AttnMask.causal(2048),
    "causal_rect": AttnMask.causal(1000, 2600),
    "doc_causal": AttnMask.varlen(CU, causal=True),
    "doc_full": AttnMask.varlen(CU, causal=False),
    "swa_causal": AttnMask.varlen([0, T], causal=True, window=300),
    "sliding_window": AttnMask.sliding_window(T, 200, 77),
    "block_causal": AttnMask.block_causal(DOCS, 200),
    "shared_question": AttnMask.shared_question(DOCS),
    "prefix_lm": AttnMask.prefix_lm(DOCS, [d // 3 for d in DOCS]),
    "causal_blockwise": AttnMask.causal_blockwise(DOCS),
    "global_sliding_window": AttnMask.global_sliding_window(T, 256, 64),
    "empty_rows": AttnMask.from_ranges(
        [[0, 300], [700, 1500]], [[0, 500], [100, 900]], ["causal", "inv_causal"], 1600, 1000
    ),
}


def _check(mask, dtype=jnp.bfloat16, hq=4, hkv=4, d=128, batch=None, softcap=0.0, seed=0, **tuning):
    q, k, v, dout, dlse = random_inputs(jax.random.key(seed), mask, hq, hkv, d, dtype, batch)
    fn = lambda a, b, c: pallas.flex_flash_attention_pallas(
        a, b, c, mask, softcap=softcap, **tuning
    )
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    dq, dk, dv = vjp((dout, dlse))
    res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    return assert_matches_reference(res, q, k, v, mask, dout, dlse, softcap=softcap)


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_bf16(name):
    _check(ZOO[name])


# Every zoo mask at every head dim, with the dtype and the GQA group turning over the masks so
# that each head dim meets both dtypes with and without GQA.
_VARIANTS = [
    (jnp.bfloat16, (4, 4)),
    (jnp.float16, (4, 2)),
    (jnp.float16, (4, 4)),
    (jnp.bfloat16, (8, 2)),
]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("index,name", list(enumerate(ZOO)))
def test_zoo_head_dims_dtypes_gqa(index, name, d):
    dtype, (hq, hkv) = _VARIANTS[(index + d // 64) % len(_VARIANTS)]
    _check(ZOO[name], dtype, hq=hq, hkv=hkv, d=d, seed=index)


@pytest.mark.parametrize(
    "dtype,d,heads",
    [
        (jnp.float16, 128, (4, 4)),
        (jnp.bfloat16, 64, (4, 4)),
        (jnp.float16, 64, (8, 2)),
        (jnp.bfloat16, 128, (8, 1)),
        (jnp.bfloat16, 256, (8, 1)),
        (jnp.float16, 256, (4, 2)),
    ],
)
def test_dtypes_head_dims_gqa(dtype, d, heads):
    _check(ZOO["doc_causal"], dtype, hq=heads[0], hkv=heads[1], d=d)


def test_head_dim_256_softcap_batch():
    _check(ZOO["causal_blockwise"], jnp.bfloat16, hq=4, hkv=2, d=256, softcap=20.0, batch=2)


@pytest.mark.parametrize("mask_name", ["causal", "doc_causal"])
def test_forward_persistent(mask_name):
    """The persistent forward in 132 programs (one per H200 SM) on long rows too (by default
    it is persistent only on short ones), GQA, batch 2, also under the backward's VJP."""
    _check(ZOO[mask_name], hq=4, hkv=2, batch=2, persistent=132)


@pytest.mark.parametrize("mask_name", ["doc_causal", "swa_causal", "empty_rows"])
def test_backward_persistent(mask_name):
    """dkv_persistent: the dK/dV kernel walks its units in 132 programs (one per H200 SM)
    with 3 slots (its largest shared-memory plan, 226 KiB at D = 128)."""
    _check(ZOO[mask_name], hq=4, hkv=2, batch=2, dkv_persistent=132, dkv_num_stages=3)


def test_softcap_batch():
    _check(ZOO["shared_question"], jnp.bfloat16, hq=4, hkv=2, softcap=20.0, batch=2)


def test_front_door_auto_picks_pallas():
    import magi_jax as mj
    from magi_jax.ffa.engine_table import choose

    mask = ZOO["doc_causal"]
    q, k, v, dout, dlse = random_inputs(jax.random.key(5), mask, 4, 2, 128, jnp.bfloat16)
    # cuDNN's packed layout runs this mask too: the engine table decides between them.
    assert mj.select_backend("auto", q, k, v, mask)[0] == choose(mask)[0]
    assert mj.select_backend("auto", q, k, v, ZOO["block_causal"])[0] == "pallas"
    assert (
        mj.select_backend(
            "auto", q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask
        )[0]
        == "xla"
    )
    fn = lambda a, b, c: mj.flex_flash_attention(a, b, c, mask)
    (out, lse), vjp = jax.vjp(jax.jit(fn), q, k, v)
    dq, dk, dv = vjp((dout, dlse))
    assert_matches_reference(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), q, k, v, mask, dout, dlse)
