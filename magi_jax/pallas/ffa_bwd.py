"""FFA backward as Mosaic GPU kernels (Hopper, sm90), over the same work lists.

* ``delta = rowsum(out · dout) − dlse`` is a fused XLA reduction in :mod:`magi_jax.pallas`
  (memory bound; the lse cotangent enters here exactly as in :mod:`magi_jax.ffa.xla`).
* dQ: one program per (q-tile of 128 rows, batch, query head) walks the q-tile's key tiles
  (the forward work list); a producer warpgroup streams K/V, two consumer warpgroups of 64
  rows recompute ``P`` from the saved lse and accumulate ``dQ += dS·K`` in float32.
* dK/dV: one program per (k-tile of 128 keys, batch, key head) walks the query tiles of
  64 rows that see it, for every query head of the GQA group, so ``dK``/``dV`` of a key head
  are summed in float32 registers and written once (no atomics, no second reduction).

Persistent mode (``BwdConfig.persistent = N``): N programs walk these units in a static
schedule instead (the host's :func:`~magi_jax.planning.work_list.persistent_schedule`), so one
unit's prologue (its own inputs) and epilogue (the output store) hide under its neighbours'
work.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from magi_jax.pallas.common import (LOG2E, check_pipeline, check_smem, kernel_grid,
                                    mask_scores, mma_lhs, scheduled_units, smem)
from magi_jax.planning.work_list import DKV_BLOCK_K, DKV_BLOCK_Q, FWD_BLOCK_K, FWD_BLOCK_Q

__all__ = ["BwdConfig", "ffa_dq", "ffa_dkv"]

_COMPUTE_WGS = 2
# ffa_dkv's split: a multiple of the rows one warpgroup stores.
DKV_SPLIT_ALIGN = DKV_BLOCK_K // _COMPUTE_WGS
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
    head_major: bool = False    # see magi_jax.pallas.common.launch_grid (persistent: unused)
    # 0: one program per unit — (q-tile, batch, query head) for dQ, (k-tile, batch, key
    # head) for dK/dV — in the order of launch_grid. N > 0: min(N, units) programs (the SM
    # count, 132 on an H200) walk the units of the host schedule the kernels take as their
    # ``schedule`` argument. Across units the producer's ring runs on (one drain at
    # the end), each consumer loads its next unit's own inputs (dQ: Q, dO, lse, delta;
    # dK/dV: its K, V) as soon as the last wgmma pair that reads them is done, and outputs
    # leave through buffers of their own, so the store of one unit overlaps the next.
    # Slower than one program per unit on the H200 (benchmarks/results/kernel/kernel_notes.md): off.
    persistent: int = 0
    # Registers per thread of a consumer and of the producer warpgroup after the split
    # (setmaxnreg; multiples of 8, 2·consumer + producer <= 504 for 3 warpgroups).
    registers: tuple[int, int] = (232, 40)
    interpret: bool = False

    def __post_init__(self):
        check_pipeline(self.num_stages, self.persistent)
        consumer, producer = self.registers
        if (consumer % 8 or producer % 8 or not 24 <= producer <= consumer <= 256
                or 2 * consumer + producer > 504):
            raise ValueError(f"registers={self.registers}: need multiples of 8 with "
                             "24 <= producer <= consumer <= 256 and 2·consumer + producer "
                             "<= 504")


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


def _stream(num_steps, stages, start_of, streams, view, base=None):
    """Producer loop: step ``i`` copies, for every ``(gmem, smem, ready, free)`` stream, the
    block starting at ``start_of(i)`` into slot ``g % stages`` (``g = base + i``, the ring's
    running step count; ``base=None``: the ring's only walk, ``g = i``) once the consumers
    freed it. With ``base=None`` it then drains the ring (:func:`_drain`); otherwise the
    caller drains once after its last walk."""
    @pl.loop(0, num_steps)
    def _(i):
        g = i if base is None else base + i
        slot = lax.rem(g, jnp.int32(stages))
        start = start_of(i)
        for gmem, buf, ready, free in streams:
            @pl.when(g >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])

            plgpu.copy_gmem_to_smem(view(gmem, start), buf.at[slot], ready.at[slot])

    if base is None:
        _drain(num_steps, stages, streams)


def _drain(total, stages, streams):
    """Waits for the last slots of a ring of ``total`` steps to be freed, so every barrier
    phase is observed before the shared memory is given back."""
    @pl.loop(lax.max(total - stages, jnp.int32(0)), total)
    def _(i):
        slot = lax.rem(i, jnp.int32(stages))
        for _, _, _, free in streams:
            plgpu.barrier_wait(free.at[slot])


def _walk_units(num_mine, work_of, body):
    """Persistent programs: ``body(j, work_of(j), base) -> base`` over this program's units
    ``j < num_mine``, ``base`` counting the ring steps of the units before (so slots and
    barrier phases carry on). Returns the program's total ring steps."""
    return lax.fori_loop(0, num_mine, lambda j, base: body(j, work_of(j), base),
                         jnp.int32(0))


def _item_step(items_ref, it, i, base, stages, ready):
    """Step ``i`` of a ring walk on item ``it``: its slot, after waiting for the slot's
    ``ready`` barriers, and the item's (other tile, slice geometry, mask kind)."""
    slot = lax.rem(i if base is None else base + i, jnp.int32(stages))
    other, geom, kind = (items_ref[it, 0], tuple(items_ref[it, f] for f in range(1, 7)),
                         items_ref[it, 7])
    for barrier in ready:
        plgpu.barrier_wait(barrier.at[slot])
    return slot, other, geom, kind


def _two_products(a, b, c, e, shape):
    """``(a·b, c·e)`` in float32 registers: two wgmmas issued back to back, one wait."""
    def body(ab_ref, ce_ref):
        plgpu.wgmma(ab_ref, a, b)
        plgpu.wgmma(ce_ref, c, e)
        return ab_ref[...], ce_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def _consume_units(num_mine, load_unit, work_of, unit):
    """A persistent consumer: loads its first unit's inputs, walks its units, and waits for
    its last stores."""
    pl.when(num_mine > 0)(lambda: load_unit(0))
    _walk_units(num_mine, work_of, unit)
    plgpu.wait_smem_to_gmem(0)


def _store_outputs(outs, persistent):
    """Writes a unit's ``(smem buffer, value, gmem destination)`` outputs through shared
    memory; a destination may be a function storing the buffer. Persistent: the buffers are
    the kernel's own, so only the previous unit's stores must have read them and this unit's
    stores run on under the next unit; otherwise the buffers are the unit's inputs and the
    stores complete here."""
    if persistent:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for buf, value, _ in outs:
        buf[...] = value
    plgpu.commit_smem()
    for buf, _, dst in outs:
        if callable(dst):
            dst(buf)
        else:
            plgpu.copy_smem_to_gmem(buf, dst)
    if not persistent:
        plgpu.wait_smem_to_gmem(0)


def ffa_dq(q, k, v, dout, lse2, delta, order, offsets, items, cfg: BwdConfig, schedule=()):
    """dQ. q/dout ``[B, Tq, Hq, D]``, k/v ``[B, Tk, Hkv, D]``; ``lse2 [B, Hq, Tq]`` float32
    is the lse times log2(e) with ``+inf`` on rows that see no key (so P = 0 there);
    ``delta [B, Hq, Tq]`` float32; the forward work list. With ``cfg.persistent``,
    ``schedule`` is the ``(offsets, units)`` of
    :func:`magi_jax.planning.work_list.persistent_schedule` for ``B·Hq`` groups. Returns dq like
    q."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    num_tiles = tq // FWD_BLOCK_Q
    assert order.shape == (num_tiles,)
    dtype = q.dtype
    bq, bk, stages = FWD_BLOCK_Q // _COMPUTE_WGS, FWD_BLOCK_K, cfg.num_stages
    persistent = cfg.persistent > 0
    grid, grid_names, schedule = kernel_grid(cfg.persistent, cfg.head_major, num_tiles, b,
                                             hq, schedule)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, order_ref, off_ref, items_ref,
               *refs):
        sched_refs, refs = refs[:len(schedule)], refs[len(schedule):]
        (dq_ref, q_smem, do_smem, stat_smem, k_smem, v_smem, in_ready, k_ready, v_ready,
         k_free, v_free, *extra) = refs
        dq_smem = extra[0] if persistent else None
        stage = extra[1:] if persistent else extra
        wg = lax.axis_index("wg")
        if persistent:
            num_mine, coords = scheduled_units(sched_refs, num_tiles, b, order_ref)

            def work_of(j):
                tile, batch, head = coords(j)
                first = off_ref[tile]
                return tile, batch, head, first, off_ref[tile + 1] - first
        else:
            tile = order_ref[lax.axis_index("tile")]
            batch = lax.axis_index("batch")
            head = lax.axis_index("head")
            first = off_ref[tile]
            num_items = off_ref[tile + 1] - first
            only_unit = (tile, batch, head, first, num_items)

        @pl.when(wg < _COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(cfg.registers[0], action="increase")
            my_q, my_do = q_smem.at[wg], do_smem.at[wg]
            ready = in_ready.at[wg]
            my_stage = stage[0].at[wg] if stage else None

            def load_inputs(rows, batch, head):
                plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], my_q, ready)
                plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], my_do, ready)
                plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], stat_smem.at[wg, 0],
                                        ready)
                plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], stat_smem.at[wg, 1],
                                        ready)

            def load_unit(j):
                tile, batch, head = coords(j)
                load_inputs(pl.ds(tile * FWD_BLOCK_Q + wg * bq, bq), batch, head)

            def prefetch(j, when):
                """Loads unit ``j + 1``'s inputs where ``when`` says unit ``j`` is done with
                them (Q, dO in shared memory; lse, delta are in registers by then)."""
                @pl.when(when & (j + 1 < num_mine))
                def _():
                    # lse/delta were read by generic loads; the TMA writes through the async
                    # proxy, so fence the two before it overwrites them.
                    plgpu.commit_smem()
                    load_unit(j + 1)

            def unit(j, work, base):
                tile, batch, head, first, num_items = work
                row0 = tile * FWD_BLOCK_Q + wg * bq
                rows = pl.ds(row0, bq)
                if not persistent:
                    load_inputs(rows, batch, head)
                plgpu.barrier_wait(ready)
                lse2 = plgpu.load(stat_smem.at[wg, 0], layout=_ROW)
                delta = plgpu.load(stat_smem.at[wg, 1], layout=_ROW)
                if persistent:   # a unit without items is done with its inputs here
                    prefetch(j, num_items == 0)

                def run(dq_acc):
                    def step(i, carry):
                        slot, ktile, geom, kind = _item_step(items_ref, first + i, i, base,
                                                             stages, (k_ready, v_ready))
                        # S = Q·Kᵀ and dP = dO·Vᵀ.
                        s, dp = _two_products(my_q, k_smem.at[slot].T, my_do,
                                              v_smem.at[slot].T, (bq, bk))
                        plgpu.barrier_arrive(v_free.at[slot])
                        if persistent:   # Q, dO are read only by those two, now complete
                            prefetch(j, i == num_items - 1)
                        s, c, dcap = _log2_scores(s, cfg)

                        s = mask_scores(s, geom, kind, row0, ktile * bk, _LAYOUT)
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
                out = dq_smem.at[wg] if persistent else my_q
                _store_outputs([(out, (dq * cfg.scale).astype(dtype),
                                 dq_ref.at[batch, rows, head])], persistent)
                return base + num_items if persistent else None

            if persistent:
                _consume_units(num_mine, load_unit, work_of, unit)
            else:
                unit(0, only_unit, None)

        @pl.when(wg == _COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(cfg.registers[1], action="decrease")
            streams = [(k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free)]

            def unit(j, work, base):
                del j
                tile, batch, head, first, num_items = work
                kv_head = lax.div(head, jnp.int32(group))
                _stream(num_items, stages, lambda i: items_ref[first + i, 0] * bk, streams,
                        lambda ref, start: ref.at[batch, pl.ds(start, bk), kv_head], base)
                return None if base is None else base + num_items

            if persistent:
                _drain(_walk_units(num_mine, work_of, unit), stages, streams)
            else:
                unit(0, only_unit, None)

    # Shared memory at D = 128, bf16, 2 stages: Q, dO 2 x 16 KiB each, lse/delta 1 KiB, the
    # K/V ring 2 x 32 KiB per stage: 193 KiB (3 stages: 257 KiB, too much); persistent adds
    # the dQ output buffer, 32 KiB: 225 KiB of the 227.
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
    out_scratch = [smem((_COMPUTE_WGS, bq, d), dtype)] if persistent else []
    check_smem("dQ", scratch, out_scratch, stages_knob="dq_num_stages", stages=stages,
               persistent_knob="bwd_persistent", persistent=cfg.persistent, d=d, dtype=dtype)
    scratch += out_scratch
    if cfg.interpret:
        scratch.append(smem((_COMPUTE_WGS, bq, bk), dtype))
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(q.shape, dtype), scratch_types=scratch,
        grid=grid, grid_names=grid_names,
        num_threads=_COMPUTE_WGS + 1, thread_name="wg", **_params(cfg),
    )(q, k, v, dout, lse2, delta, order, offsets, items, *schedule)


def ffa_dkv(q, k, v, dout, lse2, delta, order, offsets, items, cfg: BwdConfig, schedule=(),
            split: int = 0):
    """dK, dV. Same inputs as :func:`ffa_dq` but the dK/dV work list (k-tiles of 128 keys,
    q-steps of 64 rows) and a ``schedule`` for ``B·Hkv`` groups. Returns ``(dk, dv)`` like
    k; with ``split`` (a multiple of :data:`DKV_SPLIT_ALIGN` inside k's rows),
    ``(dk[:, :split], dv[:, :split], dk[:, split:], dv[:, split:])`` as four arrays, each
    tile stored straight into its part (context parallelism sums the first part in place)."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1:3]
    group = hq // hkv
    num_tiles = tk // DKV_BLOCK_K
    assert order.shape == (num_tiles,)
    assert split % DKV_SPLIT_ALIGN == 0 and 0 <= split < tk, (split, tk)
    dtype = q.dtype
    bq, bk, stages = DKV_BLOCK_Q, DKV_BLOCK_K // _COMPUTE_WGS, cfg.num_stages
    persistent = cfg.persistent > 0
    grid, grid_names, schedule = kernel_grid(cfg.persistent, cfg.head_major, num_tiles, b,
                                             hkv, schedule)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, order_ref, off_ref, items_ref,
               *refs):
        sched_refs, refs = refs[:len(schedule)], refs[len(schedule):]
        outs, refs = refs[:4 if split else 2], refs[4 if split else 2:]
        (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, q_ready, do_ready,
         lse_ready, delta_ready, q_free, do_free, lse_free, delta_free, *extra) = refs
        dk_smem, dv_smem = extra[:2] if persistent else (None, None)
        stage = extra[2:] if persistent else extra
        wg = lax.axis_index("wg")
        if persistent:
            num_mine, coords = scheduled_units(sched_refs, num_tiles, b, order_ref)

            def work_of(j):
                tile, batch, kv_head = coords(j)
                first = off_ref[tile]
                num_items = off_ref[tile + 1] - first
                return tile, batch, kv_head, first, num_items, num_items * group
        else:
            tile = order_ref[lax.axis_index("tile")]
            batch = lax.axis_index("batch")
            kv_head = lax.axis_index("head")
            first = off_ref[tile]
            num_items = off_ref[tile + 1] - first
            num_steps = num_items * group
            only_unit = (tile, batch, kv_head, first, num_items, num_steps)

        def step_item(work, i):   # step i: query head (i // num_items) of the group, item i % n
            _, _, kv_head, first, num_items, _ = work
            return first + lax.rem(i, num_items), kv_head * group + lax.div(i, num_items)

        @pl.when(wg < _COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(cfg.registers[0], action="increase")
            my_k, my_v = k_smem.at[wg], v_smem.at[wg]
            stages_ = (stage[0].at[wg, 0], stage[0].at[wg, 1]) if stage else (None, None)

            def load_kv(cols, batch, kv_head):
                plgpu.copy_gmem_to_smem(k_ref.at[batch, cols, kv_head], my_k, kv_ready.at[wg])
                plgpu.copy_gmem_to_smem(v_ref.at[batch, cols, kv_head], my_v, kv_ready.at[wg])

            def load_unit(j):
                tile, batch, kv_head = coords(j)
                load_kv(pl.ds(tile * DKV_BLOCK_K + wg * bk, bk), batch, kv_head)

            def prefetch(j, when):
                """Loads unit ``j + 1``'s K/V where ``when`` says unit ``j`` is done with
                them."""
                pl.when(when & (j + 1 < num_mine))(lambda: load_unit(j + 1))

            def unit(j, work, base):
                tile, batch, kv_head, _, _, num_steps = work
                col0 = tile * DKV_BLOCK_K + wg * bk
                cols = pl.ds(col0, bk)
                if not persistent:
                    load_kv(cols, batch, kv_head)
                plgpu.barrier_wait(kv_ready.at[wg])
                if persistent:   # a unit without steps is done with its K/V here
                    prefetch(j, num_steps == 0)

                def run(dk_acc, dv_acc):
                    def step(i, carry):
                        slot, qtile, geom, kind = _item_step(
                            items_ref, step_item(work, i)[0], i, base, stages,
                            (q_ready, do_ready))
                        # Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ.
                        st, dpt = _two_products(my_k, q_smem.at[slot].T, my_v,
                                                do_smem.at[slot].T, (bk, bq))
                        if persistent:   # K, V are read only by those two, now complete
                            prefetch(j, i == num_steps - 1)
                        st, c, dcap = _log2_scores(st, cfg)

                        st = mask_scores(st, geom, kind, qtile * bq, col0, _LAYOUT,
                                         transposed=True)
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
                out_k, out_v = (dk_smem.at[wg], dv_smem.at[wg]) if persistent else (my_k, my_v)

                def dst(l):   # where output l (0: dK, 1: dV) takes these rows
                    if not split:
                        return outs[l].at[batch, cols, kv_head]

                    def store(buf):
                        first, rest = outs[l], outs[2 + l]
                        pl.when(col0 < split)(lambda: plgpu.copy_smem_to_gmem(
                            buf, first.at[batch, cols, kv_head]))
                        pl.when(col0 >= split)(lambda: plgpu.copy_smem_to_gmem(
                            buf, rest.at[batch, pl.ds(col0 - split, bk), kv_head]))
                    return store

                _store_outputs([(out_k, (dk * cfg.scale).astype(dtype), dst(0)),
                                (out_v, dv.astype(dtype), dst(1))], persistent)
                return base + num_steps if persistent else None

            if persistent:
                _consume_units(num_mine, load_unit, work_of, unit)
            else:
                unit(0, only_unit, None)

        @pl.when(wg == _COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(cfg.registers[1], action="decrease")
            streams = [(q_ref, q_smem, q_ready, q_free), (do_ref, do_smem, do_ready, do_free),
                       (lse_ref, lse_smem, lse_ready, lse_free),
                       (delta_ref, delta_smem, delta_ready, delta_free)]

            def unit(j, work, base):
                del j
                batch, num_steps = work[1], work[5]

                def start_of(i):
                    it, head = step_item(work, i)
                    return items_ref[it, 0] * bq, head

                def view(ref, start):
                    row, head = start
                    if ref.ndim == 4:
                        return ref.at[batch, pl.ds(row, bq), head]
                    return ref.at[batch, head, pl.ds(row, bq)]

                _stream(num_steps, stages, start_of, streams, view, base)
                return None if base is None else base + num_steps

            if persistent:
                _drain(_walk_units(num_mine, work_of, unit), stages, streams)
            else:
                unit(0, only_unit, None)

    # Shared memory at D = 128, bf16: K, V 2 x 16 KiB each, the Q/dO ring 2 x 16 KiB per
    # stage, lse/delta 1 KiB each: 130 KiB with 2 stages, 162 KiB with 3; persistent adds
    # the dK and dV output buffers, 64 KiB: 194 KiB, and 226 KiB (of 227) with 3 stages.
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
    out_scratch = [smem((_COMPUTE_WGS, bk, d), dtype) for _ in range(2 if persistent else 0)]
    check_smem("dK/dV", scratch, out_scratch, stages_knob="dkv_num_stages", stages=stages,
               persistent_knob="bwd_persistent", persistent=cfg.persistent, d=d, dtype=dtype)
    scratch += out_scratch
    if cfg.interpret:
        scratch.append(smem((_COMPUTE_WGS, 2, bk, bq), dtype))
    kv = lambda rows: jax.ShapeDtypeStruct((b, rows, hkv, d), dtype)
    out_type = (kv(split), kv(split), kv(tk - split), kv(tk - split)) if split else (kv(tk),
                                                                                       kv(tk))
    return plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=grid_names,
        num_threads=_COMPUTE_WGS + 1, thread_name="wg", **_params(cfg),
    )(q, k, v, dout, lse2, delta, order, offsets, items, *schedule)
