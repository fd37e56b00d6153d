"""The wide dQ kernel (D = 256, :mod:`magi_jax.pallas.ffa_dq_wide`) in Mosaic GPU interpret
mode on the CPU (tiny shapes): against the float64 reference by docs/design.md §5 from the
portable backend's forward, free of races by the interpreter's race detector, and lowered
for sm90."""

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask
from magi_jax.pallas import plan_for_mask
from magi_jax.pallas.common import LOG2E, WIDE_BWD_D
from magi_jax.pallas.ffa_dq_wide import ffa_dq_wide
from magi_jax.pallas.tuning import WideDqConfig
from magi_jax.planning.work_list import FWD_BLOCK_Q

# q-tile [128, 256) sees no key; rows [100, 128) and [330, 384) see nothing; the slices cut
# tiles inside both 64-row halves of a q-tile and both 32-key parts of a step; q-tile
# [256, 384) walks two key tiles.
HOLES = AttnMask.from_ranges(
    [[0, 100], [256, 330], [256, 330]],
    [[0, 128], [256, 384], [0, 60]],
    ["causal", "inv_causal", "full"],
    384,
    384,
)


def _pad_rows(x, axis):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -x.shape[axis] % FWD_BLOCK_Q)
    return jnp.pad(x, pad)


@functools.partial(jax.jit, static_argnames=("mask", "scale", "softcap"))
def _kernel_inputs(q, k, v, dout, dlse, mask, scale, softcap):
    """``(q, k, v, dout, lse2, delta)`` of the dQ kernel from the portable forward, built and
    padded as ``_ffa_bwd`` in :mod:`magi_jax.pallas.api` builds them."""
    out, lse = jax.vmap(
        lambda a, b, c: mj.flex_flash_attention(
            a, b, c, mask, softmax_scale=scale, softcap=softcap, backend="xla"
        )
    )(q, k, v)
    lse_bht = jnp.swapaxes(lse, 1, 2)
    finite = jnp.isfinite(lse_bht)
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), dout.astype(jnp.float32))
    delta = delta - jnp.where(finite, jnp.swapaxes(dlse, 1, 2).astype(jnp.float32), 0.0)
    lse2 = jnp.where(finite, lse_bht * LOG2E, jnp.inf)
    return (
        _pad_rows(q, 1),
        _pad_rows(k, 1),
        _pad_rows(v, 1),
        _pad_rows(dout, 1),
        _pad_rows(lse2, 2),
        _pad_rows(delta, 2),
    )


def _dq(mask, dtype, hq, hkv, batch, softcap=0.0, seed=0, **tuning):
    """The kernel's dq (unpadded, float32) and its inputs."""
    q, k, v, dout, dlse = random_inputs(
        jax.random.key(seed), mask, hq, hkv, WIDE_BWD_D, dtype, batch
    )
    scale = WIDE_BWD_D**-0.5
    args = _kernel_inputs(q, k, v, dout, dlse, mask, scale, softcap)
    plan = plan_for_mask(mask, "pallas")
    cfg = WideDqConfig(scale=scale, softcap=softcap, interpret=True, **tuning)
    dq = ffa_dq_wide(*args, plan.q_order, plan.q_offsets, plan.q_items, cfg)
    return np.asarray(dq[:, : mask.total_q], np.float32), (q, k, v, dout, dlse)


def _check(mask, dtype, hq, hkv, batch, softcap=0.0, seed=0, **tuning):
    dq, (q, k, v, dout, dlse) = _dq(mask, dtype, hq, hkv, batch, softcap, seed, **tuning)
    assert not np.isnan(dq).any()
    assert_matches_reference(dict(dq=dq), q, k, v, mask, dout, dlse, softcap=softcap)
    return dq


@pytest.mark.parametrize("num_stages", [1, 2])
def test_holes_gqa_batch_bf16(num_stages):
    """Batch 2, Hq = 4 over Hkv = 2, tiles without keys and rows without keys (dQ 0 there),
    rings of one and two slots."""
    dq = _check(HOLES, jnp.bfloat16, hq=4, hkv=2, batch=2, num_stages=num_stages)
    assert (dq[:, 100:256] == 0).all() and (dq[:, 330:] == 0).all()


def test_causal_fp16_softcap():
    _check(AttnMask.causal(256), jnp.float16, hq=2, hkv=1, batch=1, softcap=2.0, seed=1)


def test_race_free(capfd):
    """The interpreter's happens-before race detector finds no race, and the result is
    unchanged. It checks generic loads and stores and TMA copies (here: the dS exchange's
    stores, the statistics' loads, dQ stored through Q's buffers, which it reports if both
    warpgroups store into one), not a wgmma's reads of its operands (JAX 0.11.2 interprets
    wgmma without vector clocks): those rest on the barriers' argument in the kernel. The
    interpreter raises on a barrier phase that no thread observed (a ring slot refilled
    before it was freed)."""
    plain, _ = _dq(HOLES, jnp.bfloat16, hq=2, hkv=1, batch=1)
    capfd.readouterr()
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        dq, _ = _dq(HOLES, jnp.bfloat16, hq=2, hkv=1, batch=1)
    report = capfd.readouterr().out
    assert "RACE DETECTED" not in report, report[:2000]
    np.testing.assert_array_equal(dq, plain)


def test_config_errors():
    plan = plan_for_mask(AttnMask.causal(256), "pallas")
    x = jax.ShapeDtypeStruct((1, 256, 2, WIDE_BWD_D), jnp.bfloat16)
    args = (x,) * 6 + tuple(plan[:3])
    # One program per unit, consumers that issue as they go: no such fields.
    with pytest.raises(TypeError, match="unexpected keyword argument 'persistent'"):
        WideDqConfig(scale=0.1, persistent=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'turns'"):
        WideDqConfig(scale=0.1, turns=True)
    with pytest.raises(
        ValueError,
        match=r"wide dQ kernel with dq_num_stages=3, D=256 .* "
        "lower dq_num_stages",
    ):
        jax.eval_shape(
            lambda *a: ffa_dq_wide(*a, *plan[:3], WideDqConfig(scale=0.1, num_stages=3)), *args[:6]
        )
    small = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="wide backward kernels take .* got Dqk=128, Dv=128"):
        ffa_dq_wide(*(small,) * 6, *plan[:3], WideDqConfig(scale=0.1))


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_lowers_for_sm90(softcap):
    """Layout inference and Mosaic GPU's own shared-memory check (2 stages: 209 KiB of
    buffers), for CUDA on this host (no GPU needed)."""
    plan = plan_for_mask(HOLES, "pallas")
    q = jax.ShapeDtypeStruct((2, HOLES.total_q, 4, WIDE_BWD_D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, HOLES.total_k, 2, WIDE_BWD_D), jnp.bfloat16)
    stat = jax.ShapeDtypeStruct((2, 4, HOLES.total_q), jnp.float32)
    cfg = WideDqConfig(scale=0.1, softcap=softcap)
    f = lambda q_, k_, v_, do, lse2, delta: ffa_dq_wide(q_, k_, v_, do, lse2, delta, *plan[:3], cfg)
    jax.jit(f).trace(q, kv, kv, q, stat, stat).lower(lowering_platforms=("cuda",))
