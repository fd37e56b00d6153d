"""Multi-head latent attention on the pallas kernels: a value head dim ``Dv`` of its own
(q, k ``[T, H, Dqk]``, v ``[T, Hkv, Dv]``, out ``[T, Hq, Dv]``) at Dqk/Dv = 128/64 (the
narrow kernels), 192/128 and 256/128 (the forward's half key tiles and the wide backward). In Mosaic
GPU interpret mode on the CPU at tiny shapes, forward and gradients against the float64
reference by docs/design.md §5 (interpret mode fills fresh buffers with NaN, so an output
element the kernels forget fails the NaN check); lowered for sm90 with every mode the
kernels have; on an sm90 GPU at realistic sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask
from magi_jax.pallas import (
    SUPPORTED_MLA_HEAD_DIMS,
    device_supported,
    ffa_pallas,
    flex_flash_attention_pallas,
    plan_for_mask,
    supported,
)

DIMS = [(128, 64), (192, 128)]
# Two causal documents and a full slice from the second onto the first's keys (a shared
# prompt): boundary items of every kind, rows covered by two slices, rows [230, 256) that
# see no key and keys nobody sees.
DOCS = AttnMask.from_ranges(
    [[0, 100], [100, 230], [100, 230]],
    [[0, 100], [100, 230], [0, 60]],
    ["causal", "causal", "full"],
    256,
    256,
)


def _inputs(mask, hq, hkv, dqk, dv, dtype=jnp.bfloat16, batch=None, seed=0):
    return random_inputs(jax.random.key(seed), mask, hq, hkv, dqk, dtype, batch, dv=dv)


def _fwd_bwd(mask, q, k, v, dout, dlse, softcap=0.0, **tuning):
    fn = lambda a, b, c: flex_flash_attention_pallas(a, b, c, mask, softcap=softcap, **tuning)
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    dq, dk, dv = vjp((dout, dlse))
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


@pytest.mark.parametrize("dqk,dv", SUPPORTED_MLA_HEAD_DIMS)
def test_forward_and_gradients_gqa(dqk, dv):
    """Two query heads over one key head (GQA): the dK/dV kernel sums both heads' gradients."""
    q, k, v, dout, dlse = _inputs(DOCS, 2, 1, dqk, dv)
    res = _fwd_bwd(DOCS, q, k, v, dout, dlse, interpret=True)
    assert res["out"].shape == (256, 2, dv) and res["dv"].shape == v.shape
    assert res["dq"].shape == q.shape and res["dk"].shape == k.shape
    assert_matches_reference(res, q, k, v, DOCS, dout, dlse)
    assert np.isneginf(np.asarray(res["lse"])[230:]).all()
    assert (np.asarray(res["out"], np.float32)[230:] == 0).all()
    assert (np.asarray(res["dk"], np.float32)[230:] == 0).all()


@pytest.mark.parametrize("dqk,dv", DIMS)
def test_softcap_max_logits_fp16_batch(dqk, dv):
    """fp16, a batch of two, a softcap, and the max logits beside out and lse."""
    mask = AttnMask.varlen([0, 90, 200], causal=True)
    q, k, v, dout, dlse = _inputs(mask, 1, 1, dqk, dv, jnp.float16, batch=2, seed=1)
    fn = lambda a, b, c: flex_flash_attention_pallas(
        a, b, c, mask, softcap=5.0, return_max_logits=True, interpret=True
    )
    (out, lse, peak), vjp = jax.vjp(fn, q, k, v)
    dq, dk, dv_ = vjp((dout, dlse, jnp.zeros_like(peak)))
    assert out.shape == (2, 200, 1, dv) and peak.shape == (2, 1)
    res = dict(out=out, lse=lse, max_logits=peak, dq=dq, dk=dk, dv=dv_)
    assert_matches_reference(res, q, k, v, mask, dout, dlse, softcap=5.0)


def test_persistent_narrow_kernels():
    """128/64 runs the narrow kernels, whose persistent modes walk units across programs:
    the forward's output and the dK/dV kernel's dK, dV leave through buffers of their own."""
    q, k, v, dout, dlse = _inputs(DOCS, 2, 1, 128, 64, seed=2)
    res = _fwd_bwd(DOCS, q, k, v, dout, dlse, interpret=True, persistent=3, dkv_persistent=3)
    assert_matches_reference(res, q, k, v, DOCS, dout, dlse)


@pytest.mark.parametrize("dqk,dv", SUPPORTED_MLA_HEAD_DIMS)
def test_lowers_for_sm90(dqk, dv):
    """Forward and backward lower to Mosaic GPU kernels for CUDA on this host (layout
    inference, the wgmma shapes and the shared-memory budget are checked there, no GPU
    needed): one program per unit, the persistent kernels where they exist (the forward at
    both shapes, dK/dV at 128/64), a softcap with max logits."""
    plan = plan_for_mask(DOCS, "pallas")
    q = jax.ShapeDtypeStruct((DOCS.total_q, 2, dqk), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((DOCS.total_k, 1, dqk), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((DOCS.total_k, 1, dv), jnp.bfloat16)
    modes = [
        dict(persistent=0, dkv_persistent=0),
        dict(persistent=132, dkv_persistent=132 if dqk <= 128 else 0),
        dict(softcap=20.0, return_max_logits=True),
    ]
    for mode in modes:

        def loss(q_, k_, v_, mode=mode):
            out, lse, *_ = ffa_pallas(q_, k_, v_, plan, softmax_scale=0.1, **mode)
            return out.astype(jnp.float32).sum() + lse.sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        text = grad.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("mosaic_gpu") >= 3, mode  # the forward, dQ and dK/dV kernels


def test_supported_shapes_and_reasons():
    x = lambda d, h=2: jnp.zeros((16, h, d), jnp.bfloat16)
    for dqk, dv in SUPPORTED_MLA_HEAD_DIMS:
        assert supported(x(dqk), x(dqk, 1), x(dv, 1), check_device=False) == (True, "")
    ok, why = supported(x(192), x(192), x(64), check_device=False)
    assert not ok and "Dv=64" in why and "D=192" in why and "(192, 128)" in why
    ok, why = supported(x(128), x(64), x(64), check_device=False)
    assert not ok and "q has head dim 128 and k 64" in why


def test_backend_choice():
    """``auto`` no longer falls back for the Dv pallas takes: on a CPU the reason is the
    device; a pair it does not take keeps the head dims as the reason, and so does an explicit
    ``pallas``."""
    q, k, v, *_ = _inputs(DOCS, 2, 1, 192, 128)
    name, why = mj.select_backend("auto", q, k, v, DOCS)
    if device_supported()[0]:
        assert name == "pallas"
    else:
        # the cudnn engine's reason names Dv (it takes one head dim); the kernels' does not
        kernels_why = why[why.index("pallas (Mosaic GPU)") :]
        assert name == "xla" and "Dv" not in kernels_why and "GPU" in kernels_why
    q, k, v, *_ = _inputs(DOCS, 2, 1, 192, 64)
    name, why = mj.select_backend("auto", q, k, v, DOCS)
    assert name == "xla" and "Dv=64 differs" in why and "xla backend takes any" in why
    with pytest.raises(NotImplementedError, match="Dv=64 differs"):
        mj.flex_flash_attention(q, k, v, DOCS, backend="pallas")


# Documents of unaligned lengths (4096 tokens) with a shared prompt: the first 256 keys seen
# by every later document.
_GPU_DOCS = [1000, 771, 1300, 512, 513]
_GPU_CU = np.cumsum([0] + _GPU_DOCS)
_GPU_MASK = AttnMask.from_ranges(
    [[int(a), int(b)] for a, b in zip(_GPU_CU[:-1], _GPU_CU[1:])]
    + [[int(_GPU_CU[1]), int(_GPU_CU[-1])]],
    [[int(a), int(b)] for a, b in zip(_GPU_CU[:-1], _GPU_CU[1:])] + [[0, 256]],
    ["causal"] * len(_GPU_DOCS) + ["full"],
    int(_GPU_CU[-1]),
    int(_GPU_CU[-1]),
)


@pytest.mark.gpu
@pytest.mark.skipif(not device_supported()[0], reason="needs an sm90 GPU")
@pytest.mark.parametrize("dqk,dv", DIMS)
def test_gpu_realistic_sizes(dqk, dv):
    """4096 tokens of causal documents with a shared prompt, 8 query heads over 2 key heads,
    the default kernels (persistent where they pay), forward and gradients."""
    q, k, v, dout, dlse = _inputs(_GPU_MASK, 8, 2, dqk, dv, seed=3)
    res = jax.jit(lambda *a: _fwd_bwd(_GPU_MASK, *a))(q, k, v, dout, dlse)
    assert res["out"].shape == (_GPU_MASK.total_q, 8, dv)
    assert_matches_reference(res, q, k, v, _GPU_MASK, dout, dlse)


@pytest.mark.gpu
@pytest.mark.skipif(not device_supported()[0], reason="needs an sm90 GPU")
@pytest.mark.parametrize("dqk,dv", DIMS)
def test_gpu_causal_batch_softcap(dqk, dv):
    """Causal attention over 2048 tokens in a batch of two with a softcap, fp16, 4 heads."""
    mask = AttnMask.causal(2048)
    q, k, v, dout, dlse = _inputs(mask, 4, 4, dqk, dv, jnp.float16, batch=2, seed=4)
    res = jax.jit(lambda *a: _fwd_bwd(mask, *a, softcap=30.0))(q, k, v, dout, dlse)
    assert_matches_reference(res, q, k, v, mask, dout, dlse, softcap=30.0)
