"""Host planning (pure NumPy; nothing here imports JAX, directly or through its imports).

Single device: :mod:`~magi_jax.planning.tiling` (work items),
:mod:`~magi_jax.planning.work_list` (the work lists every FFA backend reads, one format;
:mod:`~magi_jax.planning.item_runs` the runs of items they are built from),
:mod:`~magi_jax.planning.capacity` (the bounds that fix a plan's shapes;
:mod:`~magi_jax.planning.errors` the error when a mask needs more;
:mod:`~magi_jax.planning.growth` the policy that grows it over a run),
:mod:`~magi_jax.planning.backends` (the FFA backends' names),
:mod:`~magi_jax.planning.persistent_kernels` (when the persistent kernels pay),
:mod:`~magi_jax.planning.intervals` (integer ranges).

Context parallelism: :mod:`~magi_jax.planning.solver` (which chunks each rank owns),
:mod:`~magi_jax.planning.stages` (the distributed plan: per-rank stages and exactly-needed
remote KV), :mod:`~magi_jax.planning.cast_table` (group-cast tables),
:mod:`~magi_jax.planning.relay_table` (two-hop cast tables on a mesh of nodes;
:mod:`~magi_jax.planning.relay_runs` the same tables planned by runs),
:mod:`~magi_jax.planning.wire` (what a plan's casts put on the wire) and
:mod:`~magi_jax.planning.cost_model` (the overlap degree's cost model, and what a sample of
masks needs).

The names below are the front door the device layers (:mod:`magi_jax.sharding`) plan
through.
"""

from magi_jax import _moved
from magi_jax.planning.capacity import HEADROOM, CapacityError, PlanCapacity
from magi_jax.planning.cast_table import CastTable, choose_transport
from magi_jax.planning.cost_model import (
    PAIR_CAST_LEVELS,
    OverlapDegrees,
    capacity_chunk_size,
    capacity_needs,
    capacity_overlap_degree,
    cast_pieces,
    default_overlap_degrees,
)
from magi_jax.planning.relay_runs import build_relay_runs, pad_runs, relay_run_bounds
from magi_jax.planning.relay_table import NodeLayout
from magi_jax.planning.solver import ALGORITHMS, KV_LAYOUTS, solve_dispatch
from magi_jax.planning.stages import DistPlan, build_dist_plan, resolve_kv
from magi_jax.planning.wire import (
    GATINGS,
    WireCount,
    cast_wire,
    pair_levels,
    piece_len,
    relay_wire,
    slot_rows,
)
from magi_jax.planning.work_list import default_block_sizes

__all__ = [
    "ALGORITHMS",
    "CapacityError",
    "CastTable",
    "DistPlan",
    "GATINGS",
    "HEADROOM",
    "KV_LAYOUTS",
    "NodeLayout",
    "OverlapDegrees",
    "PAIR_CAST_LEVELS",
    "PlanCapacity",
    "WireCount",
    "build_dist_plan",
    "build_relay_runs",
    "capacity_chunk_size",
    "capacity_needs",
    "capacity_overlap_degree",
    "cast_pieces",
    "cast_wire",
    "choose_transport",
    "default_block_sizes",
    "default_overlap_degrees",
    "pad_runs",
    "pair_levels",
    "piece_len",
    "relay_run_bounds",
    "relay_wire",
    "resolve_kv",
    "slot_rows",
    "solve_dispatch",
]

# The modules that moved away, by their old names.
__getattr__ = _moved.old_children(__name__)
