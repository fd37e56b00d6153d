"""Integer ranges on the host (NumPy): the integers of many ranges at once, without a loop.

Planning enumerates tiles, chunks and table entries by ranges; :func:`ranges_repeat` (``[start,
stop)``) and :func:`ranges_incl` (``[start, stop]``) are the one way to write it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ranges_repeat", "ranges_incl"]


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
