"""The dQ backward kernel for wide heads (D = 256, and Dqk = 192) in Mosaic GPU (Hopper,
sm90).

:func:`~magi_jax.pallas.ffa_bwd.ffa_dq` does not fit shared memory at D = 256: Q and dO of a
128-row tile take 128 KiB, and one K/V slot of 128 keys another 128 KiB. Here one program
owns 64 query rows, half a q-tile of the forward work list (the tile's items serve both
halves; the mask predicate cuts the cells of each), and walks each 128-key item as two steps
of 64 keys. Its two consumer warpgroups share the 64 rows and split every step twice:

* the scores: warpgroup ``w`` computes ``S`` and ``dP`` of the step's keys ``w·32 ..
  w·32 + 32`` (64 x 32, over the whole head dim) and turns them into its columns of dS;
* the gradient: warpgroup ``w`` accumulates the head-dim half ``w`` of dQ (64 x 128 in
  float32), which takes the whole of dS: ``dQ_w += Σ_u dS_u · K[keys of u, half w]``.

V and dO may have a head dim of their own (multi-head latent attention, e.g. Dqk/Dv =
192/128): Q and K are then split in halves of ``Dqk / 2`` and dO and V in halves of
``Dv / 2`` (:func:`~magi_jax.pallas.common.wide_halves`).

The two column blocks of dS meet in a shared-memory exchange buffer, one writer slot per
warpgroup, double buffered by step parity so that one rendezvous a step (``ex_ready``) is
all the synchronisation between the warpgroups (the argument is at the exchange). A
producer warpgroup streams K and V through a ring of slots of 64 keys, as in ``ffa_dq``.
Every tensor along the head dim lives in shared memory as two ``[rows, 128]`` halves, each
its own TMA copy, and every wgmma operand is in shared memory (so GPU interpret mode, which
multiplies shared-memory operands only, runs the kernel as it is).

What lowering for sm90 takes (checked on the CPU): a wgmma needs one swizzle for both of
its operands and a contraction dim that is a multiple of the swizzle's width. The exchange's
rows hold 32 elements, so its buffers use the 64-byte swizzle (tiles of 8 x 32), and so must
K, the B operand of ``dS_u · K`` with a contraction of 32 keys (a 64-byte dS against the
128-byte K of the other kernels is refused), and therefore Q, K's partner in ``Q·Kᵀ``. dO
and V meet only each other (``dO·Vᵀ``) and keep the 128-byte swizzle of
:func:`~magi_jax.pallas.common.smem` (half as many TMA boxes a copy). A dS exchange of
64 keys in 128-byte tiles, each warpgroup storing 32 of its columns, is refused too (a slice
of a tiled buffer must cover whole tiles).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from magi_jax.pallas.bwd_common import (
    LAYOUT,
    ROW,
    drain,
    exp2_minus,
    log2_scores,
)
from magi_jax.pallas.common import (
    COMPUTE_WGS,
    ItemField,
    check_smem,
    item_fields,
    launch_grid,
    launch_kernel,
    mask_scores,
    smem,
    smem64,
    wide_halves,
)
from magi_jax.pallas.tuning import WideDqConfig
from magi_jax.planning.work_list import FWD_BLOCK_K, FWD_BLOCK_Q

__all__ = ["ffa_dq_wide"]

# Query rows of a program (half a q-tile), keys of a step (half a key tile), and the keys of
# a step whose scores one warpgroup computes.
_ROWS = FWD_BLOCK_Q // 2
_STEP_KEYS = FWD_BLOCK_K // 2
_COLS = _STEP_KEYS // COMPUTE_WGS


def _two_sums(shape, pairs_a, pairs_b):
    """``(Σ a·b over pairs_a, Σ a·b over pairs_b)`` in float32 registers: every wgmma issued
    back to back, one wait."""

    def body(a_ref, b_ref):
        for acc, pairs in ((a_ref, pairs_a), (b_ref, pairs_b)):
            for a, b in pairs:
                plgpu.wgmma(acc, a, b)
        return a_ref[...], b_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def ffa_dq_wide(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse2: jax.Array,
    delta: jax.Array,
    order: jax.Array,
    offsets: jax.Array,
    items: jax.Array,
    cfg: WideDqConfig,
) -> jax.Array:
    """dQ at D = 256 (or Dqk/Dv = 192/128, 256/128: :func:`~magi_jax.pallas.common.wide_halves`):
    the inputs and output of :func:`~magi_jax.pallas.ffa_bwd.ffa_dq`. q ``[B, Tq, Hq, Dqk]``,
    dout ``[B, Tq, Hq, Dv]``, k ``[B, Tk, Hkv, Dqk]``, v ``[B, Tk, Hkv, Dv]``,
    ``lse2``/``delta [B, Hq, Tq]`` float32, the forward work list. One program per (64-row
    half of a q-tile, batch, query head). Returns dq like q."""
    b, tq, hq, d = q.shape
    dv = v.shape[-1]
    if k.shape[-1] != d or dout.shape[-1] != dv:
        raise ValueError(
            f"the wide dQ kernel takes q, k of one head dim and v, dout of one; got q "
            f"{q.shape}, k {k.shape}, v {v.shape}, dout {dout.shape}"
        )
    # The head-dim halves of Q, K and of dO, V: each consumer loads one of each.
    qk_half, v_half = wide_halves(d, dv)
    hkv = k.shape[2]
    group = hq // hkv
    num_tiles = tq // FWD_BLOCK_Q
    assert order.shape == (num_tiles,)
    dtype, stages, halves = q.dtype, cfg.num_stages, COMPUTE_WGS
    per_tile = FWD_BLOCK_Q // _ROWS  # programs of a q-tile
    sub = FWD_BLOCK_K // _STEP_KEYS  # steps of an item
    # Program t of the tile axis is half t % 2 of q-tile order[t // 2]: the two halves of a
    # tile launch together, heaviest tile first, head-major as in ffa_dq.
    grid, grid_names = launch_grid(per_tile * num_tiles, b, hq)

    def kernel(
        q_ref,
        k_ref,
        v_ref,
        do_ref,
        lse_ref,
        delta_ref,
        order_ref,
        off_ref,
        items_ref,
        dq_ref,
        *refs,
    ):
        buf = dict(zip(scratch, refs, strict=True))
        q_smem, do_smem, stat_smem = buf["q"], buf["do"], buf["stats"]
        k_smem, v_smem, ex_smem = buf["k"], buf["v"], buf["ex"]
        in_ready, ex_ready = buf["in_ready"], buf["ex_ready"]
        k_ready, v_ready, k_free, v_free = (
            buf["k_ready"],
            buf["v_ready"],
            buf["k_free"],
            buf["v_free"],
        )
        wg = lax.axis_index("wg")
        t = lax.axis_index("tile")
        tile = order_ref[lax.div(t, jnp.int32(per_tile))]
        row0 = tile * FWD_BLOCK_Q + lax.rem(t, jnp.int32(per_tile)) * _ROWS
        rows = pl.ds(row0, _ROWS)
        batch = lax.axis_index("batch")
        head = lax.axis_index("head")
        first = off_ref[tile]
        num_steps = (off_ref[tile + 1] - first) * sub

        def step_keys(i):
            """Step ``i``'s work item and first key: half ``i % 2`` of item ``i // 2``."""
            it = first + lax.div(i, jnp.int32(sub))
            return it, (
                items_ref[it, ItemField.OTHER_TILE] * FWD_BLOCK_K
                + lax.rem(i, jnp.int32(sub)) * _STEP_KEYS
            )

        def half(ref, idx, h, width):  # head-dim half h of ref[idx] (a [B, T, H, D] array)
            return ref.at[(*idx, pl.ds(h * width, width))]

        @pl.when(wg < COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(cfg.registers[0], action="increase")
            # Both warpgroups multiply both halves of Q and dO: each loads its own half of
            # them, and its own copy of the rows' lse2 and delta, onto one barrier.
            plgpu.copy_gmem_to_smem(
                half(q_ref, (batch, rows, head), wg, qk_half), q_smem.at[wg], in_ready
            )
            plgpu.copy_gmem_to_smem(
                half(do_ref, (batch, rows, head), wg, v_half), do_smem.at[wg], in_ready
            )
            plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], stat_smem.at[wg, 0], in_ready)
            plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], stat_smem.at[wg, 1], in_ready)
            plgpu.barrier_wait(in_ready)
            lse2 = plgpu.load(stat_smem.at[wg, 0], layout=ROW)
            delta = plgpu.load(stat_smem.at[wg, 1], layout=ROW)
            other = 1 - wg
            my_keys, other_keys = pl.ds(wg * _COLS, _COLS), pl.ds(other * _COLS, _COLS)

            def run(dq_acc):
                def step(i, carry):
                    slot = lax.rem(i, jnp.int32(stages))
                    it, key0 = step_keys(i)
                    _, geom, kind = item_fields(items_ref, it)
                    plgpu.barrier_wait(k_ready.at[slot])
                    plgpu.barrier_wait(v_ready.at[slot])
                    # S = Q·Kᵀ and dP = dO·Vᵀ of this warpgroup's 32 keys, each summed over
                    # the two head-dim halves.
                    s, dp = _two_sums(
                        (_ROWS, _COLS),
                        [(q_smem.at[h], k_smem.at[slot, h, my_keys].T) for h in range(halves)],
                        [(do_smem.at[h], v_smem.at[slot, h, my_keys].T) for h in range(halves)],
                    )
                    plgpu.barrier_arrive(v_free.at[slot])
                    s, c, dcap = log2_scores(s, cfg.scale, cfg.softcap)

                    s = mask_scores(s, geom, kind, row0, key0 + wg * _COLS, LAYOUT)
                    p = exp2_minus(s, c, lse2, 0)
                    ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
                    if dcap is not None:
                        ds = ds * dcap
                    # The exchange: buffer i % 2, this warpgroup's writer slot. Its last
                    # readers were both warpgroups' dQ wgmmas of step i − 2; the other
                    # warpgroup waited for those (wgmma_wait) before it arrived at step
                    # i − 1's ex_ready, which this warpgroup has passed. So one rendezvous a
                    # step suffices, and a warpgroup is never more than one step ahead.
                    ex = ex_smem.at[lax.rem(i, jnp.int32(2))]
                    ex[wg] = ds.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(ex_ready)
                    # dQ[:, half wg] += dS · K[:, half wg], this warpgroup's own 32 keys first
                    # (its dS is in shared memory already), the other's once it is there.
                    plgpu.wgmma(dq_acc, ex.at[wg], k_smem.at[slot, wg, my_keys])
                    plgpu.barrier_wait(ex_ready)
                    plgpu.wgmma(dq_acc, ex.at[other], k_smem.at[slot, wg, other_keys])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(k_free.at[slot])
                    return carry

                lax.fori_loop(0, num_steps, step, 0)
                return dq_acc[...]

            dq = pl.run_scoped(run, plgpu.ACC((_ROWS, qk_half), jnp.float32))
            # dQ leaves through this warpgroup's Q half. Q is read only by the S products;
            # the other warpgroup waited for its last one before it arrived at the last
            # ex_ready, which this warpgroup has passed (with no step, nothing reads Q).
            out = q_smem.at[wg]
            out[...] = (dq * cfg.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out, half(dq_ref, (batch, rows, head), wg, qk_half))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(cfg.registers[1], action="decrease")
            # V first: its slot is freed a whole dQ product before K's.
            streams = [
                (v_ref, v_smem, v_ready, v_free, v_half),
                (k_ref, k_smem, k_ready, k_free, qk_half),
            ]
            kv_head = lax.div(head, jnp.int32(group))

            # As bwd_common.stream, but a slot takes two copies (its head-dim halves) on one
            # ready barrier, after one wait for the slot to be freed.
            @pl.loop(0, num_steps)
            def _(i):
                slot = lax.rem(i, jnp.int32(stages))
                keys = pl.ds(step_keys(i)[1], _STEP_KEYS)
                for gmem, ring, ready, free, width in streams:

                    @pl.when(i >= stages)
                    def _():
                        plgpu.barrier_wait(free.at[slot])

                    for h in range(halves):
                        plgpu.copy_gmem_to_smem(
                            half(gmem, (batch, keys, kv_head), h, width),
                            ring.at[slot, h],
                            ready.at[slot],
                        )

            drain(num_steps, stages, [s[:4] for s in streams])

    # Shared memory by name, allocated in this order. bf16, D = 256, 2 stages: Q, dO 32 KiB
    # each, lse/delta 1 KiB, the K/V ring 2 x 32 KiB per stage, the dS exchange 2 x 8 KiB:
    # 209 KiB (3 stages: 273 KiB, too much). Dqk/Dv = 192/128: 137 KiB (3 stages: 177).
    scratch = dict(
        q=smem64((halves, _ROWS, qk_half), dtype),  # by head-dim half
        do=smem((halves, _ROWS, v_half), dtype),
        stats=plgpu.SMEM((COMPUTE_WGS, 2, _ROWS), jnp.float32),  # each consumer's lse, delta
        k=smem64((stages, halves, _STEP_KEYS, qk_half), dtype),
        v=smem((stages, halves, _STEP_KEYS, v_half), dtype),
        ex=smem64((2, COMPUTE_WGS, _ROWS, _COLS), dtype),  # dS by step parity, writer
        # Q, dO halves and lse, delta of each consumer.
        in_ready=plgpu.Barrier(num_arrivals=4 * COMPUTE_WGS),
        k_ready=plgpu.Barrier(num_arrivals=halves, num_barriers=stages),
        v_ready=plgpu.Barrier(num_arrivals=halves, num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        ex_ready=plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # both dS blocks written
    )
    check_smem(
        "wide dQ",
        list(scratch.values()),
        stages_knob="dq_num_stages",
        stages=stages,
        d=d,
        dtype=dtype,
        dv=dv,
    )
    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    return launch_kernel(kernel, out_type, scratch, grid, grid_names, cfg.interpret)(
        q, k, v, dout, lse2, delta, order, offsets, items
    )
