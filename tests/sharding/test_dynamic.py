"""Masks as data under context parallelism on 8 CPU devices: a jitted training step that
takes the key as an argument compiles once over 20 packings (document-causal, and mixed zoo
kinds) within one capacity, and matches the float64 reference at every step, forward and
gradients; over-capacity masks name the field."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from tests.dynamic_masks import mixed_packings, varlen_packings
from tests.sharding.steps import attention_step
from tests.xla_options import OPTIMIZED

T = 256
CP = 8


def _mesh():
    return jax.make_mesh(
        (CP,), ("cp",), devices=jax.devices()[:CP], axis_types=(jax.sharding.AxisType.Auto,)
    )


# runs 20 times: worth optimising
_step = jax.jit(attention_step, compiler_options=OPTIMIZED)


@pytest.mark.parametrize("packings", ["varlen", "mixed"])
def test_twenty_packings_compile_once(packings):
    masks = list((varlen_packings if packings == "varlen" else mixed_packings)(T, 20, seed=5))
    capacity = mj.PlanCapacity.from_masks(masks, mesh_size=CP)
    mesh = _mesh()
    size = _step._cache_size()
    for i, mask in enumerate(masks):
        key = mj.make_flex_key(mask, mesh, "cp", capacity=capacity, ffa_backend="xla")
        q, k, v, dout, dlse = random_inputs(jax.random.key(i), mask, 4, 2, 16, jnp.float32)
        out, lse, (dq, dk, dv) = _step(q, k, v, dout, dlse, key)
        assert_matches_reference(
            dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), q, k, v, mask, dout, dlse
        )
    assert _step._cache_size() == size + 1


def test_key_static_part_depends_on_capacity_only():
    a, b = varlen_packings(T, 2, seed=7)
    cap = mj.PlanCapacity(T)
    ka = mj.make_flex_key(a, _mesh(), "cp", capacity=cap, ffa_backend="xla")
    kb = mj.make_flex_key(b, _mesh(), "cp", capacity=cap, ffa_backend="xla")
    assert ka.static == kb.static and hash(ka.static) == hash(kb.static)
    assert jax.tree.structure(ka) == jax.tree.structure(kb)
    assert [x.shape for x in jax.tree.leaves(ka)] == [x.shape for x in jax.tree.leaves(kb)]
    # Without a capacity the static part names the mask.
    assert (
        mj.make_flex_key(a, _mesh(), "cp", ffa_backend="xla").static
        != mj.make_flex_key(b, _mesh(), "cp", ffa_backend="xla").static
    )


def test_over_capacity_names_the_field():
    mask = mj.AttnMask.full(T)
    mesh = _mesh()
    for field, cap in (
        ("remote_kv", mj.PlanCapacity(T, remote_kv=8)),
        ("cast_width", mj.PlanCapacity(T, cast_width=2)),
        ("items", mj.PlanCapacity(T, items=1)),
    ):
        with pytest.raises(mj.CapacityError, match=rf"PlanCapacity\.{field}"):
            mj.make_flex_key(mask, mesh, "cp", capacity=cap, ffa_backend="xla")
    with pytest.raises(ValueError, match="overlap_degree=2 but capacity.overlap_degree=1"):
        mj.make_flex_key(
            mask,
            mesh,
            "cp",
            capacity=mj.PlanCapacity(T, overlap_degree=1),
            overlap_degree=2,
            ffa_backend="xla",
        )


def test_key_cache_is_bounded_by_bytes():
    from magi_jax.sharding.make_key import _KEYS, clear_key_cache

    mesh = _mesh()
    try:
        clear_key_cache(max_bytes=1)  # room for one key at a time
        for mask in varlen_packings(T, 3, seed=9):
            mj.make_flex_key(mask, mesh, "cp", ffa_backend="xla")
        assert len(_KEYS) == 1
    finally:
        clear_key_cache(max_bytes=1 << 30)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_stage_lists_travel_as_runs_and_expand_to_the_item_lists(backend):
    """A key's stage work lists are runs; expanded on the device (inside jit, per rank as
    under shard_map) they are exactly each rank's item lists at the capacity, for zoo
    masks, with and without a capacity."""
    from magi_jax.ffa.plan import expand_lists
    from magi_jax.mask_zoo import zoo
    from magi_jax.planning.work_list import (
        FFAPlanRuns,
        backend_blocks,
        build_work_list,
        pad_work_list,
    )

    masks = dict(list(zoo(T).items())[:6])
    mesh = _mesh()
    expand = jax.jit(
        lambda lists, items: [
            expand_lists(jax.tree.map(lambda a: a[r], lists), items) for r in range(CP)
        ],
        static_argnums=1,
    )
    for capacity in (None, mj.PlanCapacity.from_masks(masks.values(), mesh_size=CP)):
        for name, mask in masks.items():
            key = mj.make_flex_key(
                mask, mesh, "cp", capacity=capacity, ffa_backend=backend, comm_backend="xla"
            )
            for i, ((lists, _), st, stage) in enumerate(
                zip(key.stage_arrays, key.plan.stages, key.static.stages)
            ):
                assert isinstance(lists, FFAPlanRuns) and stage.items == st.items
                fwd, bwd = backend_blocks(
                    backend, key.local_len, st.kv_len, key.block_q, key.block_k
                )
                for r, got in enumerate(expand(lists, stage.items)):
                    want = (
                        *pad_work_list(
                            build_work_list(st.shapes[r], key.local_len, st.kv_len, *fwd, "q"),
                            st.items[0],
                        ),
                        *pad_work_list(
                            build_work_list(st.shapes[r], key.local_len, st.kv_len, *bwd, "k"),
                            st.items[1],
                        ),
                    )
                    for field, x, y in zip(got._fields, got, want):
                        assert x.shape == y.shape and x.dtype == y.dtype, (name, i, r, field)
                        np.testing.assert_array_equal(
                            np.asarray(x), y, err_msg=f"{name} stage {i} rank {r}"
                        )


@pytest.mark.parametrize("degree", [0, 1])
def test_runs_over_capacity_name_the_field(degree):
    """Run bounds of the stages on fetched KV (``q_runs``, ``k_runs``) and, with an overlap
    degree, of the host stage (``host_q_runs``, ``host_k_runs``)."""
    masks = list(varlen_packings(T, 3, seed=4))
    cap = mj.PlanCapacity.from_masks(masks, mesh_size=CP, headroom=1.0, overlap_degree=degree)
    mesh = _mesh()
    for mask in masks:
        mj.make_flex_key(mask, mesh, "cp", capacity=cap, ffa_backend="xla")
    fields = ("q_runs", "k_runs") + (("host_q_runs", "host_k_runs") if degree else ())
    for field in fields:
        small = mj.PlanCapacity.from_masks(
            masks, mesh_size=CP, headroom=1.0, overlap_degree=degree, **{field: 1}
        )
        with pytest.raises(mj.CapacityError, match=rf"PlanCapacity\.{field}>=\d+ .* holds 1;"):
            for mask in masks:
                mj.make_flex_key(mask, mesh, "cp", capacity=small, ffa_backend="xla")
