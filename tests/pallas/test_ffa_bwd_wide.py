"""The wide backward kernels (D = 256, :mod:`magi_jax.pallas.ffa_bwd_wide`) in Mosaic GPU
interpret mode on the CPU (tiny shapes), each against the float64 reference by
docs/design.md §5 from the portable backend's forward; and lowered for sm90."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.mask import AttnMask
from magi_jax.pallas import plan_for_mask
from magi_jax.pallas.common import LOG2E
from magi_jax.pallas.ffa_bwd import BwdConfig
from magi_jax.pallas.ffa_bwd_wide import ffa_dkv_wide, ffa_dq_wide
from magi_jax.ffa.testing import assert_matches_reference, random_inputs

D = 256
# Rows [100, 128) and [330, 384) see nothing, q-tile [128, 256) no key, k-tile [128, 256) is
# seen by no query; slices that cut tiles inside both 64-row halves.
HOLES = AttnMask.from_ranges([[0, 100], [256, 330], [256, 330]],
                             [[0, 128], [256, 384], [0, 60]],
                             ["causal", "inv_causal", "full"], 384, 384)


def _pad(x, axis):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -x.shape[axis] % 128)
    return jnp.pad(x, pad)


@functools.partial(jax.jit, static_argnames=("mask", "scale", "softcap"))
def _kernel_inputs(q, k, v, dout, dlse, mask, scale, softcap):
    """``(q, k, v, dout, lse2, delta)`` of the backward kernels, from the portable forward,
    padded as :mod:`magi_jax.pallas.api` pads them."""
    out, lse = jax.vmap(lambda a, b, c: mj.flex_flash_attention(
        a, b, c, mask, softmax_scale=scale, softcap=softcap, backend="xla"))(q, k, v)
    lse = jnp.swapaxes(lse, 1, 2)
    finite = jnp.isfinite(lse)
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), dout.astype(jnp.float32))
    delta = delta - jnp.where(finite, jnp.swapaxes(dlse, 1, 2), 0.0)
    lse2 = jnp.where(finite, lse * LOG2E, jnp.inf)
    return (_pad(q, 1), _pad(k, 1), _pad(v, 1), _pad(dout, 1), _pad(lse2, 2), _pad(delta, 2))


def _check(mask, dtype, hq, hkv, batch, softcap=0.0, seed=0, split=0, **cfg):
    q, k, v, dout, dlse = random_inputs(jax.random.key(seed), mask, hq, hkv, D, dtype, batch)
    scale = D ** -0.5
    args = _kernel_inputs(q, k, v, dout, dlse, mask, scale, softcap)
    plan = plan_for_mask(mask, "pallas")
    config = BwdConfig(scale=scale, softcap=softcap, interpret=True, **cfg)
    dq = ffa_dq_wide(*args, plan.q_order, plan.q_offsets, plan.q_items, config)
    parts = ffa_dkv_wide(*args, plan.k_order, plan.k_offsets, plan.k_items, config, split=split)
    if split:
        dk, dv = (jnp.concatenate(parts[i::2], axis=1) for i in range(2))
    else:
        dk, dv = parts
    tq, tk = mask.total_q, mask.total_k
    res = dict(dq=dq[:, :tq], dk=dk[:, :tk], dv=dv[:, :tk])
    assert_matches_reference(res, q, k, v, mask, dout, dlse, softcap=softcap)
    return res


def test_holes_gqa_batch_bf16():
    res = _check(HOLES, jnp.bfloat16, hq=4, hkv=2, batch=2)
    assert (np.asarray(res["dq"], np.float32)[:, 128:256] == 0).all()
    assert (np.asarray(res["dk"], np.float32)[:, 128:256] == 0).all()


def test_causal_fp16_softcap_split_one_slot():
    _check(AttnMask.causal(256), jnp.float16, hq=2, hkv=1, batch=1, softcap=2.0, seed=1,
           split=64, num_stages=1)


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_wide_backward_lowers_for_sm90(softcap):
    """Layout inference and Mosaic GPU's shared-memory check, for CUDA, on this host."""
    plan = plan_for_mask(HOLES, "pallas")
    q = jax.ShapeDtypeStruct((2, HOLES.total_q, 4, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, HOLES.total_k, 2, D), jnp.bfloat16)
    stat = jax.ShapeDtypeStruct((2, 4, HOLES.total_q), jnp.float32)
    cfg = BwdConfig(scale=0.1, softcap=softcap)
    for fn, lists, kw in [(ffa_dq_wide, plan[:3], {}), (ffa_dkv_wide, plan[3:6], {}),
                          (ffa_dkv_wide, plan[3:6], dict(split=128))]:
        f = jax.jit(lambda *a, fn=fn, lists=lists, kw=kw: fn(*a, *lists, cfg, **kw))
        f.trace(q, kv, kv, q, stat, stat).lower(lowering_platforms=("cuda",))
