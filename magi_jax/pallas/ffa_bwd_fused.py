"""The FFA backward as one Mosaic GPU kernel (Hopper, sm90): dK, dV and dQ from a single
pass over the dK/dV work list, five matmuls per tile pair where :func:`ffa_dq` plus
:func:`ffa_dkv` take seven.

A program owns a k-tile of 128 keys of one key head, as :func:`~magi_jax.pallas.ffa_bwd.ffa_dkv`
does: its two consumer warpgroups hold 64 keys each and walk the query steps of 64 rows that
see the tile (for every query head of the GQA group), computing ``Sᵀ``, ``dPᵀ``, then
``dV += Pᵀ·dO`` and ``dK += dSᵀ·Q`` in float32 registers. The step's ``dSᵀ`` block also goes
to shared memory, and from there the step's contribution to dQ is

    dQ[rows] += dS · K     (64 rows x D, summed over the tile's 128 keys)

which leaves as a float32 TMA reduce-add into a zeroed ``[B, Tq, Hq, D]`` float32 buffer;
:func:`ffa_dkvq` scales and casts it at the end. The adds of different programs to one block
of rows land in whatever order the programs run, so dQ is **not bitwise deterministic**
(float32 rounding differs between runs); dK and dV are. The backend keeps the deterministic
pair of kernels as its default and takes this one when asked (``deterministic=False``).

* D = 128: the two warpgroups split dQ's head dim. Warpgroup ``w`` adds the columns
  ``w·64 .. w·64 + 64`` of the step's dQ, which takes both warpgroups' ``dSᵀ`` blocks: its
  own first, the other's after a rendezvous (``ex_ready``). The exchange is double buffered
  by step parity; a block's last readers are both warpgroups' dQ wgmmas of its step, and a
  warpgroup waits for those before it arrives at the next step's rendezvous, so one
  rendezvous a step orders every reuse (as in :mod:`magi_jax.pallas.ffa_dq_wide`).
* D = 64: a 32-column half would cut the 128-byte swizzle tiles, so each warpgroup adds the
  whole ``dS_w · K_w`` of its own 64 keys (two adds per step and row block) and the
  warpgroups never wait for each other.

GPU interpret mode has no TMA reduction, so there (tests) every step's contribution is
stored apart, ``[B, Hq, warpgroup, item, 64, D]``, and summed afterwards by the items' query
steps; the kernel is otherwise the one that runs on the GPU.
"""

from __future__ import annotations

import os

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from magi_jax.pallas.common import ItemField, check_smem, launch_grid, mask_scores, mma_lhs, smem
from magi_jax.pallas.ffa_bwd import (_COL, _LAYOUT, BwdConfig, _exp2_minus, _item_step,
                                     _log2_scores, _params, _store_outputs, _stream)
from magi_jax.planning.work_list import DKV_BLOCK_K, DKV_BLOCK_Q

__all__ = ["ffa_dkvq", "FUSED_HEAD_DIMS"]

FUSED_HEAD_DIMS = (64, 128)
_COMPUTE_WGS = 2
_BQ = DKV_BLOCK_Q                     # query rows of a step
_BK = DKV_BLOCK_K // _COMPUTE_WGS     # keys of one consumer warpgroup
_DQ_COLS = 64                         # dQ columns one warpgroup adds per step
_EXCHANGE = os.environ.get("MJ_FUSED_EXCHANGE", "1") == "1"
_SKIP_DQ = os.environ.get("MJ_FUSED_SKIP_DQ", "0") == "1"
_DQ_MODE = os.environ.get("MJ_FUSED_DQ_MODE", "reduce")   # reduce|contig|copy|smem


def _f32_smem(shape):
    """Float32 shared memory in 8 x 32 tiles with the 128-byte swizzle (rows of 128 bytes)."""
    return plgpu.SMEM(shape, jnp.float32, transforms=(plgpu.TilingTransform((8, 32)),
                                                      plgpu.SwizzleTransform(128)))


def ffa_dkvq(q, k, v, dout, lse2, delta, order, offsets, items, cfg: BwdConfig):
    """``(dq, dk, dv)`` from one kernel. Inputs as :func:`~magi_jax.pallas.ffa_bwd.ffa_dkv`:
    q/dout ``[B, Tq, Hq, D]`` (``Tq`` a multiple of 64), k/v ``[B, Tk, Hkv, D]`` (``Tk`` a
    multiple of 128), ``lse2``/``delta [B, Hq, Tq]`` float32, the dK/dV work list; D 64 or
    128. dq like q, dk/dv like k. dQ is summed by float32 atomics (see the module)."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1:3]
    if d not in FUSED_HEAD_DIMS:
        raise ValueError(f"the fused backward kernel takes D in {FUSED_HEAD_DIMS}; got {d}")
    if cfg.persistent:
        raise ValueError(f"persistent={cfg.persistent}: the fused backward kernel runs one "
                         "program per (k-tile, batch, key head); pass persistent=0")
    group = hq // hkv
    num_tiles = tk // DKV_BLOCK_K
    assert order.shape == (num_tiles,) and tq % _BQ == 0 and tk % DKV_BLOCK_K == 0
    num_items = items.shape[0]
    dtype, stages = q.dtype, cfg.num_stages
    split_d = d == 2 * _DQ_COLS and _EXCHANGE   # D = 128: warpgroup w adds columns w·64 ..
    dq_cols = _DQ_COLS if split_d else d
    dq_bufs = 2 if _BQ * dq_cols <= _BQ * _DQ_COLS else 1
    grid, grid_names = launch_grid(num_tiles, b, hkv)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, order_ref, off_ref, items_ref,
               dq_ref, dk_ref, dv_ref, *refs):
        buf = dict(zip(scratch, refs, strict=True))
        k_smem, v_smem, kv_ready = buf["k"], buf["v"], buf["kv_ready"]
        q_smem, do_smem, lse_smem, delta_smem = buf["q"], buf["do"], buf["lse"], buf["delta"]
        q_ready, do_ready, lse_ready, delta_ready = (buf["q_ready"], buf["do_ready"],
                                                     buf["lse_ready"], buf["delta_ready"])
        q_free, do_free, lse_free, delta_free = (buf["q_free"], buf["do_free"],
                                                 buf["lse_free"], buf["delta_free"])
        ex_smem, dq_smem, ex_ready = buf["ex"], buf["dq"], buf.get("ex_ready")
        p_stage = buf.get("p_stage")
        wg = lax.axis_index("wg")
        tile = order_ref[lax.axis_index("tile")]
        batch = lax.axis_index("batch")
        kv_head = lax.axis_index("head")
        first = off_ref[tile]
        tile_items = off_ref[tile + 1] - first
        num_steps = tile_items * group

        def step_item(i):   # step i: query head (i // tile_items) of the group, item i % n
            return first + lax.rem(i, tile_items), kv_head * group + lax.div(i, tile_items)

        @pl.when(wg < _COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(cfg.registers[0], action="increase")
            col0 = tile * DKV_BLOCK_K + wg * _BK
            cols = pl.ds(col0, _BK)
            my_keys = pl.ds(wg * _BK, _BK)
            my_k, my_v = k_smem.at[my_keys], v_smem.at[my_keys]
            plgpu.copy_gmem_to_smem(k_ref.at[batch, cols, kv_head], my_k, kv_ready)
            plgpu.copy_gmem_to_smem(v_ref.at[batch, cols, kv_head], my_v, kv_ready)
            # dQ takes the other warpgroup's keys too (D = 128), so both wait for all of K.
            plgpu.barrier_wait(kv_ready)
            dv_stage = None if p_stage is None else p_stage.at[wg]
            other = 1 - wg
            dq_cols = pl.ds(wg * _DQ_COLS, _DQ_COLS) if split_d else pl.ds(0, d)

            def add_dq(i, it, head, qtile, dq):
                """Sends the step's dQ block (this warpgroup's part) on its way."""
                out = dq_smem.at[wg, lax.rem(i, jnp.int32(dq_bufs))]
                # The buffer's last store, dq_bufs steps back, must have read it.
                plgpu.wait_smem_to_gmem(dq_bufs - 1, wait_read_only=True)
                if _SKIP_DQ:
                    return
                out[...] = dq
                plgpu.commit_smem()
                if cfg.interpret:   # no TMA reduction there: every step's block apart
                    plgpu.copy_smem_to_gmem(
                        out, dq_ref.at[batch, head, wg, it, :, dq_cols])
                elif _DQ_MODE == "smem":
                    return
                elif _DQ_MODE == "copy":
                    plgpu.copy_smem_to_gmem(
                        out, dq_ref.at[batch, pl.ds(qtile * _BQ, _BQ), head, dq_cols])
                elif _DQ_MODE == "contig":
                    plgpu.copy_smem_to_gmem(
                        out, dq_ref.at[batch, head, qtile, wg if split_d else 0],
                        reduction_op="add")
                else:
                    plgpu.copy_smem_to_gmem(
                        out, dq_ref.at[batch, pl.ds(qtile * _BQ, _BQ), head, dq_cols],
                        reduction_op="add")

            def run(dk_acc, dv_acc):
                def step(i, carry):
                    it, head = step_item(i)
                    slot, qtile, geom, kind = _item_step(items_ref, it, i, None, stages,
                                                         (q_ready, do_ready))
                    ex = ex_smem.at[lax.rem(i, jnp.int32(2))]

                    def products(st_ref, dpt_ref):   # Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ
                        plgpu.wgmma(st_ref, my_k, q_smem.at[slot].T)
                        plgpu.wgmma(dpt_ref, my_v, do_smem.at[slot].T)
                        return st_ref[...], dpt_ref[...]

                    st, dpt = pl.run_scoped(products, plgpu.ACC((_BK, _BQ), jnp.float32),
                                            plgpu.ACC((_BK, _BQ), jnp.float32))
                    st, c, dcap = _log2_scores(st, cfg)
                    st = mask_scores(st, geom, kind, qtile * _BQ, col0, _LAYOUT,
                                     transposed=True)
                    plgpu.barrier_wait(lse_ready.at[slot])
                    lse2 = plgpu.load(lse_smem.at[slot], layout=_COL)
                    plgpu.barrier_arrive(lse_free.at[slot])
                    plgpu.barrier_wait(delta_ready.at[slot])
                    dlt = plgpu.load(delta_smem.at[slot], layout=_COL)
                    plgpu.barrier_arrive(delta_free.at[slot])
                    pt = _exp2_minus(st, c, lse2, 1)
                    dst = pt * (dpt - lax.broadcast_in_dim(dlt, dpt.shape, [1]))
                    if dcap is not None:
                        dst = dst * dcap
                    # dSᵀ into this warpgroup's exchange slot: dK's and dQ's operand.
                    ex[wg] = dst.astype(dtype)
                    plgpu.commit_smem()
                    if split_d and _DQ_MODE != "norv":
                        plgpu.barrier_arrive(ex_ready)
                    # dV += Pᵀ·dO and dK += dSᵀ·Q.
                    mma_lhs(dv_acc, pt.astype(dtype), do_smem.at[slot], dv_stage)
                    plgpu.wgmma(dk_acc, ex.at[wg], q_smem.at[slot])

                    def dq_products(dq_acc):
                        if _DQ_MODE == "nomma":
                            return dq_acc[...]
                        # dQ[:, dq_cols] += dS_w · K_w (this warpgroup's keys) ...
                        plgpu.wgmma(dq_acc, ex.at[wg].T, k_smem.at[my_keys, dq_cols])
                        if split_d:   # ... + dS_o · K_o once the other's block is there
                            if _DQ_MODE != "norv":
                                plgpu.barrier_wait(ex_ready)
                            plgpu.wgmma(dq_acc, ex.at[other].T,
                                        k_smem.at[pl.ds(other * _BK, _BK), dq_cols])
                        plgpu.wgmma_wait(0)
                        return dq_acc[...]

                    dq = pl.run_scoped(dq_products,
                                       plgpu.ACC((_BQ, _DQ_COLS if split_d else d),
                                                 jnp.float32))
                    plgpu.barrier_arrive(do_free.at[slot])
                    plgpu.barrier_arrive(q_free.at[slot])
                    add_dq(i, it, head, qtile, dq)
                    return carry

                lax.fori_loop(0, num_steps, step, 0)
                return dk_acc[...], dv_acc[...]

            dk, dv = pl.run_scoped(run, plgpu.ACC((_BK, d), jnp.float32),
                                   plgpu.ACC((_BK, d), jnp.float32))
            plgpu.wait_smem_to_gmem(0)
            if split_d:
                # dK/dV leave through this warpgroup's K and V, and the other warpgroup's
                # last dQ product reads this one's K: a last rendezvous, after both
                # warpgroups' last wgmma_wait.
                plgpu.barrier_arrive(ex_ready)
                plgpu.barrier_wait(ex_ready)
            _store_outputs([(my_k, (dk * cfg.scale).astype(dtype),
                             dk_ref.at[batch, cols, kv_head]),
                            (my_v, dv.astype(dtype), dv_ref.at[batch, cols, kv_head])],
                           persistent=False)

        @pl.when(wg == _COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(cfg.registers[1], action="decrease")
            streams = [(q_ref, q_smem, q_ready, q_free), (do_ref, do_smem, do_ready, do_free),
                       (lse_ref, lse_smem, lse_ready, lse_free),
                       (delta_ref, delta_smem, delta_ready, delta_free)]

            def start_of(i):
                it, head = step_item(i)
                return items_ref[it, ItemField.OTHER_TILE] * _BQ, head

            def view(ref, start):
                row, head = start
                if ref.ndim == 4:
                    return ref.at[batch, pl.ds(row, _BQ), head]
                return ref.at[batch, head, pl.ds(row, _BQ)]

            _stream(num_steps, stages, start_of, streams, view)

    # Shared memory by name, allocated in this order. At D = 128, bf16, 2 stages: K, V
    # 32 KiB each, the Q/dO ring 2 x 16 KiB per stage, lse/delta 1 KiB each per stage, the
    # dSᵀ exchange 2 x 16 KiB, the dQ blocks 2 x 2 x 16 KiB: 226 KiB (of 227). D = 64: 130.
    per_stage = lambda n=1: plgpu.Barrier(num_arrivals=n, num_barriers=stages)
    scratch = dict(
        k=smem((DKV_BLOCK_K, d), dtype),       # the tile's K, V; warpgroup w loads rows w·64
        v=smem((DKV_BLOCK_K, d), dtype),
        q=smem((stages, _BQ, d), dtype),       # the Q/dO/lse/delta ring
        do=smem((stages, _BQ, d), dtype),
        lse=plgpu.SMEM((stages, _BQ), jnp.float32),
        delta=plgpu.SMEM((stages, _BQ), jnp.float32),
        ex=smem((2, _COMPUTE_WGS, _BK, _BQ), dtype),       # dSᵀ by step parity, writer
        dq=_f32_smem((_COMPUTE_WGS, dq_bufs, _BQ, dq_cols)),   # dQ blocks by writer, step
        kv_ready=plgpu.Barrier(num_arrivals=2 * _COMPUTE_WGS),
        q_ready=per_stage(), do_ready=per_stage(), lse_ready=per_stage(),
        delta_ready=per_stage(),
        q_free=per_stage(_COMPUTE_WGS), do_free=per_stage(_COMPUTE_WGS),
        lse_free=per_stage(_COMPUTE_WGS), delta_free=per_stage(_COMPUTE_WGS),
    )
    if split_d:
        scratch["ex_ready"] = plgpu.Barrier(num_arrivals=_COMPUTE_WGS)
    check_smem("fused backward", list(scratch.values()), stages_knob="dkv_num_stages",
               stages=stages, d=d, dtype=dtype)
    if cfg.interpret:   # Pᵀ through shared memory (mma_lhs)
        scratch["p_stage"] = smem((_COMPUTE_WGS, _BK, _BQ), dtype)
    if cfg.interpret:
        dq_shape = (b, hq, _COMPUTE_WGS, num_items, _BQ, d)
    elif _DQ_MODE == "contig":
        dq_shape = (b, hq, tq // _BQ, d // dq_cols, _BQ, dq_cols)
    else:
        dq_shape = (b, tq, hq, d)
    dq_acc = jax.new_ref(jnp.zeros(dq_shape, jnp.float32))
    kv = jax.ShapeDtypeStruct((b, tk, hkv, d), dtype)
    dk, dv = plgpu.kernel(
        kernel, out_type=(kv, kv), scratch_types=list(scratch.values()), grid=grid,
        grid_names=grid_names, num_threads=_COMPUTE_WGS + 1, thread_name="wg",
        **_params(cfg),
    )(q, k, v, dout, lse2, delta, order, offsets, items, dq_acc)
    dq = dq_acc[...]
    if cfg.interpret:
        dq = _sum_by_query_step(dq.sum(axis=2), offsets, items, tq // _BQ)
    elif _DQ_MODE == "contig":
        dq = jnp.transpose(dq, (0, 2, 4, 1, 3, 5)).reshape(b, tq, hq, d)
    return (dq * cfg.scale).astype(dtype), dk, dv


def _sum_by_query_step(parts, offsets, items, num_steps):
    """``[B, Hq, items, 64, D]`` blocks -> dQ ``[B, Tq, Hq, D]``: each walked item's block
    added to its query step's rows (items past ``offsets[-1]`` are padding)."""
    walked = jnp.arange(items.shape[0]) < offsets[-1]
    step = jnp.where(walked, items[:, ItemField.OTHER_TILE], num_steps)
    summed = jax.vmap(jax.vmap(lambda x: jax.ops.segment_sum(x, step, num_steps + 1)))(parts)
    b, hq, _, rows, d = summed.shape
    return jnp.swapaxes(summed[:, :, :num_steps].reshape(b, hq, num_steps * rows, d), 1, 2)
