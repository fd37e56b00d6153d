"""The dK/dV kernel for D = 256 (:mod:`magi_jax.pallas.ffa_dkv_wide`) in Mosaic GPU interpret
mode on the CPU (tiny shapes): against the float64 reference by docs/design.md §5 from the
portable backend's forward, free of races by the interpreter's race detector, and lowered for
sm90."""

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask
from magi_jax.pallas.common import LOG2E, WIDE_BWD_D
from magi_jax.pallas.ffa_dkv_wide import ffa_dkv_wide
from magi_jax.pallas.tuning import WideDkvConfig, kernel_configs
from magi_jax.planning.work_list import FWD_BLOCK_Q, plan_for_mask

# As in test_ffa_bwd.py: rows [100, 128) and [330, 384) see nothing, k-tile [128, 256) is seen
# by no query (both its 64-key programs walk no step), k-tile [0, 128) four query steps per
# head; the slices cut tiles inside both 64-key halves.
HOLES = AttnMask.from_ranges(
    [[0, 100], [256, 330], [256, 330]],
    [[0, 128], [256, 384], [0, 60]],
    ["causal", "inv_causal", "full"],
    384,
    384,
)
CAUSAL = AttnMask.causal(256)


@functools.partial(jax.jit, static_argnames=("mask", "scale", "softcap"))
def _kernel_inputs(q, k, v, dout, dlse, mask, scale, softcap):
    """``(q, k, v, dout, lse2, delta)`` of the kernel from the portable forward, built and
    padded as ``_ffa_bwd`` in :mod:`magi_jax.pallas.api` does (the masks here have whole
    tiles, so only the row statistics' padding matters)."""
    out, lse = jax.vmap(
        lambda a, b, c: mj.flex_flash_attention(
            a, b, c, mask, softmax_scale=scale, softcap=softcap, backend="xla"
        )
    )(q, k, v)
    lse_bht = jnp.swapaxes(lse, 1, 2)
    finite = jnp.isfinite(lse_bht)
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), dout.astype(jnp.float32))
    delta = delta - jnp.where(finite, jnp.swapaxes(dlse, 1, 2), 0.0)
    lse2 = jnp.where(finite, lse_bht * LOG2E, jnp.inf)
    pad_stat = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, -x.shape[2] % FWD_BLOCK_Q)))
    return q, k, v, dout, pad_stat(lse2), pad_stat(delta)


def _grads(mask, dtype, *, softcap=0.0, split=0, seed=0, hq=4, hkv=2, batch=2, **cfg):
    """``(inputs, dk, dv)`` of the kernel in interpret mode (split parts joined again)."""
    inputs = random_inputs(jax.random.key(seed), mask, hq, hkv, WIDE_BWD_D, dtype, batch)
    scale = WIDE_BWD_D**-0.5
    args = _kernel_inputs(*inputs, mask, scale, softcap)
    plan = plan_for_mask(mask, "pallas")
    config = WideDkvConfig(scale=scale, softcap=softcap, interpret=True, **cfg)
    parts = ffa_dkv_wide(*args, plan.k_order, plan.k_offsets, plan.k_items, config, split=split)
    if split:
        assert [p.shape[1] for p in parts] == [split] * 2 + [mask.total_k - split] * 2
        dk, dv = (jnp.concatenate(parts[i::2], axis=1) for i in range(2))
    else:
        dk, dv = parts
    return inputs, dk, dv


@pytest.mark.parametrize(
    "mask, dtype, tuning",
    [
        (HOLES, jnp.bfloat16, dict(num_stages=1)),
        (CAUSAL, jnp.float16, dict(softcap=2.0, split=64)),
    ],
    ids=["holes-bf16-1stage", "causal-fp16-softcap-split64-2stages"],
)
def test_matches_reference(mask, dtype, tuning):
    """GQA (Hq = 4, Hkv = 2), batch 2: each key head sums its two query heads."""
    (q, k, v, dout, dlse), dk, dv = _grads(mask, dtype, **tuning)
    for name, x in (("dk", dk), ("dv", dv)):
        assert not np.isnan(np.asarray(x, np.float32)).any(), name
    assert_matches_reference(
        dict(dk=dk, dv=dv), q, k, v, mask, dout, dlse, softcap=tuning.get("softcap", 0.0)
    )
    if mask is HOLES:  # the k-tile no query sees: programs without steps store zeros
        assert (np.asarray(dk, np.float32)[:, 128:256] == 0).all()
        assert (np.asarray(dv, np.float32)[:, 128:256] == 0).all()


def test_race_free(capfd):
    """The interpreter's happens-before race detector (test_ffa_bwd.py checks that it
    reports) on the Q/dO/lse2/delta ring of 2 slots (one query head, so every step refills a
    slot) and the outputs leaving through K/V: no race, and dK, dV match the reference.

    The detector sees TMA copies, generic loads and stores and the proxy fences, not the
    wgmma reads (the interpreter's wgmma keeps no vector clock): dropping the exchange's
    double buffer or the barrier before the outputs overwrite K/V goes unreported. Those
    orders rest on the arguments in the kernel's comments."""
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        (q, k, v, dout, dlse), dk, dv = _grads(HOLES, jnp.bfloat16, hq=2, hkv=1, batch=1)
    report = capfd.readouterr().out
    assert "RACE DETECTED" not in report, report[:2000]
    assert_matches_reference(dict(dk=dk, dv=dv), q, k, v, HOLES, dout, dlse)


def test_config_errors():
    """No persistent mode nor turns, D = 256 only, and 3 ring slots do not fit (291 KiB)."""
    plan = plan_for_mask(CAUSAL, "pallas")
    q = jax.ShapeDtypeStruct((1, 256, 2, WIDE_BWD_D), jnp.bfloat16)
    stat = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)

    def trace(q_, **cfg):
        f = lambda *a: ffa_dkv_wide(*a, *plan[3:6], WideDkvConfig(scale=0.1, **cfg))
        jax.jit(f).trace(q_, q_, q_, q_, stat, stat)

    with pytest.raises(ValueError, match="dkv_persistent=4: at D = 256"):
        kernel_configs(WIDE_BWD_D, 0.1, 0.0, False, dkv_persistent=4)
    with pytest.raises(ValueError, match="a schedule of 2 arrays: at D = 256"):
        jax.jit(
            lambda *a: ffa_dkv_wide(*a, *plan[3:6], WideDkvConfig(scale=0.1), (plan[4], plan[4]))
        ).trace(q, q, q, q, stat, stat)
    # Its warpgroups meet every step already: no turns to take.
    with pytest.raises(TypeError, match="unexpected keyword argument 'turns'"):
        WideDkvConfig(scale=0.1, turns=True)
    with pytest.raises(ValueError, match="wide backward kernels take .* got Dqk=128, Dv=128"):
        trace(jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"dkv_num_stages=3, D=256 .* lower dkv_num_stages"):
        trace(q, num_stages=3)


@pytest.mark.parametrize("softcap, split, stages", [(0.0, 0, 2), (2.0, 128, 2), (0.0, 64, 1)])
def test_lowers_for_sm90(softcap, split, stages):
    """Layout inference and Mosaic GPU's shared-memory check (225 KiB with 2 slots), for
    CUDA, on this host."""
    plan = plan_for_mask(HOLES, "pallas")
    q = jax.ShapeDtypeStruct((2, HOLES.total_q, 4, WIDE_BWD_D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, HOLES.total_k, 2, WIDE_BWD_D), jnp.bfloat16)
    stat = jax.ShapeDtypeStruct((2, 4, HOLES.total_q), jnp.float32)
    cfg = WideDkvConfig(scale=0.1, softcap=softcap, num_stages=stages)
    f = lambda *a: ffa_dkv_wide(*a, *plan[3:6], cfg, split=split)
    jax.jit(f).trace(q, kv, kv, q, stat, stat).lower(lowering_platforms=("cuda",))
