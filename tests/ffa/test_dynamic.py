"""Masks as data on one device: a jitted step fed many packings within one capacity compiles
once and matches the float64 reference at every step; a mask over capacity is rejected."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from tests.dynamic_masks import mixed_packings, varlen_packings

T = 200


def _step():
    def loss(q, k, v, plan, dout, dlse):
        out, lse = mj.flex_flash_attention(q, k, v, plan)
        return (out * dout).sum() + (jnp.where(jnp.isfinite(lse), lse, 0) * dlse).sum(), \
            (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.fixture
def float32_matmuls():
    """float32 tests mean float32 matmuls (GPUs default to TF32 otherwise)."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("packings", ["varlen", "mixed"])
def test_twenty_packings_compile_once(packings, float32_matmuls):
    masks = list((varlen_packings if packings == "varlen" else mixed_packings)(T, 20, seed=3))
    capacity = mj.PlanCapacity.from_masks(masks)
    step = _step()
    for i, mask in enumerate(masks):
        q, k, v, dout, dlse = random_inputs(jax.random.key(i), mask, 4, 2, 16, jnp.float32)
        plan = mj.plan_attention(mask, capacity, backend="xla")
        (_, (out, lse)), (dq, dk, dv) = step(q, k, v, plan, dout, dlse)
        assert_matches_reference(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), q, k, v, mask,
                                 dout, dlse)
    assert step._cache_size() == 1


def test_plan_static_part_depends_on_capacity_only():
    a, b = varlen_packings(T, 2, seed=1)
    cap = mj.PlanCapacity(T)
    pa, pb = mj.plan_attention(a, cap, backend="xla"), mj.plan_attention(b, cap, backend="xla")
    assert jax.tree.structure(pa) == jax.tree.structure(pb)
    assert [x.shape for x in jax.tree.leaves(pa)] == [x.shape for x in jax.tree.leaves(pb)]


def test_over_capacity_names_the_field():
    mask = mj.AttnMask.full(T)
    small = mj.PlanCapacity(T, items=1)
    with pytest.raises(mj.CapacityError, match=r"PlanCapacity\.items>=4"):
        mj.plan_attention(mask, small, backend="xla")
    with pytest.raises(ValueError, match="total_q=100"):
        mj.plan_attention(mask, mj.PlanCapacity(100), backend="xla")


def test_plan_checks_inputs():
    mask = mj.AttnMask.causal(T)
    plan = mj.plan_attention(mask, backend="xla")
    q = jnp.zeros((T + 1, 2, 16))
    with pytest.raises(ValueError, match="capacity"):
        mj.flex_flash_attention(q, q, q, plan)
    x = jnp.zeros((T, 2, 16))
    with pytest.raises(ValueError, match="backend='pallas' but the plan was built for 'xla'"):
        mj.flex_flash_attention(x, x, x, plan, backend="pallas")


def test_from_masks_is_tight():
    masks = list(varlen_packings(T, 5, seed=2))
    cap = mj.PlanCapacity.from_masks(masks, headroom=1.0)
    from magi_jax.planning.tiling import count_items
    assert cap.items == max(count_items(m.shapes, T, T) for m in masks)
    for m in masks:
        mj.plan_attention(m, cap, backend="xla")


@pytest.mark.gpu
@pytest.mark.skipif(not mj.pallas.device_supported()[0], reason="needs an sm90 GPU")
@pytest.mark.parametrize("persistent", [True, False])
def test_pallas_packings_compile_once(persistent):
    """The Mosaic GPU kernels on plans as data, with and without the persistent schedules
    that travel with the plan."""
    total = 2048
    masks = list(varlen_packings(total, 6, seed=11)) + list(mixed_packings(total, 6, seed=11))
    capacity = mj.PlanCapacity.from_masks(masks, persistent=persistent)
    step = _step()
    for i, mask in enumerate(masks):
        q, k, v, dout, dlse = random_inputs(jax.random.key(i), mask, 4, 2, 64, jnp.bfloat16)
        plan = mj.plan_attention(mask, capacity, backend="pallas", num_heads=(4, 2))
        assert bool(plan.schedules) == persistent
        (_, (out, lse)), (dq, dk, dv) = step(q, k, v, plan, dout, dlse)
        assert_matches_reference(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), q, k, v, mask,
                                 dout, dlse)
    assert step._cache_size() == 1
