"""When the persistent Mosaic GPU kernels pay: the rule, written once (host, no JAX).

A persistent program hides each unit's prologue and epilogue under its neighbours' work, which
pays on short rows; on long ones one program per unit is faster. The limits are measured
(benchmarks/results/kernel/LATEST.md): the forward gains on q-tiles that walk fewer than
:data:`PERSISTENT_MAX_MEAN_ITEMS` items on average, the dK/dV kernel (items of half the
size) on k-tiles under :data:`DKV_PERSISTENT_MAX_MEAN_ITEMS`. The dQ kernel has no
persistent mode.
"""

from __future__ import annotations

__all__ = ["PERSISTENT_MAX_MEAN_ITEMS", "DKV_PERSISTENT_MAX_MEAN_ITEMS", "persistent_pays"]

PERSISTENT_MAX_MEAN_ITEMS = 32
DKV_PERSISTENT_MAX_MEAN_ITEMS = 64
_LIMITS = {"fwd": PERSISTENT_MAX_MEAN_ITEMS, "dkv": DKV_PERSISTENT_MAX_MEAN_ITEMS}


def persistent_pays(items: float, tiles: int, kernel: str = "fwd") -> bool:
    """Whether ``tiles`` tiles walking ``items`` work items in all are short enough rows for
    the persistent ``kernel`` (``"fwd"``: q-tiles of the forward list, ``"dkv"``: k-tiles of
    the dK/dV list): fewer items than the kernel's limit per tile on average."""
    if kernel not in _LIMITS:
        raise ValueError(f"kernel={kernel!r} must be one of {tuple(_LIMITS)}")
    return bool(items < _LIMITS[kernel] * tiles)
