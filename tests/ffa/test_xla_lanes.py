"""The xla backend's device-side lanes: every item of a CSR work list lands in exactly one
lane of its own tile, lanes hold at most ``lane_len`` items, and padding visits nothing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_jax.ffa.xla import _Lanes, _num_lanes
from magi_jax.planning.work_list import build_work_list
from tests.strategies import slice_masks


@functools.partial(jax.jit, static_argnums=(1, 2))
def _lanes(offsets, lane_len, num):
    """The lanes' fields as one program (eagerly, each of their ops compiles per shape)."""
    lanes = _Lanes(offsets, lane_len, num)
    return lanes.tile, lanes.start, lanes.count, lanes.num_real


@settings(deadline=None, max_examples=40)
@given(
    slice_masks(max_len=40),
    st.sampled_from([1, 2, 3, 16]),
    st.sampled_from(["q", "k"]),
    st.integers(0, 7),
)
def test_lanes_cover_each_item_once(mask, lane_len, by, extra):
    work = build_work_list(mask.shapes, mask.total_q, mask.total_k, 8, 8, by)
    offsets = np.asarray(work.offsets)
    capacity = len(work.items) + extra  # padded capacity: more lanes than needed
    num = _num_lanes(capacity, len(work.order), lane_len)
    tile, start, count, num_real = (
        np.asarray(a) for a in _lanes(jnp.asarray(offsets), lane_len, num)
    )
    assert int(num_real) <= num
    assert (count <= lane_len).all() and (count[int(num_real) :] == 0).all()
    seen = np.zeros(len(work.items), np.int64)
    for t, s, c in zip(tile, start, count):
        for i in range(s, s + c):
            assert offsets[t] <= i < offsets[t + 1], (t, i)
            seen[i] += 1
    np.testing.assert_array_equal(seen, 1)
