"""The device ragged lists (magi_jax/ffa/ragged.py) against NumPy models and their host twins."""

import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.ffa.ragged import (
    expand_index_runs,
    expand_item_runs,
    ragged_enumerate,
    take_in_bounds,
)
from magi_jax.mask import AttnMask
from magi_jax.planning.cast_table import expand_runs as host_index_runs
from magi_jax.planning.work_list import expand_runs as host_item_runs
from magi_jax.planning.work_list import plan_runs, work_list_runs


@pytest.mark.parametrize("counts, size", [([2, 0, 3, 1], 9), ([0, 0, 4], 4), ([5], 3), ([0], 2)])
def test_ragged_enumerate_against_a_loop(counts, size):
    owner, pos, total = (np.asarray(x) for x in ragged_enumerate(np.int32(counts), size))
    want = [(i, p) for i, c in enumerate(counts) for p in range(c)][:size]
    assert int(total) == sum(counts)
    assert [(int(o), int(p)) for o, p in zip(owner, pos)][: len(want)] == want
    # Past the total the owners stay in bounds (the caller masks those slots).
    assert ((owner >= 0) & (owner < len(counts))).all()


def test_take_in_bounds_rows():
    table = np.arange(12, dtype=np.int32).reshape(4, 3)
    got = np.asarray(take_in_bounds(jnp.asarray(table), jnp.int32([3, 0, 3])))
    np.testing.assert_array_equal(got, table[[3, 0, 3]])


def test_index_runs_equal_their_host_twin():
    rng = np.random.default_rng(0)
    runs = np.stack([rng.integers(-1, 50, 7), rng.integers(0, 5, 7)], axis=1).astype(np.int32)
    # Tables as long as the runs or longer (the host twin writes every run in full).
    for size in (int(runs[:, 1].sum()), int(runs[:, 1].sum()) + 6):
        np.testing.assert_array_equal(
            np.asarray(expand_index_runs(runs, size)), host_index_runs(runs, size)
        )


def test_item_runs_equal_their_host_twin():
    mask = AttnMask.from_ranges(
        [[0, 100], [100, 300], [120, 300]],
        [[0, 100], [0, 250], [250, 300]],
        ["causal", "full", "causal"],
        300,
        300,
    )
    one = np.zeros(len(mask.shapes.q0), np.int64)
    runs_q = work_list_runs(mask.shapes, one, 1, 300, 300, 64, 64, "q")
    runs_k = work_list_runs(mask.shapes, one, 1, 300, 300, 64, 64, "k")
    lists = plan_runs(runs_q, runs_k, None)
    n_q, n_k = int(runs_q.per_rank.max()) + 3, int(runs_k.per_rank.max()) + 3
    want = host_item_runs(lists, n_q, n_k)
    np.testing.assert_array_equal(np.asarray(expand_item_runs(lists.q_runs, n_q)), want.q_items)
    np.testing.assert_array_equal(np.asarray(expand_item_runs(lists.k_runs, n_k)), want.k_items)
    assert expand_item_runs(lists.q_runs[:, :0], 4).shape == (1, 4, want.q_items.shape[-1])
