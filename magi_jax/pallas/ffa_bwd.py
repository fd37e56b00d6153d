"""FFA backward as Mosaic GPU kernels (Hopper, sm90), over the same work lists.

* ``delta = rowsum(out · dout) − dlse`` is a fused XLA reduction in :mod:`magi_jax.pallas`
  (memory bound; the lse cotangent enters here exactly as in :mod:`magi_jax.ffa.xla`).
* dQ: one program per (q-tile of 128 rows, batch, query head) walks the q-tile's key tiles
  (the forward work list); a producer warpgroup streams K/V, two consumer warpgroups of 64
  rows recompute ``P`` from the saved lse and accumulate ``dQ += dS·K`` in float32.
* dK/dV: one program per (k-tile of 128 keys, batch, key head) walks the query tiles of
  64 rows that see it, for every query head of the GQA group, so ``dK``/``dV`` of a key head
  are summed in float32 registers and written once (no atomics, no second reduction).
  With ``steps_per_wait=2`` (D = 64) a consumer takes two query blocks between waits: four
  score products in flight, then four gradient products. With ``turns`` (the D = 128
  default with one program per unit) the two consumers issue their products in turns, one
  warpgroup's matmuls running under the other's softmax.

The dK/dV kernel's persistent mode (``DkvConfig.persistent = N``): N programs walk its units
in a static schedule instead (the host's
:func:`~magi_jax.planning.work_list.persistent_schedule`), so one unit's prologue (its own K,
V) and epilogue (the output store) hide under its neighbours' work. dQ has no persistent
mode: it measured slower than one program per unit on every mask (H200, 2026-11-30,
benchmarks/results/kernel/LATEST.md).

Both kernels scale inside the exponent (``exp2(s·c − lse)``, one FMA per score) and launch
their grid head-major (:func:`~magi_jax.pallas.common.launch_grid`).

V, dO and the output may have a head dim ``Dv`` of their own (multi-head latent attention):
``dP = dO·Vᵀ`` contracts over it and ``dV`` is ``[keys, Dv]``, while ``S = Q·Kᵀ``, ``dQ``
and ``dK`` are ``Dqk`` wide. Every buffer takes the width of the tensor it holds, so each
output still leaves through the buffer of its own input (dQ through Q, dK through K, dV
through V).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from magi_jax.pallas.bwd_common import (
    COL,
    DKV_SPLIT_ALIGN,
    LAYOUT,
    ROW,
    dkv_out_type,
    drain,
    exp2_minus,
    log2_scores,
    store_outputs,
    stream,
)
from magi_jax.pallas.common import (
    COMPUTE_WGS,
    ItemField,
    check_smem,
    item_fields,
    kernel_grid,
    launch_grid,
    launch_kernel,
    mask_scores,
    mma_lhs,
    scheduled_units,
    smem,
)
from magi_jax.pallas.tuning import DkvConfig, DqConfig
from magi_jax.planning.work_list import DKV_BLOCK_K, DKV_BLOCK_Q, FWD_BLOCK_K, FWD_BLOCK_Q

__all__ = ["ffa_dq", "ffa_dkv"]


class _DkvUnit(NamedTuple):
    """A unit of the dK/dV kernel: k-tile ``tile`` of key head ``kv_head`` in ``batch``, whose
    items are ``items[first:first + num_items]``; it walks them once per query head of the
    GQA group, ``num_steps`` steps in all."""

    tile: Any
    batch: Any
    kv_head: Any
    first: Any
    num_items: Any
    num_steps: Any


def _walk_units(num_mine, work_of, body):
    """Persistent programs: ``body(j, work_of(j), base) -> base`` over this program's units
    ``j < num_mine``, ``base`` counting the ring steps of the units before (so slots and
    barrier phases carry on). Returns the program's total ring steps."""
    return lax.fori_loop(0, num_mine, lambda j, base: body(j, work_of(j), base), jnp.int32(0))


def _item_step(items_ref, it, i, base, stages, ready):
    """Step ``i`` of a ring walk on item ``it``: its slot, after waiting for the slot's
    ``ready`` barriers, and the item's (other tile, slice geometry, mask kind)."""
    slot = lax.rem(i if base is None else base + i, jnp.int32(stages))
    other, geom, kind = item_fields(items_ref, it)
    for barrier in ready:
        plgpu.barrier_wait(barrier.at[slot])
    return slot, other, geom, kind


class _Turns(NamedTuple):
    """The issue token of two consumer warpgroups: ``take`` waits for this warpgroup's turn,
    ``give`` hands it to the other. Without the barriers both do nothing."""

    take: Any
    give: Any


def _turns(barrier, wg):
    """:class:`_Turns` over ``barrier`` (one per consumer), or no-ops for ``None``."""
    if barrier is None:
        return _Turns(lambda: None, lambda: None)
    return _Turns(
        lambda: plgpu.barrier_wait(barrier.at[wg]), lambda: plgpu.barrier_arrive(barrier.at[1 - wg])
    )


def _issue(turns, body):
    """Runs ``body`` (wgmma issues) in this warpgroup's turn."""
    turns.take()
    body()
    turns.give()


def _products(pairs, shape, turns=None):
    """``[a·b for a, b in pairs]`` in float32 registers: the wgmmas issued back to back (in
    this warpgroup's turn, with ``turns``), one wait."""

    def body(*refs):
        def issue():
            for ref, (a, b) in zip(refs, pairs):
                plgpu.wgmma(ref, a, b)

        _issue(turns or _turns(None, None), issue)
        return tuple(ref[...] for ref in refs)

    return pl.run_scoped(body, *(plgpu.ACC(shape, jnp.float32) for _ in pairs))


def _consume_units(num_mine, load_unit, work_of, unit):
    """A persistent consumer: loads its first unit's inputs, walks its units, and waits for
    its last stores."""
    pl.when(num_mine > 0)(lambda: load_unit(0))
    _walk_units(num_mine, work_of, unit)
    plgpu.wait_smem_to_gmem(0)


def ffa_dq(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse2: jax.Array,
    delta: jax.Array,
    order: jax.Array,
    offsets: jax.Array,
    items: jax.Array,
    cfg: DqConfig,
) -> jax.Array:
    """dQ. q ``[B, Tq, Hq, Dqk]``, dout ``[B, Tq, Hq, Dv]``, k ``[B, Tk, Hkv, Dqk]``, v
    ``[B, Tk, Hkv, Dv]``; ``lse2 [B, Hq, Tq]`` float32
    is the lse times log2(e) with ``+inf`` on rows that see no key (so P = 0 there);
    ``delta [B, Hq, Tq]`` float32; the forward work list. One program per (q-tile, batch,
    query head). Returns dq like q."""
    b, tq, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    group = hq // hkv
    num_tiles = tq // FWD_BLOCK_Q
    assert order.shape == (num_tiles,)
    dtype = q.dtype
    bq, bk, stages = FWD_BLOCK_Q // COMPUTE_WGS, FWD_BLOCK_K, cfg.num_stages
    grid, grid_names = launch_grid(num_tiles, b, hq)

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
        k_smem, v_smem, in_ready = buf["k"], buf["v"], buf["in_ready"]
        k_ready, v_ready, k_free, v_free = (
            buf["k_ready"],
            buf["v_ready"],
            buf["k_free"],
            buf["v_free"],
        )
        p_stage = buf.get("p_stage")
        wg = lax.axis_index("wg")
        tile = order_ref[lax.axis_index("tile")]
        batch = lax.axis_index("batch")
        head = lax.axis_index("head")
        first = off_ref[tile]
        num_items = off_ref[tile + 1] - first

        @pl.when(wg < COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(cfg.registers[0], action="increase")
            my_q, my_do = q_smem.at[wg], do_smem.at[wg]
            ready = in_ready.at[wg]
            my_stage = None if p_stage is None else p_stage.at[wg]
            row0 = tile * FWD_BLOCK_Q + wg * bq
            rows = pl.ds(row0, bq)
            plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], my_q, ready)
            plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], my_do, ready)
            plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], stat_smem.at[wg, 0], ready)
            plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], stat_smem.at[wg, 1], ready)
            plgpu.barrier_wait(ready)
            lse2 = plgpu.load(stat_smem.at[wg, 0], layout=ROW)
            delta = plgpu.load(stat_smem.at[wg, 1], layout=ROW)

            def run(dq_acc):
                def step(i, carry):
                    slot, ktile, geom, kind = _item_step(
                        items_ref, first + i, i, None, stages, (k_ready, v_ready)
                    )
                    # S = Q·Kᵀ and dP = dO·Vᵀ.
                    s, dp = _products(
                        [(my_q, k_smem.at[slot].T), (my_do, v_smem.at[slot].T)], (bq, bk)
                    )
                    plgpu.barrier_arrive(v_free.at[slot])
                    s, c, dcap = log2_scores(s, cfg.scale, cfg.softcap)

                    s = mask_scores(s, geom, kind, row0, ktile * bk, LAYOUT)
                    p = exp2_minus(s, c, lse2, 0)
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
            # dQ leaves through the Q buffer, which no wgmma reads any more.
            store_outputs(
                [(my_q, (dq * cfg.scale).astype(dtype), dq_ref.at[batch, rows, head])],
                persistent=False,
            )

        @pl.when(wg == COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(cfg.registers[1], action="decrease")
            streams = [(k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free)]
            kv_head = lax.div(head, jnp.int32(group))
            stream(
                num_items,
                stages,
                lambda i: items_ref[first + i, ItemField.OTHER_TILE] * bk,
                streams,
                lambda ref, start: ref.at[batch, pl.ds(start, bk), kv_head],
            )

    # Shared memory by name, allocated in this order. At D = 128, bf16, 2 stages: Q, dO
    # 2 x 16 KiB each, lse/delta 1 KiB, the K/V ring 2 x 32 KiB per stage: 193 KiB (3
    # stages: 257 KiB, too much).
    scratch = dict(
        q=smem((COMPUTE_WGS, bq, d), dtype),
        do=smem((COMPUTE_WGS, bq, dv), dtype),
        stats=plgpu.SMEM((COMPUTE_WGS, 2, bq), jnp.float32),  # each consumer's lse, delta
        k=smem((stages, bk, d), dtype),
        v=smem((stages, bk, dv), dtype),
        in_ready=plgpu.Barrier(num_arrivals=4, num_barriers=COMPUTE_WGS),  # Q, dO, lse, delta
        k_ready=plgpu.Barrier(num_barriers=stages),
        v_ready=plgpu.Barrier(num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
    )
    check_smem(
        "dQ",
        list(scratch.values()),
        stages_knob="dq_num_stages",
        stages=stages,
        d=d,
        dtype=dtype,
        dv=dv,
    )
    if cfg.interpret:  # dS through shared memory (mma_lhs)
        scratch["p_stage"] = smem((COMPUTE_WGS, bq, bk), dtype)
    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    return launch_kernel(kernel, out_type, scratch, grid, grid_names, cfg.interpret)(
        q, k, v, dout, lse2, delta, order, offsets, items
    )


def ffa_dkv(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse2: jax.Array,
    delta: jax.Array,
    order: jax.Array,
    offsets: jax.Array,
    items: jax.Array,
    cfg: DkvConfig,
    schedule: tuple = (),
    split: int = 0,
) -> tuple[jax.Array, ...]:
    """dK, dV. Same inputs as :func:`ffa_dq` but the dK/dV work list (k-tiles of 128 keys,
    q-steps of 64 rows) and a ``schedule`` for ``B·Hkv`` groups. Returns ``(dk, dv)``, dk
    like k and dv like v; with ``split`` (a multiple of :data:`DKV_SPLIT_ALIGN` inside k's rows),
    ``(dk[:, :split], dv[:, :split], dk[:, split:], dv[:, split:])`` as four arrays, each
    tile stored straight into its part (context parallelism sums the first part in place)."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1:3]
    dv = v.shape[-1]
    group = hq // hkv
    num_tiles = tk // DKV_BLOCK_K
    assert order.shape == (num_tiles,)
    assert split % DKV_SPLIT_ALIGN == 0 and 0 <= split < tk, (split, tk)
    dtype = q.dtype
    bq, bk, stages = DKV_BLOCK_Q, DKV_BLOCK_K // COMPUTE_WGS, cfg.num_stages
    if cfg.steps_per_wait > 1 and (max(d, dv) > 64 or stages < 2 * cfg.steps_per_wait):
        raise ValueError(
            f"dkv_steps_per_wait={cfg.steps_per_wait} needs D <= 64 and "
            f"dkv_num_stages >= {2 * cfg.steps_per_wait}; got D={max(d, dv)}, "
            f"dkv_num_stages={stages}"
        )
    persistent = cfg.persistent > 0
    grid, grid_names, schedule = kernel_grid(cfg.persistent, num_tiles, b, hkv, schedule)

    def kernel(
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, order_ref, off_ref, items_ref, *refs
    ):
        sched_refs, refs = refs[: len(schedule)], refs[len(schedule) :]
        outs, refs = refs[: 4 if split else 2], refs[4 if split else 2 :]
        buf = dict(zip(scratch, refs, strict=True))
        k_smem, v_smem, kv_ready = buf["k"], buf["v"], buf["kv_ready"]
        q_smem, do_smem, lse_smem, delta_smem = buf["q"], buf["do"], buf["lse"], buf["delta"]
        q_ready, do_ready, lse_ready, delta_ready = (
            buf["q_ready"],
            buf["do_ready"],
            buf["lse_ready"],
            buf["delta_ready"],
        )
        q_free, do_free, lse_free, delta_free = (
            buf["q_free"],
            buf["do_free"],
            buf["lse_free"],
            buf["delta_free"],
        )
        dk_smem, dv_smem, p_stage = buf.get("dk"), buf.get("dv"), buf.get("p_stage")
        wg = lax.axis_index("wg")
        turns = _turns(buf.get("turn"), wg)
        if persistent:
            num_mine, coords = scheduled_units(sched_refs, num_tiles, b, order_ref)

            def work_of(j):
                tile, batch, kv_head = coords(j)
                first = off_ref[tile]
                num_items = off_ref[tile + 1] - first
                return _DkvUnit(tile, batch, kv_head, first, num_items, num_items * group)
        else:
            tile = order_ref[lax.axis_index("tile")]
            batch = lax.axis_index("batch")
            kv_head = lax.axis_index("head")
            first = off_ref[tile]
            num_items = off_ref[tile + 1] - first
            num_steps = num_items * group
            only_unit = _DkvUnit(tile, batch, kv_head, first, num_items, num_steps)

        def step_item(work, i):  # step i: query head (i // num_items) of the group, item i % n
            return (
                work.first + lax.rem(i, work.num_items),
                work.kv_head * group + lax.div(i, work.num_items),
            )

        @pl.when(wg < COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(cfg.registers[0], action="increase")
            pl.when(wg == 1)(turns.give)  # the first turn is warpgroup 0's
            my_k, my_v = k_smem.at[wg], v_smem.at[wg]
            stages_ = (None, None) if p_stage is None else (p_stage.at[wg, 0], p_stage.at[wg, 1])

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
                tile, batch, kv_head, num_steps = (
                    work.tile,
                    work.batch,
                    work.kv_head,
                    work.num_steps,
                )
                col0 = tile * DKV_BLOCK_K + wg * bk
                cols = pl.ds(col0, bk)
                if not persistent:
                    load_kv(cols, batch, kv_head)
                plgpu.barrier_wait(kv_ready.at[wg])
                if persistent:  # a unit without steps is done with its K/V here
                    prefetch(j, num_steps == 0)

                def run(dk_acc, dv_acc):
                    def steps(i0, n):
                        """Ring steps ``i0 .. i0 + n − 1``: their Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ
                        in flight together, then their dV += Pᵀ·dO and dK += dSᵀ·Q, one wait
                        each."""
                        at = [
                            _item_step(
                                items_ref,
                                step_item(work, i0 + t)[0],
                                i0 + t,
                                base,
                                stages,
                                (q_ready, do_ready),
                            )
                            for t in range(n)
                        ]
                        prods = _products(
                            [
                                pair
                                for slot, *_ in at
                                for pair in ((my_k, q_smem.at[slot].T), (my_v, do_smem.at[slot].T))
                            ],
                            (bk, bq),
                            turns,
                        )
                        if persistent:  # K, V are read only by those, now complete
                            prefetch(j, i0 + n == num_steps)
                        grads = []
                        for t, (slot, qtile, geom, kind) in enumerate(at):
                            st, c, dcap = log2_scores(prods[2 * t], cfg.scale, cfg.softcap)
                            dpt = prods[2 * t + 1]
                            st = mask_scores(
                                st, geom, kind, qtile * bq, col0, LAYOUT, transposed=True
                            )
                            plgpu.barrier_wait(lse_ready.at[slot])
                            lse2 = plgpu.load(lse_smem.at[slot], layout=COL)
                            plgpu.barrier_arrive(lse_free.at[slot])
                            plgpu.barrier_wait(delta_ready.at[slot])
                            delta = plgpu.load(delta_smem.at[slot], layout=COL)
                            plgpu.barrier_arrive(delta_free.at[slot])
                            pt = exp2_minus(st, c, lse2, 1)
                            dst = pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))
                            if dcap is not None:
                                dst = dst * dcap
                            grads.append((pt.astype(dtype), dst.astype(dtype)))

                        def issue():  # every dV/dK product in flight before the one wait
                            for (slot, *_), (pt, dst) in zip(at, grads):
                                mma_lhs(dv_acc, pt, do_smem.at[slot], stages_[0])
                                mma_lhs(dk_acc, dst, q_smem.at[slot], stages_[1])

                        _issue(turns, issue)
                        plgpu.wgmma_wait(0)
                        for slot, *_ in at:
                            plgpu.barrier_arrive(do_free.at[slot])
                            plgpu.barrier_arrive(q_free.at[slot])

                    per_wait = cfg.steps_per_wait

                    @pl.loop(0, lax.div(num_steps, jnp.int32(per_wait)))
                    def _(group):
                        steps(group * per_wait, per_wait)

                    if per_wait > 1:  # an odd step count ends on one step
                        pl.when(lax.rem(num_steps, jnp.int32(per_wait)) == 1)(
                            lambda: steps(num_steps - 1, 1)
                        )
                    return dk_acc[...], dv_acc[...]

                dk, dv_ = pl.run_scoped(
                    run, plgpu.ACC((bk, d), jnp.float32), plgpu.ACC((bk, dv), jnp.float32)
                )
                out_k, out_v = (dk_smem.at[wg], dv_smem.at[wg]) if persistent else (my_k, my_v)

                def dst(l):  # where output l (0: dK, 1: dV) takes these rows
                    if not split:
                        return outs[l].at[batch, cols, kv_head]

                    def store(buf):
                        first, rest = outs[l], outs[2 + l]
                        pl.when(col0 < split)(
                            lambda: plgpu.copy_smem_to_gmem(buf, first.at[batch, cols, kv_head])
                        )
                        pl.when(col0 >= split)(
                            lambda: plgpu.copy_smem_to_gmem(
                                buf, rest.at[batch, pl.ds(col0 - split, bk), kv_head]
                            )
                        )

                    return store

                store_outputs(
                    [
                        (out_k, (dk * cfg.scale).astype(dtype), dst(0)),
                        (out_v, dv_.astype(dtype), dst(1)),
                    ],
                    persistent,
                )
                return base + num_steps if persistent else None

            if persistent:
                _consume_units(num_mine, load_unit, work_of, unit)
            else:
                unit(0, only_unit, None)
            pl.when(wg == 0)(turns.take)  # observe the last turn handed back

        @pl.when(wg == COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(cfg.registers[1], action="decrease")
            streams = [
                (q_ref, q_smem, q_ready, q_free),
                (do_ref, do_smem, do_ready, do_free),
                (lse_ref, lse_smem, lse_ready, lse_free),
                (delta_ref, delta_smem, delta_ready, delta_free),
            ]

            def unit(j, work, base):
                del j
                batch, num_steps = work.batch, work.num_steps

                def start_of(i):
                    it, head = step_item(work, i)
                    return items_ref[it, ItemField.OTHER_TILE] * bq, head

                def view(ref, start):
                    row, head = start
                    if ref.ndim == 4:
                        return ref.at[batch, pl.ds(row, bq), head]
                    return ref.at[batch, head, pl.ds(row, bq)]

                stream(num_steps, stages, start_of, streams, view, base)
                return None if base is None else base + num_steps

            if persistent:
                drain(_walk_units(num_mine, work_of, unit), stages, streams)
            else:
                unit(0, only_unit, None)

    # Shared memory by name, allocated in this order. At D = 128, bf16: K, V 2 x 16 KiB
    # each, the Q/dO ring 2 x 16 KiB per stage, lse/delta 1 KiB each: 130 KiB with 2
    # stages, 162 KiB with 3; persistent adds the dK and dV output buffers, 64 KiB: 194 KiB,
    # and 226 KiB (of 227) with 3 stages.
    per_stage = lambda n=1: plgpu.Barrier(num_arrivals=n, num_barriers=stages)
    scratch = dict(
        k=smem((COMPUTE_WGS, bk, d), dtype),  # each consumer's K and V
        v=smem((COMPUTE_WGS, bk, dv), dtype),
        q=smem((stages, bq, d), dtype),  # the Q/dO/lse/delta ring
        do=smem((stages, bq, dv), dtype),
        lse=plgpu.SMEM((stages, bq), jnp.float32),
        delta=plgpu.SMEM((stages, bq), jnp.float32),
        kv_ready=plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),
        q_ready=per_stage(),
        do_ready=per_stage(),
        lse_ready=per_stage(),
        delta_ready=per_stage(),
        q_free=per_stage(COMPUTE_WGS),
        do_free=per_stage(COMPUTE_WGS),
        lse_free=per_stage(COMPUTE_WGS),
        delta_free=per_stage(COMPUTE_WGS),
    )
    if cfg.turns:
        scratch["turn"] = plgpu.Barrier(num_barriers=COMPUTE_WGS)
    out_scratch = (
        dict(dk=smem((COMPUTE_WGS, bk, d), dtype), dv=smem((COMPUTE_WGS, bk, dv), dtype))
        if persistent
        else {}
    )
    check_smem(
        "dK/dV",
        list(scratch.values()),
        list(out_scratch.values()),
        stages_knob="dkv_num_stages",
        stages=stages,
        persistent_knob="dkv_persistent",
        persistent=cfg.persistent,
        d=d,
        dtype=dtype,
        dv=dv,
    )
    scratch |= out_scratch
    if cfg.interpret:  # Pᵀ and dSᵀ through shared memory (mma_lhs)
        scratch["p_stage"] = smem((COMPUTE_WGS, 2, bk, bq), dtype)
    out_type = dkv_out_type(q, k, v, split)
    return launch_kernel(kernel, out_type, scratch, grid, grid_names, cfg.interpret)(
        q, k, v, dout, lse2, delta, order, offsets, items, *schedule
    )
