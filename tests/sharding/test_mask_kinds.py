"""Attention over masks built every new way — from a predicate, a dense mask, a block mask,
set algebra, the HSTU and documents + window + global families — forward and gradients on
one device and under context parallelism at cp 4, against the float64 dense reference
(docs/design.md §5)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings

import magi_jax as mj
from magi_jax import mask_zoo as mz
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask
from tests.sharding.test_attention import _check as check_cp
from tests.test_mask_runs import dense_masks

T = 45  # odd: padded at cp 4


def _q_k():
    return np.arange(T)[:, None], np.arange(T)[None, :]


def _masks():
    q, k = _q_k()
    rng = np.random.default_rng(7)
    window = AttnMask.sliding_window(T, 6, 0)
    docs = AttnMask.varlen([0, 14, 30, T], causal=True)
    return {
        "from_fn": AttnMask.from_fn(
            lambda q, k: ((k <= q) & (q - k < 9)) | (k % 11 == 0) & (k <= q), T, T, block=(8, 16)
        ),
        "from_dense": AttnMask.from_dense((rng.random((T, T)) < 0.3) | (k == q)),
        "from_block_mask": AttnMask.from_block_mask(rng.random((6, 12)) < 0.35, 8, 4, T, T),
        "union": window | AttnMask.from_dense(np.broadcast_to(k < 3, (T, T))),
        "intersection": docs & AttnMask.from_fn(lambda q, k: (q - k) % 3 != 1, T, T),
        "difference": AttnMask.causal(T) - docs,
        "hstu": mz.hstu([20, 25], num_targets=[4, 6], num_context=[3, 2], window=8),
        "doc_window_global": mz.doc_window_global([10, 23, 12], window=4, num_global=2),
    }


def _mixed(masks):
    """One mask of every way at once: a predicate's slices with a block mask's, less a dense
    mask's cells (each cp 4 check compiles a program of its own, ~10 s on CI)."""
    q, k = _q_k()
    return (masks["from_fn"] | masks["from_block_mask"]) - AttnMask.from_dense(
        np.broadcast_to((q + 2 * k) % 7 == 0, (T, T))
    )


MASKS = _masks()
MIXED = _mixed(MASKS)
CP_MASKS = {"mixed": MIXED, "hstu": MASKS["hstu"], "doc_window_global": MASKS["doc_window_global"]}


@jax.jit
def _planned(plan, q, k, v, dout, dlse):
    """Forward and gradients with the mask as data: one compilation for every mask of a
    capacity (each mask as a constant would compile anew)."""
    (out, lse), vjp = jax.vjp(lambda a, b, c: mj.flex_flash_attention(a, b, c, plan), q, k, v)
    dq, dk, dv = vjp((dout, dlse))
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def _check_one_device(mask, seed=0):
    # Every slice of a mask this small sits in one tile: items = slices bound it.
    cap = mj.PlanCapacity(mask.total_q, mask.total_k, items=mask.total_q * mask.total_k)
    plan = mj.plan_attention(mask, cap, backend="xla")
    q, k, v, dout, dlse = random_inputs(jax.random.key(seed), mask, 2, 1, 8, "float32")
    assert_matches_reference(_planned(plan, q, k, v, dout, dlse), q, k, v, mask, dout, dlse)


def test_masks_are_what_they_say():
    q, k = _q_k()
    causal = np.tril(np.ones((T, T), bool))
    docs = AttnMask.varlen([0, 14, 30, T], causal=True).to_dense()
    np.testing.assert_array_equal(MASKS["difference"].to_dense(), causal & ~docs)
    assert MASKS["difference"].area == causal.sum() - docs.sum()
    np.testing.assert_array_equal(MASKS["intersection"].to_dense(), docs & ((q - k) % 3 != 1))
    assert set(MIXED.types.tolist()) >= {0, 1, 3}  # FULL, CAUSAL and BI_CAUSAL slices


@pytest.mark.parametrize("name", list(MASKS))
def test_one_device(name):
    _check_one_device(MASKS[name])


@pytest.mark.parametrize("name", list(CP_MASKS))
def test_cp4(name):
    check_cp(CP_MASKS[name], 4)


@settings(max_examples=4)
@given(dense_masks(min_len=20, max_len=20))
def test_random_dense_masks_one_device(dense):
    _check_one_device(AttnMask.from_dense(dense))
