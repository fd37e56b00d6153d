"""FFA backward as Mosaic GPU kernels (Hopper, sm90), over the same work lists.

* ``delta = rowsum(out · dout) − dlse`` is a fused XLA reduction in :mod:`magi_jax.pallas`
  (memory bound; the lse cotangent enters here exactly as in :mod:`magi_jax.xla_ffa`).
* dQ: one program per (q-tile of 128 rows, batch, query head) walks the q-tile's key tiles
  (the forward work list); a producer warpgroup streams K/V, two consumer warpgroups of 64
  rows recompute ``P`` from the saved lse and accumulate ``dQ += dS·K`` in float32.
* dK/dV: one program per (k-tile of 128 keys, batch, key head) walks the query tiles of
  64 rows that see it, for every query head of the GQA group, so ``dK``/``dV`` of a key head
  are summed in float32 registers and written once (no atomics, no second reduction).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from magi_jax.pallas.common import LOG2E, launch_grid, mma_lhs, smem, tile_predicate
from magi_jax.pallas.plan import DKV_BLOCK_K, DKV_BLOCK_Q, FWD_BLOCK_K, FWD_BLOCK_Q

__all__ = ["BwdConfig", "ffa_dq", "ffa_dkv"]

_COMPUTE_WGS = 2
_LAYOUT = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)
_COL = plgpu.Layout.WGMMA.reduce(0)


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """Static configuration of the backward kernels."""

    scale: float
    softcap: float
    num_stages: int = 2
    fma_softmax: bool = False   # see FwdConfig
    head_major: bool = False    # see magi_jax.pallas.common.launch_grid
    interpret: bool = False


def _log2_scores(s, cfg: BwdConfig):
    """Raw ``q·k`` -> (scores, scale still to apply in the exponent or None, ``1 − tanh²``
    for the softcap chain or None); scores in the log2 domain once scaled."""
    if cfg.softcap:
        t = jnp.tanh(s * (cfg.scale / cfg.softcap))
        return t * (cfg.softcap * LOG2E), None, 1.0 - t * t
    if cfg.fma_softmax:
        return s, cfg.scale * LOG2E, None
    return s * (cfg.scale * LOG2E), None, None


def _exp2_minus(s, c, stat, dim):
    """``exp2(s·c − stat)`` with the row/column statistic broadcast along ``dim``."""
    b = lax.broadcast_in_dim(stat, s.shape, [dim])
    return jnp.exp2(s - b if c is None else s * c - b)


def _params(cfg):
    return dict(compiler_params=plgpu.CompilerParams(approx_math=True),
                interpret=plgpu.InterpretGPUParams() if cfg.interpret else None)


def ffa_dq(q, k, v, dout, lse2, delta, order, offsets, items, cfg: BwdConfig):
    """dQ. q/dout ``[B, Tq, Hq, D]``, k/v ``[B, Tk, Hkv, D]``; ``lse2 [B, Hq, Tq]`` float32
    is the lse times log2(e) with ``+inf`` on rows that see no key (so P = 0 there);
    ``delta [B, Hq, Tq]`` float32; the forward work list. Returns dq like q."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    num_tiles = tq // FWD_BLOCK_Q
    assert order.shape == (num_tiles,)
    dtype = q.dtype
    bq, bk, stages = FWD_BLOCK_Q // _COMPUTE_WGS, FWD_BLOCK_K, cfg.num_stages

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, order_ref, off_ref, items_ref,
               dq_ref, q_smem, do_smem, stat_smem, k_smem, v_smem, in_ready, k_ready,
               v_ready, k_free, v_free, *stage):
        wg = lax.axis_index("wg")
        tile = order_ref[lax.axis_index("tile")]
        batch = lax.axis_index("batch")
        head = lax.axis_index("head")
        first = off_ref[tile]
        num_items = off_ref[tile + 1] - first

        @pl.when(wg < _COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(232, action="increase")
            row0 = tile * FWD_BLOCK_Q + wg * bq
            rows = pl.ds(row0, bq)
            my_q, my_do = q_smem.at[wg], do_smem.at[wg]
            ready = in_ready.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], my_q, ready)
            plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], my_do, ready)
            plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], stat_smem.at[wg, 0], ready)
            plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], stat_smem.at[wg, 1],
                                    ready)
            plgpu.barrier_wait(ready)
            lse2 = plgpu.load(stat_smem.at[wg, 0], layout=_ROW)
            delta = plgpu.load(stat_smem.at[wg, 1], layout=_ROW)
            my_stage = stage[0].at[wg] if stage else None

            def run(dq_acc):
                def step(i, carry):
                    slot = lax.rem(i, jnp.int32(stages))
                    it = first + i
                    ktile = items_ref[it, 0]
                    geom = tuple(items_ref[it, f] for f in range(1, 7))
                    full = items_ref[it, 7]
                    plgpu.barrier_wait(k_ready.at[slot])
                    plgpu.barrier_wait(v_ready.at[slot])

                    # S = Q·Kᵀ and dP = dO·Vᵀ issued back to back, one wait for both.
                    def qk_dov(s_ref, dp_ref):
                        plgpu.wgmma(s_ref, my_q, k_smem.at[slot].T)
                        plgpu.wgmma(dp_ref, my_do, v_smem.at[slot].T)
                        return s_ref[...], dp_ref[...]

                    s, dp = pl.run_scoped(qk_dov, plgpu.ACC((bq, bk), jnp.float32),
                                          plgpu.ACC((bq, bk), jnp.float32))
                    plgpu.barrier_arrive(v_free.at[slot])
                    s, c, dcap = _log2_scores(s, cfg)

                    def masked():
                        keep = tile_predicate(geom, row0, ktile * bk, (bq, bk), _LAYOUT)
                        return jnp.where(keep, s, -jnp.inf)

                    s = lax.cond(full != 0, lambda: s, masked)
                    p = _exp2_minus(s, c, lse2, 0)
                    ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
                    if dcap is not None:
                        ds = ds * dcap
                    mma_lhs(dq_acc, ds.astype(dtype), k_smem.at[slot], my_stage)
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(k_free.at[slot])
                    return carry

                lax.fori_loop(0, num_items, step, 0)
                return dq_acc[...]

            dq = pl.run_scoped(run, plgpu.ACC((bq, d), jnp.float32))
            my_q[...] = (dq * cfg.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_q, dq_ref.at[batch, rows, head])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, jnp.int32(group))
            _stream(num_items, stages, lambda i: items_ref[first + i, 0] * bk,
                    [(k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free)],
                    lambda ref, start: ref.at[batch, pl.ds(start, bk), kv_head])

    scratch = [
        smem((_COMPUTE_WGS, bq, d), dtype),
        smem((_COMPUTE_WGS, bq, d), dtype),
        plgpu.SMEM((_COMPUTE_WGS, 2, bq), jnp.float32),
        smem((stages, bk, d), dtype),
        smem((stages, bk, d), dtype),
        plgpu.Barrier(num_arrivals=4, num_barriers=_COMPUTE_WGS),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
    ]
    if cfg.interpret:
        scratch.append(smem((_COMPUTE_WGS, bq, bk), dtype))
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(q.shape, dtype), scratch_types=scratch,
        **dict(zip(("grid", "grid_names"), launch_grid(num_tiles, b, hq, cfg.head_major))),
        num_threads=_COMPUTE_WGS + 1, thread_name="wg", **_params(cfg),
    )(q, k, v, dout, lse2, delta, order, offsets, items)


def _stream(num_steps, stages, start_of, streams, view):
    """Producer loop: step ``i`` copies, for every ``(gmem, smem, ready, free)`` stream, the
    block starting at ``start_of(i)`` into slot ``i % stages`` once the consumers freed it;
    then waits for the last slots to be freed (so every barrier phase is observed)."""
    @pl.loop(0, num_steps)
    def _(i):
        slot = lax.rem(i, jnp.int32(stages))
        start = start_of(i)
        for gmem, buf, ready, free in streams:
            @pl.when(i >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])

            plgpu.copy_gmem_to_smem(view(gmem, start), buf.at[slot], ready.at[slot])

    @pl.loop(lax.max(num_steps - stages, jnp.int32(0)), num_steps)
    def _(i):
        slot = lax.rem(i, jnp.int32(stages))
        for _, _, _, free in streams:
            plgpu.barrier_wait(free.at[slot])


def ffa_dkv(q, k, v, dout, lse2, delta, order, offsets, items, cfg: BwdConfig):
    """dK, dV. Same inputs as :func:`ffa_dq` but the dK/dV work list (k-tiles of 128 keys,
    q-steps of 64 rows). Returns ``(dk, dv)`` like k."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1:3]
    group = hq // hkv
    num_tiles = tk // DKV_BLOCK_K
    assert order.shape == (num_tiles,)
    dtype = q.dtype
    bq, bk, stages = DKV_BLOCK_Q, DKV_BLOCK_K // _COMPUTE_WGS, cfg.num_stages

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, order_ref, off_ref, items_ref,
               dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
               kv_ready, q_ready, do_ready, lse_ready, delta_ready, q_free, do_free, lse_free,
               delta_free, *stage):
        wg = lax.axis_index("wg")
        tile = order_ref[lax.axis_index("tile")]
        batch = lax.axis_index("batch")
        kv_head = lax.axis_index("head")
        first = off_ref[tile]
        num_items = off_ref[tile + 1] - first
        num_steps = num_items * group

        def step_item(i):   # step i: query head (i // num_items) of the group, item i % n
            return first + lax.rem(i, num_items), kv_head * group + lax.div(i, num_items)

        @pl.when(wg < _COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(232, action="increase")
            col0 = tile * DKV_BLOCK_K + wg * bk
            cols = pl.ds(col0, bk)
            my_k, my_v = k_smem.at[wg], v_smem.at[wg]
            plgpu.copy_gmem_to_smem(k_ref.at[batch, cols, kv_head], my_k, kv_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[batch, cols, kv_head], my_v, kv_ready.at[wg])
            plgpu.barrier_wait(kv_ready.at[wg])
            stages_ = (stage[0].at[wg, 0], stage[0].at[wg, 1]) if stage else (None, None)

            def run(dk_acc, dv_acc):
                def step(i, carry):
                    slot = lax.rem(i, jnp.int32(stages))
                    it, _ = step_item(i)
                    qtile = items_ref[it, 0]
                    geom = tuple(items_ref[it, f] for f in range(1, 7))
                    full = items_ref[it, 7]
                    plgpu.barrier_wait(q_ready.at[slot])
                    plgpu.barrier_wait(do_ready.at[slot])

                    # Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ issued back to back, one wait for both.
                    def kq_vdo(s_ref, dp_ref):
                        plgpu.wgmma(s_ref, my_k, q_smem.at[slot].T)
                        plgpu.wgmma(dp_ref, my_v, do_smem.at[slot].T)
                        return s_ref[...], dp_ref[...]

                    st, dpt = pl.run_scoped(kq_vdo, plgpu.ACC((bk, bq), jnp.float32),
                                            plgpu.ACC((bk, bq), jnp.float32))
                    st, c, dcap = _log2_scores(st, cfg)

                    def masked():
                        keep = tile_predicate(geom, qtile * bq, col0, (bk, bq), _LAYOUT,
                                              transposed=True)
                        return jnp.where(keep, st, -jnp.inf)

                    st = lax.cond(full != 0, lambda: st, masked)
                    plgpu.barrier_wait(lse_ready.at[slot])
                    lse2 = plgpu.load(lse_smem.at[slot], layout=_COL)
                    plgpu.barrier_arrive(lse_free.at[slot])
                    plgpu.barrier_wait(delta_ready.at[slot])
                    delta = plgpu.load(delta_smem.at[slot], layout=_COL)
                    plgpu.barrier_arrive(delta_free.at[slot])
                    pt = _exp2_minus(st, c, lse2, 1)
                    dst = pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))
                    if dcap is not None:
                        dst = dst * dcap
                    # dV += Pᵀ·dO and dK += dSᵀ·Q, both in flight before the one wait.
                    mma_lhs(dv_acc, pt.astype(dtype), do_smem.at[slot], stages_[0])
                    mma_lhs(dk_acc, dst.astype(dtype), q_smem.at[slot], stages_[1])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(do_free.at[slot])
                    plgpu.barrier_arrive(q_free.at[slot])
                    return carry

                lax.fori_loop(0, num_steps, step, 0)
                return dk_acc[...], dv_acc[...]

            dk, dv = pl.run_scoped(run, plgpu.ACC((bk, d), jnp.float32),
                                   plgpu.ACC((bk, d), jnp.float32))
            my_k[...] = (dk * cfg.scale).astype(dtype)
            my_v[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_k, dk_ref.at[batch, cols, kv_head])
            plgpu.copy_smem_to_gmem(my_v, dv_ref.at[batch, cols, kv_head])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(40, action="decrease")

            def start_of(i):
                it, head = step_item(i)
                return items_ref[it, 0] * bq, head

            def view(ref, start):
                row, head = start
                if ref.ndim == 4:
                    return ref.at[batch, pl.ds(row, bq), head]
                return ref.at[batch, head, pl.ds(row, bq)]

            _stream(num_steps, stages, start_of,
                    [(q_ref, q_smem, q_ready, q_free), (do_ref, do_smem, do_ready, do_free),
                     (lse_ref, lse_smem, lse_ready, lse_free),
                     (delta_ref, delta_smem, delta_ready, delta_free)], view)

    per_stage = lambda n=1: plgpu.Barrier(num_arrivals=n, num_barriers=stages)
    scratch = [
        smem((_COMPUTE_WGS, bk, d), dtype),
        smem((_COMPUTE_WGS, bk, d), dtype),
        smem((stages, bq, d), dtype),
        smem((stages, bq, d), dtype),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.Barrier(num_arrivals=2, num_barriers=_COMPUTE_WGS),
        per_stage(), per_stage(), per_stage(), per_stage(),
        per_stage(_COMPUTE_WGS), per_stage(_COMPUTE_WGS), per_stage(_COMPUTE_WGS),
        per_stage(_COMPUTE_WGS),
    ]
    if cfg.interpret:
        scratch.append(smem((_COMPUTE_WGS, 2, bk, bq), dtype))
    kv = jax.ShapeDtypeStruct(k.shape, dtype)
    return plgpu.kernel(
        kernel, out_type=(kv, kv), scratch_types=scratch,
        **dict(zip(("grid", "grid_names"), launch_grid(num_tiles, b, hkv, cfg.head_major))),
        num_threads=_COMPUTE_WGS + 1, thread_name="wg", **_params(cfg),
    )(q, k, v, dout, lse2, delta, order, offsets, items)
