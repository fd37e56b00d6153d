"""The ``xla`` backend: flexible-mask flash attention as a blockwise online softmax in plain
JAX, on any JAX device.

It reads the same work lists as the Mosaic GPU kernels (:class:`FFAPlanArrays`: CSR lists of
work items over q-tiles and k-tiles, :mod:`magi_jax.planning.work_list`), built for its own
tile sizes. On the device each tile's run of items is cut into *lanes* of at most
``lane_len`` items, so that a few long rows do not set the length of every row; lanes run
``lanes_per_block`` at a time, each scanning its items with a float32 running max / sum /
accumulator, and a block's partial results are merged into the tiles' accumulators by
log-sum-exp. The loop over blocks runs only as many blocks as the plan's real lanes fill, so
padded capacity costs no compute. Nothing of size ``Tq·Tk`` is built; the memory is
``O(T·H·D)`` plus one block of tiles.

Backward recomputes the tiles: dQ over the q-tile lanes, dK/dV over the k-tile lanes,
accumulating in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from magi_jax.planning.backends import HOST_SPECS
from magi_jax.planning.work_list import EMPTY_ITEM, ITEM_FIELDS, FFAPlanArrays

__all__ = ["xla_ffa", "xla_ffa_forward", "xla_ffa_backward", "XlaConfig", "LANE_LEN"]

_F = {name: i for i, name in enumerate(ITEM_FIELDS)}
# Items per lane (the xla engine's host spec): long enough that a lane's state and its merge
# are cheap beside its items, short enough that the last lane of a tile wastes little.
LANE_LEN = HOST_SPECS["xla"].lane_len


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """Static configuration of the ``xla`` backend.

    ``fwd_block``: ``(block_q, block_k)`` of the q-tile list (forward and dQ);
    ``bwd_block``: that of the k-tile list (dK/dV); ``lane_len``: items per lane;
    ``lanes_per_block``: lanes computed side by side (0: one per owned tile);
    ``max_logits``: the forward also returns each head's largest scaled logit (before the
    softcap) over the allowed cells."""

    scale: float
    softcap: float
    fwd_block: tuple[int, int]
    bwd_block: tuple[int, int]
    lane_len: int = LANE_LEN
    lanes_per_block: int = 0
    max_logits: bool = False

    def __post_init__(self):
        if self.softcap < 0 or self.softcap != self.softcap:
            raise ValueError(f"softcap={self.softcap} must be a number >= 0 (0 disables it)")
        for name in ("fwd_block", "bwd_block"):
            bq, bk = getattr(self, name)
            if bq < 1 or bk < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive tile sizes")
        if self.lane_len < 1 or self.lanes_per_block < 0:
            raise ValueError(
                f"lane_len={self.lane_len} must be >= 1 and lanes_per_block="
                f"{self.lanes_per_block} >= 0"
            )


def _acc_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _tiles(x, block):
    """[T, ...] -> [ceil(T / block), block, ...], zero-padded."""
    t = x.shape[0]
    n = -(-t // block)
    x = jnp.pad(x, ((0, n * block - t),) + ((0, 0),) * (x.ndim - 1))
    return x.reshape((n, block) + x.shape[1:])


class _Lanes:
    """Lanes of a CSR work list, cut on the device: lane ``v`` owns ``tile[v]`` and visits
    items ``start[v] .. start[v] + count[v] - 1``; lanes past ``num_real`` visit nothing."""

    def __init__(self, offsets, lane_len: int, num_lanes: int):
        counts = offsets[1:] - offsets[:-1]
        per_tile = (counts + lane_len - 1) // lane_len
        ends = jnp.cumsum(per_tile)
        v = jnp.arange(num_lanes, dtype=jnp.int32)
        tile = jnp.minimum(jnp.searchsorted(ends, v, side="right"), counts.shape[0] - 1)
        first = ends[tile] - per_tile[tile]
        start = offsets[tile] + (v - first) * lane_len
        self.num_real = ends[-1]
        real = v < self.num_real
        self.tile = jnp.where(real, tile, 0).astype(jnp.int32)
        self.start = jnp.where(real, start, 0).astype(jnp.int32)
        self.count = jnp.where(real, jnp.clip(offsets[tile + 1] - start, 0, lane_len), 0).astype(
            jnp.int32
        )


def _num_lanes(num_items: int, num_tiles: int, lane_len: int) -> int:
    """Lanes that any list of ``num_items`` items over ``num_tiles`` tiles can need."""
    return max(1, -(-num_items // lane_len) + num_tiles)


def _list_lanes(offsets, items, num_tiles: int, cfg: XlaConfig) -> tuple[_Lanes, int]:
    """The lanes of one work list and how many of them run side by side (by default one
    per owned tile)."""
    lanes = _Lanes(offsets, cfg.lane_len, _num_lanes(items.shape[0], num_tiles, cfg.lane_len))
    return lanes, min(cfg.lanes_per_block or num_tiles, lanes.tile.shape[0])


def _blocks(lanes: _Lanes, width: int, body, init):
    """``body(tile [W], start [W], count [W], carry) -> carry`` over the blocks of ``width``
    lanes that hold real lanes (a loop whose trip count is data)."""
    total = lanes.tile.shape[0]
    pad = -total % width
    tile, start, count = (jnp.pad(a, (0, pad)) for a in (lanes.tile, lanes.start, lanes.count))
    num_blocks = (lanes.num_real + width - 1) // width

    def step(b, carry):
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, b * width, width)
        return body(sl(tile), sl(start), sl(count), carry)

    return jax.lax.fori_loop(0, num_blocks, step, init)


def _item(items, start, count, j):
    """Item ``j`` of every lane of a block, ``[W, 8]``; lanes with fewer items get an item
    that holds no cell (``q1 = q0``)."""
    idx = jnp.clip(start + j, 0, items.shape[0] - 1)
    it = items[idx]
    live = (j < count)[:, None]
    return jnp.where(live, it, jnp.zeros_like(it))


def _allowed(item, rows, cols):
    """Predicate of each lane's item on its tile: item [W, 8], rows [W, bq], cols [W, bk]
    -> bool [W, bq, bk], from the slice geometry (full tiles come out all-true)."""
    g = lambda name: item[:, _F[name], None, None]
    r = rows[:, :, None]
    c = cols[:, None, :]
    d = c - r
    return (
        (r >= g("q0"))
        & (r < g("q1"))
        & (c >= g("k0"))
        & (c < g("k1"))
        & (d >= g("dlo"))
        & (d <= g("dhi"))
    )


def _scores(qb, kb, item, rows, cols, cfg):
    """Scores of a tile: qb [W, bq, Hkv, G, D], kb [W, bk, Hkv, D] -> s [W, Hkv, G, bq, bk]
    (masked cells -inf), the tanh of the capped scores (for the softcap derivative), the
    predicate and the scores before the softcap (unmasked)."""
    acc = _acc_dtype(qb.dtype)
    s = raw = jnp.einsum("vqhgd,vkhd->vhgqk", qb, kb, preferred_element_type=acc) * cfg.scale
    tanh = None
    if cfg.softcap:
        tanh = jnp.tanh(s / cfg.softcap)
        s = cfg.softcap * tanh
    allowed = _allowed(item, rows, cols)[:, None, None]
    return jnp.where(allowed, s, -jnp.inf), tanh, allowed, raw


def _forward(q, k, v, plan: FFAPlanArrays, cfg: XlaConfig):
    tq, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    g = hq // hkv
    bq, bk = cfg.fwd_block
    acc = _acc_dtype(q.dtype)
    qt = _tiles(q, bq).reshape(-1, bq, hkv, g, d)
    kt, vt = _tiles(k, bk), _tiles(v, bk)
    nq = qt.shape[0]
    lanes, width = _list_lanes(plan.q_offsets, plan.q_items, nq, cfg)
    sub = jnp.arange(bq, dtype=jnp.int32)
    subk = jnp.arange(bk, dtype=jnp.int32)
    # The running max m is that of the capped scores; with a softcap the max logits need
    # the raw ones, so a per-head peak of them rides along (None: not tracked).
    track_peak = cfg.max_logits and bool(cfg.softcap)
    no_peak = jnp.full((hkv, g), -jnp.inf, acc) if track_peak else None

    def block(tile, start, count, carry):
        m_acc, l_acc, o_acc, peak_acc = carry
        qb = qt[tile]
        rows = tile[:, None] * bq + sub

        def visit(state, j):
            m, l, o, peak = state
            item = _item(plan.q_items, start, count, j)
            ktile = item[:, _F["other_tile"]]
            cols = ktile[:, None] * bk + subk
            s, _, allowed, raw = _scores(qb, kt[ktile], item, rows, cols, cfg)
            if track_peak:
                peak = jnp.maximum(peak, jnp.where(allowed, raw, -jnp.inf).max((0, 3, 4)))
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + p.sum(-1)
            pv = jnp.einsum(
                "vhgqk,vkhd->vqhgd", p.astype(v.dtype), vt[ktile], preferred_element_type=acc
            )
            return (m_new, l, o * jnp.moveaxis(alpha, -1, 1)[..., None] + pv, peak), None

        w = tile.shape[0]
        init = (
            jnp.full((w, hkv, g, bq), -jnp.inf, acc),
            jnp.zeros((w, hkv, g, bq), acc),
            jnp.zeros((w, bq, hkv, g, dv), acc),
            peak_acc,
        )
        (m, l, o, peak), _ = jax.lax.scan(visit, init, jnp.arange(cfg.lane_len, dtype=jnp.int32))
        # Merge the block's lanes into their tiles (several lanes may own one tile).
        m_new = m_acc.at[tile].max(m)
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0)
        alpha = jnp.exp(m_acc - m_safe)
        wl = jnp.exp(m - m_safe[tile])
        l_acc = (l_acc * alpha).at[tile].add(l * wl)
        o_acc = (
            (o_acc * jnp.moveaxis(alpha, -1, 1)[..., None])
            .at[tile]
            .add(o * jnp.moveaxis(wl, -1, 1)[..., None])
        )
        return m_new, l_acc, o_acc, peak

    init = (
        jnp.full((nq, hkv, g, bq), -jnp.inf, acc),
        jnp.zeros((nq, hkv, g, bq), acc),
        jnp.zeros((nq, bq, hkv, g, dv), acc),
        no_peak,
    )
    m, l, o, peak = _blocks(lanes, width, block, init)
    has = l > 0
    lse = jnp.where(has, m + jnp.log(jnp.where(has, l, 1)), -jnp.inf)
    out = o / jnp.moveaxis(jnp.where(has, l, 1), -1, 1)[..., None]
    out = out.reshape(-1, hq, dv)[:tq].astype(q.dtype)
    lse = jnp.moveaxis(lse, -1, 1).reshape(-1, hq)[:tq]
    if not cfg.max_logits:
        return out, lse
    # Without a softcap the rows' running maxima are the raw scaled logits themselves
    # (-inf on rows, padding included, that see no cell).
    peak = m.max((0, 3)) if peak is None else peak
    return out, lse, jax.lax.stop_gradient(peak.reshape(hq))


def _tile_grads(qb, kb, vb, dob, lse_b, delta_b, item, rows, cols, cfg):
    """Recomputes a tile: ``(p, ds)`` ``[W, Hkv, G, bq, bk]`` in float32 (lse_b, delta_b:
    ``[W, Hkv, G, bq]``)."""
    s, tanh, allowed, _ = _scores(qb, kb, item, rows, cols, cfg)
    finite = jnp.isfinite(lse_b)
    lse_safe = jnp.where(finite, lse_b, 0)
    p = jnp.where(allowed & finite[..., None], jnp.exp(s - lse_safe[..., None]), 0)
    dp = jnp.einsum("vqhgd,vkhd->vhgqk", dob, vb, preferred_element_type=p.dtype)
    ds = p * (dp - delta_b[..., None])
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    return p, ds


def _backward(q, k, v, out, lse, dout, dlse, plan: FFAPlanArrays, cfg: XlaConfig):
    tq, hq, d = q.shape
    tk, hkv = k.shape[:2]
    dv_dim = v.shape[-1]
    g = hq // hkv
    acc = _acc_dtype(q.dtype)
    # delta = rowsum(out * dout); the lse cotangent enters as -dlse (d lse / d s = p).
    delta = jnp.einsum("thd,thd->th", out.astype(acc), dout.astype(acc))
    delta = delta - jnp.where(jnp.isfinite(lse), dlse.astype(acc), 0)
    lse = jnp.where(jnp.isfinite(lse), lse, -jnp.inf).astype(acc)

    def q_side(block):
        """q, dout and the row statistics in tiles of ``block`` rows."""
        tiles = lambda x: _tiles(x, block).reshape(-1, block, hkv, g, *x.shape[2:])
        stat = lambda x: jnp.moveaxis(_tiles(x, block).reshape(-1, block, hkv, g), 1, -1)
        return tiles(q), tiles(dout), stat(lse), stat(delta)

    # dQ: lanes over the q-tiles of the forward list.
    bq, bk = cfg.fwd_block
    qt, dot, lse_t, delta_t = q_side(bq)
    kt, vt = _tiles(k, bk), _tiles(v, bk)
    nq = qt.shape[0]
    lanes, width = _list_lanes(plan.q_offsets, plan.q_items, nq, cfg)
    sub, subk = jnp.arange(bq, dtype=jnp.int32), jnp.arange(bk, dtype=jnp.int32)

    def dq_block(tile, start, count, dq_acc):
        qb, dob, lse_b, delta_b = qt[tile], dot[tile], lse_t[tile], delta_t[tile]
        rows = tile[:, None] * bq + sub

        def visit(dq, j):
            item = _item(plan.q_items, start, count, j)
            ktile = item[:, _F["other_tile"]]
            cols = ktile[:, None] * bk + subk
            kb = kt[ktile]
            _, ds = _tile_grads(qb, kb, vt[ktile], dob, lse_b, delta_b, item, rows, cols, cfg)
            return dq + jnp.einsum(
                "vhgqk,vkhd->vqhgd", ds.astype(k.dtype), kb, preferred_element_type=acc
            ), None

        dq, _ = jax.lax.scan(
            visit, jnp.zeros(qb.shape, acc), jnp.arange(cfg.lane_len, dtype=jnp.int32)
        )
        return dq_acc.at[tile].add(dq)

    dq = _blocks(lanes, width, dq_block, jnp.zeros(qt.shape, acc))
    dq = (dq.reshape(-1, hq, d)[:tq] * cfg.scale).astype(q.dtype)

    # dK, dV: lanes over the k-tiles of the backward list.
    bq, bk = cfg.bwd_block
    qt, dot, lse_t, delta_t = q_side(bq)
    kt, vt = _tiles(k, bk), _tiles(v, bk)
    nk = kt.shape[0]
    lanes, width = _list_lanes(plan.k_offsets, plan.k_items, nk, cfg)
    sub, subk = jnp.arange(bq, dtype=jnp.int32), jnp.arange(bk, dtype=jnp.int32)

    def dkv_block(tile, start, count, carry):
        kb, vb = kt[tile], vt[tile]
        cols = tile[:, None] * bk + subk

        def visit(state, j):
            dk, dv = state
            item = _item(plan.k_items, start, count, j)
            qtile = item[:, _F["other_tile"]]
            rows = qtile[:, None] * bq + sub
            qb, dob = qt[qtile], dot[qtile]
            p, ds = _tile_grads(
                qb, kb, vb, dob, lse_t[qtile], delta_t[qtile], item, rows, cols, cfg
            )
            dk = dk + jnp.einsum(
                "vhgqk,vqhgd->vkhd", ds.astype(q.dtype), qb, preferred_element_type=acc
            )
            dv = dv + jnp.einsum(
                "vhgqk,vqhgd->vkhd", p.astype(dout.dtype), dob, preferred_element_type=acc
            )
            return (dk, dv), None

        init = (jnp.zeros(kb.shape, acc), jnp.zeros(vb.shape, acc))
        (dk, dv), _ = jax.lax.scan(visit, init, jnp.arange(cfg.lane_len, dtype=jnp.int32))
        dk_acc, dv_acc = carry
        return dk_acc.at[tile].add(dk), dv_acc.at[tile].add(dv)

    init = (jnp.zeros(kt.shape, acc), jnp.zeros(vt.shape, acc))
    dk, dv = _blocks(lanes, width, dkv_block, init)
    dk = dk.reshape(-1, hkv, d)[:tk] * cfg.scale
    dv = dv.reshape(-1, hkv, dv_dim)[:tk]
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ffa(q, k, v, plan, cfg):
    return _forward(q, k, v, plan, cfg)


def _ffa_fwd(q, k, v, plan, cfg):
    res = _forward(q, k, v, plan, cfg)
    return res, (q, k, v, plan) + tuple(res[:2])


def _ffa_bwd(cfg, res, cts):
    q, k, v, plan, out, lse = res
    # The max logits (a third output with cfg.max_logits) are a statistic: no gradient.
    dq, dk, dv = _backward(q, k, v, out, lse, *cts[:2], plan, cfg)
    return dq, dk, dv, jax.tree.map(lambda _: None, plan)


_ffa.defvjp(_ffa_fwd, _ffa_bwd)
# Compiled once per shape and config, so eager calls (and their VJPs) do not run op by op;
# inside an enclosing jit it simply inlines.
_ffa_jit = jax.jit(_ffa, static_argnums=(4,))


def _config(
    softmax_scale, softcap, block_q, block_k, lane_len=LANE_LEN, max_logits=False
) -> XlaConfig:
    block = (int(block_q), int(block_k))
    return XlaConfig(
        float(softmax_scale),
        float(softcap),
        block,
        block,
        int(lane_len),
        max_logits=bool(max_logits),
    )


@jax.named_scope("ffa_xla")
def xla_ffa(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    plan: FFAPlanArrays,
    *,
    softmax_scale: float,
    softcap: float,
    block_q: int,
    block_k: int,
    lane_len: int = LANE_LEN,
    return_max_logits: bool = False,
) -> tuple[jax.Array, ...]:
    """Flexible-mask attention from plan arrays (no mask object): the entry point of the
    front door and of every context-parallel rank.

    q ``[Tq, Hq, D]``, k ``[Tk, Hkv, D]``, v ``[Tk, Hkv, Dv]`` (``Dv`` may differ from ``D``:
    multi-head latent attention), or with a leading batch axis that shares the plan;
    ``plan``: both work lists built on ``block_q x block_k`` tiles over these ``Tq``/``Tk``
    (:func:`magi_jax.planning.work_list.build_plan_arrays`), int32 NumPy, device or traced
    arrays. Returns ``out`` ``[(B,) Tq, Hq, Dv]`` in q's dtype and ``lse`` ``[(B,) Tq, Hq]``
    float32. Differentiable in q, k, v (and through lse).

    ``return_max_logits=True`` adds a third output, each query head's largest scaled logit
    ``softmax_scale·q·k`` (before the softcap) over the allowed cells, ``[(B,) Hq]`` float32
    (``-inf`` for a head that sees none), from the forward's own running maxima; it has no
    gradient."""
    cfg = _config(softmax_scale, softcap, block_q, block_k, lane_len, return_max_logits)
    if q.ndim == 4:
        return _batched(q, k, v, plan, cfg)
    return _ffa_jit(q, k, v, _device(plan), cfg)


@jax.named_scope("ffa_xla_fwd")
def xla_ffa_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    plan: FFAPlanArrays,
    *,
    softmax_scale: float,
    softcap: float,
    block_q: int,
    block_k: int,
    return_max_logits: bool = False,
) -> tuple[jax.Array, ...]:
    """The forward of :func:`xla_ffa` alone (3-D inputs, not differentiable): ``(out, lse)``
    (and the max logits ``[Hq]`` with ``return_max_logits``). With :func:`xla_ffa_backward`,
    for callers that keep only ``(out, lse)`` between the two passes (context-parallel
    stages that re-fetch KV, ring attention)."""
    return _forward(
        q,
        k,
        v,
        _device(plan),
        _config(softmax_scale, softcap, block_q, block_k, max_logits=return_max_logits),
    )


@jax.named_scope("ffa_xla_bwd")
def xla_ffa_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    dlse: jax.Array,
    plan: FFAPlanArrays,
    *,
    softmax_scale: float,
    softcap: float,
    block_q: int,
    block_k: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` of :func:`xla_ffa` from the forward's ``(out, lse)`` and the
    cotangents ``(dout, dlse)`` (3-D inputs); the tiles are recomputed, nothing else is
    needed from the forward. ``q [Tq, Hq, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]``,
    ``out``/``dout`` ``[Tq, Hq, Dv]``, ``lse``/``dlse`` ``[Tq, Hq]`` float32; ``dq``, ``dk``,
    ``dv`` shaped like ``q``, ``k``, ``v``."""
    return _backward(
        q,
        k,
        v,
        out,
        lse,
        dout,
        dlse,
        _device(plan),
        _config(softmax_scale, softcap, block_q, block_k),
    )


def _device(plan):
    plan = FFAPlanArrays(*(jnp.asarray(a, jnp.int32) for a in plan))
    # A list without items (an empty mask) gets one empty item, so item gathers have a row.
    pad = lambda items: jnp.asarray(EMPTY_ITEM)[None] if items.shape[0] == 0 else items
    return plan._replace(q_items=pad(plan.q_items), k_items=pad(plan.k_items))


def _batched(q, k, v, plan, cfg):
    """[B, T, H, D] (v [B, T, Hkv, Dv]): fold the batch into heads (query head b*Hq + h keeps
    key head b*Hkv + h // G), so one plan serves the whole batch."""
    b, tq, hq, _ = q.shape
    tk, hkv = k.shape[1:3]
    fold = lambda x, t, h: jnp.moveaxis(x, 0, 1).reshape(t, b * h, x.shape[-1])
    res = _ffa_jit(fold(q, tq, hq), fold(k, tk, hkv), fold(v, tk, hkv), _device(plan), cfg)
    out = jnp.moveaxis(res[0].reshape(tq, b, hq, v.shape[-1]), 1, 0)
    lse = jnp.moveaxis(res[1].reshape(tq, b, hq), 1, 0)
    return (out, lse) + tuple(x.reshape(b, hq) for x in res[2:])
