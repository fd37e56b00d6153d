"""CapacityPolicy: grow, skip or raise on a packing that overflows; utilisation; its logs;
and prefetch_keys driving it (host planning only, no compiles)."""

import logging

import numpy as np
import pytest

from magi_jax.masks import AttnMask, packings
from magi_jax.planning import CapacityError, PlanCapacity, capacity_needs
from magi_jax.planning.capacity import GROWN_FIELDS
from magi_jax.planning.growth import CapacityPolicy
from magi_jax.prefetch import prefetch_keys

T, CP = 1024, 4


def stream(n, seed=0):
    rng = np.random.default_rng(seed)
    return [packings.packing_mask(packings.sample_doc_lens(T, rng)) for _ in range(n)]


def test_grow_settles_within_headroom_of_the_tightest_and_logs_each_growth(caplog):
    masks = stream(16)
    start = PlanCapacity.from_masks(masks[:1], mesh_size=CP)
    policy = CapacityPolicy(start)
    assert policy.mesh_size == CP
    with caplog.at_level(logging.WARNING, logger="magi_jax"):
        caps = [policy.fit(m) for m in masks]
    grown = [r for r in caplog.records if "capacity grown" in r.getMessage()]
    assert len(grown) == len(policy.growths) >= 1
    assert all(r.name == "magi_jax.planning.growth" for r in grown)
    # Every packing fits the capacity fit() returned for it; the capacity only grows.
    for mask, cap in zip(masks, caps):
        need = policy.needs(mask)
        for f in GROWN_FIELDS:
            have = cap.held(f, CP)
            assert need[f] is None or have is None or need[f] <= have, (f, need[f], have)
    tight = capacity_needs(masks, CP, start.chunk_size, start.overlap_degree)
    for f in GROWN_FIELDS:
        have = policy.capacity.held(f, CP)
        if tight[f] is not None and have is not None:
            assert have <= 1.5 * tight[f], (f, have, tight[f])
    use = policy.utilisation()
    assert use["items"]["max"] == tight["items"]
    assert 0 < use["items"]["max_share"] <= 1 and use["items"]["p99"] <= use["items"]["max"]
    assert "items" in policy.report()


def test_skip_and_raise_leave_the_capacity_as_it_was(caplog):
    masks = [AttnMask.causal(T), AttnMask.full(T), AttnMask.causal(T)]
    start = PlanCapacity.from_masks(masks[:1], mesh_size=CP, headroom=1.0)
    skip = CapacityPolicy(start, on_overflow="skip")
    with caplog.at_level(logging.WARNING, logger="magi_jax"):
        got = [skip.fit(m) for m in masks]
    assert got == [start, None, start] and skip.skipped == 1 and skip.capacity is start
    assert any("skipped" in r.getMessage() for r in caplog.records)
    strict = CapacityPolicy(start, on_overflow="raise")
    with pytest.raises(CapacityError, match=r"packing 0 needs PlanCapacity\.\w+>=\d+.*grow\("):
        strict.fit(masks[1])


def test_policy_checks_its_arguments():
    cap = PlanCapacity.from_masks([AttnMask.causal(T)], mesh_size=CP)
    with pytest.raises(ValueError, match="on_overflow='ignore'"):
        CapacityPolicy(cap, on_overflow="ignore")
    with pytest.raises(ValueError, match="mesh_size=4 .* 8 ranks"):
        CapacityPolicy(cap, mesh_size=8)
    with pytest.raises(TypeError, match="PlanCapacity"):
        CapacityPolicy(object())


def test_single_device_policy_grows_items_and_runs():
    masks = [AttnMask.causal(T), packings.packing_mask(packings.equal_doc_lens(T, 200))]
    policy = CapacityPolicy(PlanCapacity.from_masks(masks[:1]))
    assert policy.mesh_size is None
    cap = policy.fit(masks[1])
    assert cap.items >= policy.needs(masks[1])["items"] > masks[0].total_q // 128
    from magi_jax.ffa.plan import plan_attention

    plan_attention(masks[1], cap, backend="xla")


def test_prefetch_keys_fits_each_batch_and_drops_the_skipped():
    masks = [AttnMask.causal(T), AttnMask.full(T), AttnMask.causal(T), AttnMask.full(T)]
    start = PlanCapacity.from_masks(masks[:1], mesh_size=CP, headroom=1.0)
    seen = []
    policy = CapacityPolicy(start, on_overflow="skip")
    out = list(
        prefetch_keys(
            range(4),
            lambda i, cap: seen.append((i, cap)) or i,
            capacity=policy,
            masks_of=lambda i: masks[i],
        )
    )
    assert out == [(0, 0), (2, 2)] and [c for _, c in seen] == [start, start]
    grow = CapacityPolicy(start)
    keys = list(
        prefetch_keys(range(4), lambda i, cap: cap, capacity=grow, masks_of=masks.__getitem__)
    )
    assert [k for _, k in keys][1:] == [grow.capacity] * 3 and len(grow.growths) == 1
    with pytest.raises(ValueError, match="masks_of"):
        next(prefetch_keys(range(2), lambda i, c: i, capacity=grow))
    with pytest.raises(TypeError, match="CapacityPolicy"):
        next(prefetch_keys(range(2), lambda i, c: i, capacity=start, masks_of=masks.__getitem__))
