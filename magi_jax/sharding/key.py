"""Keys: everything context-parallel attention needs for one (mask, mesh, options), plus
``dispatch`` / ``undispatch`` / ``position_ids``.

A :class:`MagiKey` is a JAX pytree: its leaves are the stacked ``[cp, ...]`` int32 plan arrays
(sharded over the mesh's cp axis) and the dispatch permutation; everything else (mesh, axis,
stage shapes, transports) is static. It can be closed over or passed through ``jax.jit``.
Building one is host work, cached by (mask fingerprint, mesh, options).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from magi_jax.mask import AttnMask
from magi_jax.planning.cast_table import choose_transport
from magi_jax.planning.work_list import default_block_sizes
from magi_jax.planning.solver import ALGORITHMS, DispatchMeta, solve_dispatch
from magi_jax.planning.stages import DistPlan, build_dist_plan, split_areas
from magi_jax.sharding import native
from magi_jax.sharding.collectives import TRANSPORTS, CastArrays, CastSpec
from magi_jax.sharding.ffa_backends import FFA_BACKENDS

__all__ = ["MagiKey", "StageStatic", "make_flex_key", "make_varlen_key", "dispatch",
           "undispatch", "position_ids", "default_overlap_degree", "COMM_BACKENDS"]

COMM_BACKENDS = ("auto", "xla") + TRANSPORTS
# Cost model of the default overlap degree (H200 figures of PERF.md, bf16, Hq = Hkv = 16,
# D = 128): seconds per attended cell, per fetched KV token, per stage (fixed, and per local
# token: the stage's merge and the second kernel's tail), and the share of the ideal overlap
# that XLA achieves. The last three from benchmarks/results/overlap/overlap_20261130_0800 (2 H200s,
# doc-causal 128k: +0.35 ms of compute per extra stage on 65k local tokens; 30-50 % of the
# communication hidden).
_SEC_PER_CELL = 4 * 16 * 128 / 400e12
_SEC_PER_TOKEN = 2 * 16 * 128 * 2 / 250e9
_SEC_PER_STAGE = 30e-6
_SEC_PER_STAGE_TOKEN = 5e-9
_OVERLAP_EFFICIENCY = 0.5
_MAX_DEGREE = 4


@dataclasses.dataclass(frozen=True)
class StageStatic:
    """Static description of one stage: its KV length, whether its KV is local KV followed
    by the cast buffer (``combined``), and the cast spec (``None`` for the host stage)."""

    kv_len: int
    combined: bool
    cast: CastSpec | None


class _Static:
    """Hashable static half of a key (compared by its token)."""

    def __init__(self, token, **fields):
        self.token = token
        self.__dict__.update(fields)

    def __hash__(self):
        return hash(self.token)

    def __eq__(self, other):
        return isinstance(other, _Static) and self.token == other.token


@jax.tree_util.register_pytree_node_class
class MagiKey:
    """Context-parallel plan of one mask on one mesh (see :func:`make_flex_key`).

    Attributes: ``mesh``, ``cp_axis``, ``cp``, ``total`` (real tokens), ``padded_total``
    (dispatched length), ``local_len`` (tokens per rank), ``overlap_degree``, ``plan`` (the
    host :class:`~magi_jax.planning.stages.DistPlan`), ``stages`` (static per-stage info).
    Leaves: ``order`` int32 ``[padded_total]`` (global position of each dispatched token),
    ``inverse`` int32 ``[total]`` (dispatched index of each natural position) and per stage
    ``(FFAPlanArrays, CastArrays | None)`` stacked ``[cp, ...]``.
    """

    def __init__(self, static: _Static, order, inverse, stage_arrays):
        self._static = static
        self.order = order
        self.inverse = inverse
        self.stage_arrays = stage_arrays

    def tree_flatten(self):
        return (self.order, self.inverse, self.stage_arrays), self._static

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(static, *children)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._static.__dict__[name]
        except KeyError:
            raise AttributeError(name) from None

    def plot(self, path=None, **kwargs):
        """Picture of the plan (PNG at ``path``); see :func:`magi_jax.plot.plot_plan`."""
        from magi_jax.plot import plot_key
        return plot_key(self, path, **kwargs)

    def __repr__(self):
        p = self.plan
        return (f"MagiKey(cp={self.cp}, total={self.total}, padded_total={self.padded_total}, "
                f"chunk_size={p.meta.chunk_size}, overlap_degree={self.overlap_degree}, "
                f"imbalance={p.meta.imbalance():.4f}, "
                f"max_remote_kv={int(p.remote_tokens.max())})")


def default_overlap_degree(mask: AttnMask, meta: DispatchMeta) -> int:
    """Overlap degree minimising a simple per-rank pipeline model: stage 0 computes the host
    area while remote stage 0 arrives; each later stage computes its share while the next
    arrives — of which ideal overlap only a measured share is realised; every stage costs a
    fixed overhead plus one per local token. Degree 0 fetches everything, then computes.
    Needs no kernel plan (areas from the clipped slices)."""
    host, rem, tokens = (x.astype(np.float64) for x in split_areas(mask, meta))
    if not tokens.any():
        return 0
    host, rem, comm = host * _SEC_PER_CELL, rem * _SEC_PER_CELL, tokens * _SEC_PER_TOKEN
    stage = _SEC_PER_STAGE + _SEC_PER_STAGE_TOKEN * meta.padded_total / meta.cp
    serial = comm + host + rem
    best, best_t = 0, float(np.max(serial)) + stage
    for k in range(1, _MAX_DEGREE + 1):
        c, r = comm / k, rem / k
        ideal = np.maximum(c, host) + (k - 1) * np.maximum(c, r) + r
        t = serial - _OVERLAP_EFFICIENCY * (serial - ideal) + (k + 1) * stage
        if float(t.max()) < best_t * 0.98:
            best, best_t = k, float(t.max())
    return best


def _check_mesh(mesh, cp_axis):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    if cp_axis not in mesh.axis_names:
        raise ValueError(f"cp_axis={cp_axis!r} is not an axis of the mesh (axes: "
                         f"{mesh.axis_names}); pass the name of the context-parallel axis")
    return int(mesh.shape[cp_axis])


def make_flex_key(mask: AttnMask, mesh: Mesh, cp_axis: str = "cp", *,
                  chunk_size: int | None = None, overlap_degree: int | None = None,
                  comm_backend: str = "auto", dispatch_algorithm: str = "magi",
                  dispatch_from: MagiKey | None = None, block_q: int | None = None,
                  block_k: int | None = None, ffa_backend: str = "xla",
                  backward_refetch: bool = True) -> MagiKey:
    """Plans context-parallel attention of ``mask`` over ``mesh``'s ``cp_axis``.

    Args:
      mask: a self-attention :class:`AttnMask` (``total_q == total_k``) over the packed
        sequence in natural order. Lengths need not divide anything: the sequence is padded.
      mesh, cp_axis: the mesh and the name of its context-parallel axis (other axes, if any,
        see the same sequence shard: replicated).
      chunk_size: dispatch granularity in tokens (default: chosen by the solver, ≥ 8 chunks
        per rank).
      overlap_degree: number of remote stages (0: fetch all remote KV, then one FFA call);
        default from a compute/communication cost model.
      comm_backend: ``"xla"`` (XLA collectives, transport per stage), ``"ppermute"``,
        ``"all_to_all"``, ``"native"`` (the FFI transport of :mod:`magi_jax.sharding.native`)
        or ``"auto"``: ``native`` on GPUs with one process per GPU when its CUDA library was
        built, else ``xla`` (``magi_jax.sharding.native.auto_reason(mesh, cp_axis)`` says
        why).
      dispatch_algorithm: one of :data:`~magi_jax.planning.solver.ALGORITHMS`.
      dispatch_from: reuse this key's dispatch (same chunks on the same ranks) for another
        mask over the same sequence — layers with different masks share one dispatch.
      block_q, block_k: FFA tile sizes (default 128, smaller for short local lengths).
      ffa_backend: per-rank FFA implementation: ``"xla"`` (portable) or ``"pallas"`` (Mosaic
        GPU kernels: Hopper, bf16/fp16, D 64/128).
      backward_refetch: the backward re-fetches each remote stage's KV (one more group-cast
        per stage) instead of keeping every stage's buffer from the forward (memory: local
        KV plus the stage in flight; DESIGN.md §2.5). ``False`` keeps the buffers (less
        communication, more memory).

    Returns a :class:`MagiKey`; cached by (mask fingerprint, mesh, options).
    """
    if not isinstance(mask, AttnMask):
        raise TypeError(f"mask must be an AttnMask (e.g. AttnMask.varlen(...)); got "
                        f"{type(mask).__name__}")
    cp = _check_mesh(mesh, cp_axis)
    if comm_backend not in COMM_BACKENDS:
        raise ValueError(f"comm_backend={comm_backend!r} is not one of {COMM_BACKENDS}")
    if comm_backend == "native":
        native.check_mesh(mesh, cp_axis)
    elif comm_backend == "auto" and native.auto_reason(mesh, cp_axis) is None:
        comm_backend = "native"
    if ffa_backend not in FFA_BACKENDS:
        raise ValueError(f"ffa_backend={ffa_backend!r} is not one of {FFA_BACKENDS}")
    if dispatch_algorithm not in ALGORITHMS:
        raise ValueError(f"dispatch_algorithm={dispatch_algorithm!r} is not one of "
                         f"{ALGORITHMS}")
    if dispatch_from is not None:
        if not isinstance(dispatch_from, MagiKey):
            raise TypeError(f"dispatch_from must be a MagiKey; got "
                            f"{type(dispatch_from).__name__}")
        if dispatch_from.total != mask.total_q or dispatch_from.mesh != mesh or \
                dispatch_from.cp_axis != cp_axis:
            raise ValueError(
                f"dispatch_from was made for {dispatch_from.total} tokens on axis "
                f"{dispatch_from.cp_axis!r} of its mesh, but this mask has {mask.total_q} "
                f"tokens (axis {cp_axis!r}); a shared dispatch needs the same sequence and mesh")
    return _make_key(mask, mesh, cp_axis, chunk_size, overlap_degree, comm_backend,
                     dispatch_algorithm,
                     None if dispatch_from is None else _MetaRef(dispatch_from.plan.meta),
                     block_q, block_k, ffa_backend, cp, bool(backward_refetch))


class _MetaRef:
    """Hashable handle of a DispatchMeta (by its content)."""

    def __init__(self, meta):
        self.meta = meta
        self._fp = meta.fingerprint()

    def __hash__(self):
        return hash(self._fp)

    def __eq__(self, other):
        return isinstance(other, _MetaRef) and self._fp == other._fp


@functools.lru_cache(maxsize=64)
def _make_key(mask, mesh, cp_axis, chunk_size, overlap_degree, comm_backend, algorithm,
              meta_ref, block_q, block_k, ffa_backend, cp, backward_refetch) -> MagiKey:
    if meta_ref is not None:
        meta = meta_ref.meta
    else:
        meta = solve_dispatch(mask, cp, chunk_size, algorithm)
    auto_q, auto_k = default_block_sizes(meta.local_len, meta.local_len)
    bq, bk = int(block_q or auto_q), int(block_k or auto_k)
    degree = (default_overlap_degree(mask, meta) if overlap_degree is None
              else int(overlap_degree))
    plan: DistPlan = build_dist_plan(mask, meta, degree, bq, bk, ffa_backend)
    shard = NamedSharding(mesh, P(cp_axis))
    put = lambda a: _put(a, shard)
    statics, arrays = [], []
    for st in plan.stages:
        ffa = type(st.ffa)(*(put(a) for a in st.ffa))
        if st.cast is None:
            statics.append(StageStatic(st.kv_len, False, None))
            arrays.append((ffa, None))
            continue
        transport = (choose_transport(st.cast) if comm_backend in ("auto", "xla")
                     else comm_backend)
        runs = None
        if transport == "native":
            native.check_table(st.cast)
            runs = native.reduce_runs(st.cast)
        spec = CastSpec(cp_axis, cp, st.cast.shifts, st.cast.widths, transport, runs)
        combined = st.kv_len != st.cast.buffer_len
        statics.append(StageStatic(st.kv_len, combined, spec))
        arrays.append((ffa, CastArrays(put(st.cast.send_index), put(st.cast.recv_index))))
    order = meta.positions.reshape(-1)
    inverse = np.empty(meta.padded_total, np.int64)
    inverse[order] = np.arange(meta.padded_total)
    replicated = NamedSharding(mesh, P())
    token = (mask.fingerprint, meta.fingerprint(), id(mesh), cp_axis, degree, bq, bk,
             comm_backend, ffa_backend, backward_refetch)
    static = _Static(token, mesh=mesh, cp_axis=cp_axis, cp=cp, total=meta.total,
                     padded_total=meta.padded_total, local_len=meta.local_len,
                     overlap_degree=plan.overlap_degree, block_q=bq, block_k=bk,
                     stages=tuple(statics), plan=plan, mask=mask, ffa_backend=ffa_backend,
                     backward_refetch=backward_refetch)
    return MagiKey(static, _put(order, replicated), _put(inverse[:meta.total], replicated),
                   tuple(arrays))


def _put(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host int32 array every process computed identically -> a global array; each
    process fills only its addressable shards (multi-host safe, no cross-host transfer)."""
    a = np.ascontiguousarray(a, np.int32)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def make_varlen_key(cu_seqlens, mesh: Mesh, cp_axis: str = "cp", *, causal: bool = True,
                    window=None, **options) -> MagiKey:
    """:func:`make_flex_key` for packed documents (``AttnMask.varlen(cu_seqlens, causal,
    window)``); ``options`` as for :func:`make_flex_key`."""
    return make_flex_key(AttnMask.varlen(cu_seqlens, causal=causal, window=window), mesh,
                         cp_axis, **options)


def _check_key(key):
    if not isinstance(key, MagiKey):
        raise TypeError(f"key must be a MagiKey from make_flex_key/make_varlen_key; got "
                        f"{type(key).__name__}")


def dispatch(x, key: MagiKey, seq_axis: int = 0):
    """Natural order -> dispatched order along ``seq_axis`` (``total`` -> ``padded_total``
    rows), sharded over the cp axis: rank ``r`` holds rows ``[r·local_len, (r+1)·local_len)``;
    padding rows are zero. Differentiable (the VJP gathers the cotangent back)."""
    _check_key(key)
    axis = _axis(x, seq_axis, "dispatch")
    if x.shape[axis] != key.total:
        raise ValueError(f"dispatch: x has shape {tuple(x.shape)} but the key is for "
                         f"{key.total} tokens; seq_axis={seq_axis} must be the packed sequence")
    pad = key.padded_total - key.total
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths)
    return _shard_rows(jnp.take(x, key.order, axis=axis), key, axis)


def undispatch(x, key: MagiKey, seq_axis: int = 0):
    """Dispatched -> natural order along ``seq_axis`` (``padded_total`` -> ``total`` rows,
    padding dropped). Differentiable (padding rows get zero cotangent)."""
    _check_key(key)
    axis = _axis(x, seq_axis, "undispatch")
    if x.shape[axis] != key.padded_total:
        raise ValueError(f"undispatch: x has shape {tuple(x.shape)} but the key dispatches "
                         f"{key.padded_total} rows ({key.total} tokens + padding) along "
                         f"seq_axis={seq_axis}; pass an array produced by dispatch/"
                         "magi_attention with this key")
    if any(t == jax.sharding.AxisType.Explicit for t in key.mesh.axis_types):
        x = jax.sharding.reshard(x, NamedSharding(key.mesh, P()))
    return jnp.take(x, key.inverse, axis=axis)


def _axis(x, seq_axis, fn):
    if not -x.ndim <= seq_axis < x.ndim:
        raise ValueError(f"{fn}: seq_axis={seq_axis} is out of range for an array of shape "
                         f"{tuple(x.shape)}")
    return seq_axis % x.ndim


def position_ids(key: MagiKey):
    """int32 ``[padded_total]``: the global position of every dispatched token (for RoPE);
    padding tokens get positions ``>= total``. Sharded like dispatched arrays."""
    _check_key(key)
    return _shard_rows(key.order, key)


def _shard_rows(x, key: MagiKey, axis: int = 0):
    """Constrains ``x`` to be sharded along ``axis`` over the cp axis (Auto or Explicit)."""
    spec = P(*([None] * axis), key.cp_axis, *([None] * (x.ndim - axis - 1)))
    explicit = any(t == jax.sharding.AxisType.Explicit for t in key.mesh.axis_types)
    if explicit:
        return jax.sharding.reshard(x, NamedSharding(key.mesh, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(key.mesh, spec))
