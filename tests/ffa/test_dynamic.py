"""Masks as data on one device: a jitted step fed many packings within one capacity compiles
once and matches the float64 reference at every step; a mask over capacity is rejected."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from tests.dynamic_masks import mixed_packings, varlen_packings
from tests.xla_options import OPTIMIZED

T = 200


def _step():
    def loss(q, k, v, plan, dout, dlse):
        out, lse = mj.flex_flash_attention(q, k, v, plan)
        return (out * dout).sum() + (jnp.where(jnp.isfinite(lse), lse, 0) * dlse).sum(), (out, lse)

    # It runs 20 times: worth optimising (tests/xla_options.py).
    return jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), compiler_options=OPTIMIZED
    )


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
        assert_matches_reference(
            dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), q, k, v, mask, dout, dlse
        )
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
        assert_matches_reference(
            dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), q, k, v, mask, dout, dlse
        )
    assert step._cache_size() == 1


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_plans_travel_as_runs_and_expand_to_the_item_lists(backend):
    """A plan stores its lists as runs; expanded on the device (inside jit) they are exactly
    the item lists the kernels read, padded to the capacity, for every zoo mask."""
    from magi_jax.ffa.plan import expand_lists
    from magi_jax.mask_zoo import zoo
    from magi_jax.planning.work_list import (
        FFAPlanRuns,
        backend_blocks,
        build_work_list,
        pad_work_list,
    )

    total = 512
    masks = zoo(total)
    cap = mj.PlanCapacity.from_masks(masks.values())
    expand = jax.jit(expand_lists, static_argnums=1)
    fwd, bwd = backend_blocks(backend, total, total)
    for name, mask in masks.items():
        plan = mj.plan_attention(mask, cap, backend=backend)
        assert isinstance(plan.lists, FFAPlanRuns), name
        want = (
            *pad_work_list(
                build_work_list(mask.shapes, total, total, *fwd, "q"), plan.static.items[0]
            ),
            *pad_work_list(
                build_work_list(mask.shapes, total, total, *bwd, "k"), plan.static.items[1]
            ),
        )
        got = expand(plan.lists, plan.static.items)
        for field, x, y in zip(got._fields, got, want):
            assert x.dtype == y.dtype and x.shape == y.shape, (name, field)
            np.testing.assert_array_equal(np.asarray(x), y, err_msg=f"{name} {field}")


def test_runs_over_capacity_name_the_field():
    from magi_jax.planning.work_list import count_runs

    mask = mj.AttnMask.varlen([0, 50, 120, T], causal=True)
    cap = mj.PlanCapacity.from_masks([mask], headroom=1.0)
    assert (cap.q_runs, cap.k_runs) == count_runs(mask.shapes, T, T)
    lists = mj.plan_attention(mask, mj.PlanCapacity(T), backend="pallas").lists
    need = dict(
        q_runs=int((lists.q_runs[:, -1] > 0).sum()), k_runs=int((lists.k_runs[:, -1] > 0).sum())
    )
    mj.plan_attention(mask, mj.PlanCapacity(T, **need), backend="pallas")
    for field, n in need.items():
        with pytest.raises(
            mj.CapacityError,
            match=rf"PlanCapacity\.{field}>={n} .* holds "
            rf"{n - 1};",
        ):
            mj.plan_attention(mask, mj.PlanCapacity(T, **{field: n - 1}), backend="pallas")
    with pytest.raises(ValueError, match=r"PlanCapacity\.k_runs=0"):
        mj.PlanCapacity(T, k_runs=0)
