"""The ``native`` transport of the group collectives: a C++ XLA FFI library (``ffi/``).

Two shared libraries, built by the package build (``CMakeLists.txt``):

- ``_magi_native_cpu.so`` — CPU handlers. The host devices of one process meet in a
  rendezvous, publish their buffers and each pulls what its tables say (docs/design.md §3.2). It
  exists so that the FFI path runs in CI; it is not a fast path.
- ``_magi_native_cuda.so`` — CUDA handlers over NVSHMEM, one process per GPU. One kernel per
  collective: some blocks move their rows chunk by chunk through a symmetric staging buffer
  and raise a flag per chunk (NVSHMEM signal), the others wait for the flags of the rows they
  need and copy them into XLA's output (cast) or sum them in float32 (reduce). Two data paths
  (:class:`CudaTuning`): ``push`` (stores into the peer's staging over NVLink, local copy
  out) and ``pull`` (local gather into our staging, the peer loads it over NVLink straight
  into its output). Stream-ordered, no host synchronisation; calls alternate between two
  staging regions and reuse is guarded by per-PE acknowledgements, so back-to-back calls need
  no barrier.

Semantics (both platforms) are those of ``cast_model`` / ``reduce_model`` in
:mod:`magi_jax.sharding.transport`, for tables that satisfy :func:`check_table` (every real
send entry is received exactly once, every received entry is a real send entry — which
:func:`~magi_jax.planning.cast_table.build_cast_table` guarantees).

NVSHMEM needs every process to join: :func:`initialize` (called lazily by the first traced
native collective, identically on every process of an SPMD program) takes the unique id from
process 0 through the ``jax.distributed`` key-value store and reserves the symmetric staging
buffer; a collective whose rows do not fit raises a ``ValueError`` that says how much to
reserve. :func:`available` / :func:`unavailable_reason` say whether a platform can run it.

Limits today: on GPU the cp axis must be the mesh's only axis of size > 1, over all processes
in process order (:func:`check_mesh`); up to 64 slots per cast; reduce input bf16/f16/f32.
Measured on two H200s (``benchmarks/results/collectives/collective_notes.md``, Run 10,
2026-11-30), GPU time per op of back-to-back ops at 256 MiB per rank: cast 343-345 GB/s
(0.89x a peer copy; ppermute 307), reduce 325-330 GB/s; 1 MiB cast 18 us.

A reduce can also run in two calls (:func:`group_reduce_start`): its sends go out beside other
kernels (the attention's backward puts its dQ kernel there) and the done call sums. Started
reduces have their own staging (``initialize(started_bytes=...)``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import itertools
import math
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

# The library's loading and the platform / mesh checks live in library.py; the public ones
# are this module's API too.
from magi_jax.sharding.transport.native._library import (
    CAST_TARGET,
    DONE_TARGET,
    REDUCE_TARGET,
    START_TARGET,
    gpu_mesh_problem,
    load_library,
    platform_key,
    unavailable_reason,
)

if TYPE_CHECKING:  # annotations only: the collectives import this module
    from jax.sharding import Mesh

    from magi_jax.planning import CastTable
    from magi_jax.sharding.transport._collectives import CastSpec

# One array or a list of arrays of the same rows (moved side by side by one collective).
Arrays = jax.Array | list[jax.Array]


DEFAULT_TIMEOUT_S = 60.0
# Runs per rank above which a reduce is not started (each run is one contiguous copy per
# array; a started reduce's copy kernel takes up to 128 of them per launch).
MAX_RUNS = 64
_FLAG_CAPACITY = 1 << 16
_DEFAULT_SYMMETRIC_BYTES = 1 << 30
_call_ids = itertools.count(1)
_MODES = {"push": 0, "pull": 1}  # CudaTuning.mode -> the handlers' `mode` attribute


@dataclasses.dataclass(frozen=True)
class CudaTuning:
    """How the CUDA kernels move rows. Performance only: every setting gives the same result.

    ``mode``: ``"push"`` (send blocks store into the peer's staging over NVLink, receive blocks
    copy their own staging out) or ``"pull"`` (send blocks gather into their own staging,
    receive blocks load the peer's staging over NVLink into the output; falls back to push
    when a PE is not load/store reachable). ``send_blocks`` / ``recv_blocks``: upper bounds on
    the blocks of 512 threads of each kind (small collectives launch fewer); the rest of the GPU
    stays free for overlapping compute. ``chunk_kib``: bytes behind one arrival flag (smaller:
    finer overlap of arrival and copy-out, more flags and fences). ``double_buffer``: alternate
    between two staging regions (when both fit) so a call does not wait for the peers to have
    read the previous call's rows. ``stream``: 0 runs the collective on XLA's compute stream
    (serialised with the attention kernels); ``n > 0`` places it on XLA's explicit GPU stream
    ``n`` (``compute_on("gpu_stream:n")``, an async call XLA joins before the consumers);
    ``"collective"`` on XLA's collective stream (``compute_on("gpu_stream:collective")``,
    docs/design.md §3.2). On 2 H200s with jax 0.11.2 neither stream overlapped the attention: XLA
    joined each call right after starting it (Run 7 of
    ``benchmarks/results/collectives/collective_notes.md``).
    ``started_reduce``: the attention's backward starts the group-reduce of its last remote
    stage between its dK/dV and dQ kernels and ends it after dQ
    (:func:`group_reduce_start`): a copy kernel of 16 blocks on a high-priority stream moves
    the rows beside the dQ kernel. Needs the runs of ``CastSpec.runs`` and every PE
    load/store reachable; otherwise the reduce runs where it is called.

    Defaults come from ``MAGI_NATIVE_CAST_MODE``, ``MAGI_NATIVE_SEND_BLOCKS``,
    ``MAGI_NATIVE_RECV_BLOCKS``, ``MAGI_NATIVE_CHUNK_KIB``, ``MAGI_NATIVE_DOUBLE_BUFFER``,
    ``MAGI_NATIVE_STREAM``, ``MAGI_NATIVE_STARTED_REDUCE`` (read at import); :func:`tuning`
    changes them for the collectives traced inside it.
    """

    mode: str = "push"
    send_blocks: int = 64
    recv_blocks: int = 64
    chunk_kib: int = 256
    # One staging region: on 2 H200s (results/collectives/collective_20261130_0849_*) a second
    # region measured no gain (256 MiB: 311.8 GB/s with it, 318.7 without; 1 MiB: 31.9 vs 30.6 us).
    double_buffer: bool = False
    stream: int | str = 0
    started_reduce: bool = True

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"CudaTuning.mode={self.mode!r} is not one of {tuple(_MODES)}")
        for name in ("send_blocks", "recv_blocks", "chunk_kib"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"CudaTuning.{name} must be >= 1, got {getattr(self, name)}")
        if self.stream != "collective" and not (str(self.stream).isdigit()):
            raise ValueError(
                f"CudaTuning.stream must be an int >= 0 (0: XLA's compute "
                f"stream) or 'collective', got {self.stream!r}"
            )


def _stream(v: str) -> int | str:
    return int(v) if v.isdigit() else v


def _tuning_from_env() -> CudaTuning:
    env, d = os.environ.get, CudaTuning()  # the defaults live in one place: the class
    return CudaTuning(
        mode=env("MAGI_NATIVE_CAST_MODE", d.mode),
        send_blocks=int(env("MAGI_NATIVE_SEND_BLOCKS", d.send_blocks)),
        recv_blocks=int(env("MAGI_NATIVE_RECV_BLOCKS", d.recv_blocks)),
        chunk_kib=int(env("MAGI_NATIVE_CHUNK_KIB", d.chunk_kib)),
        double_buffer=env("MAGI_NATIVE_DOUBLE_BUFFER", str(int(d.double_buffer)))
        not in ("0", "false"),
        stream=_stream(env("MAGI_NATIVE_STREAM", str(d.stream))),
        started_reduce=env("MAGI_NATIVE_STARTED_REDUCE", str(int(d.started_reduce)))
        not in ("0", "false"),
    )


_tuning = [_tuning_from_env()]


def cuda_tuning() -> CudaTuning:
    """The :class:`CudaTuning` that native collectives traced now would use."""
    return _tuning[-1]


@contextlib.contextmanager
def tuning(**changes: Any) -> Iterator[CudaTuning]:
    """Collectives traced inside ``with native.tuning(mode="pull", chunk_kib=128): ...`` use
    those settings (for benchmarks; a jitted function keeps what it was traced with)."""
    _tuning.append(dataclasses.replace(_tuning[-1], **changes))
    try:
        yield _tuning[-1]
    finally:
        _tuning.pop()


def check_table(table: CastTable) -> None:
    """Raises ``ValueError`` unless ``table`` (a stacked :class:`CastTable`) is one the native
    transport moves exactly: for every rank ``d`` and slot ``j``, the entries ``j·S + p`` of
    ``recv_index[d]`` are exactly the real entries ``p`` of ``send_index[(d - shift_j) % cp, j]``,
    each once. (The CUDA kernels skip padding rows and put each row at its slot position.)"""
    send, recv = np.asarray(table.send_index), np.asarray(table.recv_index)
    cp, n, s = send.shape
    for d in range(cp):
        e = recv[d][recv[d] >= 0]
        if len(np.unique(e)) != len(e):
            raise ValueError(f"cast table: rank {d} receives some slot entry twice")
        want = []
        for j, shift in enumerate(table.shifts):
            src = (d - shift) % cp
            want.append(j * s + np.nonzero(send[src, j] >= 0)[0])
        want = np.concatenate(want) if want else np.zeros(0, np.int64)
        if not np.array_equal(np.sort(e), np.sort(want)):
            raise ValueError(
                f"cast table: rank {d} receives slot entries {sorted(set(e) ^ set(want))[:8]} "
                "that are padding, or misses real ones; the native transport needs every real "
                "send entry received exactly once (tables from build_cast_table satisfy this)"
            )


# ---- NVSHMEM bootstrap ----------------------------------------------------------------------

_nv = {"bytes": 0, "started_bytes": 0, "all_mapped": False, "initialized": False}


def initialize(
    symmetric_bytes: int = _DEFAULT_SYMMETRIC_BYTES, started_bytes: int | None = None
) -> None:
    """Joins NVSHMEM (every process must call this, in the same order as its other
    collectives) and reserves ``symmetric_bytes`` of staging per GPU, plus ``started_bytes``
    for started reduces (default: as much when :attr:`CudaTuning.started_reduce` is on, else
    none). Call after ``jax.distributed.initialize``; leave GPU memory free for it (e.g.
    ``XLA_PYTHON_CLIENT_MEM_FRACTION``). Called with the default by the first
    ``make_flex_key(comm_backend="auto")`` over several GPUs (which picks ``xla`` if it
    fails), else lazily by the first native collective with max(its need (twice with
    :attr:`CudaTuning.double_buffer`), 1 GiB)."""
    if _nv["initialized"]:
        if symmetric_bytes > _nv["bytes"]:
            raise ValueError(
                f"NVSHMEM is already initialized with {_nv['bytes']} bytes of "
                f"staging; {symmetric_bytes} were asked for. Call "
                "magi_jax.sharding.native.initialize(symmetric_bytes=...) with "
                "the largest need before the first native collective and the "
                "first make_flex_key(comm_backend='auto') on GPUs (which joins "
                "NVSHMEM with the default staging)"
            )
        return
    lib = load_library("cuda")
    rank, n = jax.process_index(), jax.process_count()
    size = lib.magi_nv_uid_size()
    if n > 1:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError(
                "the native transport over several processes needs "
                "jax.distributed.initialize() first"
            )
        key = "magi_jax/nvshmem_uid"
        if rank == 0:
            buf = ctypes.create_string_buffer(size)
            if lib.magi_nv_get_uid(buf) != 0:
                raise RuntimeError("nvshmemx_get_uniqueid failed")
            client.key_value_set_bytes(key, buf.raw)
        uid = client.blocking_key_value_get_bytes(key, 300_000)
    else:
        buf = ctypes.create_string_buffer(size)
        if lib.magi_nv_get_uid(buf) != 0:
            raise RuntimeError("nvshmemx_get_uniqueid failed")
        uid = buf.raw
    symmetric_bytes = int(symmetric_bytes)
    started_bytes = int(
        symmetric_bytes
        if started_bytes is None and cuda_tuning().started_reduce
        else started_bytes or 0
    )
    flags_bytes = 16 * _FLAG_CAPACITY + (1 << 20)
    os.environ.setdefault(
        "NVSHMEM_SYMMETRIC_SIZE", str(symmetric_bytes + started_bytes + flags_bytes + (64 << 20))
    )
    err = ctypes.create_string_buffer(512)
    rc = lib.magi_nv_init(uid, rank, n, symmetric_bytes, _FLAG_CAPACITY, started_bytes, err, 512)
    if rc != 0:
        raise RuntimeError(f"NVSHMEM initialization failed ({rc}): {err.value.decode()}")
    _nv.update(
        bytes=symmetric_bytes,
        started_bytes=started_bytes,
        all_mapped=lib.magi_nv_all_mapped() == 1,
        initialized=True,
    )
    atexit.register(finalize)


def finalize() -> None:
    """Frees the symmetric buffers and leaves NVSHMEM (registered at exit)."""
    if _nv["initialized"]:
        _nv["initialized"] = False
        load_library("cuda").magi_nv_finalize()


def auto_reason(mesh: Mesh, cp_axis: str) -> str | None:
    """``None`` if ``comm_backend="auto"`` should pick ``native`` for ``mesh``: GPUs, one per
    process, the cp axis spanning every process in process order, the CUDA library built and,
    over more than one rank, NVSHMEM initialised (:func:`init_problem`: every process makes
    the same keys, so all join it together). Otherwise the reason it picks ``xla``."""
    devices = list(np.asarray(mesh.devices).reshape(-1))
    if devices[0].platform != "gpu":
        return f"the mesh is on {devices[0].platform}, the native fast path needs GPUs"
    problem = gpu_mesh_problem(mesh, cp_axis) or unavailable_reason("cuda")
    if problem is None and int(mesh.shape[cp_axis]) > 1:
        problem = init_problem()
    return problem


def init_problem() -> str | None:
    """Joins NVSHMEM now, with the default staging (unless
    :func:`magi_jax.sharding.native.initialize` ran already), so that ``comm_backend="auto"``
    learns at key time, not inside a traced step, whether the native transport can run here:
    ``None`` when it can, else why not (and a warning that says ``auto`` uses ``xla``). A
    failed initialisation is not retried in this process."""
    global _INIT_FAILURE
    if _INIT_FAILURE is None:
        try:
            initialize()
            _INIT_FAILURE = ""
        except (RuntimeError, OSError, ValueError) as e:
            _INIT_FAILURE = f"NVSHMEM failed to initialize ({type(e).__name__}: {e})"
            import warnings

            warnings.warn(
                f"comm_backend='auto' uses 'xla': {_INIT_FAILURE}", RuntimeWarning, stacklevel=3
            )
    return _INIT_FAILURE or None


_INIT_FAILURE: str | None = None  # None: not tried; "": initialized; else the failure


def staging_bytes(n_slots: int, slot_len: int, row_shape: tuple[int, ...], dtype: Any) -> int:
    """Symmetric staging bytes one collective needs: every position of the received blocks
    (``n_slots · S`` rows of ``row_shape`` and ``dtype``)."""
    return n_slots * slot_len * math.prod(row_shape) * np.dtype(dtype).itemsize


# ---- the collectives (inside shard_map) -----------------------------------------------------


def _where(axis_name: str):
    """int32 [2]: this device's rank on the cp axis and the index of its cp group (the other
    mesh axes flattened), so concurrent groups never share a CPU rendezvous."""
    rank = jax.lax.axis_index(axis_name).astype(jnp.int32)
    group = jnp.int32(0)
    mesh = jax.sharding.get_abstract_mesh()
    for name in getattr(mesh, "axis_names", ()):
        if name != axis_name and name in getattr(mesh, "manual_axes", ()):
            group = group * mesh.shape[name] + jax.lax.axis_index(name).astype(jnp.int32)
    return jnp.stack([rank, group])


def _platform() -> str:
    mesh = jax.sharding.get_abstract_mesh()
    plat = getattr(mesh, "_platform", None) or getattr(mesh, "platform", None)
    return platform_key(plat or jax.default_backend())


def _common_attrs(spec, timeout_s, prefix):
    return dict(
        cp=np.int64(spec.cp),
        shifts=np.asarray(spec.shifts, np.int64),
        call_id=np.int64(next(_call_ids)),
        prefix=bool(prefix),
        timeout_ms=np.int64(int(1000 * (DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s))),
    )


def _cuda_attrs(spec, n_rows_per_slot, row_bytes):
    t = cuda_tuning()
    total = max(1, sum(spec.widths))
    # Chunks of ~chunk_kib, but at least one per send block when the cast is small, and no
    # more than one bank of flags holds (the kernels use a bank per staging region).
    bank = _FLAG_CAPACITY // 2
    chunk_rows = max(1, t.chunk_kib * 1024 // max(1, row_bytes))
    rows_per_chunk = max(
        1, min(chunk_rows, -(-total // t.send_blocks)), -(-total // (bank - len(spec.widths)))
    )
    chunks = sum(-(-w // rows_per_chunk) for w in spec.widths)
    if chunks > bank:
        raise ValueError(f"native collective needs {chunks} flags (> {bank})")
    return dict(
        widths=np.asarray(spec.widths, np.int64),
        slot_len=np.int64(n_rows_per_slot),
        rows_per_chunk=np.int64(rows_per_chunk),
        send_blocks=np.int64(t.send_blocks),
        recv_blocks=np.int64(t.recv_blocks),
        mode=np.int64(_MODES[t.mode]),
        double_buffer=bool(t.double_buffer),
    )


def _on_stream(plat, call):
    """``call`` on the XLA GPU stream of :attr:`CudaTuning.stream` (unless 0)."""
    n = cuda_tuning().stream
    if plat != "cuda" or n in (0, "0"):
        return call
    from jax.experimental.compute_on import compute_on

    return compute_on(compute_type=f"gpu_stream:{n}", out_memory_spaces=jax.memory.Space.Device)(
        call
    )


def _ensure_staging(send, row_bytes: int, what: str):
    n, s = send.shape
    need = n * s * row_bytes
    if not _nv["initialized"]:
        # With CudaTuning.double_buffer, room for two calls' regions.
        initialize(max((1 + bool(_tuning[-1].double_buffer)) * need, _DEFAULT_SYMMETRIC_BYTES))
    if need > _nv["bytes"]:
        raise ValueError(
            f"this native collective stages {need / 2**20:.1f} MiB per GPU ({n} "
            f"slots x {s} rows of {what}) but only "
            f"{_nv['bytes'] / 2**20:.1f} MiB of NVSHMEM symmetric memory were reserved; call "
            f"magi_jax.sharding.native.initialize(symmetric_bytes={need}) (or more) before "
            "the first native collective, or use more overlap stages (smaller casts)"
        )


# Arrays one native collective moves at once (the handlers' kMaxLeaves).
MAX_ARRAYS = 4


def _arrays(x, what: str):
    """``(list of arrays, whether x was one array)``, checked: 1 to :data:`MAX_ARRAYS`
    arrays with one number of rows."""
    single = not isinstance(x, (list, tuple))
    xs = [x] if single else list(x)
    if not 1 <= len(xs) <= MAX_ARRAYS:
        raise ValueError(f"native {what} moves 1 to {MAX_ARRAYS} arrays at once; got {len(xs)}")
    if len({a.shape[0] for a in xs}) != 1:
        raise ValueError(
            f"native {what}: the arrays must have the same number of rows; got "
            f"shapes {[tuple(a.shape) for a in xs]}"
        )
    return xs, single


def _row_desc(xs) -> str:
    return " + ".join(f"{tuple(a.shape[1:])} {np.dtype(a.dtype).name}" for a in xs)


def _row_bytes(xs) -> int:
    return sum(math.prod(a.shape[1:]) * np.dtype(a.dtype).itemsize for a in xs)


def group_cast(
    x: Arrays,
    tables: tuple[jax.Array, jax.Array],
    spec: CastSpec,
    *,
    prefix: bool = False,
    timeout_s: float | None = None,
) -> Arrays:
    """Native :func:`~magi_jax.sharding.transport.group_cast` (no VJP of its own: the
    transport-generic ``group_cast`` wraps it). ``x [T, ...]`` -> ``[B, ...]``; ``x`` may be
    a list of up to :data:`MAX_ARRAYS` arrays with the same rows (e.g. ``[k, v]``): one
    collective moves their rows side by side, without concatenating them, and returns a list.
    ``prefix=True`` returns ``concatenate([x, cast(x)])`` (``[T + B, ...]``) without a
    concatenation: the kernel copies x's rows while the peers' rows are on their way."""
    send, recv = tables
    plat = _platform()
    load_library(plat)
    xs, single = _arrays(x, "group_cast")
    attrs = _common_attrs(spec, timeout_s, prefix)
    if plat == "cuda":
        _ensure_staging(send, _row_bytes(xs), _row_desc(xs))
        attrs.update(_cuda_attrs(spec, send.shape[1], _row_bytes(xs)))
    rows = recv.shape[0] + (xs[0].shape[0] if prefix else 0)
    flat = [a.reshape(a.shape[0], -1) for a in xs]
    outs = [jax.ShapeDtypeStruct((rows, f.shape[1]), f.dtype) for f in flat]
    got = _on_stream(plat, lambda *a: jax.ffi.ffi_call(CAST_TARGET, outs)(*a, **attrs))(
        send, recv, _where(spec.axis_name), *flat
    )
    got = [g.reshape((rows,) + a.shape[1:]) for g, a in zip(got, xs)]
    return got[0] if single else got


def _reduce_call(y, tables, spec, num_rows, acc, prefix, out_dtype, timeout_s, own=None):
    """What a native reduce passes to its handler: ``(plat, ys, single, args, outs, attrs,
    inputs, aliases)``; ``args`` are the handler's arguments (tables, ``where``, own rows,
    arrays, initial sums), ``inputs`` the flattened arrays among them, ``aliases`` the
    ``input_output_aliases`` of the call (the own rows, where the sums go in place)."""
    send, recv = tables
    plat = _platform()
    load_library(plat)
    ys, single = _arrays(y, "group_reduce")
    if len({a.dtype for a in ys}) != 1:
        raise TypeError(
            "native group_reduce sums arrays of one dtype at a time; got "
            f"{[str(a.dtype) for a in ys]}"
        )
    dtype = ys[0].dtype
    wide = dtype == jnp.float64
    acc_dtype = jnp.float64 if wide else jnp.float32
    if plat == "cuda" and dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise TypeError(f"native group_reduce on GPU takes bf16, f16 or f32; got {dtype}")
    out_dtype = acc_dtype if out_dtype is None else jnp.dtype(out_dtype)
    if out_dtype not in (acc_dtype, dtype):
        raise TypeError(
            f"native group_reduce: out_dtype={out_dtype} is neither the sums' "
            f"{jnp.dtype(acc_dtype)} nor the input's {dtype}"
        )
    owns = []
    if own is not None:
        owns = [own] if single else list(own)
        if prefix:
            raise ValueError(
                "native group_reduce: pass the own rows either in y (prefix=True) "
                "or as own=, not both"
            )
        if len(owns) != len(ys):
            raise ValueError(
                f"native group_reduce: {len(owns)} own arrays for {len(ys)} "
                "arrays; pass one per array"
            )
        for i, (o, a) in enumerate(zip(owns, ys)):
            if o.shape != (num_rows,) + a.shape[1:] or o.dtype != dtype:
                raise ValueError(
                    f"native group_reduce: own[{i}] is {tuple(o.shape)} {o.dtype}, expected "
                    f"{(num_rows,) + a.shape[1:]} {dtype} (num_rows rows of y[{i}]'s rows)"
                )
    want = recv.shape[0] + (num_rows if prefix else 0)
    if ys[0].shape[0] != want:
        raise ValueError(
            f"native group_reduce: y has {ys[0].shape[0]} rows, expected {want} ("
            + (f"num_rows={num_rows} own rows, then " if prefix else "")
            + f"one per buffer row, {recv.shape[0]})"
        )
    flat = [a.reshape(a.shape[0], -1) for a in ys]
    outs = [jax.ShapeDtypeStruct((num_rows, f.shape[1]), out_dtype) for f in flat]
    accumulate = acc is not None
    accs = []
    if accumulate:
        accs = [acc] if single else list(acc)
        if len(accs) != len(ys):
            raise ValueError(
                f"native group_reduce: {len(accs)} initial sums for {len(ys)} "
                "arrays; pass one per array"
            )
        accs = [a.astype(acc_dtype).reshape(num_rows, f.shape[1]) for a, f in zip(accs, flat)]
    attrs = _common_attrs(spec, timeout_s, prefix)
    attrs["accumulate"] = accumulate
    attrs["out_input_dtype"] = out_dtype != acc_dtype
    attrs["own_apart"] = bool(owns)
    owns = [o.reshape(num_rows, -1) for o in owns]
    where = _where(spec.axis_name)
    head = [send, recv, where]
    if plat == "cuda":
        _ensure_staging(send, _row_bytes(ys), _row_desc(ys))
        attrs.update(_cuda_attrs(spec, send.shape[1], _row_bytes(ys)))
        head += _inverse_tables(send, recv, num_rows)
    # Sums in the own rows' dtype and nothing to add: in place (rows nobody sends to stay).
    aliases = (
        {len(head) + i: i for i in range(len(owns))}
        if owns and out_dtype == dtype and not accumulate
        else {}
    )
    return (plat, ys, single, [*head, *owns, *flat, *accs], outs, attrs, flat, aliases)


def _inverse_tables(send, recv, num_rows):
    """The CUDA reduce's index tables: ``inv[row, j] = p`` with ``send[j, p] = row`` (the
    owner's slot position of each row) and ``rinv[j*S + p] = b`` with ``recv[b] = j*S + p``
    (the buffer row that answers it)."""
    n, s = send.shape
    rows = jnp.where(send < 0, num_rows, send)
    inv = (
        jnp.full((num_rows + 1, n), -1, jnp.int32)
        .at[rows, jnp.arange(n)[:, None]]
        .set(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (n, s)))[:num_rows]
    )
    ridx = jnp.where(recv < 0, n * s, recv)
    rinv = (
        jnp.full((n * s + 1,), -1, jnp.int32)
        .at[ridx]
        .set(jnp.arange(recv.shape[0], dtype=jnp.int32))[: n * s]
    )
    return [inv, rinv]


def _unflat(got, ys, num_rows, single):
    got = [g.reshape((num_rows,) + a.shape[1:]) for g, a in zip(got, ys)]
    return got[0] if single else got


def group_reduce(
    y: Arrays,
    tables: tuple[jax.Array, jax.Array],
    spec: CastSpec,
    num_rows: int,
    *,
    acc: Arrays | None = None,
    prefix: bool = False,
    own: Arrays | None = None,
    out_dtype: Any = None,
    timeout_s: float | None = None,
) -> Arrays:
    """Native :func:`~magi_jax.sharding.transport.group_reduce`: ``y [B, ...]`` summed in
    float32 (float64 for float64 ``y``; CPU only) into the owners' rows ->
    ``[num_rows, ...]``, added to ``acc`` (same shape, float32) when given. ``y`` (and
    ``acc``) may be lists of up to :data:`MAX_ARRAYS` arrays of one dtype with the same rows:
    one collective sums them all and returns a list. ``prefix=True``: ``y`` is
    ``[num_rows + B, ...]``, the owner's own rows first, and they are added to the sums (the
    adjoint of ``group_cast(prefix=True)``). ``own``: those own rows as arrays of their own
    (``[num_rows, ...]``, like ``y``), with ``y`` only the buffer; when the sums come in
    their dtype and there is no ``acc``, the result is written in place into them (XLA
    copies an ``own`` that is used afterwards) and rows nobody sends to cost nothing.
    ``out_dtype``: the float32 (float64) sums by default, or ``y``'s dtype, rounded once."""
    plat, ys, single, args, outs, attrs, _, aliases = _reduce_call(
        y, tables, spec, num_rows, acc, prefix, out_dtype, timeout_s, own
    )
    got = _on_stream(
        plat,
        lambda *a: jax.ffi.ffi_call(REDUCE_TARGET, outs, input_output_aliases=aliases)(*a, **attrs),
    )(*args)
    return _unflat(got, ys, num_rows, single)


def reduce_runs(table: CastTable) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """What a started reduce copies, from a stacked ``CastTable``: per rank, the maximal runs
    ``(b0, e0, length)`` of its receive table (``recv_index[b0 + i] = e0 + i`` within one
    slot), flattened, and the offsets of each rank's runs in them (``cp + 1``). Buffer rows
    ``b0 ..`` go back to the owner's slot positions ``e0 ..`` in one copy per array. ``None``
    when some rank has more than :data:`MAX_RUNS` runs."""
    recv = np.asarray(table.recv_index, np.int64)
    s = table.slot_len
    flat, offsets = [], [0]
    for e in recv:
        b = np.nonzero(e >= 0)[0]
        eb = e[b]
        start = np.ones(len(b), bool)
        start[1:] = (np.diff(b) != 1) | (np.diff(eb) != 1) | (eb[1:] // s != eb[:-1] // s)
        first = np.nonzero(start)[0]
        if len(first) > MAX_RUNS:
            return None
        lens = np.diff(np.append(first, len(b)))
        flat.extend(np.stack([b[first], eb[first], lens], 1).reshape(-1).tolist())
        offsets.append(len(flat))
    return tuple(flat), tuple(offsets)


def can_start_reduce(spec: CastSpec) -> bool:
    """Whether :func:`group_reduce_start` can run for ``spec`` here: its runs are known
    (:func:`reduce_runs`), :attr:`CudaTuning.started_reduce` is on and, on GPU, NVSHMEM is
    initialized (a forward's cast does it) with staging for started reduces and every PE
    load/store reachable (the sends write the peers' staging)."""
    if spec.runs is None or not spec.shifts or not cuda_tuning().started_reduce:
        return False
    if _platform() != "cuda":
        return True
    return _nv["initialized"] and _nv["all_mapped"] and _nv["started_bytes"] > 0


def group_reduce_start(
    y: Arrays,
    tables: tuple[jax.Array, jax.Array],
    spec: CastSpec,
    num_rows: int,
    *,
    prefix: bool = False,
    own: Arrays | None = None,
    out_dtype: Any = None,
    timeout_s: float | None = None,
) -> tuple[jax.Array, Callable[[jax.Array], Arrays]]:
    """:func:`group_reduce` in two calls, so that other kernels run while its rows move:
    returns ``(token, done)``; ``done(token)`` returns what ``group_reduce`` would. On GPU the
    start queues, on a high-priority side stream, a copy kernel of 16 blocks that writes the
    runs of ``spec.runs`` into the owners' staging (the rest of the GPU stays with the
    kernels XLA runs meanwhile); ``done`` waits for them and sums. Order the work to overlap
    between the two with the token (e.g. ``jax.lax.optimization_barrier``), and pass it
    through nothing else: ``y`` must reach ``done`` as the same buffer (checked); ``own``
    (as in :func:`group_reduce`) is read only by ``done``. The done
    calls of several started reduces must come in the order of their starts. Needs
    :func:`can_start_reduce`. On CPU the start checks the runs against the tables and the
    done call does the whole reduce."""
    if not can_start_reduce(spec):
        raise ValueError(
            "group_reduce_start: this reduce cannot be started here (see "
            "magi_jax.sharding.native.can_start_reduce); call group_reduce"
        )
    plat, ys, single, args, outs, attrs, flat, aliases = _reduce_call(
        y, tables, spec, num_rows, None, prefix, out_dtype, timeout_s, own
    )
    if plat == "cuda" and (
        not _nv["all_mapped"]
        or _nv["started_bytes"] < staging_bytes(*tables[0].shape, (_row_bytes(ys),), np.uint8)
    ):
        raise ValueError(
            "group_reduce_start needs every PE load/store reachable and staging for started "
            f"reduces of {staging_bytes(*tables[0].shape, (_row_bytes(ys),), np.uint8)} "
            f"bytes; {_nv['started_bytes']} were reserved (magi_jax.sharding.native.initialize("
            "started_bytes=...))"
        )
    runs, offsets = spec.runs
    start_attrs = dict(
        cp=attrs["cp"],
        slot_len=np.int64(tables[0].shape[1]),
        runs=np.asarray(runs, np.int64),
        run_offsets=np.asarray(offsets, np.int64),
    )
    if plat == "cuda":
        start_attrs.update(
            {
                k: v
                for k, v in attrs.items()
                if k not in ("accumulate", "out_input_dtype", "own_apart")
            }
        )
    _, recv, where = args[:3]
    token = jax.ffi.ffi_call(START_TARGET, jax.ShapeDtypeStruct((1,), jnp.int32))(
        recv, where, *flat, **start_attrs
    )

    def done(token):
        got = jax.ffi.ffi_call(
            DONE_TARGET, outs, input_output_aliases={i + 1: o for i, o in aliases.items()}
        )(token, *args, **attrs)
        return _unflat(got, ys, num_rows, single)

    return token, done
