"""FFA backward for wide heads (D = 256) as Mosaic GPU kernels (Hopper, sm90).

At D = 256 the kernels of :mod:`magi_jax.pallas.ffa_bwd` do not fit: a warpgroup that owns
64 keys would hold dK and dV of 64 x 256 in float32 (256 registers a thread), and Q, dO of a
128-row tile plus one K/V slot of 128 keys take 256 KiB of shared memory. Here, as in
FlashAttention-3's hdim-256 backward, one program owns 64 rows (dQ: query rows, dK/dV: keys)
and its two consumer warpgroups split the work twice:

* the scores: warpgroup ``w`` computes the 32 columns ``w·32 ..`` of the step's S (dQ: keys;
  dK/dV: the transposed tile's query rows) and of dP, over the whole head dim, and turns
  them into P and dS;
* the gradients: warpgroup ``w`` accumulates the head-dim half ``w`` of the program's
  outputs, ``[64, 128]`` in float32, which needs the whole of P and dS.

The two halves of P / dS meet in a shared-memory exchange buffer: each warpgroup writes its
columns, both wait at ``ex_ready``, both multiply, and ``ex_free`` says both are done reading
before the next step writes again. Every tensor of the head dim lives in shared memory as
two ``[rows, 128]`` halves, each its own TMA copy; every wgmma operand is in shared memory.

The programs walk the forward's / the dK/dV work list like :func:`ffa_dq` /
:func:`ffa_dkv`: a 128-row tile of the list becomes two programs of 64 rows (the mask
predicate cuts the cells of each), and the dQ kernel walks each 128-key item as two steps of
64 keys. No kernel is persistent (its output buffers would not fit).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from magi_jax.pallas.common import (ItemField, check_smem, item_fields, launch_grid,
                                    mask_scores)
from magi_jax.pallas.ffa_bwd import (_COL, _LAYOUT, _ROW, BwdConfig, _drain, _exp2_minus,
                                     _log2_scores, _params, _stream)
from magi_jax.planning.work_list import DKV_BLOCK_K, DKV_BLOCK_Q, FWD_BLOCK_K, FWD_BLOCK_Q

__all__ = ["ffa_dq_wide", "ffa_dkv_wide", "WIDE_ROWS"]

_COMPUTE_WGS = 2
# Rows a program owns (query rows in dQ, keys in dK/dV), and the columns of a step's scores
# each warpgroup computes.
WIDE_ROWS = 64
_COLS = WIDE_ROWS // _COMPUTE_WGS
_HALF = 128   # the head-dim half each warpgroup accumulates


def _halves(d: int) -> int:
    if d % _HALF or d // _HALF != _COMPUTE_WGS:
        raise ValueError(f"the wide backward kernels take D = {_HALF * _COMPUTE_WGS}; got {d}")
    return d // _HALF


def _smem(shape, dtype):
    """Shared memory in tiles of 32 columns with the 64-byte swizzle: the exchange buffers
    have rows of 32 elements, and a wgmma takes both operands in one swizzle (lowering for
    sm90 refuses a 64-byte A with a 128-byte B), so every buffer of these kernels uses it."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, _COLS)),
                                                plgpu.SwizzleTransform(2 * _COLS)))


def _exchange(dtype):
    """One warpgroup's columns of P or dS per writer: ``[writers, 64, 32]``."""
    return _smem((_COMPUTE_WGS, WIDE_ROWS, _COLS), dtype)


def _scores(acc_shape, pairs):
    """``Σ a·b`` over ``pairs`` (one per head-dim half) in float32 registers, one wait."""
    def body(ref):
        for a, b in pairs:
            plgpu.wgmma(ref, a, b)
        return ref[...]

    return pl.run_scoped(body, plgpu.ACC(acc_shape, jnp.float32))


def _two_scores(shape, pairs_a, pairs_b):
    """Two accumulations of :func:`_scores` issued back to back, one wait."""
    def body(ra, rb):
        for a, b in pairs_a:
            plgpu.wgmma(ra, a, b)
        for a, b in pairs_b:
            plgpu.wgmma(rb, a, b)
        return ra[...], rb[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def _share(parts, mine, wg, ex_ready, ex_free, first_step):
    """Writes this warpgroup's ``parts`` (registers) into its writer slot of the exchange
    buffers ``mine`` once the other warpgroup has read the previous step's (``ex_free``; not
    before the first step), then waits until both warpgroups have written (``ex_ready``)."""
    @pl.when(jnp.logical_not(first_step))
    def _():
        plgpu.barrier_wait(ex_free)

    for buf, x in zip(mine, parts, strict=True):
        buf.at[wg][...] = x
    plgpu.commit_smem()
    plgpu.barrier_arrive(ex_ready)
    plgpu.barrier_wait(ex_ready)


def _half_streams(ref, name, buf):
    """Producer streams of the two head-dim halves of ``ref`` into ``buf[name]``: ``((ref,
    h), smem, ready, free)`` with the barriers ``{name}_ready{h}`` / ``{name}_free{h}`` (one
    array of slots per half: the interpreter does not index barriers twice)."""
    return [((ref, h), buf[name].at[h], buf[f"{name}_ready{h}"], buf[f"{name}_free{h}"])
            for h in range(_COMPUTE_WGS)]


def _half_barriers(name, stages):
    """The ready / free barriers of :func:`_half_streams` for ``stages`` slots."""
    out = {}
    for h in range(_COMPUTE_WGS):
        out[f"{name}_ready{h}"] = plgpu.Barrier(num_barriers=stages)
    for h in range(_COMPUTE_WGS):
        out[f"{name}_free{h}"] = plgpu.Barrier(num_arrivals=_COMPUTE_WGS,
                                               num_barriers=stages)
    return out


def ffa_dq_wide(q, k, v, dout, lse2, delta, order, offsets, items, cfg: BwdConfig):
    """dQ at D = 256: the inputs and output of :func:`~magi_jax.pallas.ffa_bwd.ffa_dq`. One
    program per (64-row half of a q-tile, batch, query head)."""
    if cfg.persistent:
        raise ValueError(f"persistent={cfg.persistent}: the dQ kernel runs one program per "
                         "unit; pass a BwdConfig with persistent=0")
    b, tq, hq, d = q.shape
    halves = _halves(d)
    group = hq // k.shape[2]
    num_tiles = tq // FWD_BLOCK_Q
    assert order.shape == (num_tiles,)
    dtype, rows, stages = q.dtype, WIDE_ROWS, cfg.num_stages
    per_tile = FWD_BLOCK_Q // rows          # programs per q-tile
    sub = FWD_BLOCK_K // rows               # steps per key tile
    grid, grid_names = launch_grid(num_tiles * per_tile, b, hq)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, order_ref, off_ref, items_ref,
               dq_ref, *refs):
        buf = dict(zip(scratch, refs, strict=True))
        qs, dos, ks, vs = buf["q"], buf["do"], buf["k"], buf["v"]
        wg = lax.axis_index("wg")
        t = lax.axis_index("tile")
        tile = order_ref[lax.div(t, jnp.int32(per_tile))]
        row0 = tile * FWD_BLOCK_Q + lax.rem(t, jnp.int32(per_tile)) * rows
        batch, head = lax.axis_index("batch"), lax.axis_index("head")
        first = off_ref[tile]
        num_steps = (off_ref[tile + 1] - first) * sub

        def key_row(i):
            it = first + lax.div(i, jnp.int32(sub))
            return it, (items_ref[it, ItemField.OTHER_TILE] * FWD_BLOCK_K
                        + lax.rem(i, jnp.int32(sub)) * rows)

        @pl.when(wg < _COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(cfg.registers[0], action="increase")
            ready = buf["in_ready"]
            # Q, dO (both halves), lse, delta: six copies on one barrier. Both warpgroups
            # need all of them; warpgroup 0 issues, both wait.
            @pl.when(wg == 0)
            def _():
                for h in range(halves):
                    cols = pl.ds(h * _HALF, _HALF)
                    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, rows), head, cols],
                                            qs.at[h], ready)
                    plgpu.copy_gmem_to_smem(do_ref.at[batch, pl.ds(row0, rows), head, cols],
                                            dos.at[h], ready)
                plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, pl.ds(row0, rows)],
                                        buf["stats"].at[0], ready)
                plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, pl.ds(row0, rows)],
                                        buf["stats"].at[1], ready)

            plgpu.barrier_wait(ready)
            lse2 = plgpu.load(buf["stats"].at[0], layout=_ROW)
            delta = plgpu.load(buf["stats"].at[1], layout=_ROW)
            my_cols = pl.ds(wg * _COLS, _COLS)

            def run(dq_acc):
                def step(i, carry):
                    slot = lax.rem(i, jnp.int32(stages))
                    it, col0 = key_row(i)
                    _, geom, kind = item_fields(items_ref, it)
                    for h in range(halves):
                        plgpu.barrier_wait(buf[f"k_ready{h}"].at[slot])
                        plgpu.barrier_wait(buf[f"v_ready{h}"].at[slot])
                    # S and dP of this warpgroup's 32 keys over the whole head dim.
                    s, dp = _two_scores(
                        (rows, _COLS),
                        [(qs.at[h], ks.at[h, slot, my_cols].T) for h in range(halves)],
                        [(dos.at[h], vs.at[h, slot, my_cols].T) for h in range(halves)])
                    for h in range(halves):
                        plgpu.barrier_arrive(buf[f"v_free{h}"].at[slot])
                    s, c, dcap = _log2_scores(s, cfg)
                    s = mask_scores(s, geom, kind, row0, col0 + wg * _COLS, _LAYOUT)
                    p = _exp2_minus(s, c, lse2, 0)
                    ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
                    if dcap is not None:
                        ds = ds * dcap
                    _share([ds.astype(dtype)], [buf["ex_ds"]], wg, buf["ex_ready"],
                           buf["ex_free"], i == 0)
                    # dQ[:, half wg] += dS · K[:, half wg], dS in two 32-key parts.
                    for u in range(_COMPUTE_WGS):
                        plgpu.wgmma(dq_acc, buf["ex_ds"].at[u],
                                    ks.at[wg, slot, pl.ds(u * _COLS, _COLS)])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(buf["ex_free"])
                    for h in range(halves):
                        plgpu.barrier_arrive(buf[f"k_free{h}"].at[slot])
                    return carry

                lax.fori_loop(0, num_steps, step, 0)
                pl.when(num_steps > 0)(lambda: plgpu.barrier_wait(buf["ex_free"]))
                return dq_acc[...]

            dq = pl.run_scoped(run, plgpu.ACC((rows, _HALF), jnp.float32))
            # Q is read only by the S products, all done before the last ex_ready, so this
            # warpgroup's Q half carries its dQ half out.
            out = qs.at[wg]
            out[...] = (dq * cfg.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out, dq_ref.at[batch, pl.ds(row0, rows), head, pl.ds(wg * _HALF, _HALF)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(cfg.registers[1], action="decrease")
            kv_head = lax.div(head, jnp.int32(group))
            streams = _half_streams(k_ref, "k", buf) + _half_streams(v_ref, "v", buf)
            _stream(num_steps, stages, lambda i: key_row(i)[1], streams,
                    lambda src, start: src[0].at[batch, pl.ds(start, rows), kv_head,
                                                 pl.ds(src[1] * _HALF, _HALF)])

    # Shared memory by name, allocated in this order. bf16, 2 stages: Q, dO 2 x 32 KiB,
    # the K/V ring 64 KiB a slot, dS 8 KiB, lse/delta 1 KiB: 201 KiB.
    scratch = dict(
        q=_smem((halves, rows, _HALF), dtype), do=_smem((halves, rows, _HALF), dtype),
        stats=plgpu.SMEM((2, rows), jnp.float32),      # lse2, delta
        k=_smem((halves, stages, rows, _HALF), dtype),   # the K/V ring, by head-dim half
        v=_smem((halves, stages, rows, _HALF), dtype),
        ex_ds=_exchange(dtype),
        in_ready=plgpu.Barrier(num_arrivals=2 * halves + 2),
        **_half_barriers("k", stages), **_half_barriers("v", stages),
        ex_ready=plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
        ex_free=plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
    )
    check_smem("wide dQ", list(scratch.values()), stages_knob="dq_num_stages", stages=stages,
               d=d, dtype=dtype)
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=list(scratch.values()), grid=grid, grid_names=grid_names,
        num_threads=_COMPUTE_WGS + 1, thread_name="wg", **_params(cfg),
    )(q, k, v, dout, lse2, delta, order, offsets, items)


def ffa_dkv_wide(q, k, v, dout, lse2, delta, order, offsets, items, cfg: BwdConfig,
                 schedule=(), split: int = 0):
    """dK, dV at D = 256: the inputs and outputs of
    :func:`~magi_jax.pallas.ffa_bwd.ffa_dkv` (``split`` a multiple of 64). One program per
    (64-key half of a k-tile, batch, key head), walking the tile's query steps once per query
    head of the GQA group."""
    if cfg.persistent or schedule:
        raise ValueError(f"dkv_persistent={cfg.persistent}: at D = 256 the dK/dV kernel runs "
                         "one program per unit (the persistent mode's output buffers do not "
                         "fit); pass dkv_persistent=0")
    b, tq, hq, d = q.shape
    halves = _halves(d)
    tk, hkv = k.shape[1:3]
    group = hq // hkv
    num_tiles = tk // DKV_BLOCK_K
    assert order.shape == (num_tiles,)
    assert split % WIDE_ROWS == 0 and 0 <= split < tk, (split, tk)
    dtype, rows, bq, stages = q.dtype, WIDE_ROWS, DKV_BLOCK_Q, cfg.num_stages
    assert bq == WIDE_ROWS   # the exchange buffers are 64 x 64 in all
    per_tile = DKV_BLOCK_K // rows
    grid, grid_names = launch_grid(num_tiles * per_tile, b, hkv)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, order_ref, off_ref, items_ref,
               *refs):
        outs, refs = refs[:4 if split else 2], refs[4 if split else 2:]
        buf = dict(zip(scratch, refs, strict=True))
        ks, vs, qs, dos = buf["k"], buf["v"], buf["q"], buf["do"]
        wg = lax.axis_index("wg")
        t = lax.axis_index("tile")
        tile = order_ref[lax.div(t, jnp.int32(per_tile))]
        col0 = tile * DKV_BLOCK_K + lax.rem(t, jnp.int32(per_tile)) * rows
        batch, kv_head = lax.axis_index("batch"), lax.axis_index("head")
        first = off_ref[tile]
        num_items = off_ref[tile + 1] - first
        num_steps = num_items * group

        def step_item(i):   # step i: query head (i // num_items) of the group, item i % n
            return first + lax.rem(i, num_items), kv_head * group + lax.div(i, num_items)

        @pl.when(wg < _COMPUTE_WGS)
        def consumer():
            plgpu.set_max_registers(cfg.registers[0], action="increase")
            ready = buf["kv_ready"]

            @pl.when(wg == 0)
            def _():
                for h in range(halves):
                    cols = pl.ds(h * _HALF, _HALF)
                    plgpu.copy_gmem_to_smem(k_ref.at[batch, pl.ds(col0, rows), kv_head, cols],
                                            ks.at[h], ready)
                    plgpu.copy_gmem_to_smem(v_ref.at[batch, pl.ds(col0, rows), kv_head, cols],
                                            vs.at[h], ready)

            plgpu.barrier_wait(ready)
            my_rows = pl.ds(wg * _COLS, _COLS)   # this warpgroup's query rows of a step

            def run(dk_acc, dv_acc):
                def step(i, carry):
                    slot = lax.rem(i, jnp.int32(stages))
                    it, _ = step_item(i)
                    qtile, geom, kind = item_fields(items_ref, it)
                    for h in range(halves):
                        plgpu.barrier_wait(buf[f"q_ready{h}"].at[slot])
                        plgpu.barrier_wait(buf[f"do_ready{h}"].at[slot])
                    # Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ of this warpgroup's 32 query rows.
                    st, dpt = _two_scores(
                        (rows, _COLS),
                        [(ks.at[h], qs.at[h, slot, my_rows].T) for h in range(halves)],
                        [(vs.at[h], dos.at[h, slot, my_rows].T) for h in range(halves)])
                    st, c, dcap = _log2_scores(st, cfg)
                    st = mask_scores(st, geom, kind, qtile * bq + wg * _COLS, col0, _LAYOUT,
                                     transposed=True)
                    plgpu.barrier_wait(buf["lse_ready"].at[slot])
                    lse = plgpu.load(buf["lse"].at[slot, my_rows], layout=_COL)
                    plgpu.barrier_wait(buf["delta_ready"].at[slot])
                    dlt = plgpu.load(buf["delta"].at[slot, my_rows], layout=_COL)
                    plgpu.barrier_arrive(buf["lse_free"].at[slot])
                    plgpu.barrier_arrive(buf["delta_free"].at[slot])
                    pt = _exp2_minus(st, c, lse, 1)
                    dst = pt * (dpt - lax.broadcast_in_dim(dlt, dpt.shape, [1]))
                    if dcap is not None:
                        dst = dst * dcap
                    _share([pt.astype(dtype), dst.astype(dtype)], [buf["ex_p"], buf["ex_ds"]],
                           wg, buf["ex_ready"], buf["ex_free"], i == 0)
                    # dV[:, half wg] += Pᵀ·dO[:, half wg], dK[:, half wg] += dSᵀ·Q[:, half wg],
                    # Pᵀ and dSᵀ in two parts of 32 query rows.
                    for u in range(_COMPUTE_WGS):
                        part = pl.ds(u * _COLS, _COLS)
                        plgpu.wgmma(dv_acc, buf["ex_p"].at[u], dos.at[wg, slot, part])
                        plgpu.wgmma(dk_acc, buf["ex_ds"].at[u], qs.at[wg, slot, part])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(buf["ex_free"])
                    for h in range(halves):
                        plgpu.barrier_arrive(buf[f"q_free{h}"].at[slot])
                        plgpu.barrier_arrive(buf[f"do_free{h}"].at[slot])
                    return carry

                lax.fori_loop(0, num_steps, step, 0)
                pl.when(num_steps > 0)(lambda: plgpu.barrier_wait(buf["ex_free"]))
                return dk_acc[...], dv_acc[...]

            dk, dv = pl.run_scoped(run, plgpu.ACC((rows, _HALF), jnp.float32),
                                   plgpu.ACC((rows, _HALF), jnp.float32))
            # K and V are read only by the Sᵀ/dPᵀ products, all done before the last
            # ex_ready, so this warpgroup's K and V halves carry its dK and dV halves out.
            out_k, out_v = ks.at[wg], vs.at[wg]
            out_k[...] = (dk * cfg.scale).astype(dtype)
            out_v[...] = dv.astype(dtype)
            plgpu.commit_smem()
            half = pl.ds(wg * _HALF, _HALF)
            for l, buf_ in enumerate((out_k, out_v)):
                if not split:
                    plgpu.copy_smem_to_gmem(
                        buf_, outs[l].at[batch, pl.ds(col0, rows), kv_head, half])
                    continue
                head_part, rest = outs[l], outs[2 + l]
                pl.when(col0 < split)(functools.partial(
                    plgpu.copy_smem_to_gmem, buf_,
                    head_part.at[batch, pl.ds(col0, rows), kv_head, half]))
                pl.when(col0 >= split)(functools.partial(
                    plgpu.copy_smem_to_gmem, buf_,
                    rest.at[batch, pl.ds(col0 - split, rows), kv_head, half]))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _COMPUTE_WGS)
        def producer():
            plgpu.set_max_registers(cfg.registers[1], action="decrease")
            streams = (_half_streams(q_ref, "q", buf) + _half_streams(do_ref, "do", buf)
                       + [(lse_ref, buf["lse"], buf["lse_ready"], buf["lse_free"]),
                          (delta_ref, buf["delta"], buf["delta_ready"], buf["delta_free"])])

            def start_of(i):
                it, head = step_item(i)
                return items_ref[it, ItemField.OTHER_TILE] * bq, head

            def view(src, start):
                row, head = start
                if isinstance(src, tuple):
                    ref, h = src
                    return ref.at[batch, pl.ds(row, bq), head, pl.ds(h * _HALF, _HALF)]
                return src.at[batch, head, pl.ds(row, bq)]

            _stream(num_steps, stages, start_of, streams, view)

    # Shared memory by name, allocated in this order. bf16, 2 stages: K, V 2 x 32 KiB, the
    # Q/dO ring 64 KiB a slot, lse/delta 1 KiB each, Pᵀ and dSᵀ 8 KiB each: 210 KiB.
    per_stage = lambda n=1: plgpu.Barrier(num_arrivals=n, num_barriers=stages)
    scratch = dict(
        k=_smem((halves, rows, _HALF), dtype), v=_smem((halves, rows, _HALF), dtype),
        q=_smem((halves, stages, bq, _HALF), dtype),   # the Q/dO ring, by head-dim half
        do=_smem((halves, stages, bq, _HALF), dtype),
        lse=plgpu.SMEM((stages, bq), jnp.float32),
        delta=plgpu.SMEM((stages, bq), jnp.float32),
        ex_p=_exchange(dtype), ex_ds=_exchange(dtype),
        kv_ready=plgpu.Barrier(num_arrivals=2 * halves),
        **_half_barriers("q", stages), **_half_barriers("do", stages),
        lse_ready=per_stage(), delta_ready=per_stage(),
        lse_free=per_stage(_COMPUTE_WGS), delta_free=per_stage(_COMPUTE_WGS),
        ex_ready=plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
        ex_free=plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
    )
    check_smem("wide dK/dV", list(scratch.values()), stages_knob="dkv_num_stages", stages=stages, d=d,
               dtype=dtype)
    kv = lambda n: jax.ShapeDtypeStruct((b, n, hkv, d), dtype)
    out_type = (kv(split), kv(split), kv(tk - split), kv(tk - split)) if split else (kv(tk),
                                                                                       kv(tk))
    return plgpu.kernel(
        kernel, out_type=out_type, scratch_types=list(scratch.values()), grid=grid,
        grid_names=grid_names, num_threads=_COMPUTE_WGS + 1, thread_name="wg", **_params(cfg),
    )(q, k, v, dout, lse2, delta, order, offsets, items)
