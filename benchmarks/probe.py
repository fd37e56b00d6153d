"""Overlap probe: the pieces of ``magi_attention`` as separately jitted programs, to prove
(or disprove) that communication overlaps compute (docs/design.md §3.2): time ``comm`` alone,
``compute`` alone (FFA stages on pre-fetched KV), and ``both`` (the real thing). Overlap
hides ``comm + compute − both`` of the communication.

    fns = overlap_probe(key, q, k, v)          # q/k/v dispatched
    bufs = fns["comm"](k, v)                   # group-casts only -> KV buffers
    out, lse = fns["compute"](q, k, v, bufs)   # FFA stages + merge, no communication
    out, lse = fns["both"](q, k, v)            # magi_attention
    ms = time_ms(fns["both"], q, k, v)

``backward=True`` gives the forward+backward versions (``comm``: cast then reduce;
``compute``: FFA VJPs with the buffers' cotangents; ``both``: VJP of ``magi_attention``).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from magi_jax.sharding.attention import (
    magi_attention,
    rank_stages,
    stages_backward,
    stages_cfg,
    stages_forward,
)
from magi_jax.sharding.collectives import group_cast, group_reduce
from magi_jax.sharding.key import MagiKey

__all__ = ["overlap_probe", "nocomm_attention", "time_ms", "measure_overlap"]


def _remote_stages(key):
    return [i for i, st in enumerate(key.stages) if st.cast is not None]


def overlap_probe(
    key: MagiKey,
    q,
    k,
    v,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    backward: bool = False,
) -> dict:
    """Jitted ``comm``, ``compute`` and ``both`` for ``key`` and inputs shaped like the
    dispatched ``q, k, v`` (``[padded_total, H, D]``); see the module docstring."""
    if backward and key.static.backward_stages is not None:
        raise ValueError(
            f"overlap_probe(backward=True) splits the backward by the forward's stages; this "
            f"key's backward has its own (overlap_degree={key.overlap_degree}, "
            f"backward_overlap_degree={key.backward_overlap_degree}): probe a key of one degree"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    spec = P(key.cp_axis)
    arr_specs = jax.tree.map(lambda _: spec, key.stage_arrays)
    remote = _remote_stages(key)

    def mine(arrays):
        return jax.tree.map(lambda a: a[0], arrays)

    def comm_body(k, v, arrays):
        arrays = mine(arrays)
        bufs = tuple(group_cast((k, v), arrays[i][1], key.stages[i].cast) for i in remote)
        if not backward:
            return bufs
        # The backward's communication: the same casts, then reduces of same-sized buffers.
        red = [
            group_reduce(b, arrays[i][1], key.stages[i].cast, k.shape[0])
            for b, i in zip(bufs, remote)
        ]
        return bufs + tuple(jax.tree.map(lambda r: r.astype(k.dtype), x) for x in red)

    cfg = stages_cfg(key, scale, float(softcap))

    def compute_body(q, k, v, bufs, arrays):
        # magi_attention's own forward and backward code, with the remote KV given.
        arrays = tuple(mine(arrays))
        kv = (k, v)
        given = dict(zip(remote, bufs))

        def fetch(i):
            kk, vv = given[i]
            if cfg.stages[i].combined:
                kk, vv = jnp.concatenate([k, kk]), jnp.concatenate([v, vv])
            return kk, vv

        (out, lse), _ = stages_forward(q, kv, arrays, cfg, fetch)
        if not backward:
            return out, lse
        dbufs = {}

        def send_back(i, rows, final):
            # Keeps the buffer rows (for the comm-free timing) and returns the local rows of a
            # combined stage (zeros otherwise), like a reduce that received nothing.
            t = k.shape[0]
            combined = cfg.stages[i].combined
            dbufs[i] = jax.tree.map(lambda r: r[t:], rows) if combined else rows
            own = jax.tree.map(
                lambda r: (
                    r[:t].astype(jnp.float32)
                    if combined
                    else jnp.zeros((t,) + r.shape[1:], jnp.float32)
                ),
                rows,
            )
            return jax.tree.map(lambda o, r: o.astype(r.dtype), own, rows) if final else own

        dq, (dk, dv) = stages_backward(
            q, kv, arrays, cfg, out, lse, (out, jnp.zeros_like(lse)), fetch, send_back
        )
        return (
            dq.astype(q.dtype),
            dk.astype(k.dtype),
            dv.astype(v.dtype),
            tuple(dbufs[i] for i in remote),
        )

    num_out = len(remote) * (2 if backward else 1)
    comm = jax.jit(
        jax.shard_map(
            comm_body,
            mesh=key.mesh,
            in_specs=(spec, spec, arr_specs),
            out_specs=(spec,) * num_out,
            check_vma=False,
        )
    )
    buf_specs = (spec,) * len(remote)
    compute = jax.jit(
        jax.shard_map(
            compute_body,
            mesh=key.mesh,
            in_specs=(spec, spec, spec, buf_specs, arr_specs),
            out_specs=(spec, spec, spec, buf_specs) if backward else (spec, spec),
            check_vma=False,
        )
    )

    def both_fn(q, k, v):
        out, lse = magi_attention(q, k, v, key, softmax_scale=scale, softcap=softcap)
        return out, lse

    if backward:

        def both_vjp(q, k, v):
            (out, lse), vjp = jax.vjp(both_fn, q, k, v)
            return vjp((out, jnp.zeros_like(lse)))

        both = jax.jit(both_vjp)
    else:
        both = jax.jit(both_fn)
    return {
        "comm": lambda k, v: comm(k, v, key.stage_arrays),
        "compute": lambda q, k, v, bufs: compute(
            q, k, v, tuple(bufs)[: len(remote)], key.stage_arrays
        ),
        "both": both,
    }


def _local_fetch(kv, stage_arrays, cfg):
    """Remote stage ``i``'s KV buffer filled from local rows (no group-cast)."""
    k, v = kv

    def fetch(i):
        stage = cfg.stages[i]
        n = stage.kv_len - (k.shape[0] if stage.combined else 0)
        rows = jnp.arange(n) % k.shape[0]
        kb, vb = jnp.take(k, rows, axis=0), jnp.take(v, rows, axis=0)
        if stage.combined:
            return jnp.concatenate([k, kb]), jnp.concatenate([v, vb])
        return kb, vb

    return fetch


def _local_send_back(kv, stage_arrays, cfg):
    """A remote stage's dK/dV gathered onto local rows (no group-reduce). Kept rather than
    dropped: a dropped kernel output lets XLA remove the kernel, and the probe would time
    less work than magi does."""
    t_loc = kv[0].shape[0]

    def send_back(i, rows, final):
        def one(r):
            buf = r[t_loc:] if cfg.stages[i].combined else r
            got = jnp.take(buf, jnp.arange(t_loc) % buf.shape[0], axis=0).astype(jnp.float32)
            if cfg.stages[i].combined:
                got = got + r[:t_loc].astype(jnp.float32)
            return got.astype(r.dtype) if final else got

        return jax.tree.map(one, rows)

    return send_back


def nocomm_attention(
    q, k, v, key: MagiKey, *, softmax_scale: float | None = None, softcap: float = 0.0
):
    """A timing probe, not attention: ``magi_attention``'s own per-rank stages, merge and
    backward with every remote KV buffer filled from local rows instead of the group-cast,
    and the remote stages' partial dK/dV gathered onto local rows instead of group-reduced.
    ``magi − nocomm`` is magi's exposed communication; ``nocomm −`` single-device FFA on the
    same work, its stage and merge overhead. Same arguments and shapes as ``magi_attention``
    (``[padded_total, H, D]``)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    cfg = stages_cfg(key, scale, float(softcap))
    spec = P(key.cp_axis)

    def body(q, k, v, stage_arrays):
        forward, backward = jax.tree.map(lambda x: x[0], stage_arrays)
        return rank_stages(q, (k, v), tuple(forward), backward, cfg, _local_fetch, _local_send_back)

    arrays = (key.stage_arrays, key.backward_stage_arrays)
    specs = jax.tree.map(lambda _: spec, arrays)
    fn = jax.shard_map(
        body,
        mesh=key.mesh,
        in_specs=(spec, spec, spec, specs),
        out_specs=(spec, spec),
        check_vma=False,
    )
    return fn(q, k, v, arrays)


def time_ms(fn, *args, warmup: int = 2, iters: int = 10) -> float:
    """Median wall time of ``fn(*args)`` in milliseconds (blocking on the outputs)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def measure_overlap(
    key: MagiKey, q, k, v, *, backward: bool = False, iters: int = 10, **attention_kwargs
) -> dict:
    """Timings (ms) of ``comm`` alone, ``compute`` alone and ``both``, the communication they
    hide (``hidden_ms = comm + compute − both``, clipped at 0; ``hidden_fraction`` of comm),
    and the per-device TFLOP/s of ``both`` counted on the most loaded rank's area
    (``4·area·Hq·D``, ×3.5 with the backward) — the figure to compare with
    single-device FFA on the same per-device work."""
    fns = overlap_probe(key, q, k, v, backward=backward, **attention_kwargs)
    bufs = fns["comm"](k, v)
    comm = time_ms(fns["comm"], k, v, iters=iters)
    compute = time_ms(fns["compute"], q, k, v, bufs, iters=iters)
    both = time_ms(fns["both"], q, k, v, iters=iters)
    hidden = max(0.0, comm + compute - both)
    batch = q.shape[0] if q.ndim == 4 else 1
    area = int(key.plan.meta.rank_area().max())
    flops = 4.0 * area * q.shape[-2] * q.shape[-1] * batch * (3.5 if backward else 1.0)
    return dict(
        comm_ms=comm,
        compute_ms=compute,
        both_ms=both,
        hidden_ms=hidden,
        hidden_fraction=hidden / comm if comm else 0.0,
        tflops_per_device=flops / (both * 1e-3) / 1e12,
        max_rank_area=area,
        remote_kv_max=int(key.plan.remote_tokens.max()),
        overlap_degree=key.overlap_degree,
        backward=backward,
    )
