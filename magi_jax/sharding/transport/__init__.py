"""The group collectives and their transports.

:mod:`~magi_jax.sharding.transport._collectives` states the contract every transport
implements (static int32 tables and a spec), dispatches by the spec and holds the VJPs
(``group_cast`` and its adjoint ``group_reduce``). One module per transport: ``ppermute``
slot by slot (``_slot``) or pair by pair (``_pair``), ``all_to_all`` (``_all_to_all``), the
two-hop relay on a mesh of nodes (``_relay``), and ``native`` (the C++ FFI collectives, a
package of its own); ``_gather`` holds the row gathers they share.
"""

from magi_jax.sharding.transport import native
from magi_jax.sharding.transport._collectives import (
    TRANSPORTS,
    CastArrays,
    CastRuns,
    CastSpec,
    RelayArrays,
    RelayRuns,
    RelaySpec,
    cast_rows,
    expand_index_runs,
    expand_tables,
    group_cast,
    group_reduce,
    reduce_rows,
    start_reduce_rows,
)

__all__ = [
    "CastArrays",
    "CastRuns",
    "CastSpec",
    "RelayArrays",
    "RelayRuns",
    "RelaySpec",
    "TRANSPORTS",
    "expand_index_runs",
    "expand_tables",
    "group_cast",
    "group_reduce",
    "cast_rows",
    "reduce_rows",
    "start_reduce_rows",
    "native",
]
