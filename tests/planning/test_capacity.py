"""PlanCapacity: the default holds every mask at every mesh size, the one growth rule, the
mesh size it records, its file, and what its errors say (host planning only, no compiles)."""

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from magi_jax.ffa.plan import plan_attention
from magi_jax.masks import AttnMask, packings
from magi_jax.planning import (
    CapacityError,
    PlanCapacity,
    build_dist_plan,
    capacity_chunk_size,
    capacity_needs,
    capacity_overlap_degree,
    default_block_sizes,
    solve_dispatch,
)
from magi_jax.planning.capacity import GROWN_FIELDS, default_items

LENGTHS = (256, 512, 1024, 4096)
MESH_SIZES = (1, 2, 4, 8)


def plan_at(mask: AttnMask, capacity: PlanCapacity, cp: int, backend: str = "xla") -> None:
    """Plans ``mask`` at ``capacity`` as a key over ``cp`` ranks plans it (the capacity's
    chunk and both overlap degrees; ``cp == 1`` also as a single-device plan); raises
    :class:`CapacityError` where it does not fit."""
    if cp == 1:
        plan_attention(mask, capacity, backend=backend)
    capacity.check_mesh_size(cp)
    chunk = capacity.chunk_size or capacity_chunk_size(mask.total_q, cp)
    meta = solve_dispatch(mask, cp, chunk, "magi")
    bq, bk = default_block_sizes(meta.local_len, meta.local_len)
    for degree in sorted(set(capacity_overlap_degree(mask.total_q, cp, chunk))):
        build_dist_plan(mask, meta, degree, bq, bk, backend, capacity)


def doc_mask(total: int, cuts: list[int], causal: bool, window: int | None) -> AttnMask:
    bounds = np.unique(np.clip(np.asarray([0, *cuts, total]), 0, total))
    lens = np.diff(bounds)
    return packings.packing_mask(
        lens, causal=causal, window=None if window is None else (window, 0)
    )


@pytest.mark.parametrize("cp", MESH_SIZES)
@pytest.mark.parametrize("total", LENGTHS)
def test_default_capacity_holds_simple_masks_at_every_mesh_size(total, cp):
    cap = PlanCapacity(total)
    rng = np.random.default_rng([total, cp])
    masks = [
        AttnMask.full(total),
        AttnMask.causal(total),
        AttnMask.sliding_window(total, 64, 0),
        AttnMask.sliding_window(total, 7, 3),
        packings.packing_mask(packings.sample_doc_lens(total, rng)),
        packings.packing_mask(np.ones(total, np.int64)),  # a document per token
    ]
    for mask in masks:
        plan_at(mask, cap, cp)


@given(
    total=st.sampled_from(LENGTHS),
    cp=st.sampled_from(MESH_SIZES),
    cuts=st.lists(st.integers(1, 4095), max_size=64),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 300)),
    backend=st.sampled_from(("xla", "pallas")),
)
def test_default_capacity_holds_random_document_masks(total, cp, cuts, causal, window, backend):
    plan_at(
        doc_mask(total, [c for c in cuts if c < total], causal, window),
        PlanCapacity(total),
        cp,
        backend,
    )


def test_mesh_size_is_recorded_and_another_size_is_refused():
    mask = AttnMask.causal(1024)
    cap = PlanCapacity.from_masks([mask], mesh_size=4)
    assert cap.mesh_size == (4,)
    plan_at(mask, cap, 4)
    with pytest.raises(ValueError, match=r"mesh_size=4.*8 ranks.*mesh_size=8"):
        plan_at(mask, cap, 8)
    assert PlanCapacity(1024, mesh_size=[8, 2, 8]).mesh_size == (2, 8)
    both = PlanCapacity(1024, mesh_size=(2, 8))
    assert both.held("items") == max(default_items(1024, 1024, m) for m in (2, 8))
    with pytest.raises(ValueError, match="mesh_size"):
        PlanCapacity(1024, mesh_size=0)


def test_grow_raises_only_the_fields_that_hold_less():
    cap = PlanCapacity(1024, items=100, q_runs=10, k_runs=10, remote_kv=300, mesh_size=4)
    grown = cap.grow(items=120, q_runs=5, remote_kv=None, headroom=1.5)
    assert (grown.items, grown.q_runs, grown.k_runs, grown.remote_kv) == (180, 10, 10, 300)
    assert cap.grow(items=100) is cap
    # Defaults that hold anything stay defaults; the default item count grows past itself.
    free = PlanCapacity(1024)
    assert free.grow(cast_width=10**6).cast_width is None
    big = default_items(1024, 1024) + 1
    assert free.grow(items=big, headroom=1).items == big
    with pytest.raises(ValueError, match="not fields that grow"):
        cap.grow(chunk_size=64)


def test_from_masks_is_the_sample_need_times_headroom():
    masks = [packings.packing_mask(packings.sample_doc_lens(2048, s)) for s in range(3)]
    need = capacity_needs(masks, 4)
    cap = PlanCapacity.from_masks(masks, mesh_size=4, headroom=1.5)
    for f in GROWN_FIELDS:
        if need[f] is not None:
            assert getattr(cap, f) == int(np.ceil(need[f] * 1.5)), f
    for mask in masks:
        plan_at(mask, cap, 4)


def test_capacity_round_trips_through_its_file(tmp_path):
    cap = PlanCapacity(4096, 2048, items=77, q_runs=9, overlap_degree=2, mesh_size=(4, 8))
    path = tmp_path / "capacity.json"
    cap.save(path)
    assert PlanCapacity.load(path) == cap
    assert json.loads(path.read_text())["PlanCapacity"]["mesh_size"] == [4, 8]
    assert PlanCapacity.load(path).to_dict() == cap.to_dict()
    path.write_text(json.dumps({"PlanCapacity": {"total_q": 8, "itmes": 3}}))
    with pytest.raises(ValueError, match="itmes"):
        PlanCapacity.load(path)


def test_list_sizes_is_the_one_sizing_rule():
    cap = PlanCapacity(1024, items=50, q_runs=70, k_runs=20, host_k_runs=5)
    assert cap.list_sizes((128, 128), (64, 128)) == ((50, 100), (50, 20))
    assert cap.list_sizes((128, 128), (64, 128), host=True) == ((50, 100), (50, 5))
    free = PlanCapacity(1024)
    n = default_items(1024, 1024, 4, 16)
    assert free.list_sizes((64, 64), (64, 64), mesh_size=4, chunk_size=16) == ((n, n), (n, n))


def test_capacity_error_names_the_limit_in_words_and_the_fix():
    mask = AttnMask.full(1024)
    cap = PlanCapacity(1024, items=8, mesh_size=4)
    with pytest.raises(CapacityError) as err:
        plan_at(mask, cap, 4)
    text = str(err.value)
    assert "work items" in text and "capacity.grow(items=" in text, text
    cap = dataclasses.replace(PlanCapacity.from_masks([AttnMask.causal(1024)], mesh_size=4))
    with pytest.raises(CapacityError, match=r"remote_kv|cast_width|runs") as err:
        plan_at(mask, cap, 4)
    assert "capacity.grow(" in str(err.value)
