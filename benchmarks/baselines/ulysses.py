"""Ulysses (DeepSpeed) context parallelism: an ``all_to_all`` trades the sequence shard for a
head shard, every rank runs FFA over the whole sequence for ``H / cp`` heads, and a second
``all_to_all`` trades back. Its compute is balanced by heads whatever the mask; it needs
``Hq % cp == 0`` and KV heads divisible by ``cp`` — with fewer KV heads (GQA) each KV head is
repeated just enough (the usual Ulysses fallback), at the price of more KV traffic.

The sequence it sees is the dispatched one (all ranks' local tokens back to back), so the
inputs share the baselines' zigzag layout and the mask is planned in that order.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from benchmarks.baselines.common import BaselinePlan, Layout, LocalFFA, area, replicate, sub_shapes

__all__ = [
    "UlyssesPlan",
    "make_ulysses_plan",
    "ulysses_attention",
    "ulysses_attention_local",
    "kv_repeat",
]


@dataclasses.dataclass(frozen=True)
class _UlyssesStatic:
    axis: str
    cp: int
    ffa: LocalFFA
    mesh: jax.sharding.Mesh
    layout: Layout = dataclasses.field(compare=False, hash=False, repr=False)
    area: int = dataclasses.field(compare=False, hash=False, repr=False, default=0)


@jax.tree_util.register_pytree_node_class
class UlyssesPlan(BaselinePlan):
    """One FFA plan of the whole mask in dispatched order (the same on every rank)."""


def make_ulysses_plan(layout: Layout, ffa: LocalFFA) -> UlyssesPlan:
    meta = layout.meta
    c = meta.chunk_size
    chunks = np.arange(meta.num_chunks)
    offsets = meta.chunk_owner * meta.local_len + meta.chunk_slot * c
    ranks = range(layout.cp)
    shapes = sub_shapes(
        layout, ranks, chunks, offsets, q_offset_of_rank=[r * meta.local_len for r in ranks]
    )
    plan = ffa.plan(shapes, meta.padded_total, meta.padded_total)
    static = _UlyssesStatic(layout.axis, layout.cp, ffa, layout.mesh, layout, area(shapes))
    return UlyssesPlan(static, replicate(plan, layout))


def kv_repeat(hq: int, hkv: int, cp: int) -> int:
    """How many times every KV head is repeated so that the KV heads split over ``cp``."""
    if hq % cp:
        raise ValueError(
            f"Ulysses needs the query heads to split over the ranks: Hq={hq} is "
            f"not a multiple of cp={cp}"
        )
    need = math.lcm(hkv, cp)
    if hq % need:
        raise ValueError(
            f"Ulysses: Hkv={hkv} cannot be repeated to a multiple of cp={cp} that divides Hq={hq}"
        )
    return need // hkv


def ulysses_attention_local(
    q, k, v, ffa_plan, static: _UlyssesStatic, *, softmax_scale=None, softcap: float = 0.0
):
    """Per-rank body inside ``shard_map``: local q/k/v ``[Tl, H, D]`` -> local (out, lse)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    ax, cp = static.axis, static.cp
    rep = kv_repeat(q.shape[1], k.shape[1], cp)
    if rep > 1:
        k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    hkv = k.shape[1]
    # Sequence shard -> head shard: [Tl, H, D] -> [cp·Tl, H / cp, D]. With K and V in one
    # all_to_all the head split must keep each rank's K heads and V heads together.
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], 2 * hkv, k.shape[2])
    to_heads = lambda x: jax.lax.all_to_all(x, ax, split_axis=1, concat_axis=0, tiled=True)
    qh, kvh = to_heads(q), to_heads(kv)
    kvh = kvh.reshape(kvh.shape[0], hkv // cp, 2, kvh.shape[2])
    out, lse = static.ffa.forward(
        qh, kvh[:, :, 0], kvh[:, :, 1], ffa_plan, scale=scale, softcap=float(softcap)
    )
    to_seq = lambda x: jax.lax.all_to_all(x, ax, split_axis=0, concat_axis=1, tiled=True)
    return to_seq(out), to_seq(lse)


def ulysses_attention(q, k, v, plan: UlyssesPlan, *, softmax_scale=None, softcap: float = 0.0):
    """Ulysses attention of dispatched q/k/v (zigzag layout); returns dispatched
    ``(out, lse)``, differentiable in q, k, v."""
    st = plan.static
    spec = P(st.axis)

    def body(q, k, v, ffa_plan):
        return ulysses_attention_local(
            q, k, v, ffa_plan, st, softmax_scale=softmax_scale, softcap=softcap
        )

    fn = jax.shard_map(
        body,
        mesh=st.mesh,
        in_specs=(spec, spec, spec, jax.tree.map(lambda _: P(), plan.arrays)),
        out_specs=(spec, spec),
        check_vma=False,
    )
    return fn(q, k, v, plan.arrays)
