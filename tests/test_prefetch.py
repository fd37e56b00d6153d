"""prefetch_keys: order, look-ahead, errors, and the cache switch."""

import threading
import time

import pytest

import magi_jax as mj


def test_yields_in_order_and_plans_ahead():
    started = []

    def make(b):
        started.append(b)
        return b * 10

    gen = mj.prefetch_keys(range(6), make, depth=2)
    first = next(gen)
    assert first == (0, 0)
    deadline = time.time() + 5
    while len(started) < 3 and time.time() < deadline:  # batches 1 and 2 are in flight
        time.sleep(0.01)
    assert started[:3] == [0, 1, 2]
    assert list(gen) == [(b, b * 10) for b in range(1, 6)]


def test_planning_runs_off_the_calling_thread():
    main = threading.get_ident()
    threads = [t for _, t in mj.prefetch_keys(range(3), lambda b: threading.get_ident())]
    assert all(t != main for t in threads)


def test_error_surfaces_at_its_batch():
    def make(b):
        if b == 2:
            raise ValueError("bad batch 2")
        return b

    gen = mj.prefetch_keys(range(4), make)
    assert [next(gen), next(gen)] == [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match="bad batch 2"):
        next(gen)


def test_rejects_bad_depth():
    with pytest.raises(ValueError, match="depth=0"):
        list(mj.prefetch_keys(range(2), lambda b: b, depth=0))


def test_clear_caches_empties_plan_caches():
    from magi_jax.planning.work_list import plan_for_mask

    plan_for_mask(mj.AttnMask.causal(64), "xla")
    assert plan_for_mask.cache_info().currsize >= 1
    mj.clear_caches()
    assert plan_for_mask.cache_info().currsize == 0


def test_loader_error_after_the_batches_it_delivered():
    """A loader that raises after 3 good batches: all 3 come out (planned), then its error."""

    def loader():
        yield from range(3)
        raise OSError("shard 4 is unreadable")

    seen = []
    with pytest.raises(OSError, match="shard 4"):
        for batch, key in mj.prefetch_keys(loader(), lambda b: b * 10, depth=2):
            seen.append((batch, key))
    assert seen == [(0, 0), (1, 10), (2, 20)]
