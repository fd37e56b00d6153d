"""Ring attention (zigzag layout) on our FFA: the KV blocks travel around the ring with
``ppermute``; every rank merges its partial results by log-sum-exp.

Forward, rank ``r``, step ``s = 0 .. cp−1``: it holds the KV block of rank ``r − s`` (its own
at ``s = 0``), sends it on to ``r + 1`` (issued before the step's FFA, so XLA may overlap the
two) and runs FFA of its queries against it with the plan of the sub-mask between its tokens
and that block (a block it sees no cell of costs no tile). Steps ``0 .. cp−2`` are one
``lax.scan`` (one compiled step, whatever ``cp``), the last step sends nothing.

Backward (``custom_vjp``): the same ring again, now carrying KV *and* its partial dK/dV
(float32). At every step each rank runs the FFA backward of its queries against the block it
holds, given the merged ``(out, lse)``, adds dQ locally and dK/dV onto the travelling
accumulator; a final hop brings every dK/dV home. Nothing is recomputed and at most one
remote block is held at a time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.baselines.common import BaselinePlan, Layout, LocalFFA, area, sub_shapes
from magi_jax.sharding.attention import merge_partials

__all__ = ["RingPlan", "make_ring_plan", "ring_attention", "ring_attention_local"]


@dataclasses.dataclass(frozen=True)
class _RingStatic:
    axis: str
    cp: int
    ffa: LocalFFA
    mesh: jax.sharding.Mesh
    layout: Layout = dataclasses.field(compare=False, hash=False, repr=False)
    step_area: np.ndarray = dataclasses.field(compare=False, hash=False, repr=False)


@jax.tree_util.register_pytree_node_class
class RingPlan(BaselinePlan):
    """``arrays``: the FFA plans of every (step ``s``, rank ``r``) — rank ``r``'s sub-mask
    against the block of rank ``r − s`` — stacked ``[cp_steps, cp, ...]`` (padded to the
    largest), sharded over ranks. Host figures: ``step_area [cp_steps, cp]``."""

    @property
    def step_area(self) -> np.ndarray:
        return self.static.step_area


def make_ring_plan(layout: Layout, ffa: LocalFFA) -> RingPlan:
    """Host plan of ring attention over ``layout``."""
    cp, tl, c = layout.cp, layout.local_len, layout.meta.chunk_size
    chunks = layout.meta.rank_chunks
    offsets = np.arange(chunks.shape[1]) * c
    plans, areas = [], []
    for s in range(cp):
        for r in range(cp):
            shapes = sub_shapes(layout, [r], chunks[(r - s) % cp], offsets)
            areas.append(area(shapes))
            plans.append(ffa.plan(shapes, tl, tl))
    stacked = ffa.stack(plans)
    spec = NamedSharding(layout.mesh, P(None, layout.axis))
    steps = type(stacked)(
        *(
            jax.device_put(np.ascontiguousarray(a.reshape((cp, cp) + a.shape[1:]), np.int32), spec)
            for a in stacked
        )
    )
    static = _RingStatic(
        layout.axis, cp, ffa, layout.mesh, layout, np.array(areas, np.int64).reshape(cp, cp)
    )
    return RingPlan(static, steps)


def _shift(x, axis, cp):
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % cp) for i in range(cp)])


def _split(steps):
    """[cp_steps, ...] plans -> (all but the last step, the last step)."""
    return (jax.tree.map(lambda a: a[:-1], steps), jax.tree.map(lambda a: a[-1], steps))


def _forward(q, k, v, steps, st: _RingStatic, scale, softcap):
    hkv = k.shape[1]
    ffa = functools.partial(st.ffa.forward, scale=scale, softcap=softcap)
    f32 = jnp.float32

    def step(carry, plan):
        kv, out, lse = carry
        nxt = _shift(kv, st.axis, st.cp)  # issued before the FFA: may overlap with it
        o, l = ffa(q, kv[:, :hkv], kv[:, hkv:], plan)
        out, lse = merge_partials([out, o], [lse, l], f32)
        return (nxt, out, lse), None

    kv = jnp.concatenate([k, v], axis=1)  # one ppermute carries K and V
    init = (kv, jnp.zeros(q.shape, f32), jnp.full(q.shape[:2], -jnp.inf, f32))
    rotating, last = _split(steps)
    (kv, out, lse), _ = jax.lax.scan(step, init, rotating)
    o, l = ffa(q, kv[:, :hkv], kv[:, hkv:], last)  # the last block: nothing more to send
    return merge_partials([out, o], [lse, l], q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, steps, st, scale, softcap):
    return _forward(q, k, v, steps, st, scale, softcap)


def _ring_fwd(q, k, v, steps, st, scale, softcap):
    out, lse = _forward(q, k, v, steps, st, scale, softcap)
    return (out, lse), (q, k, v, steps, out, lse)


def _ring_bwd(st, scale, softcap, res, cts):
    q, k, v, steps, out, lse = res
    dout, dlse = cts
    hkv = k.shape[1]
    f32 = jnp.float32

    def grads(kv, dkv, dq, plan):
        dq_s, dk_s, dv_s = st.ffa.backward(
            q, kv[:, :hkv], kv[:, hkv:], out, lse, dout, dlse, plan, scale=scale, softcap=softcap
        )
        return (dkv + jnp.concatenate([dk_s, dv_s], axis=1).astype(f32), dq + dq_s.astype(f32))

    def step(carry, plan):
        kv, dkv, dq = carry
        nxt = _shift(kv, st.axis, st.cp)
        dkv, dq = grads(kv, dkv, dq, plan)
        return (nxt, _shift(dkv, st.axis, st.cp), dq), None

    kv = jnp.concatenate([k, v], axis=1)
    init = (kv, jnp.zeros(kv.shape, f32), jnp.zeros(q.shape, f32))
    rotating, last = _split(steps)
    (kv, dkv, dq), _ = jax.lax.scan(step, init, rotating)
    dkv, dq = grads(kv, dkv, dq, last)
    # Rank r now holds the dK/dV of rank r + 1: one more hop brings every block home.
    dkv = _shift(dkv, st.axis, st.cp)
    return (dq.astype(q.dtype), dkv[:, :hkv].astype(k.dtype), dkv[:, hkv:].astype(v.dtype), None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_local(
    q, k, v, steps, static: _RingStatic, *, softmax_scale=None, softcap: float = 0.0
):
    """Per-rank body (inside ``shard_map`` over the plan's axis): q ``[Tl, Hq, D]``, k/v
    ``[Tl, Hkv, D]``, ``steps`` this rank's plans ``[cp_steps, ...]``. Returns local
    ``(out, lse)``."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _ring(q, k, v, steps, static, scale, float(softcap))


def ring_attention(q, k, v, plan: RingPlan, *, softmax_scale=None, softcap: float = 0.0):
    """Ring attention of dispatched (zigzag layout) q ``[padded_total, Hq, D]``, k/v
    ``[padded_total, Hkv, D]`` sharded over the plan's axis. Returns dispatched
    ``(out, lse)``; differentiable in q, k, v."""
    st = plan.static
    spec = P(st.axis)

    def body(q, k, v, steps):
        steps = jax.tree.map(lambda a: a[:, 0], steps)
        return ring_attention_local(
            q, k, v, steps, st, softmax_scale=softmax_scale, softcap=softcap
        )

    step_specs = jax.tree.map(lambda _: P(None, st.axis), plan.arrays)
    fn = jax.shard_map(
        body,
        mesh=st.mesh,
        in_specs=(spec, spec, spec, step_specs),
        out_specs=(spec, spec),
        check_vma=False,
    )
    return fn(q, k, v, plan.arrays)
