"""Keys: what one mask (or one batch of masks) planned for a mesh carries into the step.

:mod:`~magi_jax.sharding.keys._key` (the key types :class:`MagiKey`, ``KeyStatic``,
``CheckedKey`` and the mesh helpers), :mod:`~magi_jax.sharding.keys._options`
(:class:`KeyOptions`: the options of a key, each checked when built),
:mod:`~magi_jax.sharding.keys._make` (building keys: :func:`make_flex_key`,
:func:`make_varlen_key`, what the options mean with a mask and a mesh, the key cache),
:mod:`~magi_jax.sharding.keys._batch` (:func:`make_batch_key`: one plan per batch row),
:mod:`~magi_jax.sharding.keys._relay` (a stage's two-hop cast) and
:mod:`~magi_jax.sharding.keys._wire` (what a key's casts put on the wire).
"""

from magi_jax.sharding.keys._batch import batch_rows, make_batch_key
from magi_jax.sharding.keys._key import (
    ROLES,
    CheckedKey,
    KeyStatic,
    MagiKey,
    StageStatic,
    axes_entry,
    check_devices,
    check_key,
    check_mesh,
    check_pod_axes,
    cp_names,
    cp_ranks,
    device_ids,
    is_checked,
    normal_cp_axis,
    rows_desc,
    token_index,
)
from magi_jax.sharding.keys._make import (
    clear_key_cache,
    make_flex_key,
    make_varlen_key,
    put_global,
)
from magi_jax.sharding.keys._options import (
    CAST_GATINGS,
    COMM_BACKENDS,
    HIERARCHICAL,
    MAX_OVERLAP_DEGREE,
    KeyOptions,
    check_overlap_degree,
)
from magi_jax.sharding.keys._resolve import ResolvedOptions, ffa_backend_reason
from magi_jax.sharding.keys._wire import key_wire

__all__ = [
    "MagiKey",
    "KeyStatic",
    "StageStatic",
    "CheckedKey",
    "KeyOptions",
    "ResolvedOptions",
    "make_flex_key",
    "make_varlen_key",
    "make_batch_key",
    "batch_rows",
    "key_wire",
    "clear_key_cache",
    "ffa_backend_reason",
    "put_global",
    "ROLES",
    "check_devices",
    "check_key",
    "device_ids",
    "is_checked",
    "rows_desc",
    "token_index",
    "check_mesh",
    "cp_names",
    "cp_ranks",
    "normal_cp_axis",
    "axes_entry",
    "check_pod_axes",
    "check_overlap_degree",
    "COMM_BACKENDS",
    "MAX_OVERLAP_DEGREE",
    "HIERARCHICAL",
    "CAST_GATINGS",
]
