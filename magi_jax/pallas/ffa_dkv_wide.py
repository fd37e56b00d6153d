"""FFA dK/dV for wide heads (D = 256, and Dqk = 192) as a Mosaic GPU kernel (Hopper, sm90).

At D = 256 :func:`~magi_jax.pallas.ffa_bwd.ffa_dkv` does not fit: each consumer warpgroup
would hold dK and dV of 64 x 256 in float32 (256 registers a thread for the two), and its
K, V beside a Q/dO ring take more than the 227 KiB of shared memory. Here, as in
FlashAttention-3's hdim-256 backward, one program owns 64 keys (half a k-tile of the work
list) and its two consumer warpgroups split the work twice:

* the scores: warpgroup ``w`` computes the 32 query columns ``w·32 ..`` of a step's Sᵀ and
  dPᵀ (64 keys x 32 rows, over the whole head dim) and turns them into Pᵀ and dSᵀ;
* the gradients: warpgroup ``w`` accumulates the head-dim half ``w`` of dK and dV (64 x 128
  each in float32: 128 registers a thread), which needs all 64 columns of Pᵀ and dSᵀ.

With a value head dim of its own (multi-head latent attention, e.g. Dqk/Dv = 192/128),
K, Q and dK are split in halves of ``Dqk / 2`` and V, dO and dV in halves of ``Dv / 2``
(:func:`~magi_jax.pallas.common.wide_halves`).

The two column halves meet in a shared-memory exchange buffer: each warpgroup writes its
half, both pass the ``exchanged`` barrier, both multiply. The exchange is double-buffered
by step parity, so that one barrier a step is all the two warpgroups share (see the step's
comments for why neither overwrites what the other still reads).

Every head-dim tensor lives in shared memory as two ``[rows, 128]`` halves, each its own TMA
copy, and every wgmma operand is in shared memory (so GPU interpret mode runs the kernel as
it is). All buffers use tiles of 32 columns with the 64-byte swizzle: the exchange halves
have rows of 32 elements, a wgmma takes both operands in one swizzle (lowering for sm90
refuses a 64-byte A with a 128-byte B), and the dK/dV products contract over 32 query rows,
which the 128-byte swizzle (64-element K groups) cannot split. An exchange of 64 x 64 with
the 128-byte swizzle would need each warpgroup to store half a swizzle tile, which Pallas
refuses ("slice start (32) ... divisible by the tile size (64)").

The work list is the one of :func:`~magi_jax.pallas.ffa_bwd.ffa_dkv`: both 64-key halves of a
k-tile walk all of its items (the mask predicate, evaluated with the half's first key, cuts
the cells), once per query head of the GQA group. No persistent mode: its output buffers
would not fit.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from magi_jax.pallas.bwd_common import (
    COL,
    DKV_SPLIT_ALIGN,
    LAYOUT,
    dkv_out_type,
    exp2_minus,
    log2_scores,
    store_outputs,
)
from magi_jax.pallas.common import (
    COMPUTE_WGS,
    WIDE_BWD_D,
    ItemField,
    check_smem,
    item_fields,
    launch_grid,
    launch_kernel,
    mask_scores,
    smem64,
    wide_halves,
)
from magi_jax.pallas.tuning import WideDkvConfig
from magi_jax.planning.work_list import DKV_BLOCK_K, DKV_BLOCK_Q

__all__ = ["ffa_dkv_wide"]

# Keys a program owns: half a k-tile of the work list.
_KEYS = DKV_BLOCK_K // 2
_HALVES = DKV_BLOCK_K // _KEYS
# Query rows of a step whose scores one consumer computes.
_ROWS = DKV_BLOCK_Q // COMPUTE_WGS
# A program's 64 keys go to one part of a split output.
assert DKV_SPLIT_ALIGN % _KEYS == 0, (DKV_SPLIT_ALIGN, _KEYS)


def _transposed_scores(k_halves, v_halves, q_halves, do_halves, q_ready, do_ready):
    """``(Sᵀ, dPᵀ) = (K·Qᵀ, V·dOᵀ)`` in float32 registers, each summed over the head-dim
    halves: four wgmmas and one wait. Those of Sᵀ are issued as soon as Q has landed, so
    they run while dO may still be on its way."""

    def body(st_ref, dpt_ref):
        plgpu.barrier_wait(q_ready)
        for h in range(COMPUTE_WGS):
            plgpu.wgmma(st_ref, k_halves.at[h], q_halves.at[h].T)
        plgpu.barrier_wait(do_ready)
        for h in range(COMPUTE_WGS):
            plgpu.wgmma(dpt_ref, v_halves.at[h], do_halves.at[h].T)
        return st_ref[...], dpt_ref[...]

    acc = plgpu.ACC((_KEYS, _ROWS), jnp.float32)
    return pl.run_scoped(body, acc, acc)


def ffa_dkv_wide(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse2: jax.Array,
    delta: jax.Array,
    order: jax.Array,
    offsets: jax.Array,
    items: jax.Array,
    cfg: WideDkvConfig,
    schedule: tuple = (),
    split: int = 0,
) -> tuple[jax.Array, ...]:
    """dK, dV at D = 256 (or Dqk/Dv = 192/128, 256/128:
    :func:`~magi_jax.pallas.common.wide_halves`): the inputs and outputs of
    :func:`~magi_jax.pallas.ffa_bwd.ffa_dkv`
    (the dK/dV work list; ``split`` a multiple of :data:`DKV_SPLIT_ALIGN` gives four outputs,
    each 64-key piece stored straight into its part). One program per (64-key half of a
    k-tile, batch, key head); ``schedule`` must be empty (no persistent mode)."""
    if len(schedule):
        raise ValueError(
            f"a schedule of {len(schedule)} arrays: at D = {WIDE_BWD_D} the dK/dV kernel "
            "runs one program per unit (its shared memory leaves no room for "
            "the persistent mode's output buffers); pass dkv_persistent=0"
        )
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1:3]
    dv = v.shape[-1]
    # The head-dim halves of K, Q, dK and of V, dO, dV: each consumer accumulates one of each.
    qk_half, v_half = wide_halves(d, dv)
    group = hq // hkv
    num_tiles = tk // DKV_BLOCK_K
    assert order.shape == (num_tiles,)
    assert split % DKV_SPLIT_ALIGN == 0 and 0 <= split < tk, (split, tk)
    dtype, stages = q.dtype, cfg.num_stages
    # Both halves of a k-tile side by side in the launch order (tiles heaviest first).
    grid, grid_names = launch_grid(_HALVES * num_tiles, b, hkv)

    def kernel(
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, order_ref, off_ref, items_ref, *refs
    ):
        outs, refs = refs[: 4 if split else 2], refs[4 if split else 2 :]
        buf = dict(zip(scratch, refs, strict=True))
        k_smem, v_smem, kv_ready = buf["k"], buf["v"], buf["kv_ready"]
        q_smem, do_smem, stats = buf["q"], buf["do"], buf["stats"]
        q_ready, do_ready, stats_ready, free = (
            buf["q_ready"],
            buf["do_ready"],
            buf["stats_ready"],
            buf["free"],
        )
        exchange, exchanged = buf["exchange"], buf["exchanged"]
        wg = lax.axis_index("wg")
        unit = lax.axis_index("tile")
        tile = order_ref[lax.div(unit, jnp.int32(_HALVES))]
        col0 = tile * DKV_BLOCK_K + lax.rem(unit, jnp.int32(_HALVES)) * _KEYS
        batch = lax.axis_index("batch")
        kv_head = lax.axis_index("head")
        first = off_ref[tile]
        num_items = off_ref[tile + 1] - first
        num_steps = num_items * group
        keys = pl.ds(col0, _KEYS)

        def step_item(i):  # step i: query head (i // num_items) of the group, item i % n
            return first + lax.rem(i, num_items), kv_head * group + lax.div(i, num_items)

        def both_consumers_here():
            """Returns once both consumers have called this (as often)."""
            plgpu.barrier_arrive(exchanged)
            plgpu.barrier_wait(exchanged)

        @pl.when(wg < COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(cfg.registers[0], action="increase")
            # This consumer's head-dim half of K/dK (0) and of V/dV (1).
            my_d = (pl.ds(wg * qk_half, qk_half), pl.ds(wg * v_half, v_half))
            # Each consumer loads its head-dim half of K and V; both need both halves.
            plgpu.copy_gmem_to_smem(
                k_ref.at[batch, keys, kv_head, my_d[0]], k_smem.at[wg], kv_ready
            )
            plgpu.copy_gmem_to_smem(
                v_ref.at[batch, keys, kv_head, my_d[1]], v_smem.at[wg], kv_ready
            )
            plgpu.barrier_wait(kv_ready)
            my_rows = pl.ds(pl.multiple_of(wg * _ROWS, _ROWS), _ROWS)

            def run(dk_acc, dv_acc):
                def step(i, carry):
                    slot = lax.rem(i, jnp.int32(stages))
                    parity = lax.rem(i, jnp.int32(2))
                    qstep, geom, kind = item_fields(items_ref, step_item(i)[0])
                    q_slot, do_slot = q_smem.at[slot], do_smem.at[slot]
                    # Sᵀ and dPᵀ of this consumer's 32 query rows: (64 keys, 32 rows).
                    st, dpt = _transposed_scores(
                        k_smem,
                        v_smem,
                        q_slot.at[:, my_rows],
                        do_slot.at[:, my_rows],
                        q_ready.at[slot],
                        do_ready.at[slot],
                    )
                    st, c, dcap = log2_scores(st, cfg.scale, cfg.softcap)
                    st = mask_scores(
                        st,
                        geom,
                        kind,
                        qstep * DKV_BLOCK_Q + wg * _ROWS,
                        col0,
                        LAYOUT,
                        transposed=True,
                    )
                    plgpu.barrier_wait(stats_ready.at[slot])
                    lse2 = plgpu.load(stats.at[slot, 0, my_rows], layout=COL)
                    dlt = plgpu.load(stats.at[slot, 1, my_rows], layout=COL)
                    pt = exp2_minus(st, c, lse2, 1)
                    dst = pt * (dpt - lax.broadcast_in_dim(dlt, dpt.shape, [1]))
                    if dcap is not None:
                        dst = dst * dcap
                    # The exchange of this step's parity held step i − 2's halves. The other
                    # consumer read them in its step i − 2, whose wgmmas it waited for
                    # before it reached the barrier of step i − 1, which this consumer has
                    # passed: so they are free to overwrite, and one barrier a step is all
                    # the exchange needs.
                    mine = exchange.at[parity]
                    mine.at[0, wg][...] = pt.astype(dtype)
                    mine.at[1, wg][...] = dst.astype(dtype)
                    plgpu.commit_smem()  # the wgmmas (async proxy) read what was stored
                    both_consumers_here()
                    # dV[:, half wg] += Pᵀ·dO[:, half wg] and dK[:, half wg] += dSᵀ·Q[:,
                    # half wg], contracted over the step's 64 query rows as the two
                    # consumers' 32-row parts.
                    for u in range(COMPUTE_WGS):
                        part = pl.ds(u * _ROWS, _ROWS)
                        plgpu.wgmma(dv_acc, mine.at[0, u], do_slot.at[wg, part])
                        plgpu.wgmma(dk_acc, mine.at[1, u], q_slot.at[wg, part])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(free.at[slot])  # Q, dO, lse2, delta all read
                    return carry

                lax.fori_loop(0, num_steps, step, 0)
                return dk_acc[...], dv_acc[...]

            dk, dv_ = pl.run_scoped(
                run,
                plgpu.ACC((_KEYS, qk_half), jnp.float32),
                plgpu.ACC((_KEYS, v_half), jnp.float32),
            )
            # dK and dV leave through this consumer's K and V halves. Only the Sᵀ/dPᵀ wgmmas
            # read those, and each consumer waits for its own before its last step's
            # dK/dV wgmmas, so once both are past one more barrier (after their last
            # wgmma_wait) no wgmma reads K or V any more. Without steps nobody read them;
            # their loads are complete (kv_ready).
            pl.when(num_steps > 0)(both_consumers_here)

            def dst(l):  # where output l (0: dK, 1: dV) takes these keys
                def store(src):
                    if not split:
                        plgpu.copy_smem_to_gmem(src, outs[l].at[batch, keys, kv_head, my_d[l]])
                        return
                    head_part, rest = outs[l], outs[2 + l]
                    pl.when(col0 < split)(
                        lambda: plgpu.copy_smem_to_gmem(
                            src, head_part.at[batch, keys, kv_head, my_d[l]]
                        )
                    )
                    pl.when(col0 >= split)(
                        lambda: plgpu.copy_smem_to_gmem(
                            src, rest.at[batch, pl.ds(col0 - split, _KEYS), kv_head, my_d[l]]
                        )
                    )

                return store

            store_outputs(
                [
                    (k_smem.at[wg], (dk * cfg.scale).astype(dtype), dst(0)),
                    (v_smem.at[wg], dv_.astype(dtype), dst(1)),
                ],
                persistent=False,
            )

        @pl.when(wg == COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(cfg.registers[1], action="decrease")

            # Step i fills slot i % stages with the step's Q and dO (two head-dim halves
            # each) and its lse2 and delta rows, once both consumers freed the slot.
            @pl.loop(0, num_steps)
            def _(i):
                slot = lax.rem(i, jnp.int32(stages))
                it, head = step_item(i)
                rows = pl.ds(items_ref[it, ItemField.OTHER_TILE] * DKV_BLOCK_Q, DKV_BLOCK_Q)

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                for src, dst_, ready, width in (
                    (q_ref, q_smem, q_ready, qk_half),
                    (do_ref, do_smem, do_ready, v_half),
                ):
                    for h in range(COMPUTE_WGS):
                        plgpu.copy_gmem_to_smem(
                            src.at[batch, rows, head, pl.ds(h * width, width)],
                            dst_.at[slot, h],
                            ready.at[slot],
                        )
                for s, src in enumerate((lse_ref, delta_ref)):
                    plgpu.copy_gmem_to_smem(
                        src.at[batch, head, rows], stats.at[slot, s], stats_ready.at[slot]
                    )

            # Drain: observe the release of the last slots, so every barrier phase is seen
            # before the shared memory is given back.
            @pl.loop(lax.max(num_steps - stages, jnp.int32(0)), num_steps)
            def _(i):
                plgpu.barrier_wait(free.at[lax.rem(i, jnp.int32(stages))])

    # Shared memory by name, allocated in this order. bf16/fp16, D = 256, 2 stages: K, V
    # 2 x 16 KiB each, the Q/dO ring 2 x 16 KiB each a slot, lse2/delta 1 KiB, the exchange
    # 32 KiB (parity x Pᵀ/dSᵀ x writer x 64 x 32): 225 KiB of 227 (3 stages: 291 KiB). A
    # single exchange (209 KiB) would need a second barrier a step, for the other consumer's
    # reads. Dqk/Dv = 192/128: 161 KiB (3 stages: 201 KiB).
    per_stage = lambda n: plgpu.Barrier(num_arrivals=n, num_barriers=stages)
    scratch = dict(
        k=smem64((COMPUTE_WGS, _KEYS, qk_half), dtype),  # by head-dim half
        v=smem64((COMPUTE_WGS, _KEYS, v_half), dtype),
        q=smem64((stages, COMPUTE_WGS, DKV_BLOCK_Q, qk_half), dtype),  # the ring
        do=smem64((stages, COMPUTE_WGS, DKV_BLOCK_Q, v_half), dtype),
        stats=plgpu.SMEM((stages, 2, DKV_BLOCK_Q), jnp.float32),  # lse2, delta
        exchange=smem64((2, 2, COMPUTE_WGS, _KEYS, _ROWS), dtype),
        kv_ready=plgpu.Barrier(num_arrivals=2 * COMPUTE_WGS),  # K, V halves
        q_ready=per_stage(COMPUTE_WGS),
        do_ready=per_stage(COMPUTE_WGS),  # halves
        stats_ready=per_stage(2),  # lse2, delta
        free=per_stage(COMPUTE_WGS),  # the slot, by both
        exchanged=plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    )
    check_smem(
        f"dK/dV (D = {d})",
        list(scratch.values()),
        stages_knob="dkv_num_stages",
        stages=stages,
        d=d,
        dtype=dtype,
        dv=dv,
    )
    # No cross-warp reductions here, so none of the scratch Mosaic GPU reserves for them: the
    # buffers above are all the shared memory (check_smem's count).
    call = launch_kernel(
        kernel,
        dkv_out_type(q, k, v, split),
        scratch,
        grid,
        grid_names,
        cfg.interpret,
        reduction_scratch=False,
    )
    return call(q, k, v, dout, lse2, delta, order, offsets, items)
