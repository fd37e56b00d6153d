"""The options of a key: :class:`KeyOptions`, the sixteen keywords of
:func:`~magi_jax.sharding.make_flex_key` beside ``(mask, mesh, cp_axis)``, each
checked when the options are built; what they mean with a mask and a mesh (cross attention,
the transport, two-hop casts, the capacity) is decided by
:func:`~magi_jax.sharding.keys._resolve.resolve_options`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from magi_jax.planning import ALGORITHMS, KV_LAYOUTS, OverlapDegrees, PlanCapacity
from magi_jax.planning.backends import check_backend
from magi_jax.sharding.keys._key import MagiKey
from magi_jax.sharding.transport import TRANSPORTS

COMM_BACKENDS = ("auto", "xla") + TRANSPORTS
# Largest overlap degree a key accepts (the bound of PlanCapacity.overlap_degree): every stage
# costs a kernel launch, a merge and a collective, and the cost model never picks more than 4.
MAX_OVERLAP_DEGREE = 8
# Environment variable that turns on check_dispatch for every key make_flex_key builds.
CHECK_DISPATCH_ENV = "MAGI_JAX_CHECK_DISPATCH"

HIERARCHICAL = (True, False, "auto")

# How the lax.ppermute slots of a key's casts follow the rows (make_flex_key's cast_gating).
CAST_GATINGS = ("auto", "slot", "pair")


@dataclasses.dataclass(frozen=True)
class KeyOptions:
    """The options of :func:`~magi_jax.sharding.make_flex_key` (see it for what
    each means), with its defaults. Built, they are checked one by one (``ValueError`` or
    ``TypeError`` naming the option, the value and the fix) and normalised: integer options
    are Python ints or ``None``, ``overlap_degree`` ``None`` (the cost model's, also for
    ``"auto"``) or :class:`~magi_jax.planning.cost_model.OverlapDegrees` (an integer is both
    degrees), ``backward_refetch`` a bool, and ``check_dispatch`` a bool (``None`` reads the
    ``MAGI_JAX_CHECK_DISPATCH`` environment variable). Checks that need the mask or the mesh
    are :func:`~magi_jax.sharding.keys._resolve.resolve_options`'."""

    chunk_size: int | None = None
    overlap_degree: int | tuple[int, int] | str | None = None
    comm_backend: str = "auto"
    dispatch_algorithm: str = "magi"
    dispatch_from: MagiKey | None = None
    block_q: int | None = None
    block_k: int | None = None
    ffa_backend: str = "auto"
    backward_refetch: bool = True
    capacity: PlanCapacity | None = None
    check_dispatch: bool | None = None
    kv_layout: str = "auto"
    hierarchical: bool | str = "auto"
    batch_axes: str | Sequence[str] = ()
    head_axes: str | Sequence[str] = ()
    cast_gating: str = "auto"

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f'kv_layout={self.kv_layout!r} is not one of {KV_LAYOUTS} ("auto": '
                "shared for self-attention, by the size rule for cross attention)"
            )
        put(
            "chunk_size",
            _check_int("chunk_size", self.chunk_size, 1, "a positive number of tokens"),
        )
        put("block_q", _check_int("block_q", self.block_q, 1, "a positive tile size"))
        put("block_k", _check_int("block_k", self.block_k, 1, "a positive tile size"))
        put("overlap_degree", check_overlap_degree(self.overlap_degree))
        put("check_dispatch", _check_dispatch_flag(self.check_dispatch))
        if self.comm_backend not in COMM_BACKENDS:
            raise ValueError(f"comm_backend={self.comm_backend!r} is not one of {COMM_BACKENDS}")
        if not (
            isinstance(self.hierarchical, bool)
            or (isinstance(self.hierarchical, str) and self.hierarchical == "auto")
        ):
            raise ValueError(
                f"hierarchical={self.hierarchical!r} must be True, False or 'auto' (two-hop "
                "casts on a mesh of nodes; 'auto': where they move fewer rows between "
                "nodes)"
            )
        if not isinstance(self.cast_gating, str) or self.cast_gating not in CAST_GATINGS:
            raise ValueError(
                f"cast_gating={self.cast_gating!r} is not one of {CAST_GATINGS} ('auto': "
                "each pair's exact rows for a key of one mask, gated slots at a capacity; "
                "'pair': gated pieces per pair at a capacity too)"
            )
        if self.cast_gating != "auto" and self.comm_backend in ("all_to_all", "native"):
            raise ValueError(
                f"cast_gating={self.cast_gating!r} chooses how lax.ppermute slots move, but "
                f"comm_backend={self.comm_backend!r} moves none: pass comm_backend='xla' "
                "(or 'ppermute'), or leave cast_gating='auto'"
            )
        check_backend(self.ffa_backend, "ffa_backend", context_parallel=True)
        if self.capacity is not None and not isinstance(self.capacity, PlanCapacity):
            raise TypeError(f"capacity must be a PlanCapacity; got {type(self.capacity).__name__}")
        if self.dispatch_algorithm not in ALGORITHMS:
            raise ValueError(
                f"dispatch_algorithm={self.dispatch_algorithm!r} is not one of {ALGORITHMS}"
            )
        if self.dispatch_from is not None and not isinstance(self.dispatch_from, MagiKey):
            raise TypeError(
                f"dispatch_from must be a MagiKey; got {type(self.dispatch_from).__name__}"
            )
        if not isinstance(self.backward_refetch, (bool, np.bool_)):
            raise ValueError(f"backward_refetch={self.backward_refetch!r} must be True or False")
        put("backward_refetch", bool(self.backward_refetch))
        degrees = self.overlap_degree
        if (
            degrees is not None
            and degrees.forward != degrees.backward
            and not self.backward_refetch
        ):
            raise ValueError(
                f"overlap_degree={tuple(degrees)!r} gives the backward its own stages, but "
                "backward_refetch=False keeps the forward's stage buffers for the backward: "
                "pass backward_refetch=True (the default), or one degree for both"
            )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names, in :func:`~magi_jax.sharding.make_flex_key`'s
        order."""
        return tuple(f.name for f in dataclasses.fields(cls))


_DEGREE_RANGE = (
    f"in [0, {MAX_OVERLAP_DEGREE}] (0: fetch all remote KV, then one FFA call; k: the host "
    "stage plus k remote stages, each costing a kernel, a merge and a collective)"
)


def check_overlap_degree(value: object) -> OverlapDegrees | None:
    """``make_flex_key``'s ``overlap_degree`` normalised: ``None`` for ``None`` or
    ``"auto"`` (the cost model's degrees), :class:`OverlapDegrees` for one integer (both
    the forward and the backward) or a pair ``(forward, backward)``; ``ValueError`` naming
    the value and the fix otherwise."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return None
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(
                f"overlap_degree={value!r}: a sequence must be a pair (forward, backward) of "
                f"integers {_DEGREE_RANGE}, e.g. overlap_degree=(1, 2)"
            )
        names = ("overlap_degree[0] (forward)", "overlap_degree[1] (backward)")
        return OverlapDegrees(
            *(
                _check_int(n, x, 0, _DEGREE_RANGE, hi=MAX_OVERLAP_DEGREE)
                for n, x in zip(names, value)
            )
        )
    if isinstance(value, str):
        raise ValueError(
            f"overlap_degree={value!r} is not a degree: pass an integer {_DEGREE_RANGE}, a "
            "pair (forward, backward), 'auto' or None (the cost model's), or the degrees "
            "mj.calibrate_overlap(...) measured on this machine (its .degrees)"
        )
    degree = _check_int("overlap_degree", value, 0, _DEGREE_RANGE, hi=MAX_OVERLAP_DEGREE)
    return OverlapDegrees(degree, degree)


def _check_int(name: str, value: object, lo: int, what: str, hi: int | None = None) -> int | None:
    """``None`` or an integer in ``[lo, hi]`` (an option of :func:`make_flex_key`)."""
    if value is None:
        return None
    value = value.item() if isinstance(value, np.generic) else value
    ok = not isinstance(value, bool) and (
        isinstance(value, (int, np.integer))
        or (isinstance(value, (float, np.floating)) and float(value).is_integer())
    )
    if not ok or value < lo or (hi is not None and value > hi):
        default = "the cost model's choice" if name.startswith("overlap") else "the default"
        raise ValueError(
            f"{name}={value!r} must be an integer {what} (or None for {default})"
            if hi is not None
            else f"{name}={value!r} must be {what} (or None for {default})"
        )
    return int(value)


def _check_dispatch_flag(value: bool | None) -> bool:
    if value is not None:
        return bool(value)
    env = os.environ.get(CHECK_DISPATCH_ENV, "").strip().lower()
    if env in ("", "0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    raise ValueError(
        f"{CHECK_DISPATCH_ENV}={os.environ[CHECK_DISPATCH_ENV]!r}: use 1 (check "
        "that magi_attention's inputs were dispatched) or 0"
    )
