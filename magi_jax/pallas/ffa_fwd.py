"""FFA forward as a Mosaic GPU kernel (Hopper, sm90), over a q-tile work list.

One program per (q-tile of 128 rows, batch, query head), launched heaviest tile first.
Warp specialised in the style of FlashAttention-3: a producer warpgroup streams the K/V
tiles of the program's work items through a ring of shared-memory slots with TMA, and two
consumer warpgroups (64 query rows each) run ``wgmma`` for ``S = Q·Kᵀ`` and ``O += P·V``
with the online softmax in float32 between them. Each warpgroup issues an item's Q·Kᵀ
together with the previous item's P·V, which runs under the item's softmax, and the two
warpgroups take turns issuing, so one's softmax also overlaps the other's matmuls. The mask
predicate is evaluated only on boundary items, from the slice geometry the item carries (one
range check per cell where only the diagonal bounds cut the tile,
:func:`~magi_jax.pallas.common.mask_scores`).

At D = 64 the exponentials, not the matmuls, bound an item (the ``ex2`` unit makes 16 a clock
per SM), so part of each score block is exponentiated on the FMA pipes instead
(``FwdConfig.fma_exp_cols``, :func:`~magi_jax.pallas.common.exp2_cols`).

Above D = 128 (192 and 256) a ring slot holds half a key tile (64 keys: two slots of
128 x 256 would not fit beside Q), and each work item is walked as two steps; everything else
is the same kernel.

V may have a head dim ``Dv`` of its own (multi-head latent attention): ``S = Q·Kᵀ``
contracts over the query/key head dim ``Dqk``, which alone sets the key tile, and the output
is ``[rows, Dv]``. It then leaves through a buffer of its own (with ``Dv = Dqk`` through Q's
buffer, unless persistent).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from magi_jax.pallas.common import (
    COMPUTE_WGS,
    LN2,
    LOG2E,
    MAX_NARROW_D,
    ItemField,
    check_fma_cols,
    check_smem,
    exp2_cols,
    item_geometry,
    kernel_grid,
    launch_kernel,
    mask_scores,
    mma_lhs,
    scheduled_units,
    smem,
)
from magi_jax.pallas.tuning import FwdConfig
from magi_jax.planning.work_list import FULL, FWD_BLOCK_K, FWD_BLOCK_Q

__all__ = ["ffa_forward"]

_WG_ROWS = FWD_BLOCK_Q // COMPUTE_WGS


def ffa_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    order: jax.Array,
    offsets: jax.Array,
    items: jax.Array,
    cfg: FwdConfig,
    schedule: tuple = (),
) -> tuple[jax.Array, ...]:
    """q ``[B, Tq, Hq, Dqk]``, k ``[B, Tk, Hkv, Dqk]``, v ``[B, Tk, Hkv, Dv]`` (Tq, Tk
    multiples of 128; bf16/fp16), plan arrays of the forward work list; with
    ``cfg.persistent``, ``schedule`` is the ``(offsets, units)`` pair of
    :func:`magi_jax.planning.work_list.persistent_schedule` for ``B·Hq`` groups. Returns
    ``out [B, Tq, Hq, Dv]`` and ``lse [B, Hq, Tq]`` float32 (natural
    log; ``-inf`` for rows that see no key); with ``cfg.row_max`` also ``row_max [B, Hq, Tq]``
    float32, each row's largest ``scale·q·k`` over its allowed cells (``-inf`` where none)."""
    b, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    dv = v.shape[-1]
    group = hq // hkv
    num_tiles = tq // FWD_BLOCK_Q
    assert tq % FWD_BLOCK_Q == 0 and tk % FWD_BLOCK_K == 0, (tq, tk)
    assert order.shape == (num_tiles,), (order.shape, num_tiles)
    dtype = q.dtype
    bq, stages = _WG_ROWS, cfg.num_stages
    # Key rows per ring slot: a whole key tile of the work list, or where Q/K's head dim is
    # above MAX_NARROW_D half of one (K/V slots of 128 x 256 would leave no room for two of
    # them beside Q), each item then walked as two steps.
    bk = FWD_BLOCK_K if d <= MAX_NARROW_D else FWD_BLOCK_K // 2
    sub = FWD_BLOCK_K // bk
    check_fma_cols(cfg.fma_exp_cols, bk, f"the forward's score blocks at D={d}")
    softcap = cfg.softcap
    # A unit is one (q-tile, batch, head); persistent programs walk those of their schedule.
    persistent = cfg.persistent > 0
    grid, grid_names, schedule = kernel_grid(cfg.persistent, num_tiles, b, hq, schedule)
    # Scores are kept in the log2 domain: s2 = S·log2(e), so exp2 needs one FMA.
    s2_scale = cfg.scale * LOG2E if not softcap else cfg.scale / softcap
    last_item = items.shape[0] - 1
    # With a softcap and row_max the running max m is of the raw scores S·scale/softcap;
    # the softmax's max is then its capped image (-inf stays -inf).
    raw_m = bool(softcap) and cfg.row_max

    def capped(m):
        return jnp.where(m == -jnp.inf, -jnp.inf, jnp.tanh(m) * (softcap * LOG2E))

    def kernel(q_ref, k_ref, v_ref, order_ref, off_ref, items_ref, *refs):
        sched_refs, refs = refs[: len(schedule)], refs[len(schedule) :]
        out_ref, lse_ref, *refs = refs
        row_max_ref = refs.pop(0) if cfg.row_max else None
        buf = dict(zip(scratch, refs, strict=True))
        q_smem, k_smem, v_smem, lse_smem = buf["q"], buf["k"], buf["v"], buf["lse"]
        q_ready, k_ready, v_ready = buf["q_ready"], buf["k_ready"], buf["v_ready"]
        k_free, v_free, turn = buf["k_free"], buf["v_free"], buf["turn"]
        o_smem = buf.get("o", q_smem)
        p_stage, row_max_smem = buf.get("p_stage"), buf.get("row_max")
        wg = lax.axis_index("wg")
        if persistent:
            num_mine, unit_coords = scheduled_units(sched_refs, num_tiles, b, order_ref)

        # A warpgroup issues its wgmmas when it holds the turn and hands it on right after,
        # so the two warpgroups' matmuls alternate without one waiting for the other's
        # softmax.
        def take_turn():
            plgpu.barrier_wait(turn.at[wg])

        def pass_turn():
            plgpu.barrier_arrive(turn.at[1 - wg])

        def slot_of(g):
            return lax.rem(g, jnp.int32(stages))

        def item_of(first, i):
            """The work item of a unit's step ``i`` (``sub`` steps per item)."""
            return first + i if sub == 1 else first + lax.div(i, jnp.int32(sub))

        def key_row(it, i):
            """The first key row of step ``i``, on item ``it``."""
            row = items_ref[it, ItemField.OTHER_TILE] * FWD_BLOCK_K
            return row if sub == 1 else row + lax.rem(i, jnp.int32(sub)) * bk

        def coords(j):
            """(q-tile, batch, head) of this program's ``j``-th unit."""
            if not persistent:
                return (
                    order_ref[lax.axis_index("tile")],
                    lax.axis_index("batch"),
                    lax.axis_index("head"),
                )
            return unit_coords(j)

        def for_units(body):
            """Runs ``body(j, tile, batch, head, base) -> base`` over this program's units;
            ``base`` counts the steps walked before, so the ring's slots and barrier phases
            carry on across units. Returns the program's step count."""
            if not persistent:
                # base: a Python 0 (a captured array constant does not lower inside loops).
                return body(0, *coords(0), 0)
            return lax.fori_loop(
                0, num_mine, lambda j, base: body(j, *coords(j), base), jnp.int32(0)
            )

        @pl.when(wg < COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(232, action="increase")
            my_q = q_smem.at[wg]
            layout = plgpu.Layout.WGMMA
            row_layout = plgpu.Layout.WGMMA.reduce(1)

            my_o = o_smem.at[wg]

            def load_q(j):
                tile, batch, head = coords(j)
                plgpu.copy_gmem_to_smem(
                    q_ref.at[batch, pl.ds(tile * FWD_BLOCK_Q + wg * bq, bq), head],
                    my_q,
                    q_ready.at[wg],
                )

            def prefetch_q(j, when):
                """Loads the next unit's Q (persistent mode) once this one's is read."""
                if persistent:
                    pl.when(when & (j + 1 < num_mine))(lambda: load_q(j + 1))

            if persistent:
                pl.when(num_mine > 0)(lambda: load_q(0))
            pl.when(wg == 1)(pass_turn)  # the first turn is warpgroup 0's

            def unit(j, tile, batch, head, base):
                first = off_ref[tile]
                num_steps = (off_ref[tile + 1] - first) * sub
                row0 = tile * FWD_BLOCK_Q + wg * bq
                if not persistent:
                    load_q(j)
                plgpu.barrier_wait(q_ready.at[wg])
                m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
                l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
                acc = plgpu.layout_cast(jnp.zeros((bq, dv), jnp.float32), layout)

                def softmax(s, m_i, l_i, i, masked):
                    """Scores of item ``i`` to ``(P, alpha, m, l)``: the item's probabilities
                    (float32), the factor that moves the running output to the new row
                    maxima, and the running maxima and sums."""
                    exp_scale = None  # the scale still to apply inside exp2

                    def mask(s):
                        if not masked:
                            return s
                        it = item_of(first, i)
                        geom, kind = item_geometry(items_ref, it), items_ref[it, ItemField.KIND]
                        return mask_scores(s, geom, kind, row0, key_row(it, i), layout)

                    if raw_m:
                        # Masked before the tanh, so the raw row max sees allowed cells only;
                        # tanh(-inf) is finite, hence the select.
                        s = mask(s * s2_scale)
                        m_new = jnp.maximum(m_i, s.max(axis=1))
                        cap = jnp.tanh(s) * (softcap * LOG2E)
                        s = jnp.where(s == -jnp.inf, -jnp.inf, cap) if masked else cap
                        m_prev, m_cur = capped(m_i), capped(m_new)
                    else:
                        if softcap:
                            s = jnp.tanh(s * s2_scale) * (softcap * LOG2E)
                        else:  # scaled inside the exponent: exp2(s·c − m), one FMA a score
                            exp_scale = s2_scale
                        s = mask(s)
                        row_max = s.max(axis=1)
                        m_new = jnp.maximum(
                            m_i, row_max if exp_scale is None else row_max * exp_scale
                        )
                        m_prev, m_cur = m_i, m_new
                    # Rows with no cell yet keep m = -inf; use 0 there so exp2 gives 0, not NaN.
                    m_use = jnp.where(m_cur == -jnp.inf, 0.0, m_cur)
                    alpha = jnp.exp2(m_prev - m_use)
                    m_b = lax.broadcast_in_dim(m_use, s.shape, [0])
                    p = exp2_cols(
                        s - m_b if exp_scale is None else s * exp_scale - m_b, cfg.fma_exp_cols
                    )
                    return p, alpha, m_new, l_i * alpha + p.sum(axis=1)

                def rescale(acc, alpha):
                    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                # wgmma accumulates P·V into the rescaled output registers (pl.run_state);
                # GPU interpret mode cannot run that, so there P·V lands in a fresh
                # accumulator that is then added.
                fused = not cfg.interpret

                def pv_prev(o_ref, p_prev, i):
                    """Issues ``o_ref += P·V`` of item ``i − 1`` (its P in registers)."""
                    prev = slot_of(base + i - 1)
                    plgpu.barrier_wait(v_ready.at[prev])
                    mma_lhs(
                        o_ref, p_prev, v_smem.at[prev], None if p_stage is None else p_stage.at[wg]
                    )

                def pv_last(o_ref, p_last, i):
                    """The P·V of the unit's last item ``i − 1``, in this warpgroup's turn."""
                    take_turn()
                    pv_prev(o_ref, p_last, i)
                    pass_turn()

                def overlapped(o_ref, carry, i, masked):
                    """Item ``i`` with the P·V of item ``i − 1`` (when ``i > 0``) issued
                    right after its Q·Kᵀ, running under this item's softmax; ``o_ref``
                    accumulates that P·V. Returns ``(P, alpha, m, l)`` of item ``i`` (P in
                    float32)."""
                    m_i, l_i, p_prev = carry
                    slot = slot_of(base + i)
                    plgpu.barrier_wait(k_ready.at[slot])

                    def qk(s_ref):
                        take_turn()
                        plgpu.wgmma(s_ref, my_q, k_smem.at[slot].T)
                        if o_ref is not None:
                            pv_prev(o_ref, p_prev, i)
                        pass_turn()
                        # Waits for the Q·Kᵀ only; the P·V stays in flight.
                        return plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if o_ref is None else 1)

                    s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    prefetch_q(j, i == num_steps - 1)
                    return softmax(s, m_i, l_i, i, masked)

                def overlapped_step(i, carry, masked):
                    """Item ``i >= 1`` of the intra-warpgroup overlapped loop; the carry is
                    ``(acc, m, l, P of item i − 1)``, ``acc`` already rescaled for it.

                    This item's P is narrowed to the input dtype only once the previous P·V
                    is done: that wgmma reads the previous P's registers until then, and
                    ptxas serialises every wgmma of the kernel if they are written earlier
                    (measured on the H200: 20-30 % slower)."""
                    acc, *rest = carry
                    if fused:

                        def body(refs):
                            o_ref, m_ref, l_ref, p_ref = refs
                            p, alpha, m_new, l_new = overlapped(
                                o_ref, (m_ref[...], l_ref[...], p_ref[...]), i, masked
                            )
                            o, p = lax.optimization_barrier((o_ref[...], p))
                            o_ref[...] = rescale(o, alpha)
                            m_ref[...], l_ref[...], p_ref[...] = m_new, l_new, p.astype(dtype)

                        acc, m_new, l_new, p16 = pl.run_state(body)((plgpu.ACC.init(acc), *rest))
                    else:

                        def body(o_ref):
                            return (*overlapped(o_ref, rest, i, masked), o_ref[...])

                        p, alpha, m_new, l_new, o = pl.run_scoped(
                            body, plgpu.ACC((bq, dv), jnp.float32)
                        )
                        acc, p16 = rescale(acc + o, alpha), p.astype(dtype)
                    plgpu.barrier_arrive(v_free.at[slot_of(base + i - 1)])
                    return acc, m_new, l_new, p16

                # The plan puts a tile's FULL items first: they run in a loop without the
                # predicate's code (in a loop with it, full 16k ran 5 % slower), the rest
                # after.
                def walk(start, carry, step_fn):
                    """Items ``start..`` through ``step_fn(i, carry, masked)``."""

                    def more_full(c):
                        it = jnp.minimum(item_of(first, c[0]), last_item)
                        return (c[0] < num_steps) & (items_ref[it, ItemField.KIND] == FULL)

                    split, *carry = lax.while_loop(
                        more_full,
                        lambda c: (c[0] + 1, *step_fn(c[0], c[1:], False)),
                        (start, *carry),
                    )
                    return lax.fori_loop(
                        split, num_steps, lambda i, c: step_fn(i, c, True), tuple(carry)
                    )

                # Item 0 alone (any kind), then items 1.. with the previous item's P·V under
                # each softmax, then the last item's P·V. p0 only gives the P of the carry
                # its shape before item 0 (it is never multiplied).
                p0 = plgpu.layout_cast(jnp.zeros((bq, bk), dtype), layout)

                def first_item(i, c):
                    p, _, m_new, l_new = overlapped(None, c[1:], i, True)
                    return c[0], m_new, l_new, p.astype(dtype)

                carry = lax.fori_loop(0, jnp.minimum(num_steps, 1), first_item, (acc, m_i, l_i, p0))
                carry = walk(jnp.minimum(num_steps, 1), carry, overlapped_step)

                def last_pv(i, c):
                    acc, m_i, l_i, p_last = c
                    if fused:
                        acc = pl.run_state(lambda o_ref: pv_last(o_ref, p_last, i))(
                            plgpu.ACC.init(acc)
                        )
                    else:

                        def body(o_ref):
                            pv_last(o_ref, p_last, i)
                            return o_ref[...]

                        acc = acc + pl.run_scoped(body, plgpu.ACC((bq, dv), jnp.float32))
                    plgpu.barrier_arrive(v_free.at[slot_of(base + i - 1)])
                    return acc, m_i, l_i, p_last

                acc, m_i, l_i, _ = lax.fori_loop(
                    num_steps, num_steps + jnp.minimum(num_steps, 1), last_pv, tuple(carry)
                )
                prefetch_q(j, num_steps == 0)
                seen = l_i > 0
                inv = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
                acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
                m_lse = capped(m_i) if raw_m else m_i
                lse = jnp.where(seen, (m_lse + jnp.log2(jnp.where(seen, l_i, 1.0))) * LN2, -jnp.inf)
                if persistent:
                    # The previous unit's stores must have read my_o and lse_smem out.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                my_o[...] = acc.astype(dtype)
                lse_smem[wg] = lse
                if cfg.row_max:
                    # m back to logits: it is S·scale/softcap (raw_m) or S·scale·log2(e).
                    row_max_smem[wg] = m_i * (softcap if raw_m else LN2)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(my_o, out_ref.at[batch, pl.ds(row0, bq), head])
                plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(row0, bq)])
                if cfg.row_max:
                    plgpu.copy_smem_to_gmem(
                        row_max_smem.at[wg], row_max_ref.at[batch, head, pl.ds(row0, bq)]
                    )
                return base + num_steps

            for_units(unit)
            pl.when(wg == 0)(take_turn)  # observe the last turn passed back
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(40, action="decrease")

            def unit(j, tile, batch, head, base):
                del j
                first = off_ref[tile]
                num_steps = (off_ref[tile + 1] - first) * sub
                kv_head = lax.div(head, jnp.int32(group))

                @pl.loop(0, num_steps)
                def _(i):
                    g = base + i
                    slot = slot_of(g)
                    src = (batch, pl.ds(key_row(item_of(first, i), i), bk), kv_head)

                    @pl.when(g >= stages)
                    def _():
                        plgpu.barrier_wait(k_free.at[slot])

                    plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_ready.at[slot])

                    @pl.when(g >= stages)
                    def _():
                        plgpu.barrier_wait(v_free.at[slot])

                    plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_ready.at[slot])

                return base + num_steps

            total = for_units(unit)

            # Drain: observe the release of the last slots, so every barrier phase is seen
            # before the shared memory is given back.
            @pl.loop(lax.max(total - stages, jnp.int32(0)), total)
            def _(g):
                slot = slot_of(g)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

    out_shape = (
        jax.ShapeDtypeStruct((b, tq, hq, dv), dtype),
        jax.ShapeDtypeStruct((b, hq, tq), jnp.float32),
    )
    if cfg.row_max:
        out_shape += (jax.ShapeDtypeStruct((b, hq, tq), jnp.float32),)
    # Shared memory by name, allocated in this order.
    scratch = dict(
        q=smem((COMPUTE_WGS, bq, d), dtype),  # each consumer's Q
        k=smem((stages, bk, d), dtype),  # the K/V ring
        v=smem((stages, bk, dv), dtype),
        lse=plgpu.SMEM((COMPUTE_WGS, bq), jnp.float32),  # the lse on its way out
        q_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        k_ready=plgpu.Barrier(num_barriers=stages),
        v_ready=plgpu.Barrier(num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        turn=plgpu.Barrier(num_barriers=COMPUTE_WGS),  # whose turn to issue wgmmas
    )
    # Persistent: each consumer's output leaves through a buffer of its own, and so does an
    # output of another head dim than Q's; otherwise it leaves through its Q buffer.
    out_scratch = dict(o=smem((COMPUTE_WGS, bq, dv), dtype)) if persistent else {}
    if dv != d and not persistent:
        scratch["o"] = smem((COMPUTE_WGS, bq, dv), dtype)
    row_max_scratch = (
        dict(row_max=plgpu.SMEM((COMPUTE_WGS, bq), jnp.float32)) if cfg.row_max else {}
    )
    check_smem(
        "forward",
        [*scratch.values(), *row_max_scratch.values()],
        list(out_scratch.values()),
        stages_knob="num_stages",
        stages=stages,
        persistent_knob="persistent",
        persistent=cfg.persistent,
        d=d,
        dtype=dtype,
        dv=dv,
    )
    scratch |= out_scratch
    if cfg.interpret:  # P through shared memory (mma_lhs)
        scratch["p_stage"] = smem((COMPUTE_WGS, bq, bk), dtype)
    scratch |= row_max_scratch
    # The row reductions of the WGMMA layout stay inside a warp, so they need none of the
    # cross-warp reduction scratch Mosaic GPU reserves by default (2 KiB); without it
    # num_stages=3 fits at D = 128.
    call = launch_kernel(
        kernel, out_shape, scratch, grid, grid_names, cfg.interpret, reduction_scratch=False
    )
    return call(q, k, v, order, offsets, items, *schedule)
