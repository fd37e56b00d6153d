"""Building keys: :func:`make_flex_key` (one mask), :func:`make_varlen_key` and the key
cache. A key's options are :class:`~magi_jax.sharding.keys._options.KeyOptions`; what they
mean with a mask and a mesh is resolved by :mod:`~magi_jax.sharding.keys._resolve`, planned
on the host by :mod:`~magi_jax.sharding.keys._host`; keys of a batch of masks are
:mod:`~magi_jax.sharding.keys._batch`'s.

Building a key is host work (NumPy planning in :mod:`magi_jax.planning`), cached by (mask
fingerprint, mesh, options); the host arrays become global arrays whose shards each process
fills itself (:func:`put_global`), so every process of a multi-host job builds the same key
with nothing exchanged.

Cross attention (``total_q != total_k``) keys dispatch the queries like self-attention and
keep the keys either whole on every rank (``key.kv_layout == "replicated"``) or dispatched
by a permutation of their own (``"dispatched"``).

The names imported ``as`` themselves are what this module held before option resolution and
host planning left it, importable from its old path (``magi_jax.sharding.make_key``) for one
release.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from magi_jax._log import get_logger
from magi_jax.caches import Cache
from magi_jax.masks import AttnMask
from magi_jax.planning import KV_LAYOUTS as KV_LAYOUTS
from magi_jax.planning import PlanCapacity
from magi_jax.sharding.keys._host import HostKey as HostKey
from magi_jax.sharding.keys._host import host_key
from magi_jax.sharding.keys._key import CheckedKey, MagiKey
from magi_jax.sharding.keys._options import CHECK_DISPATCH_ENV as CHECK_DISPATCH_ENV
from magi_jax.sharding.keys._options import COMM_BACKENDS as COMM_BACKENDS
from magi_jax.sharding.keys._options import HIERARCHICAL as HIERARCHICAL
from magi_jax.sharding.keys._options import MAX_OVERLAP_DEGREE as MAX_OVERLAP_DEGREE
from magi_jax.sharding.keys._options import KeyOptions
from magi_jax.sharding.keys._resolve import ResolvedOptions, resolve_options
from magi_jax.sharding.keys._resolve import ffa_backend_reason as ffa_backend_reason


def make_flex_key(
    mask: AttnMask,
    mesh: Mesh,
    cp_axis: str = "cp",
    *,
    chunk_size: int | None = None,
    overlap_degree: int | tuple[int, int] | str | None = None,
    comm_backend: str = "auto",
    dispatch_algorithm: str = "magi",
    dispatch_from: MagiKey | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    ffa_backend: str = "auto",
    backward_refetch: bool = True,
    capacity: PlanCapacity | None = None,
    check_dispatch: bool | None = None,
    kv_layout: str = "auto",
    hierarchical: bool | str = "auto",
    batch_axes: str | Sequence[str] = (),
    head_axes: str | Sequence[str] = (),
    cast_gating: str = "auto",
) -> MagiKey:
    """Plans context-parallel attention of ``mask`` over ``mesh``'s ``cp_axis``.

    Args:
      mask: an :class:`AttnMask` over the packed sequence in natural order: self-attention
        (``total_q == total_k``) or cross attention (``total_q`` queries of one sequence,
        ``total_k`` keys of another, e.g. video tokens attending to text tokens). Lengths
        need not divide anything: the sequences are padded.
      mesh, cp_axis: the mesh and the name of its context-parallel axis (other axes, if any,
        see the same sequence shard: replicated), or a tuple of axis names, e.g.
        ``("node", "local")``: context parallelism over their flattening (rank
        ``node · local_size + local``; shard arrays with ``P(("node", "local"))``).
      chunk_size: dispatch granularity in tokens (default: chosen by the solver, ≥ 8 chunks
        per rank).
      overlap_degree: number of remote stages (0: fetch all remote KV, then one FFA call;
        at most :data:`MAX_OVERLAP_DEGREE`): one integer for the forward and the backward,
        or a pair ``(forward, backward)``: the backward then runs a stage split of its own
        (its ratio of compute to communication differs: ~2.5x the forward's FLOPs against a
        second cast of the KV and a reduce of dK/dV; ``key.overlap_degree`` and
        ``key.backward_overlap_degree`` say what was chosen; a pair of different degrees
        needs ``backward_refetch=True``). ``None`` or ``"auto"`` (default): one degree for
        both, from a compute/communication cost model whose constants were measured on a
        pair of H200s (:func:`~magi_jax.planning.cost_model.default_overlap_degree`). To choose by
        timing on the machine at hand, pass the ``degrees`` of
        :func:`~magi_jax.sharding.calibrate.calibrate_overlap`.
      comm_backend: ``"xla"`` (XLA collectives, transport per stage), ``"ppermute"``,
        ``"all_to_all"``, ``"native"`` (the FFI transport of :mod:`magi_jax.sharding.native`)
        or ``"auto"``: ``native`` on GPUs with one process per GPU when its CUDA library was
        built, else ``xla`` (``magi_jax.sharding.native.auto_reason(mesh, cp_axis)`` says
        why).
      dispatch_algorithm: one of :data:`~magi_jax.planning.solver.ALGORITHMS`.
      dispatch_from: reuse this key's dispatch (same chunks on the same ranks) for another
        mask over the same sequence — layers with different masks share one dispatch.
      block_q, block_k: FFA tile sizes (default 128, smaller for short local lengths).
      ffa_backend: per-rank FFA implementation: ``"auto"`` (default: ``"pallas"`` when the
        default device is an sm90 GPU, else ``"xla"``; :func:`ffa_backend_reason` says why),
        ``"xla"`` (portable) or ``"pallas"`` (Mosaic GPU kernels: Hopper, bf16/fp16, D 64,
        128 or 256; :func:`~magi_jax.sharding.magi_attention` rejects other inputs, naming the
        fix).
      backward_refetch: the backward re-fetches each remote stage's KV (one more group-cast
        per stage) instead of keeping every stage's buffer from the forward (memory: local
        KV plus the stage in flight; docs/design.md §3.2). ``False`` keeps the buffers (less
        communication, more memory).
      capacity: a :class:`~magi_jax.planning.capacity.PlanCapacity` over ``total`` tokens:
        the key's arrays and static part then depend on (mesh, axis, capacity, options)
        only, so a jitted step that takes the key as an argument compiles once for every
        mask within the capacity (chunk size and overlap degree come from the capacity). A
        mask that needs more raises :class:`~magi_jax.planning.capacity.CapacityError`
        naming the field. ``None``: a key sized for this mask alone (its static part names
        the mask: a new mask compiles anew).
      check_dispatch: debug mode that makes natural-order inputs of
        :func:`~magi_jax.sharding.magi_attention` impossible to mistake for dispatched ones
        (default: the ``MAGI_JAX_CHECK_DISPATCH`` environment variable, off). Returns a
        :class:`CheckedKey`: same plan, same results, but its dispatched layout carries one
        hidden row at the end of every rank's block (``key.padded_total`` and
        ``key.local_len`` count it), so an array that skipped :func:`dispatch` — even one
        sharded over the cp axis, even under ``jit`` on an Auto mesh — never has the
        dispatched length and is rejected ("dispatch first"). Costs a slice and a pad of
        q/k/v/out per call; for debugging, not for training runs. Self-attention keys only.
        Arrays dispatched with another key of the same mesh (a stale key) are caught by
        ``dispatch(x, key, typed=True)`` (:class:`~magi_jax.sharding.DispatchedArray`), not
        by this layout.
      kv_layout: where the keys of a cross-attention mask live (``key.kv_layout`` says what
        was chosen). ``"auto"`` (default): ``"shared"`` for ``total_q == total_k`` (the
        self-attention plan: keys dispatched with the queries), otherwise
        ``"replicated"`` when ``total_k <= ceil(total_q / cp)`` and ``"dispatched"`` beyond
        (:func:`~magi_jax.planning.solver.auto_kv_layout`; the rule reads lengths only).
        ``"replicated"``: every rank holds all ``total_k`` keys; the forward moves no KV and
        the backward sums dK/dV over the ranks. ``"dispatched"``: the keys are padded, cut
        into chunks of their own and spread evenly over the ranks (the chunks most seen by a
        rank's queries go to that rank, :func:`~magi_jax.planning.solver.solve_kv_dispatch`),
        and remote keys are fetched as in self-attention. Either way lay keys and values out
        with ``dispatch(k, key, role="kv")``. Cross keys run on the XLA transports
        (``comm_backend="auto"`` picks ``"xla"`` for them; ``"native"`` is refused).

      hierarchical: two-hop casts on a mesh of nodes, for ``cp_axis=(node_axis,
        local_axis)``: a KV row that several ranks of one node need crosses between nodes
        once, to one of them, which forwards it inside the node; the backward sums inside
        the node first, then sends once (:mod:`magi_jax.planning.relay_table`). ``"auto"``
        (default): for every stage whose two-hop cast sends fewer rows between nodes (padding
        of the ``ppermute`` slots included), on a
        key of one mask (at a capacity every slot is padded to its width, so it moves no
        fewer; ``True`` turns it on there). ``True``: every stage; needs two cp axes and
        the ``lax.ppermute`` transport. ``False``: flat casts.

      batch_axes: mesh axes the batch axis of ``[B, T, H, D]`` inputs is sharded over (data
        or fully-sharded data parallelism, e.g. ``("dp",)`` or ``("dp", "fsdp")``): each
        device attends only the rows it holds, with no collective over these axes. Default
        ``()``: the batch is replicated over every non-cp axis (each device computes every
        row). For a different packing per row, see :func:`make_batch_key`.
      head_axes: mesh axes the heads of q, k, v are sharded over (tensor parallelism): every
        head shard runs the same plan on its heads, with no collective over these axes; the
        query and key/value head counts must divide by their size.
      cast_gating: how the ``lax.ppermute`` slots of the ``xla`` transport (one slot per
        shift ``s`` of the ranks, rank ``r`` sending to ``r + s``) follow the rows each
        sender-receiver pair needs (:mod:`magi_jax.sharding.transport._pair`). ``"auto"``
        (default): a key of one mask moves each pair's exact rows (its counts are static: a
        few ``ppermute`` levels per slot, no conditional); a key at a capacity moves each
        slot in gated pieces that its fullest rank fills (one conditional per slot).
        ``"pair"``: a key at a capacity moves each pair's own gated pieces
        (:data:`~magi_jax.planning.cost_model.PAIR_CAST_PIECES` a slot): the busiest rank's
        wire stays within 1.25x its real rows on every mask counted
        (benchmarks/results/wire/LATEST.md) against up to 3.2x, at ``cp · (cp − 1) · 6``
        conditional collectives per cast instead of ``cp − 1`` (their cost on GPUs is
        unmeasured; CPU figures in benchmarks/results/wire/LATEST.md). ``"slot"``:
        gated slots at a capacity and whole slots for a key of one mask (as before pairs).
        Two-hop casts (``hierarchical``) are gated by slot whatever this says; the
        ``native`` transport moves exact rows anyway (``"slot"`` and ``"pair"`` need
        ``comm_backend="xla"`` or ``"ppermute"``).

    Returns a :class:`MagiKey`; cached by (mask fingerprint, mesh, options, capacity), in a
    cache bounded by the bytes of its keys' arrays (:func:`clear_key_cache`).
    """
    options = KeyOptions(
        chunk_size=chunk_size,
        overlap_degree=overlap_degree,
        comm_backend=comm_backend,
        dispatch_algorithm=dispatch_algorithm,
        dispatch_from=dispatch_from,
        block_q=block_q,
        block_k=block_k,
        ffa_backend=ffa_backend,
        backward_refetch=backward_refetch,
        capacity=capacity,
        check_dispatch=check_dispatch,
        kv_layout=kv_layout,
        hierarchical=hierarchical,
        batch_axes=batch_axes,
        head_axes=head_axes,
        cast_gating=cast_gating,
    )
    resolved = resolve_options(mask, mesh, cp_axis, options)
    key = _KEYS.get(resolved, lambda: _make_key(resolved))
    return CheckedKey.of(key) if resolved.check else key


# Keys by their resolved options, bounded by the bytes of the keys' device arrays (each key
# holds [cp, ...] plan arrays on every device): 1 GiB, a few hundred keys of 32k tokens, a
# handful at 1M.
_KEYS = Cache("keys", max_bytes=1 << 30, size_of=lambda key: key.nbytes())


def clear_key_cache(max_bytes: int | None = None) -> None:
    """Drops every cached key (and with ``max_bytes``, sets the cache's bound in bytes of
    device arrays; default 1 GiB). Cached host plans are cleared by
    :func:`magi_jax.clear_caches`."""
    _KEYS.clear()
    if max_bytes is not None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        _KEYS.max_bytes = int(max_bytes)


_LOG = get_logger("keys")


def _make_key(resolved: ResolvedOptions) -> MagiKey:
    """A key of one mask: :func:`~magi_jax.sharding.keys._host.host_key`, its arrays made
    global (plans sharded over the cp axis, replicated over every other axis; the chunk
    permutations replicated)."""
    start = time.perf_counter()
    hk = host_key(resolved)
    st = hk.static
    _LOG.debug(
        "planned a key: %d tokens, %d slices, cp %d over %r, %s, padded_total %d, %d stages; "
        "host plan in %.3f s",
        st.total,
        hk.mask.num_slices if hk.mask is not None else -1,
        st.cp,
        st.cp_axis,
        "one mask" if st.capacity is None else "at a capacity",
        st.padded_total,
        len(st.stages),
        time.perf_counter() - start,
    )
    mesh, cp_axis = hk.static.mesh, hk.static.cp_axis
    by_rank = NamedSharding(mesh, P(cp_axis))
    replicated = NamedSharding(mesh, P())
    stage_arrays, backward_stage_arrays = jax.tree.map(
        lambda a: put_global(a, by_rank), (hk.stage_arrays, hk.backward_stage_arrays)
    )
    return MagiKey(
        hk.static,
        put_global(hk.chunk_order, replicated),
        put_global(hk.chunk_inverse, replicated),
        stage_arrays,
        *(put_global(a, replicated) for a in hk.kv_chunks),
        backward_stage_arrays=backward_stage_arrays,
        plan_id=put_global(hk.plan_id, by_rank),
        plan=hk.plan,
        mask=hk.mask,
    )


def put_global(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host int32 array every process computed identically -> a global array; each
    process fills only its addressable shards (multi-host safe, no cross-host transfer)."""
    a = np.ascontiguousarray(a, np.int32)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def make_varlen_key(
    cu_seqlens: Sequence[int] | np.ndarray,
    mesh: Mesh,
    cp_axis: str = "cp",
    *,
    causal: bool = True,
    window: int | tuple[int, int] | None = None,
    **options: Any,
) -> MagiKey:
    """:func:`make_flex_key` for packed documents (``AttnMask.varlen(cu_seqlens, causal,
    window)``; causal by default, like ``AttnMask.varlen``); ``options`` as for
    :func:`make_flex_key`."""
    return make_flex_key(
        AttnMask.varlen(cu_seqlens, causal=causal, window=window), mesh, cp_axis, **options
    )
