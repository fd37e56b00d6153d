"""The library's caches: one class (:class:`Cache`), one decorator (:func:`cached`) and one
switch that clears them all (:func:`clear_caches`).

Host plans are cached by mask fingerprint (work lists, dispatches, distributed plans) and
keys by their arguments, in a cache bounded by the bytes of its keys' device arrays
(:func:`magi_jax.sharding.keys.clear_key_cache` sets the bound). Every cache registers
itself when it is made, so :func:`clear_caches` reaches all of them. Host only (no JAX)."""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, TypeVar

from magi_jax._log import get_logger

__all__ = ["Cache", "CacheInfo", "cached", "register", "clear_caches"]

_F = TypeVar("_F", bound=Callable[..., Any])
# Every cache's clear function, in the order they were made.
_REGISTRY: list[Callable[[], None]] = []
_REGISTRY_LOCK = threading.Lock()
_LOG = get_logger("caches")


class CacheInfo(NamedTuple):
    """Counts of a :class:`Cache` (the fields of ``functools.lru_cache``'s)."""

    hits: int
    misses: int
    maxsize: int | None
    currsize: int


class Cache:
    """Values by hashable key, least recently used first out, thread-safe.

    ``max_items``: at most this many entries (``None``: no bound). ``max_bytes`` with
    ``size_of(value) -> int``: at most this many bytes of values, but always the newest
    entry. A value is built outside the lock (two threads may build one key; the first
    stored stays). Registered with :func:`clear_caches` when made."""

    def __init__(
        self,
        name: str,
        max_items: int | None = None,
        *,
        max_bytes: int | None = None,
        size_of: Callable[[Any], int] | None = None,
    ):
        if max_bytes is not None and size_of is None:
            raise ValueError(f"Cache {name!r}: max_bytes needs size_of")
        self.name = name
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._sizes: dict = {}
        self._bytes = 0
        self._hits = self._misses = 0
        self._lock = threading.Lock()
        register(self.clear)

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value cached at ``key``, else ``build()``, stored."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self._hits += 1
                return self._items[key]
            self._misses += 1
        start = time.perf_counter()
        value = build()
        if _LOG.isEnabledFor(10):  # DEBUG
            _LOG.debug(
                "cache %r: miss, built in %.3f s (%d hits, %d misses, %d held)",
                self.name,
                time.perf_counter() - start,
                self._hits,
                self._misses,
                len(self._items),
            )
        size = self._size_of(value) if self._size_of is not None else 0
        with self._lock:
            if key not in self._items:
                self._items[key] = value
                self._sizes[key] = size
                self._bytes += size
            self._evict()
        return value

    def _evict(self) -> None:
        while self._items and (
            (self.max_items is not None and len(self._items) > self.max_items)
            or (
                self.max_bytes is not None and self._bytes > self.max_bytes and len(self._items) > 1
            )
        ):
            key, _ = self._items.popitem(last=False)
            self._bytes -= self._sizes.pop(key)

    def clear(self) -> None:
        """Drops every entry."""
        with self._lock:
            self._items.clear()
            self._sizes.clear()
            self._bytes = 0

    def values(self) -> list:
        """The values held, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._items.values())

    def info(self) -> CacheInfo:
        """Hits, misses, the entry bound and the entries held."""
        with self._lock:
            return CacheInfo(self._hits, self._misses, self.max_items, len(self._items))

    @property
    def nbytes(self) -> int:
        """Bytes of the values held (as ``size_of`` counts them; 0 without it)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)


_KWARGS = object()  # separates positional from keyword arguments in a key


def cached(maxsize: int) -> Callable[[_F], _F]:
    """Memoizes a function of hashable arguments in a :class:`Cache` of ``maxsize`` entries
    (as ``functools.lru_cache``, which it replaces: the wrapper has ``cache_clear()``,
    ``cache_info()`` and its ``cache``)."""

    def wrap(fn: _F) -> _F:
        cache = Cache(f"{fn.__module__}.{fn.__qualname__}", maxsize)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            key = args + (_KWARGS, *kwargs.items()) if kwargs else args
            return cache.get(key, lambda: fn(*args, **kwargs))

        wrapper.cache = cache
        wrapper.cache_clear = cache.clear
        wrapper.cache_info = cache.info
        return wrapper

    return wrap


def register(clear: Callable[[], None]) -> None:
    """Adds ``clear`` (a function that empties one cache) to those :func:`clear_caches`
    calls; :class:`Cache` registers itself."""
    with _REGISTRY_LOCK:
        _REGISTRY.append(clear)


def clear_caches() -> None:
    """Drops every cached plan and key (their device arrays are freed once nothing else
    holds them), and the small compiled programs the library keeps for eager calls (``roll``'s
    routes, the plan-agreement check of ``undispatch``), built again at their next use.
    JAX's own compilation caches are left as they are."""
    with _REGISTRY_LOCK:
        clears = list(_REGISTRY)
    for clear in clears:
        clear()
