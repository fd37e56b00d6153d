"""All-gather context parallelism (Transformer Engine's default CP for irregular masks): every
rank all-gathers the whole KV, runs one FFA call of its queries (zigzag layout) against it,
and the backward reduce-scatters the partial dK/dV (summed in float32) back to the owners.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from benchmarks.baselines.common import (
    BaselinePlan,
    Layout,
    LocalFFA,
    area,
    shard_stacked,
    sub_shapes,
)

__all__ = [
    "AllGatherPlan",
    "make_allgather_plan",
    "allgather_attention",
    "allgather_attention_local",
]


@dataclasses.dataclass(frozen=True)
class _AGStatic:
    axis: str
    cp: int
    ffa: LocalFFA
    mesh: jax.sharding.Mesh
    layout: Layout = dataclasses.field(compare=False, hash=False, repr=False)
    rank_area: np.ndarray = dataclasses.field(compare=False, hash=False, repr=False)


@jax.tree_util.register_pytree_node_class
class AllGatherPlan(BaselinePlan):
    """Every rank's FFA plan of its queries against the gathered KV (dispatched order),
    stacked ``[cp, ...]``."""


def make_allgather_plan(layout: Layout, ffa: LocalFFA) -> AllGatherPlan:
    meta = layout.meta
    c = meta.chunk_size
    chunks = np.arange(meta.num_chunks)
    offsets = meta.chunk_owner * meta.local_len + meta.chunk_slot * c
    shapes = [sub_shapes(layout, [r], chunks, offsets) for r in range(layout.cp)]
    plans = [ffa.plan(x, meta.local_len, meta.padded_total) for x in shapes]
    static = _AGStatic(
        layout.axis,
        layout.cp,
        ffa,
        layout.mesh,
        layout,
        np.array([area(x) for x in shapes], np.int64),
    )
    return AllGatherPlan(static, shard_stacked(ffa.stack(plans), layout))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(x, axis):
    return jax.lax.all_gather(x, axis, axis=0, tiled=True)


def _gather_fwd(x, axis):
    return _gather(x, axis), None


def _gather_bwd(axis, _, ct):
    # The adjoint of all-gather, summed in float32 (the partial dK/dV of every rank).
    red = jax.lax.psum_scatter(ct.astype(jnp.float32), axis, scatter_dimension=0, tiled=True)
    return (red.astype(ct.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def allgather_attention_local(
    q, k, v, ffa_plan, static: _AGStatic, *, softmax_scale=None, softcap: float = 0.0
):
    """Per-rank body inside ``shard_map``: local q/k/v ``[Tl, H, D]`` -> local (out, lse)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    hkv = k.shape[1]
    kv = _gather(jnp.concatenate([k, v], axis=1), static.axis)  # one collective for K and V
    return static.ffa.forward(
        q, kv[:, :hkv], kv[:, hkv:], ffa_plan, scale=scale, softcap=float(softcap)
    )


def allgather_attention(q, k, v, plan: AllGatherPlan, *, softmax_scale=None, softcap: float = 0.0):
    """All-gather CP attention of dispatched q/k/v (zigzag layout); returns dispatched
    ``(out, lse)``, differentiable in q, k, v."""
    st = plan.static
    spec = P(st.axis)

    def body(q, k, v, ffa_plan):
        ffa_plan = jax.tree.map(lambda a: a[0], ffa_plan)
        return allgather_attention_local(
            q, k, v, ffa_plan, st, softmax_scale=softmax_scale, softcap=softcap
        )

    fn = jax.shard_map(
        body,
        mesh=st.mesh,
        in_specs=(spec, spec, spec, jax.tree.map(lambda _: spec, plan.arrays)),
        out_specs=(spec, spec),
        check_vma=False,
    )
    return fn(q, k, v, plan.arrays)
