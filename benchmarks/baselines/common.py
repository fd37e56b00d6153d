"""What the context-parallel baselines share: the per-rank FFA (our kernels, so that only the
parallel strategy differs from magi-jax), the zigzag layout, and the host planning of the
sub-masks each rank computes.

Every baseline takes its inputs in one *dispatched* layout (:class:`Layout`): the packed
sequence is padded to ``2·cp`` blocks and rank ``r`` holds blocks ``r`` and ``2·cp − 1 − r``
(the load-balanced zigzag layout of ring attention), via the dispatch solver's ``"zigzag"``
algorithm. All host work (which cells each rank computes against which KV buffer) is NumPy,
done once; devices see int32 plan arrays stacked ``[cp, ...]`` and sharded over the cp axis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from magi_jax.mask import AttnMask, SliceShapes
from magi_jax.planning.backends import backend_blocks, check_backend
from magi_jax.planning.solver import DispatchMeta, solve_dispatch
from magi_jax.planning.stages import _clip_to_segments, rank_views
from magi_jax.planning.work_list import build_plan_arrays, stack_plans

__all__ = ["LocalFFA", "Layout", "make_layout", "pick_backend", "sub_shapes"]


def pick_backend(backend: str, dtype, head_dim: int) -> tuple[str, str]:
    """The per-rank FFA engine: ``(name, reason)``, from the library's registry
    (:func:`magi_jax.ffa.backends.auto_backend` among the engines a rank runs)."""
    from magi_jax.ffa.backends import auto_backend

    check_backend(backend, context_parallel=True)
    if backend != "auto":
        return backend, "requested"
    x = jax.ShapeDtypeStruct((1, 1, head_dim), jnp.dtype(dtype))
    return auto_backend(x, x, x, context_parallel=True)


@dataclasses.dataclass(frozen=True)
class LocalFFA:
    """One rank's flexible-mask attention from plan arrays, on one of our FFA backends.

    ``forward`` is differentiable (the backends' own VJPs); ``backward`` is the FFA backward
    from *given* ``(out, lse)`` — the merged results of all KV blocks — which is what ring
    attention runs per KV block (``P = exp(S − lse)`` with the global ``lse``), with no
    forward recomputation. ``interpret`` runs the pallas kernels in interpret mode (tests).
    """

    backend: str = "xla"
    block_q: int = 128
    block_k: int = 128
    interpret: bool = False

    def __post_init__(self):
        if self.backend == "auto":
            raise ValueError("LocalFFA backend='auto': resolve it with pick_backend first")
        check_backend(self.backend, auto=False, context_parallel=True)

    # ---- host ----
    def plan(self, shapes: SliceShapes, tq: int, tk: int):
        blocks = backend_blocks(self.backend, tq, tk, self.block_q, self.block_k)
        return build_plan_arrays(shapes, tq, tk, *blocks)

    def stack(self, plans):
        """Stacks per-rank plans along a new leading axis (padded to the largest)."""
        return stack_plans(list(plans))

    # ---- device ----
    def forward(self, q, k, v, plan, *, scale: float, softcap: float):
        """q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` -> ``(out, lse [Tq, Hq] float32)``."""
        if self.backend == "xla":
            from magi_jax.ffa.xla import xla_ffa

            return xla_ffa(
                q,
                k,
                v,
                plan,
                softmax_scale=scale,
                softcap=softcap,
                block_q=self.block_q,
                block_k=self.block_k,
            )
        from magi_jax.pallas import ffa_pallas

        return ffa_pallas(
            q, k, v, plan, softmax_scale=scale, softcap=softcap, interpret=self.interpret
        )

    def backward(self, q, k, v, out, lse, dout, dlse, plan, *, scale: float, softcap: float):
        """FFA backward of one KV block given the merged ``(out, lse)``: ``(dq, dk, dv)``."""
        if self.backend == "xla":
            from magi_jax.ffa.xla import xla_ffa_backward

            return xla_ffa_backward(
                q,
                k,
                v,
                out,
                lse,
                dout,
                dlse,
                plan,
                softmax_scale=scale,
                softcap=softcap,
                block_q=self.block_q,
                block_k=self.block_k,
            )
        from magi_jax.pallas import ffa_pallas_backward

        return ffa_pallas_backward(
            q,
            k,
            v,
            plan,
            out,
            lse,
            dout,
            dlse,
            softmax_scale=scale,
            softcap=softcap,
            interpret=self.interpret,
        )


# ---- layout ---------------------------------------------------------------------------------


class BaselinePlan:
    """A baseline's plan: hashable host-static half (``static``, with a ``layout``) and the
    stacked device plan arrays (``arrays``, the pytree leaves). Subclasses only register
    themselves as pytrees and document their arrays."""

    def __init__(self, static, arrays):
        self.static = static
        self.arrays = arrays

    def tree_flatten(self):
        return (self.arrays,), self.static

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(static, *children)

    @property
    def layout(self) -> "Layout":
        return self.static.layout


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """The zigzag layout of one mask on one mesh axis: ``meta`` (dispatch), ``order``
    (global position of each dispatched token, padding ``>= total``) and ``inverse``."""

    mask: AttnMask
    mesh: jax.sharding.Mesh
    axis: str
    meta: DispatchMeta
    order: np.ndarray
    inverse: np.ndarray

    @property
    def cp(self) -> int:
        return self.meta.cp

    @property
    def local_len(self) -> int:
        return self.meta.local_len

    @property
    def padded_total(self) -> int:
        return self.meta.padded_total

    def spec(self):
        return NamedSharding(self.mesh, P(self.axis))

    def dispatch(self, x):
        """Natural order ``[total, ...]`` -> dispatched ``[padded_total, ...]``, sharded."""
        pad = self.padded_total - self.meta.total
        xp = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) if pad else x
        y = jnp.take(xp, jnp.asarray(self.order), axis=0)
        return jax.lax.with_sharding_constraint(y, self.spec())

    def undispatch(self, x):
        """Dispatched ``[padded_total, ...]`` -> natural order ``[total, ...]``."""
        return jnp.take(x, jnp.asarray(self.inverse), axis=0)

    @functools.cached_property
    def views(self):
        return rank_views(self.mask, self.meta, 1)

    @functools.cached_property
    def q_shift(self) -> np.ndarray:
        """Per chunk: local query index minus global position."""
        c = self.meta.chunk_size
        return self.meta.chunk_slot * c - np.arange(self.meta.num_chunks) * c

    def rank_area(self) -> np.ndarray:
        return self.meta.rank_area()


def make_layout(
    mask: AttnMask,
    mesh,
    axis: str = "cp",
    *,
    chunk_size: int | None = None,
    algorithm: str = "zigzag",
) -> Layout:
    """The zigzag (default) layout of ``mask`` over ``mesh``'s ``axis``."""
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {mesh.axis_names}")
    cp = int(mesh.shape[axis])
    meta = solve_dispatch(mask, cp, chunk_size, algorithm)
    order = meta.positions.reshape(-1)
    inverse = np.empty(meta.padded_total, np.int64)
    inverse[order] = np.arange(meta.padded_total)
    return Layout(
        mask, mesh, axis, meta, order.astype(np.int32), inverse[: meta.total].astype(np.int32)
    )


def sub_shapes(
    layout: Layout, ranks, kv_chunks: np.ndarray, kv_offsets: np.ndarray, q_offset_of_rank=None
) -> SliceShapes:
    """The cells that the queries of ``ranks`` see among the KV chunks ``kv_chunks`` laid out
    at buffer offsets ``kv_offsets``, in local coordinates: query ``i`` = the ranks' local
    tokens back to back (rank ``ranks[j]`` starts at ``q_offset_of_rank[j]``, default 0),
    key ``j`` = position in the KV buffer."""
    c = layout.meta.chunk_size
    kv_chunks = np.asarray(kv_chunks, np.int64)
    g0 = kv_chunks * c
    order = np.argsort(g0, kind="stable")
    g0 = g0[order]
    shift = np.asarray(kv_offsets, np.int64)[order] - g0
    parts = []
    ranks = list(ranks)
    offs = [0] * len(ranks) if q_offset_of_rank is None else list(q_offset_of_rank)
    for r, off in zip(ranks, offs):
        parts.append(
            _clip_to_segments(
                layout.mask.shapes, layout.views[r].pairs, g0, g0 + c, shift, layout.q_shift + off
            )
        )
    return SliceShapes(
        *(
            np.concatenate([getattr(p, f.name) for p in parts])
            for f in dataclasses.fields(SliceShapes)
        )
    )


def shard_stacked(plan, layout: Layout):
    """Puts a ``[cp, ...]`` stacked plan on the mesh, sharded over the cp axis."""
    put = lambda a: jax.device_put(np.ascontiguousarray(a, np.int32), layout.spec())
    return type(plan)(*(put(a) for a in plan))


def replicate(plan, layout: Layout):
    put = lambda a: jax.device_put(
        np.ascontiguousarray(a, np.int32), NamedSharding(layout.mesh, P())
    )
    return type(plan)(*(put(a) for a in plan))


def area(shapes: SliceShapes) -> int:
    return int(shapes.areas().sum())
