"""``magi_attention``: context-parallel flexible-mask attention under ``shard_map``.

Per rank (DESIGN.md §3): stage 0 runs FFA on the local KV while remote stage 0 is
group-cast; every remote stage runs FFA on its fetched KV buffer; the partial ``(out, lse)``
are merged in float32. With ``overlap_degree = 0`` all remote KV is fetched first and one FFA
call covers ``concat(local KV, remote KV)``. Backward is autodiff of these pieces: FFA's own
VJP, the merge, and ``group_cast``'s adjoint ``group_reduce``, which sums the partial dK/dV
of fetched KV (float32) back onto their owners. With ``backward_refetch=True`` on the key,
each remote stage is rematerialised in the backward (its KV buffer re-fetched rather than
kept, so memory stays at local KV plus the stage in flight) at the price of re-running that
stage's FFA forward; by default the buffers are kept as residuals.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from magi_jax.sharding.collectives import group_cast
from magi_jax.sharding.ffa_backends import get_backend
from magi_jax.sharding.key import MagiKey, _check_key

__all__ = ["magi_attention", "magi_attention_local", "merge_partials"]
_REMOTE_KV = "magi_remote_kv"


def merge_partials(outs, lses, dtype):
    """Exact merge of partial attention over disjoint key sets, in float32:
    ``lse = log Σ exp(lse_i)``, ``out = Σ out_i · exp(lse_i − lse)``. Rows with no key in any
    part give ``out = 0``, ``lse = -inf`` (and finite, zero gradients)."""
    if len(outs) == 1:
        return outs[0].astype(dtype), lses[0]
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
    lse = jnp.stack([x.astype(acc) for x in lses])                  # [n, T, H]
    m = jax.lax.stop_gradient(jnp.max(lse, axis=0))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)                                             # 0 where lse = -inf
    total = w.sum(axis=0)
    has = total > 0
    safe = jnp.where(has, total, 1.0)
    merged_lse = jnp.where(has, m + jnp.log(safe), -jnp.inf)
    out = sum(o.astype(acc) * (wi / safe)[..., None] for o, wi in zip(outs, w))
    return out.astype(dtype), merged_lse.astype(lses[0].dtype)


def _stage_ffa(q, k_local, v_local, kv_local, ffa_arrays, cast_arrays, stage, key, scale,
               softcap):
    ffa = get_backend(key.ffa_backend).call
    hkv = k_local.shape[-2]
    seq = q.ndim - 3                                   # 1 with a leading batch axis
    if stage.cast is None:
        kk, vv = k_local, v_local
    else:
        # The cast moves rows of its first axis: put the sequence first for batched inputs.
        buf = group_cast(jnp.moveaxis(kv_local, seq, 0), cast_arrays, stage.cast)
        buf = jnp.moveaxis(buf, 0, seq)
        kk, vv = buf[..., :hkv, :], buf[..., hkv:, :]
        if stage.combined:
            kk = jnp.concatenate([k_local, kk], axis=seq)
            vv = jnp.concatenate([v_local, vv], axis=seq)
        # The values FFA keeps for its backward are named, so the stage's checkpoint policy
        # (backward_refetch) re-fetches them instead of holding every stage's KV buffer.
        kk, vv = checkpoint_name(kk, _REMOTE_KV), checkpoint_name(vv, _REMOTE_KV)
    return ffa(q, kk, vv, ffa_arrays, softmax_scale=scale, softcap=softcap,
               block_q=key.block_q, block_k=key.block_k)


def _local(q, k, v, stage_arrays, key: MagiKey, scale: float, softcap: float):
    """One rank: q/k/v ``[(B,) local_len, H, D]``, ``stage_arrays`` this rank's plan arrays."""
    kv = jnp.concatenate([k, v], axis=-2)         # one collective carries K and V
    outs, lses = [], []
    for stage, (ffa_arrays, cast_arrays) in zip(key.stages, stage_arrays):
        fn = functools.partial(_stage_ffa, stage=stage, key=key, scale=scale,
                               softcap=softcap)
        if stage.cast is not None and key.backward_refetch:
            # Re-fetch the remote KV in the backward instead of keeping every stage's buffer
            # (costs re-running the stage's FFA forward: the FFA contract has no entry that
            # takes saved (out, lse) without its inputs).
            fn = jax.checkpoint(
                fn, policy=jax.checkpoint_policies.save_any_names_but_these(_REMOTE_KV))
        o, l = fn(q, k, v, kv, ffa_arrays, cast_arrays)
        outs.append(o)
        lses.append(l)
    return merge_partials(outs, lses, q.dtype)


def _check_inputs(q, k, v, key):
    _check_key(key)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim not in (3, 4) or x.ndim != q.ndim:
            raise ValueError(f"magi_attention: {name} must be [padded_total, H, D] or "
                             f"[B, padded_total, H, D] (dispatched tokens, like q); got shape "
                             f"{tuple(x.shape)}")
        if x.shape[-3] != key.padded_total:
            raise ValueError(
                f"magi_attention: {name} has {x.shape[-3]} tokens but the key dispatches "
                f"{key.padded_total} ({key.total} + padding); dispatch it first with "
                "mj.dispatch(x, key)" + (", seq_axis=1" if x.ndim == 4 else ""))
    if q.ndim == 4 and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q has D={q.shape[-1]}, k/v have D={k.shape[-1]}")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"q has {q.shape[-2]} heads and k/v have {k.shape[-2]}: the number "
                         "of query heads must be a multiple of the number of key/value heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them "
                        "to one dtype")


def magi_attention(q, k, v, key: MagiKey, *, softmax_scale: float | None = None,
                   softcap: float = 0.0):
    """Context-parallel attention of dispatched tokens.

    Args:
      q: ``[padded_total, Hq, D]``, k/v: ``[padded_total, Hkv, D]`` — outputs of
        :func:`~magi_jax.sharding.key.dispatch` (or computed from dispatched activations),
        sharded over ``key.cp_axis``; or ``[B, padded_total, H, D]`` (one mask for the
        batch; dispatch with ``seq_axis=1``).
      key: from :func:`make_flex_key` / :func:`make_varlen_key`.
      softmax_scale: default ``D ** -0.5``; softcap: tanh soft-capping (0 = off).

    Returns ``(out, lse)`` in dispatched order: ``out`` like ``q``, ``lse``
    ``[(B,) padded_total, Hq]`` float32; padding rows give ``out = 0``, ``lse = -inf``.
    Differentiable in q, k, v; works under ``jax.jit``.
    """
    _check_inputs(q, k, v, key)
    if softcap < 0:
        raise ValueError(f"softcap={softcap} must be >= 0 (0 disables soft-capping)")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    spec = P(key.cp_axis) if q.ndim == 3 else P(None, key.cp_axis)
    plan_spec = P(key.cp_axis)

    def body(q, k, v, stage_arrays):
        stage_arrays = jax.tree.map(lambda a: a[0], stage_arrays)
        return _local(q, k, v, stage_arrays, key, scale, float(softcap))

    arr_specs = jax.tree.map(lambda _: plan_spec, key.stage_arrays)
    fn = jax.shard_map(body, mesh=key.mesh, in_specs=(spec, spec, spec, arr_specs),
                       out_specs=(spec, spec), check_vma=False)
    return fn(q, k, v, key.stage_arrays)


def magi_attention_local(q, k, v, key: MagiKey, *, softmax_scale: float | None = None,
                         softcap: float = 0.0):
    """The per-rank body, for callers already inside ``shard_map`` over ``key.cp_axis``:
    q/k/v are this rank's ``[local_len, H, D]`` tokens; the rank's plan rows are picked with
    ``lax.axis_index`` from the (replicated) stacked plan. Returns ``(out, lse)`` local."""
    _check_key(key)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    r = jax.lax.axis_index(key.cp_axis)
    stage_arrays = jax.tree.map(lambda a: jnp.asarray(a)[r], key.stage_arrays)
    return _local(q, k, v, stage_arrays, key, scale, float(softcap))
