"""The one cache class, its decorator and the switch that clears every cache."""

import ast
import pathlib

import magi_jax as mj
from magi_jax.caches import Cache, cached, clear_caches


def test_least_recently_used_out_by_count():
    cache = Cache("test count", 2)
    builds = []
    get = lambda k: cache.get(k, lambda: builds.append(k) or k * 10)
    assert [get(1), get(2), get(1), get(3)] == [10, 20, 10, 30]  # 2 was the least recent
    assert get(1) == 10 and get(2) == 20
    assert builds == [1, 2, 3, 2] and len(cache) == 2
    assert cache.info() == (2, 4, 2, 2)


def test_bounded_by_bytes_keeps_the_newest():
    cache = Cache("test bytes", max_bytes=10, size_of=len)
    cache.get("a", lambda: "x" * 6)
    cache.get("b", lambda: "y" * 4)
    assert len(cache) == 2 and cache.nbytes == 10
    cache.get("c", lambda: "z" * 20)  # over the bound alone: kept, the others out
    assert len(cache) == 1 and cache.nbytes == 20
    cache.max_bytes = 100
    cache.get("d", lambda: "w")
    assert len(cache) == 2 and cache.nbytes == 21


def test_cached_function_and_clear_caches():
    calls = []

    @cached(8)
    def square(x, *, shift=0):
        calls.append((x, shift))
        return x * x + shift

    assert [square(3), square(3), square(3, shift=1), square(3, shift=1)] == [9, 9, 10, 10]
    assert calls == [(3, 0), (3, 1)] and square.cache_info().currsize == 2
    plain = Cache("test registered", 4)
    plain.get("k", lambda: 1)
    clear_caches()
    assert square.cache_info().currsize == 0 and len(plain) == 0
    assert square(3) == 9 and calls[-1] == (3, 0)


def test_clear_caches_reaches_the_library_caches():
    """The planner's caches, the distributed plans' and the keys' are emptied by
    ``magi_jax.clear_caches`` (two of them were missed when it listed them by hand)."""
    from magi_jax.planning import solver, work_list

    mask = mj.AttnMask.causal(256)
    work_list.plan_for_mask(mask, "xla")
    solver.solve_dispatch(mask, 2, 64)
    assert work_list.plan_for_mask.cache_info().currsize >= 1
    assert solver.solve_dispatch.cache_info().currsize >= 1
    mj.clear_caches()
    for fn in (work_list.plan_for_mask, solver.solve_dispatch, solver._balanced_cached):
        assert fn.cache_info().currsize == 0, fn.__name__


def test_no_hand_written_cache_left():
    """Memoized data lives in :class:`Cache` (``cached``): no ``functools.lru_cache`` in the
    library (``functools.cache`` stays for memoized factories of objects without data)."""
    root = pathlib.Path(mj.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "lru_cache":
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []
