"""Portable flexible-mask flash attention: blockwise online softmax in plain JAX.

The ``xla`` backend of :func:`magi_jax.flex_flash_attention` and the test oracle of the
kernels. It is driven by a host-built plan (:class:`~magi_jax.planning.lanes.XlaFFAPlan`):
lanes of work items (see :mod:`magi_jax.planning.tiling`), so the work follows the mask area
and the memory ``T·H·D`` — nothing of size ``Tq·Tk`` is ever built. The device entry point
:func:`xla_ffa` takes the plan as int32 arrays of static shape
(:class:`~magi_jax.planning.lanes.FFAPlanArrays`), never a mask, so context
parallelism can feed it each rank's own plan, stacked and sharded, under ``shard_map``.

Forward: every lane scans its items, keeps a float32 running max/sum/accumulator, and the
partial results of the lanes of one q-tile are merged by their log-sum-exp. Backward
recomputes the tiles: dQ over q-lanes, dK/dV over k-lanes (each output tile has its lanes),
accumulating in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from magi_jax.planning.lanes import FFAPlanArrays

__all__ = ["xla_ffa", "xla_ffa_forward", "xla_ffa_backward"]


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    softcap: float
    block_q: int
    block_k: int


def _acc_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _allowed(items, rows, cols):
    """Predicate of each lane's item on its tile: items [V, 8], rows [V, bq], cols [V, bk]
    -> bool [V, bq, bk]. Evaluated from the slice geometry; full tiles come out all-true."""
    q0, q1, k0, k1, dlo, dhi = (items[:, i, None, None] for i in range(1, 7))
    r = rows[:, :, None]
    c = cols[:, None, :]
    d = c - r
    return (r >= q0) & (r < q1) & (c >= k0) & (c < k1) & (d >= dlo) & (d <= dhi)


def _scores(qb, kb, items, rows, cols, cfg):
    """Scores of a tile. qb [V, bq, Hkv, G, D], kb [V, bk, Hkv, D] -> s [V, Hkv, G, bq, bk]
    (masked cells -inf), the raw capped-input tanh (for the softcap derivative) and the
    predicate."""
    acc = _acc_dtype(qb.dtype)
    s = jnp.einsum("vqhgd,vkhd->vhgqk", qb, kb, preferred_element_type=acc) * cfg.scale
    tanh = None
    if cfg.softcap:
        tanh = jnp.tanh(s / cfg.softcap)
        s = cfg.softcap * tanh
    allowed = _allowed(items, rows, cols)[:, None, None]
    return jnp.where(allowed, s, -jnp.inf), tanh, allowed


def _tiles(x, block):
    """[T, H, D] -> [T_pad / block, block, H, D], zero-padded."""
    t = x.shape[0]
    n = -(-t // block)
    x = jnp.pad(x, ((0, n * block - t),) + ((0, 0),) * (x.ndim - 1))
    return x.reshape((n, block) + x.shape[1:])


def _merge_lanes(lane_tile, lane_lse, lane_out, num_tiles):
    """Merges partial (out, lse) of lanes into their tiles by log-sum-exp.
    lane_lse [V, Hkv, G, bq], lane_out [V, bq, Hkv, G, D] (float32)."""
    m = jax.ops.segment_max(lane_lse, lane_tile, num_segments=num_tiles)
    m_safe = jnp.where(jnp.isfinite(m), m, 0)
    w = jnp.exp(lane_lse - m_safe[lane_tile])            # 0 for lanes without cells
    total = jax.ops.segment_sum(w, lane_tile, num_segments=num_tiles)
    lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1)), -jnp.inf)
    scale = jnp.where(total > 0, 1 / jnp.where(total > 0, total, 1), 0)
    out = jax.ops.segment_sum(lane_out * jnp.moveaxis(w, -1, 1)[..., None], lane_tile,
                              num_segments=num_tiles)
    out = out * jnp.moveaxis(scale, -1, 1)[..., None]
    return out, lse


def _forward(q, k, v, plan: FFAPlanArrays, cfg: _Config):
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    bq, bk = cfg.block_q, cfg.block_k
    acc = _acc_dtype(q.dtype)
    qt = _tiles(q, bq).reshape(-1, bq, hkv, g, d)
    kt, vt = _tiles(k, bk), _tiles(v, bk)
    lane_tile = plan.q_lane_tile
    num_lanes = lane_tile.shape[0]
    qb = qt[lane_tile]
    rows = lane_tile[:, None] * bq + jnp.arange(bq, dtype=jnp.int32)

    def visit(carry, item):
        m, l, o = carry
        ktile = item[:, 0]
        cols = ktile[:, None] * bk + jnp.arange(bk, dtype=jnp.int32)
        s, _, _ = _scores(qb, kt[ktile], item, rows, cols, cfg)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + p.sum(-1)
        pv = jnp.einsum("vhgqk,vkhd->vqhgd", p.astype(v.dtype), vt[ktile],
                        preferred_element_type=acc)
        o = o * jnp.moveaxis(alpha, -1, 1)[..., None] + pv
        return (m_new, l, o), None

    init = (jnp.full((num_lanes, hkv, g, bq), -jnp.inf, acc),
            jnp.zeros((num_lanes, hkv, g, bq), acc),
            jnp.zeros((num_lanes, bq, hkv, g, d), acc))
    (m, l, o), _ = jax.lax.scan(visit, init, jnp.moveaxis(plan.q_items, 1, 0))
    has = l > 0
    lane_lse = jnp.where(has, m + jnp.log(jnp.where(has, l, 1)), -jnp.inf)
    lane_out = o / jnp.moveaxis(jnp.where(has, l, 1), -1, 1)[..., None]
    out, lse = _merge_lanes(lane_tile, lane_lse, lane_out, qt.shape[0])
    out = out.reshape(-1, hq, d)[:tq].astype(q.dtype)
    lse = jnp.moveaxis(lse, -1, 1).reshape(-1, hq)[:tq]
    return out, lse


def _tile_grads(qb, kb, vb, dob, lse_b, delta_b, item, rows, cols, cfg):
    """Recomputes a tile and returns (p, ds) [V, Hkv, G, bq, bk] in float32.
    lse_b, delta_b: [V, Hkv, G, bq]."""
    s, tanh, allowed = _scores(qb, kb, item, rows, cols, cfg)
    finite = jnp.isfinite(lse_b)
    lse_safe = jnp.where(finite, lse_b, 0)
    p = jnp.where(allowed & finite[..., None], jnp.exp(s - lse_safe[..., None]), 0)
    acc = p.dtype
    dp = jnp.einsum("vqhgd,vkhd->vhgqk", dob, vb, preferred_element_type=acc)
    ds = p * (dp - delta_b[..., None])
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    return p, ds


def _backward(q, k, v, out, lse, dout, dlse, plan: FFAPlanArrays, cfg: _Config):
    tq, hq, d = q.shape
    tk, hkv = k.shape[:2]
    g = hq // hkv
    bq, bk = cfg.block_q, cfg.block_k
    acc = _acc_dtype(q.dtype)
    # delta = rowsum(out * dout); the lse cotangent enters as -dlse (d lse / d s = p).
    delta = jnp.einsum("thd,thd->th", out.astype(acc), dout.astype(acc))
    delta = delta - jnp.where(jnp.isfinite(lse), dlse.astype(acc), 0)
    qt = _tiles(q, bq).reshape(-1, bq, hkv, g, d)
    dot = _tiles(dout, bq).reshape(-1, bq, hkv, g, d)

    def row_stat(x):   # [Tq, Hq] -> [nq, Hkv, G, bq]
        t = _tiles(x, bq).reshape(-1, bq, hkv, g)
        return jnp.moveaxis(t, 1, -1)

    lse_t = row_stat(jnp.where(jnp.isfinite(lse), lse, -jnp.inf).astype(acc))
    delta_t = row_stat(delta)
    kt, vt = _tiles(k, bk), _tiles(v, bk)
    lanes_q = jnp.arange(bq, dtype=jnp.int32)
    lanes_k = jnp.arange(bk, dtype=jnp.int32)

    # dQ: lanes over q-tiles.
    lt = plan.q_lane_tile
    qb, dob, lse_b, delta_b = qt[lt], dot[lt], lse_t[lt], delta_t[lt]
    rows = lt[:, None] * bq + lanes_q

    def visit_dq(dq, item):
        ktile = item[:, 0]
        cols = ktile[:, None] * bk + lanes_k
        kb = kt[ktile]
        _, ds = _tile_grads(qb, kb, vt[ktile], dob, lse_b, delta_b, item, rows, cols, cfg)
        dq = dq + jnp.einsum("vhgqk,vkhd->vqhgd", ds.astype(k.dtype), kb,
                             preferred_element_type=acc)
        return dq, None

    dq_l, _ = jax.lax.scan(visit_dq, jnp.zeros(qb.shape, acc), jnp.moveaxis(plan.q_items, 1, 0))
    dq = jax.ops.segment_sum(dq_l, lt, num_segments=qt.shape[0])
    dq = (dq.reshape(-1, hq, d)[:tq] * cfg.scale).astype(q.dtype)

    # dK, dV: lanes over k-tiles.
    lt = plan.k_lane_tile
    kb, vb = kt[lt], vt[lt]
    cols = lt[:, None] * bk + lanes_k

    def visit_dkv(carry, item):
        dk, dv = carry
        qtile = item[:, 0]
        rows = qtile[:, None] * bq + lanes_q
        qb, dob = qt[qtile], dot[qtile]
        p, ds = _tile_grads(qb, kb, vb, dob, lse_t[qtile], delta_t[qtile], item, rows, cols,
                            cfg)
        dk = dk + jnp.einsum("vhgqk,vqhgd->vkhd", ds.astype(q.dtype), qb,
                             preferred_element_type=acc)
        dv = dv + jnp.einsum("vhgqk,vqhgd->vkhd", p.astype(dout.dtype), dob,
                             preferred_element_type=acc)
        return (dk, dv), None

    init = (jnp.zeros(kb.shape, acc), jnp.zeros(vb.shape, acc))
    (dk_l, dv_l), _ = jax.lax.scan(visit_dkv, init, jnp.moveaxis(plan.k_items, 1, 0))
    nk = kt.shape[0]
    dk = jax.ops.segment_sum(dk_l, lt, num_segments=nk).reshape(-1, hkv, d)[:tk] * cfg.scale
    dv = jax.ops.segment_sum(dv_l, lt, num_segments=nk).reshape(-1, hkv, d)[:tk]
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ffa(q, k, v, plan, cfg):
    return _forward(q, k, v, plan, cfg)


def _ffa_fwd(q, k, v, plan, cfg):
    out, lse = _forward(q, k, v, plan, cfg)
    return (out, lse), (q, k, v, plan, out, lse)


def _ffa_bwd(cfg, res, cts):
    q, k, v, plan, out, lse = res
    dout, dlse = cts
    dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, plan, cfg)
    return dq, dk, dv, None


_ffa.defvjp(_ffa_fwd, _ffa_bwd)
# Compiled once per shape and config, so eager calls (and their VJPs) do not run op by op;
# inside an enclosing jit it simply inlines.
_ffa_jit = jax.jit(_ffa, static_argnums=(4,))


def xla_ffa(q, k, v, plan: FFAPlanArrays, *, softmax_scale: float, softcap: float,
            block_q: int, block_k: int):
    """Flexible-mask attention from plan arrays (no mask object): the entry point that context
    parallelism calls on every rank.

    q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` (or with a leading batch axis shared by the
    plan); ``plan`` built for tiles ``block_q x block_k`` over these ``Tq``/``Tk``.
    Returns ``out`` (q's shape and dtype) and ``lse`` ``[(B,) Tq, Hq]`` float32.
    Differentiable in q, k, v (and through lse).
    """
    cfg = _Config(float(softmax_scale), float(softcap), int(block_q), int(block_k))
    if q.ndim == 4:
        return _batched(q, k, v, plan, cfg)
    return _ffa_jit(q, k, v, plan, cfg)


def xla_ffa_forward(q, k, v, plan: FFAPlanArrays, *, softmax_scale: float, softcap: float,
                    block_q: int, block_k: int):
    """The forward of :func:`xla_ffa` alone (3-D inputs, not differentiable): ``(out, lse)``.
    With :func:`xla_ffa_backward`, for callers that keep only ``(out, lse)`` between the two
    passes (context-parallel stages that re-fetch KV, ring attention)."""
    cfg = _Config(float(softmax_scale), float(softcap), int(block_q), int(block_k))
    return _forward(q, k, v, plan, cfg)


def xla_ffa_backward(q, k, v, out, lse, dout, dlse, plan: FFAPlanArrays, *,
                     softmax_scale: float, softcap: float, block_q: int, block_k: int):
    """``(dq, dk, dv)`` of :func:`xla_ffa` from the forward's ``(out, lse)`` and the
    cotangents ``(dout, dlse)`` (3-D inputs); the tiles are recomputed, nothing else is
    needed from the forward."""
    cfg = _Config(float(softmax_scale), float(softcap), int(block_q), int(block_k))
    return _backward(q, k, v, out, lse, dout, dlse, plan, cfg)


def _batched(q, k, v, plan, cfg):
    """[B, T, H, D]: fold the batch into heads (query head b*Hq + h keeps key head
    b*Hkv + h // G), so one plan serves the whole batch."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1:3]
    fold = lambda x, t, h: jnp.moveaxis(x, 0, 1).reshape(t, b * h, d)
    out, lse = _ffa_jit(fold(q, tq, hq), fold(k, tk, hkv), fold(v, tk, hkv), plan, cfg)
    out = jnp.moveaxis(out.reshape(tq, b, hq, d), 1, 0)
    lse = jnp.moveaxis(lse.reshape(tq, b, hq), 1, 0)
    return out, lse
