"""Integer ranges on the host (NumPy): the integers of many ranges at once, without a loop.

Planning enumerates tiles, chunks and table entries by ranges; :func:`ranges_repeat` (``[start,
stop)``) and :func:`ranges_incl` (``[start, stop]``) are the one way to write it;
:func:`merge_intervals` joins ranges into disjoint ones.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ranges_repeat", "ranges_incl", "merge_intervals"]


def ranges_repeat(start: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each i, the integers ``[start[i], stop[i])`` (int ``[n]`` each; empty where
    ``stop <= start``): ``(owner, value)``, int ``[sum of lengths]`` each, ``owner`` the
    range ``i`` each value comes from, in order."""
    n = np.maximum(np.asarray(stop) - np.asarray(start), 0)
    owner = np.repeat(np.arange(len(n)), n)
    value = np.arange(int(n.sum())) + np.repeat(np.asarray(start) - (np.cumsum(n) - n), n)
    return owner, value


def ranges_incl(start: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each i, the integers ``[start[i], stop[i]]`` (both ends included):
    :func:`ranges_repeat` of ``(start, stop + 1)``."""
    return ranges_repeat(start, np.asarray(stop) + 1)


def merge_intervals(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Union of half-open intervals sorted by start -> disjoint sorted ``int64 [n, 2]``."""
    if not len(starts):
        return np.zeros((0, 2), np.int64)
    run_end = np.maximum.accumulate(ends)
    # A new run starts where the interval begins after everything before it ended.
    new = np.ones(len(starts), bool)
    new[1:] = starts[1:] > run_end[:-1]
    first = np.nonzero(new)[0]
    last = np.append(first[1:], len(starts)) - 1
    return np.stack([starts[first], run_end[last]], axis=1).astype(np.int64)
