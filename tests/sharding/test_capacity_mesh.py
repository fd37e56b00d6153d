"""A capacity records the mesh size it was built for: a key at another size is refused with
an error naming ``mesh_size`` and the fix; the default capacity builds keys at every size
(host planning and device arrays only, no compiles)."""

import jax
import pytest
from jax.sharding import AxisType

import magi_jax as mj


def _mesh(cp):
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(AxisType.Auto,))


def test_key_at_another_mesh_size_names_mesh_size_and_the_fix():
    mask = mj.AttnMask.full(512)
    cap = mj.PlanCapacity.from_masks([mask], mesh_size=4)
    mj.make_flex_key(mask, _mesh(4), "cp", capacity=cap)
    with pytest.raises(
        ValueError, match=r"mesh_size=4 .* 8 ranks.*from_masks\(sample, mesh_size=8\)"
    ):
        mj.make_flex_key(mask, _mesh(8), "cp", capacity=cap)


@pytest.mark.parametrize("cp", [2, 8])
def test_default_capacity_builds_keys_of_dense_masks_at_every_size(cp):
    cap = mj.PlanCapacity(512)
    for mask in (mj.AttnMask.full(512), mj.AttnMask.causal(512)):
        key = mj.make_flex_key(mask, _mesh(cp), "cp", capacity=cap)
        assert key.capacity is cap
