"""The fused backward kernel (:mod:`magi_jax.pallas.ffa_bwd_fused`) in Mosaic GPU interpret
mode on the CPU (tiny shapes): against the float64 reference by docs/design.md §5 from the
portable backend's forward, free of races by the interpreter's race detector, and lowered for
sm90. Interpret mode stores each step's dQ block apart instead of the TMA reduce-add (which
it lacks); the GPU tests run the reduction."""

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask
from magi_jax.pallas.common import LOG2E
from magi_jax.pallas.ffa_bwd import BwdConfig
from magi_jax.pallas.ffa_bwd_fused import ffa_dkvq
from magi_jax.planning.work_list import FWD_BLOCK_Q, plan_for_mask

# Rows [100, 128) and [330, 384) see nothing, k-tile [128, 256) is seen by no query (its
# programs walk no step and store zeros), and the slices cut tiles inside both 64-key halves.
HOLES = AttnMask.from_ranges([[0, 100], [256, 330], [256, 330]],
                             [[0, 128], [256, 384], [0, 60]],
                             ["causal", "inv_causal", "full"], 384, 384)
CAUSAL = AttnMask.causal(256)


@functools.partial(jax.jit, static_argnames=("mask", "scale", "softcap"))
def _kernel_inputs(q, k, v, dout, dlse, mask, scale, softcap):
    """``(q, k, v, dout, lse2, delta)`` of the kernel from the portable forward, as
    ``_ffa_bwd`` in :mod:`magi_jax.pallas.api` builds them."""
    out, lse = jax.vmap(lambda a, b, c: mj.flex_flash_attention(
        a, b, c, mask, softmax_scale=scale, softcap=softcap, backend="xla"))(q, k, v)
    lse_bht = jnp.swapaxes(lse, 1, 2)
    finite = jnp.isfinite(lse_bht)
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), dout.astype(jnp.float32))
    delta = delta - jnp.where(finite, jnp.swapaxes(dlse, 1, 2), 0.0)
    lse2 = jnp.where(finite, lse_bht * LOG2E, jnp.inf)
    pad_stat = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, -x.shape[2] % FWD_BLOCK_Q)))
    return q, k, v, dout, pad_stat(lse2), pad_stat(delta)


def _grads(mask, dtype, d, *, softcap=0.0, seed=0, hq=4, hkv=2, batch=2, **cfg):
    inputs = random_inputs(jax.random.key(seed), mask, hq, hkv, d, dtype, batch)
    scale = d ** -0.5
    args = _kernel_inputs(*inputs, mask, scale, softcap)
    plan = plan_for_mask(mask, "pallas")
    config = BwdConfig(scale=scale, softcap=softcap, interpret=True, **cfg)
    return inputs, ffa_dkvq(*args, plan.k_order, plan.k_offsets, plan.k_items, config)


@pytest.mark.parametrize("mask, dtype, d, tuning", [
    (HOLES, jnp.bfloat16, 128, dict(num_stages=1)),
    (HOLES, jnp.float16, 64, {}),
    (CAUSAL, jnp.bfloat16, 128, dict(softcap=2.0)),
], ids=["holes-bf16-d128-1stage", "holes-fp16-d64", "causal-bf16-d128-softcap"])
def test_matches_reference(mask, dtype, d, tuning):
    """GQA (Hq = 4, Hkv = 2), batch 2: each key head sums its two query heads, and each
    query step's dQ sums the k-tiles that see it."""
    (q, k, v, dout, dlse), (dq, dk, dv) = _grads(mask, dtype, d, **tuning)
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not np.isnan(np.asarray(x, np.float32)).any(), name
    assert_matches_reference(dict(dq=dq, dk=dk, dv=dv), q, k, v, mask, dout, dlse,
                             softcap=tuning.get("softcap", 0.0))
    if mask is HOLES:   # rows that see no key, and the k-tile no query sees
        assert (np.asarray(dq, np.float32)[:, 100:128] == 0).all()
        assert (np.asarray(dk, np.float32)[:, 128:256] == 0).all()


def test_race_free(capfd):
    """The race detector on the Q/dO/lse2/delta ring (one query head: every step refills a
    slot), the dQ blocks handed to the producer and freed by it, and the outputs leaving
    through K/V. It does not see wgmma reads, so the exchange's reuse (``ds_read``) and the
    wait before K is overwritten rest on the arguments in the kernel."""
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        (q, k, v, dout, dlse), (dq, dk, dv) = _grads(HOLES, jnp.bfloat16, 128, hq=2, hkv=1,
                                                     batch=1)
    report = capfd.readouterr().out
    assert "RACE DETECTED" not in report, report[:2000]
    assert_matches_reference(dict(dq=dq, dk=dk, dv=dv), q, k, v, HOLES, dout, dlse)


def test_config_errors():
    plan = plan_for_mask(CAUSAL, "pallas")
    stat = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)

    def trace(d, **cfg):
        q = jax.ShapeDtypeStruct((1, 256, 2, d), jnp.bfloat16)
        f = lambda *a: ffa_dkvq(*a, *plan[3:6], BwdConfig(scale=0.1, **cfg))
        jax.jit(f).trace(q, q, q, q, stat, stat)

    with pytest.raises(ValueError, match=r"takes D in \(64, 128\); got 256"):
        trace(256)
    with pytest.raises(ValueError, match="persistent=4"):
        trace(128, persistent=4)
    with pytest.raises(ValueError, match="turns=True"):
        trace(128, turns=True)
    with pytest.raises(ValueError, match=r"dkv_num_stages=3, D=128 .* lower dkv_num_stages"):
        trace(128, num_stages=3)


@pytest.mark.parametrize("d, softcap", [(128, 0.0), (64, 2.0)])
def test_lowers_for_sm90(d, softcap):
    """Layout inference, the transposed dS operand, the producer's float32 reduce-adds and
    the exchange barriers, for CUDA."""
    plan = plan_for_mask(HOLES, "pallas")
    q = jax.ShapeDtypeStruct((2, HOLES.total_q, 4, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, HOLES.total_k, 2, d), jnp.bfloat16)
    stat = jax.ShapeDtypeStruct((2, 4, HOLES.total_q), jnp.float32)
    cfg = BwdConfig(scale=0.1, softcap=softcap)
    f = lambda *a: ffa_dkvq(*a, *plan[3:6], cfg)
    text = jax.jit(f).trace(q, kv, kv, q, stat, stat).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
