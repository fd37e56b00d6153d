"""magi-jax: exact attention over ultra-long packed sequences with irregular slice masks.

Layers (folders): :mod:`magi_jax.planning` (host planning, pure NumPy, no JAX),
:mod:`magi_jax.ffa` (single-device attention), :mod:`magi_jax.pallas` (Mosaic GPU kernels),
:mod:`magi_jax.sharding` (context parallelism), :mod:`magi_jax.nn` (Flax modules).

The public names below are imported on first use, so that ``import magi_jax.masks`` or
``import magi_jax.planning`` (host planning) does not import JAX.
"""

from importlib import import_module as _import_module

from magi_jax import _log, _moved  # noqa: F401  (_log: the logger, quiet by default)
from magi_jax.masks import AttnMask, AttnMaskType

_moved.install()

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "flex_flash_attention": "magi_jax.ffa",
    "select_backend": "magi_jax.ffa",
    "reference_attention": "magi_jax.ffa",
    "dot_product_attention": "magi_jax.ffa.dpa",
    "plan_attention": "magi_jax.ffa.plan",
    "AttnPlan": "magi_jax.ffa.plan",
    "PlanCapacity": "magi_jax.planning.capacity",
    "CapacityError": "magi_jax.planning.capacity",
    "CapacityPolicy": "magi_jax.planning.growth",
    "prefetch_keys": "magi_jax.prefetch",
    "clear_caches": "magi_jax.caches",
    "dispatch": "magi_jax.sharding",
    "DispatchedArray": "magi_jax.sharding",
    "magi_attention": "magi_jax.sharding",
    "make_flex_key": "magi_jax.sharding",
    "make_batch_key": "magi_jax.sharding",
    "batch_rows": "magi_jax.sharding",
    "make_varlen_key": "magi_jax.sharding",
    "position_ids": "magi_jax.sharding",
    "roll": "magi_jax.sharding",
    "undispatch": "magi_jax.sharding",
    "calibrate_overlap": "magi_jax.sharding",
    "OverlapCalibration": "magi_jax.sharding",
    "overlap_calibrations": "magi_jax.sharding",
    "clear_overlap_calibrations": "magi_jax.sharding",
}
_SUBPACKAGES = ("caches", "cli", "ffa", "masks", "nn", "pallas", "planning", "plot", "sharding")

__all__ = [
    "AttnMask",
    "AttnMaskType",
    "flex_flash_attention",
    "reference_attention",
    "select_backend",
    "dot_product_attention",
    "plan_attention",
    "AttnPlan",
    "PlanCapacity",
    "CapacityError",
    "CapacityPolicy",
    "prefetch_keys",
    "clear_caches",
    "dispatch",
    "DispatchedArray",
    "magi_attention",
    "make_flex_key",
    "make_batch_key",
    "batch_rows",
    "make_varlen_key",
    "position_ids",
    "roll",
    "undispatch",
    "calibrate_overlap",
    "OverlapCalibration",
    "overlap_calibrations",
    "clear_overlap_calibrations",
]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(_import_module(_LAZY[name]), name)
    elif name in _SUBPACKAGES or f"magi_jax.{name}" in _moved.MOVED:
        value = _import_module(f"magi_jax.{name}")
    else:
        raise AttributeError(f"module 'magi_jax' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({"__version__", *__all__, *_SUBPACKAGES})
