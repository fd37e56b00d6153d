"""The FFA backward as one Mosaic GPU kernel (Hopper, sm90): dK, dV and dQ from one pass over
the dK/dV work list, five matmuls per tile pair where :func:`~magi_jax.pallas.ffa_bwd.ffa_dq`
plus :func:`~magi_jax.pallas.ffa_bwd.ffa_dkv` take seven (the dQ kernel recomputes S and dP).

A program owns a k-tile of 128 keys of one key head, as ``ffa_dkv`` does: its two consumer
warpgroups hold 64 keys each and walk the query steps of 64 rows that see the tile (for every
query head of the GQA group), computing ``Sᵀ``, ``dPᵀ``, then ``dV += Pᵀ·dO`` and
``dK += dSᵀ·Q`` in float32 registers. Each step's ``dSᵀ`` block also goes to shared memory,
and from there the step's contribution to dQ, ``dS·K`` over the tile's keys, is computed and
handed, as float32 in shared memory, to the producer warpgroup, which sends it as a TMA
reduce-add into a zeroed float32 ``[B, Tq, Hq, D]`` buffer. The consumers never wait for
those adds: the producer issues them between its loads, a few steps behind, and frees each
buffer once the TMA has read it.

* D = 128: the two warpgroups split dQ's head dim, warpgroup ``w`` adding columns
  ``64w .. 64w + 63``, which takes both warpgroups' ``dSᵀ`` blocks. A warpgroup computes the
  dQ block of step ``i − 1`` in step ``i`` (after issuing step ``i``'s dV and dK products),
  so the other warpgroup's block is normally there already and the two do not run in
  lockstep. The exchange buffers alternate by step parity; before overwriting its half a
  warpgroup waits until the other has read it (``ex_read``).
* D = 64: each warpgroup adds the whole ``dS_w·K_w`` of its own 64 keys (two adds per step
  to the same rows); the warpgroups never wait for each other.

The adds of different programs to one block of rows land in whatever order the programs run,
so dQ is **not bitwise reproducible** (float32 rounding may differ between runs); dK and dV
are. The backend runs this kernel only when asked (``deterministic=False``).

GPU interpret mode has no TMA reduction, so there (tests) every step's block is stored
apart, ``[B, Hq, warpgroup, item, 64, D]``, and summed afterwards by the items' query steps;
the kernel is otherwise the one that runs on the GPU.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from magi_jax.pallas.common import (ItemField, check_smem, item_fields, launch_grid,
                                    mask_scores, mma_lhs, smem)
from magi_jax.pallas.ffa_bwd import (_COL, _LAYOUT, BwdConfig, _drain, _exp2_minus,
                                     _log2_scores, _params, _products, _store_outputs)
from magi_jax.planning.work_list import DKV_BLOCK_K, DKV_BLOCK_Q

__all__ = ["ffa_dkvq", "FUSED_HEAD_DIMS"]

FUSED_HEAD_DIMS = (64, 128)
_COMPUTE_WGS = 2
_BQ = DKV_BLOCK_Q                     # query rows of a step
_BK = DKV_BLOCK_K // _COMPUTE_WGS     # keys of one consumer warpgroup
_SPLIT_D = 128                        # the head dim whose dQ columns the warpgroups split
_DQ_BUFS = 2                          # dQ blocks in flight between consumers and producer


def _f32_smem(shape):
    """Float32 shared memory in 8 x 32 tiles with the 128-byte swizzle (rows of 128 bytes)."""
    return plgpu.SMEM(shape, jnp.float32, transforms=(plgpu.TilingTransform((8, 32)),
                                                      plgpu.SwizzleTransform(128)))


def ffa_dkvq(q, k, v, dout, lse2, delta, order, offsets, items, cfg: BwdConfig):
    """``(dq, dk, dv)`` from one kernel. Inputs as :func:`~magi_jax.pallas.ffa_bwd.ffa_dkv`:
    q/dout ``[B, Tq, Hq, D]`` (``Tq`` a multiple of 64), k/v ``[B, Tk, Hkv, D]`` (``Tk`` a
    multiple of 128), ``lse2``/``delta [B, Hq, Tq]`` float32, the dK/dV work list; D 64 or
    128. dq like q, dk/dv like k. dQ is summed by float32 reduce-adds (see the module)."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1:3]
    if d not in FUSED_HEAD_DIMS:
        raise ValueError(f"the fused backward kernel takes D in {FUSED_HEAD_DIMS}; got {d}")
    if cfg.persistent or cfg.turns or cfg.steps_per_wait != 1:
        raise ValueError("the fused backward kernel runs one program per unit, its consumers "
                         "issuing as they go, one query block per wait; got persistent="
                         f"{cfg.persistent}, turns={cfg.turns}, "
                         f"steps_per_wait={cfg.steps_per_wait}")
    group = hq // hkv
    num_tiles = tk // DKV_BLOCK_K
    assert order.shape == (num_tiles,) and tq % _BQ == 0 and tk % DKV_BLOCK_K == 0
    num_items = items.shape[0]
    dtype, stages = q.dtype, cfg.num_stages
    split_d = d == _SPLIT_D
    dq_cols = d // _COMPUTE_WGS if split_d else d
    # The producer reduces step j's dQ after loading step j + lag: by then the consumers have
    # freed step j + lag − stages = j + 1, so that block is stored and the wait is short.
    lag = stages + 1
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
        ds_smem, dq_smem = buf["ds"], buf["dq"]
        dq_full, dq_free = buf["dq_full"], buf["dq_free"]
        ds_ready, ds_read = buf.get("ds_ready"), buf.get("ds_read")
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

        def parity(i):
            return lax.rem(i, jnp.int32(2))

        @pl.when(wg < _COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(cfg.registers[0], action="increase")
            col0 = tile * DKV_BLOCK_K + wg * _BK
            cols = pl.ds(col0, _BK)
            my_keys = pl.ds(wg * _BK, _BK)
            my_k, my_v = k_smem.at[my_keys], v_smem.at[my_keys]
            plgpu.copy_gmem_to_smem(k_ref.at[batch, cols, kv_head], my_k, kv_ready)
            plgpu.copy_gmem_to_smem(v_ref.at[batch, cols, kv_head], my_v, kv_ready)
            # At D = 128 dQ takes the other warpgroup's keys too, so both wait for all of K.
            plgpu.barrier_wait(kv_ready)
            stage = (lambda n: None) if p_stage is None else (lambda n: p_stage.at[wg, n])
            other = 1 - wg
            my_cols = pl.ds(wg * dq_cols, dq_cols)

            def dq_block(j):
                """Step ``j``'s dQ block (this warpgroup's columns, or its keys' share at
                D = 64) into shared memory, for the producer to add."""
                ds_buf = ds_smem.at[parity(j)]
                if split_d:   # the other warpgroup's dSᵀ block of step j
                    plgpu.barrier_wait(ds_ready.at[parity(j)])
                    pairs = [(ds_buf.at[wg].T, k_smem.at[my_keys, my_cols]),
                             (ds_buf.at[other].T, k_smem.at[pl.ds(other * _BK, _BK),
                                                            my_cols])]
                else:
                    pairs = [(ds_buf.at[wg].T, my_k)]

                def issue(acc):
                    for a, b_ in pairs:
                        plgpu.wgmma(acc, a, b_)
                    return acc[...]   # waits for every wgmma in flight

                dq = pl.run_scoped(issue, plgpu.ACC((_BQ, dq_cols), jnp.float32))
                if split_d:   # this warpgroup is done reading the other's half
                    plgpu.barrier_arrive(ds_read.at[parity(j) * _COMPUTE_WGS + wg])
                out = dq_smem.at[lax.rem(j, jnp.int32(_DQ_BUFS)), wg]
                pl.when(j >= _DQ_BUFS)(lambda: plgpu.barrier_wait(
                    dq_free.at[lax.rem(j, jnp.int32(_DQ_BUFS))]))
                out[...] = dq
                plgpu.commit_smem()
                plgpu.barrier_arrive(dq_full.at[lax.rem(j, jnp.int32(_DQ_BUFS))])

            def run(dk_acc, dv_acc):
                def step(i, carry):
                    # Step i − 1's dQ first, while only the dK/dV accumulators are live.
                    pl.when(i > 0)(lambda: dq_block(i - 1))
                    it, _ = step_item(i)
                    qtile, geom, kind = item_fields(items_ref, it)
                    slot = lax.rem(i, jnp.int32(stages))
                    plgpu.barrier_wait(q_ready.at[slot])
                    plgpu.barrier_wait(do_ready.at[slot])
                    st, dpt = _products([(my_k, q_smem.at[slot].T),
                                         (my_v, do_smem.at[slot].T)], (_BK, _BQ))
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
                    dst = dst.astype(dtype)
                    # dSᵀ into this warpgroup's half of the step's exchange buffer, once the
                    # other warpgroup has read what step i − 2 left there.
                    if split_d:
                        pl.when(i >= 2)(lambda: plgpu.barrier_wait(
                            ds_read.at[parity(i) * _COMPUTE_WGS + other]))
                    ds_smem.at[parity(i), wg][...] = dst
                    plgpu.commit_smem()
                    if split_d:
                        plgpu.barrier_arrive(ds_ready.at[parity(i)])
                    # dV += Pᵀ·dO and dK += dSᵀ·Q.
                    mma_lhs(dv_acc, pt.astype(dtype), do_smem.at[slot], stage(0))
                    mma_lhs(dk_acc, dst, q_smem.at[slot], stage(1))
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(do_free.at[slot])
                    plgpu.barrier_arrive(q_free.at[slot])
                    return carry

                lax.fori_loop(0, num_steps, step, 0)
                pl.when(num_steps > 0)(lambda: dq_block(num_steps - 1))
                return dk_acc[...], dv_acc[...]

            dk, dv = pl.run_scoped(run, plgpu.ACC((_BK, d), jnp.float32),
                                   plgpu.ACC((_BK, d), jnp.float32))
            # Observe the last phases of the barriers the loop waits on only for reuse: the
            # producer's frees of the last dQ blocks and, at D = 128, the other warpgroup's
            # reads of this one's last dSᵀ halves. dK/dV then leave through this warpgroup's
            # K and V, which the other's last dQ product (read with those halves) is done
            # with.
            @pl.loop(lax.max(num_steps - 2, jnp.int32(0)), num_steps)
            def _(j):
                plgpu.barrier_wait(dq_free.at[lax.rem(j, jnp.int32(_DQ_BUFS))])
                if split_d:
                    plgpu.barrier_wait(ds_read.at[parity(j) * _COMPUTE_WGS + other])

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

            def view(ref, row, head):
                if ref.ndim == 4:
                    return ref.at[batch, pl.ds(row, _BQ), head]
                return ref.at[batch, head, pl.ds(row, _BQ)]

            def reduce_dq(j):
                """Adds step ``j``'s dQ blocks into the float32 buffer, then frees them."""
                it, head = step_item(j)
                qtile = items_ref[it, ItemField.OTHER_TILE]
                slot = lax.rem(j, jnp.int32(_DQ_BUFS))
                plgpu.barrier_wait(dq_full.at[slot])
                for w in range(_COMPUTE_WGS):
                    cols = pl.ds(w * dq_cols, dq_cols) if split_d else pl.ds(0, d)
                    if cfg.interpret:   # no TMA reduction there: every step's block apart
                        dst = dq_ref.at[batch, head, w, it, :, cols]
                        plgpu.copy_smem_to_gmem(dq_smem.at[slot, w], dst)
                    else:
                        dst = dq_ref.at[batch, pl.ds(qtile * _BQ, _BQ), head, cols]
                        plgpu.copy_smem_to_gmem(dq_smem.at[slot, w], dst, reduction_op="add")
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(dq_free.at[slot])

            @pl.loop(0, num_steps)
            def _(i):
                slot = lax.rem(i, jnp.int32(stages))
                it, head = step_item(i)
                row = items_ref[it, ItemField.OTHER_TILE] * _BQ
                for gmem, smem_buf, ready, free in streams:
                    pl.when(i >= stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
                    plgpu.copy_gmem_to_smem(view(gmem, row, head), smem_buf.at[slot],
                                            ready.at[slot])
                pl.when(i >= lag)(lambda: reduce_dq(i - lag))

            @pl.loop(lax.max(num_steps - lag, jnp.int32(0)), num_steps)
            def _(j):
                reduce_dq(j)

            _drain(num_steps, stages, streams)
            plgpu.wait_smem_to_gmem(0)

    # Shared memory by name, allocated in this order. At D = 128, bf16, 2 stages: K, V
    # 32 KiB each, the Q/dO ring 2 x 16 KiB per stage, lse/delta 1 KiB each, the dSᵀ
    # exchange 2 x 16 KiB, the dQ blocks 2 x 2 x 16 KiB: 226 KiB (of 227). D = 64: 114 KiB.
    per_stage = lambda n=1: plgpu.Barrier(num_arrivals=n, num_barriers=stages)
    scratch = dict(
        k=smem((DKV_BLOCK_K, d), dtype),       # the tile's K, V; warpgroup w loads rows 64w
        v=smem((DKV_BLOCK_K, d), dtype),
        q=smem((stages, _BQ, d), dtype),       # the Q/dO/lse/delta ring
        do=smem((stages, _BQ, d), dtype),
        lse=plgpu.SMEM((stages, _BQ), jnp.float32),
        delta=plgpu.SMEM((stages, _BQ), jnp.float32),
        ds=smem((2, _COMPUTE_WGS, _BK, _BQ), dtype),            # dSᵀ by step parity, writer
        dq=_f32_smem((_DQ_BUFS, _COMPUTE_WGS, _BQ, dq_cols)),    # dQ blocks by step, writer
        kv_ready=plgpu.Barrier(num_arrivals=2 * _COMPUTE_WGS),
        q_ready=per_stage(), do_ready=per_stage(), lse_ready=per_stage(),
        delta_ready=per_stage(),
        q_free=per_stage(_COMPUTE_WGS), do_free=per_stage(_COMPUTE_WGS),
        lse_free=per_stage(_COMPUTE_WGS), delta_free=per_stage(_COMPUTE_WGS),
        dq_full=plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=_DQ_BUFS),
        dq_free=plgpu.Barrier(num_barriers=_DQ_BUFS),
    )
    if split_d:
        # ds_ready[p]: both halves of buffer p written; ds_read[2p + w]: warpgroup w has read
        # the other's half of buffer p.
        scratch["ds_ready"] = plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=2)
        scratch["ds_read"] = plgpu.Barrier(num_barriers=2 * _COMPUTE_WGS)
    check_smem("fused backward", list(scratch.values()), stages_knob="dkv_num_stages",
               stages=stages, d=d, dtype=dtype)
    if cfg.interpret:   # Pᵀ and dSᵀ through shared memory (mma_lhs)
        scratch["p_stage"] = smem((_COMPUTE_WGS, 2, _BK, _BQ), dtype)
    dq_shape = (b, hq, _COMPUTE_WGS, num_items, _BQ, d) if cfg.interpret else (b, tq, hq, d)
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
    return (dq * cfg.scale).astype(dtype), dk, dv


def _sum_by_query_step(parts, offsets, items, num_steps):
    """``[B, Hq, items, 64, D]`` blocks -> dQ ``[B, Tq, Hq, D]``: each walked item's block
    added to its query step's rows (items past ``offsets[-1]`` are padding)."""
    walked = jnp.arange(items.shape[0]) < offsets[-1]
    step = jnp.where(walked, items[:, ItemField.OTHER_TILE], num_steps)
    summed = jax.vmap(jax.vmap(lambda x: jax.ops.segment_sum(x, step, num_steps + 1)))(parts)
    b, hq, _, rows, d = summed.shape
    return jnp.swapaxes(summed[:, :, :num_steps].reshape(b, hq, num_steps * rows, d), 1, 2)
