"""The ``native`` transport of the group collectives: a C++ XLA FFI library (``ffi/``).

:mod:`~magi_jax.sharding.transport.native._calls` holds the collectives
(``group_cast``, ``group_reduce``, a started reduce, NVSHMEM set-up);
:mod:`~magi_jax.sharding.transport.native._library` finds, loads and registers the compiled
library and says whether a platform or a mesh can run it.
"""

from magi_jax import _moved
from magi_jax.sharding.transport.native._calls import (
    DEFAULT_TIMEOUT_S,
    MAX_ARRAYS,
    MAX_RUNS,
    CudaTuning,
    auto_reason,
    can_start_reduce,
    check_table,
    cuda_tuning,
    finalize,
    group_cast,
    group_reduce,
    group_reduce_start,
    initialize,
    reduce_runs,
    staging_bytes,
    tuning,
    unavailable_reason,
)
from magi_jax.sharding.transport.native._library import NativeUnavailable, available, check_mesh

__all__ = [
    "available",
    "unavailable_reason",
    "group_cast",
    "group_reduce",
    "MAX_ARRAYS",
    "check_table",
    "initialize",
    "finalize",
    "staging_bytes",
    "auto_reason",
    "DEFAULT_TIMEOUT_S",
    "CudaTuning",
    "tuning",
    "cuda_tuning",
    "group_reduce_start",
    "can_start_reduce",
    "reduce_runs",
    "MAX_RUNS",
    "check_mesh",
    "NativeUnavailable",
]


def __getattr__(name: str) -> object:  # the modules that moved away, by their old names
    return _moved.old_child(__name__, name)
