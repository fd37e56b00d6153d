"""The ``pallas`` backend of :func:`magi_jax.flex_flash_attention`: Mosaic GPU kernels for
Hopper (sm90) over host-built work lists (:mod:`magi_jax.planning.work_list`).

Entry points (:mod:`magi_jax.pallas.api`):
  * :func:`flex_flash_attention_pallas` — from an :class:`~magi_jax.AttnMask` (plans cached by
    the mask's fingerprint);
  * :func:`ffa_pallas` — from plan arrays of static shape (no mask object), the form context
    parallelism calls per rank under ``shard_map``;
  * :func:`supported` — whether the kernels take these inputs here, and why not.

Each kernel's config, its defaults and the rules that pick them: :mod:`magi_jax.pallas.tuning`.
"""

from magi_jax.pallas.api import (
    DKV_SPLIT_ALIGN,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    SUPPORTED_MLA_HEAD_DIMS,
    FFAPlanArrays,
    device_supported,
    ffa_pallas,
    ffa_pallas_backward,
    flex_flash_attention_pallas,
    head_dims_problem,
    plan_for_mask,
    supported,
)
from magi_jax.pallas.tuning import DKV_PERSISTENT_MAX_MEAN_ITEMS, PERSISTENT_MAX_MEAN_ITEMS

__all__ = [
    "flex_flash_attention_pallas",
    "ffa_pallas",
    "ffa_pallas_backward",
    "supported",
    "device_supported",
    "DKV_SPLIT_ALIGN",
    "FFAPlanArrays",
    "plan_for_mask",
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_MLA_HEAD_DIMS",
    "head_dims_problem",
    "SUPPORTED_DTYPES",
    "PERSISTENT_MAX_MEAN_ITEMS",
    "DKV_PERSISTENT_MAX_MEAN_ITEMS",
]
