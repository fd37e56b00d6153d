"""Pieces shared by the Mosaic GPU FFA kernels."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from magi_jax.planning.work_list import BAND, FULL, GENERAL, ITEM_FIELDS

__all__ = [
    "LOG2E",
    "LN2",
    "COMPUTE_WGS",
    "MAX_NARROW_D",
    "WIDE_BWD_D",
    "WIDE_HALF_D",
    "wide_halves",
    "SMEM_BYTES",
    "ItemField",
    "item_geometry",
    "item_fields",
    "smem",
    "smem64",
    "smem_bytes",
    "check_smem",
    "mma_lhs",
    "tile_predicate",
    "mask_scores",
    "launch_grid",
    "kernel_grid",
    "launch_kernel",
    "scheduled_units",
    "check_pipeline",
    "check_schedule",
    "exp2_fma",
    "exp2_cols",
    "check_fma_cols",
]

# Consumer warpgroups of every kernel (a producer warpgroup beside them streams the inputs).
COMPUTE_WGS = 2
# The largest head dim of the narrow kernels. Above it a forward ring slot holds half a key
# tile, and the backward runs the wide kernels (ffa_dq_wide, ffa_dkv_wide), none persistent.
MAX_NARROW_D = 128
# The head dim of the wide backward kernels: each of their two consumer warpgroups
# accumulates one half of it.
WIDE_HALF_D = 128
WIDE_BWD_D = 2 * WIDE_HALF_D


def wide_halves(dqk: int, dv: int) -> tuple[int, int]:
    """The head-dim halves ``(Dqk / 2, Dv / 2)`` of the wide backward kernels, which each of
    their two consumer warpgroups accumulates; ``ValueError`` where those kernels cannot
    take the head dims. The halves of Q and K sit in tiles of 32 columns (the 64-byte
    swizzle), those of dO and V in tiles of 64 (the 128-byte swizzle of the dQ kernel's
    ``dO·Vᵀ``), so ``Dqk`` is a multiple of 64 in (``MAX_NARROW_D``, ``WIDE_BWD_D``] and ``Dv``
    one of 128 up to ``Dqk``."""
    if not (MAX_NARROW_D < dqk <= WIDE_BWD_D and dqk % 64 == 0 and dv % 128 == 0 and dv <= dqk):
        raise ValueError(
            f"the wide backward kernels take a query/key head dim Dqk that is a multiple of 64 "
            f"in ({MAX_NARROW_D}, {WIDE_BWD_D}] and a value head dim Dv that is a multiple "
            f"of 128 up to Dqk; got Dqk={dqk}, Dv={dv} (at Dqk <= {MAX_NARROW_D}: ffa_dq, "
            "ffa_dkv)"
        )
    return dqk // 2, dv // 2


LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Diagonal bounds are clamped to +-_DIAG_CLAMP before the tile offset is subtracted: no int32
# overflow in the bounds or in their difference (<= 2**30), and no change to the predicate,
# since supported() keeps both sides under 65535 tiles of 128 tokens (< 2**23).
_DIAG_CLAMP = 1 << 29

# Shared memory of one sm90 block (the opt-in maximum) and Mosaic GPU's accounting of it:
# every scratch buffer starts on a 1 KiB boundary, a barrier takes 8 bytes. The kernels need
# no cross-warp reduction scratch (their row reductions stay inside a warp).
SMEM_BYTES = 227 * 1024
_SMEM_ALIGN = 1024
_BARRIER_BYTES = 8


class ItemField(enum.IntEnum):
    """Columns of a work item (:data:`~magi_jax.planning.work_list.ITEM_FIELDS`): the tile on
    the other side, the slice's canonical geometry, the mask kind."""

    OTHER_TILE = 0
    Q0 = 1
    Q1 = 2
    K0 = 3
    K1 = 4
    DLO = 5
    DHI = 6
    KIND = 7


assert tuple(f.name.lower() for f in ItemField) == ITEM_FIELDS, ITEM_FIELDS
_GEOMETRY = tuple(ItemField)[ItemField.Q0 : ItemField.DHI + 1]  # (q0, q1, k0, k1, dlo, dhi)


def item_geometry(items_ref: Any, it: Any) -> tuple:
    """The slice geometry ``(q0, q1, k0, k1, dlo, dhi)`` of item ``it`` of a work list, as
    :func:`mask_scores` takes it."""
    return tuple(items_ref[it, f] for f in _GEOMETRY)


def item_fields(items_ref: Any, it: Any) -> tuple:
    """Item ``it`` of a work list as ``(other tile, slice geometry, mask kind)``."""
    return (
        items_ref[it, ItemField.OTHER_TILE],
        item_geometry(items_ref, it),
        items_ref[it, ItemField.KIND],
    )


def smem(shape: tuple[int, ...], dtype: Any) -> Any:
    """Shared memory in tiles of 8 x 64 with the 128-byte swizzle (16-bit dtypes): the
    layout of the kernels' Q, K, V, dO buffers and of what a wgmma reads with them."""
    return plgpu.SMEM(
        shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    )


def smem64(shape: tuple[int, ...], dtype: Any) -> Any:
    """Shared memory in tiles of 8 x 32 with the 64-byte swizzle (16-bit dtypes): for buffers
    with rows of 32 elements and the buffers a wgmma pairs with them (a wgmma takes one
    swizzle for both operands), as the D = 256 backward kernels exchange them."""
    return plgpu.SMEM(
        shape, dtype, transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))
    )


def smem_bytes(scratch: Sequence[Any]) -> int:
    """Shared memory of the scratch buffers and barriers ``scratch`` as Mosaic GPU allocates
    it."""
    total = 0
    for buf in scratch:
        if isinstance(buf, plgpu.Barrier):
            total += _BARRIER_BYTES * math.prod(buf.num_barriers)
        else:
            size = math.prod(buf.shape) * jnp.dtype(buf.dtype).itemsize
            total += -(-size // _SMEM_ALIGN) * _SMEM_ALIGN
    return total


def check_smem(
    kernel: str,
    scratch: Sequence[Any],
    out_scratch: Sequence[Any] = (),
    *,
    stages_knob: str,
    stages: int,
    persistent_knob: str | None = None,
    persistent: int = 0,
    d: int,
    dtype: Any,
    dv: int | None = None,
) -> None:
    """Raises ``ValueError`` naming the knobs to turn when the buffers ``scratch`` and the
    persistent mode's output buffers ``out_scratch`` do not fit one sm90 block
    (``persistent_knob=None``: a kernel without a persistent mode). ``d`` is the query/key
    head dim, ``dv`` v's where it differs."""
    total = smem_bytes(scratch) + smem_bytes(out_scratch)
    if total <= SMEM_BYTES:
        return
    fix = f"lower {stages_knob}"
    if out_scratch and smem_bytes(scratch) <= SMEM_BYTES:
        fix += (
            f" or turn {persistent_knob} off (its output buffers take "
            f"{smem_bytes(out_scratch)} bytes)"
        )
    mode = "" if persistent_knob is None else f", persistent={persistent}"
    dims = f"D={d}" if dv in (None, d) else f"Dqk={d}, Dv={dv}"
    raise ValueError(
        f"the {kernel} kernel with {stages_knob}={stages}{mode}, {dims} and "
        f"{jnp.dtype(dtype).name} needs {total} bytes of shared memory "
        f"(> {SMEM_BYTES} on sm90); {fix}"
    )


def mma_lhs(acc_ref: Any, x: jax.Array, b_ref: Any, stage: Any) -> None:
    """``acc_ref += x @ b_ref`` with ``x`` in registers. GPU interpret mode only multiplies
    shared-memory operands, so there (``stage`` given) ``x`` goes through shared memory."""
    if stage is None:
        plgpu.wgmma(acc_ref, x, b_ref)
    else:
        stage[...] = x
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, stage, b_ref)


def _inside(x, lo, n):
    """``lo <= x < lo + n`` (``n >= 0``) as one unsigned comparison. Six signed comparisons
    joined by ``&`` compiled to bit-packed predicate vectors on the H200 (the dQ kernel spent
    about as long masking a tile as computing it); three of these compile to a compare and a
    select per cell each."""
    return (x - lo).astype(jnp.uint32) < n.astype(jnp.uint32)


def _local_diagonals(geom, row0, col0):
    """The slice's diagonal bounds ``dlo <= c − r <= dhi`` as ``(lo, n)`` of
    :func:`_inside` on the tile-local difference ``ic − ir``."""
    *_, dlo, dhi = geom
    off = col0 - row0
    lo = lax.max(dlo, jnp.int32(-_DIAG_CLAMP))
    hi = lax.min(dhi, jnp.int32(_DIAG_CLAMP))
    return lo - off, lax.max(hi - lo + 1, jnp.int32(0))


def tile_predicate(
    geom: tuple,
    row0: Any,
    col0: Any,
    shape: tuple[int, int],
    layout: Any,
    transposed: bool = False,
) -> jax.Array:
    """Cells of a tile that belong to the slice of geometry ``geom`` (``(q0, q1, k0, k1,
    dlo, dhi)``, :func:`item_fields`). The tile's first query row is ``row0`` and first key
    ``col0``; queries run along axis 0 (axis 1 if ``transposed``)."""
    q_axis, k_axis = (1, 0) if transposed else (0, 1)
    ir = plgpu.broadcasted_iota(jnp.int32, shape, q_axis, layout=layout)
    ic = plgpu.broadcasted_iota(jnp.int32, shape, k_axis, layout=layout)
    q0, q1, k0, k1, _, _ = geom
    return (
        _inside(ir, q0 - row0, q1 - q0)
        & _inside(ic, k0 - col0, k1 - k0)
        & _inside(ic - ir, *_local_diagonals(geom, row0, col0))
    )


def mask_scores(
    s: jax.Array,
    geom: tuple,
    kind: Any,
    row0: Any,
    col0: Any,
    layout: Any,
    transposed: bool = False,
) -> jax.Array:
    """``s`` with the cells outside the item's slice set to ``-inf``, by the item's ``kind``
    (:data:`~magi_jax.planning.work_list.GENERAL`, ``FULL``, ``BAND``); arguments as
    :func:`tile_predicate`."""

    def general():
        return jnp.where(tile_predicate(geom, row0, col0, s.shape, layout, transposed), s, -jnp.inf)

    def band():
        q_axis, k_axis = (1, 0) if transposed else (0, 1)
        t = plgpu.broadcasted_iota(
            jnp.int32, s.shape, k_axis, layout=layout
        ) - plgpu.broadcasted_iota(jnp.int32, s.shape, q_axis, layout=layout)
        return jnp.where(_inside(t, *_local_diagonals(geom, row0, col0)), s, -jnp.inf)

    branches = {GENERAL: general, FULL: lambda: s, BAND: band}
    return lax.switch(kind, [branches[i] for i in range(len(branches))])


def launch_grid(num_tiles: int, batch: int, heads: int) -> tuple[tuple, tuple]:
    """``(grid, grid_names)`` of a kernel over (tile, batch, head). The last grid axis varies
    fastest at launch: tiles (heaviest first within each head), so programs running together
    share one head's K/V (or Q/dO) through L2, as cuDNN/tokamax order their grids. (Heads
    fastest was the other order measured on the H200, 2026-11-30.)"""
    return (heads, batch, num_tiles), ("head", "batch", "tile")


def kernel_grid(
    persistent: int, num_tiles: int, batch: int, heads: int, schedule: Sequence[Any]
) -> tuple[tuple, tuple, tuple]:
    """``(grid, grid_names, schedule)`` of a kernel over ``num_tiles · batch · heads`` units:
    one program per unit in the order of :func:`launch_grid`, or ``persistent`` programs
    walking the host ``schedule`` (checked against the grid by :func:`check_schedule`;
    ``()`` when not persistent)."""
    num_units = num_tiles * batch * heads
    if persistent:
        num_progs = min(persistent, num_units)
        schedule = tuple(schedule)
        check_schedule(schedule, num_progs, num_units)
        return (num_progs,), ("prog",), schedule
    return (*launch_grid(num_tiles, batch, heads), ())


def launch_kernel(
    kernel: Callable,
    out_type: Any,
    scratch: dict[str, Any],
    grid: tuple,
    grid_names: tuple,
    interpret: bool,
    *,
    reduction_scratch: bool = True,
) -> Callable:
    """``plgpu.kernel`` of one FFA kernel: ``COMPUTE_WGS`` consumer warpgroups and the
    producer beside them (thread axis ``"wg"``), approximate math, GPU interpret mode when
    ``interpret``. ``reduction_scratch=False`` gives none of shared memory to the cross-warp
    reduction scratch Mosaic GPU reserves by default, for kernels that have no such
    reductions."""
    params = dict(approx_math=True)
    if not reduction_scratch:
        params["reduction_scratch_bytes"] = 0
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=list(scratch.values()),
        grid=grid,
        grid_names=grid_names,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(**params),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


def scheduled_units(
    schedule_refs: Sequence[Any], num_tiles: int, batch: int, order_ref: Any
) -> tuple[Any, Callable]:
    """``(num_mine, coords)`` of a persistent program: how many units it walks, and
    ``coords(j)``, the (tile, batch, head) of its ``j``-th, from the ``(offsets, units)`` of
    :func:`magi_jax.planning.work_list.persistent_schedule` (units numbered in the head-major launch
    order, ``(head·B + batch)·N + rank`` with ``rank`` a position of ``order_ref``)."""
    prog = lax.axis_index("prog")
    off_ref, units_ref = schedule_refs
    first_unit = off_ref[prog]

    def coords(j):
        u = units_ref[first_unit + j]
        rank, rest = lax.rem(u, jnp.int32(num_tiles)), lax.div(u, jnp.int32(num_tiles))
        return order_ref[rank], lax.rem(rest, jnp.int32(batch)), lax.div(rest, jnp.int32(batch))

    return off_ref[prog + 1] - first_unit, coords


def check_pipeline(num_stages: int, persistent: int) -> None:
    """The knobs every kernel config shares: ring slots and persistent programs."""
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if persistent < 0:
        raise ValueError(
            f"persistent={persistent} must be >= 0 (0: off, else the number of "
            "programs, e.g. the SM count)"
        )


def check_schedule(schedule: Sequence[Any], num_progs: int, num_units: int) -> None:
    """The ``(offsets, units)`` of a persistent kernel's host schedule fit its grid."""
    if (
        len(schedule) != 2
        or schedule[0].shape != (num_progs + 1,)
        or schedule[1].shape != (num_units,)
    ):
        raise ValueError(
            f"a persistent schedule for {num_progs} programs is (offsets "
            f"[{num_progs + 1}], units [{num_units}]) of persistent_schedule; "
            f"got {[getattr(a, 'shape', a) for a in schedule]}"
        )


# 2^f on [-1/2, 1/2], relative minimax of degree 3 (max relative error 7.5e-5, under half
# an fp16 ulp). FlashAttention-4 also moves part of its exponentials to the FMA pipes.
_EXP2_POLY = (0.99992811, 0.69326099, 0.24261054, 0.05517132)
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: x + this rounds x to an integer in the low bits


def exp2_fma(x: jax.Array) -> jax.Array:
    """``2**x`` in float32 for ``x <= 0`` (``-inf`` included) without the ``ex2`` unit:
    ``x`` is split as ``j + f`` with ``j`` the nearest integer and ``|f| <= 1/2``; ``2**f``
    is a cubic, and ``j`` is added to its exponent bits; below -126 the result is 0 (``ex2``
    flushes there too). Adds, multiplies, shifts and one select; the barrier keeps
    ``(x + M) − M`` from being simplified to ``x`` (XLA on the CPU, where interpret mode
    runs, does that)."""
    t = lax.optimization_barrier(x + _ROUND_MAGIC)
    f = x - (t - _ROUND_MAGIC)
    c0, c1, c2, c3 = _EXP2_POLY
    p = ((c3 * f + c2) * f + c1) * f + c0
    # The low bits of t hold j; shifted into the exponent field, they add j to p's exponent.
    bits = lax.bitcast_convert_type(p, jnp.int32) + lax.shift_left(
        lax.bitcast_convert_type(t, jnp.int32), jnp.int32(23)
    )
    return jnp.where(x >= -126.0, lax.bitcast_convert_type(bits, jnp.float32), 0.0)


def exp2_cols(x: jax.Array, fma_cols: int = 0) -> jax.Array:
    """``exp2`` of a ``(rows, cols)`` float32 array in the WGMMA layout, its last
    ``fma_cols`` columns by :func:`exp2_fma` on the FMA pipes and the rest on the ``ex2``
    unit (16 results per clock per SM on sm90, the limit of a softmax beside short
    matmuls). A column slice of that layout is a subset of each thread's registers."""
    if not fma_cols:
        return jnp.exp2(x)
    n = x.shape[1] - fma_cols
    return jnp.concatenate([jnp.exp2(x[:, :n]), exp2_fma(x[:, n:])], axis=1)


def check_fma_cols(fma_cols: int, cols: int | None = None, where: str = "") -> None:
    """``fma_exp_cols`` of a kernel config: a multiple of 8 (the layout's column tile),
    below the ``cols`` of the score blocks ``where`` when given."""
    if fma_cols < 0 or fma_cols % 8:
        raise ValueError(
            f"fma_exp_cols={fma_cols} must be a multiple of 8 >= 0 (score "
            "columns exponentiated on the FMA pipes)"
        )
    if cols is not None and fma_cols >= cols:
        raise ValueError(f"fma_exp_cols={fma_cols} must be below the {cols} columns of {where}")
