"""``magi_attention``: context-parallel flexible-mask attention under ``shard_map``.

Per rank (DESIGN.md §3): stage 0 runs FFA on the local KV while remote stage 0 is
group-cast; every remote stage runs FFA on its fetched KV buffer; the partial ``(out, lse)``
are merged in float32. With ``overlap_degree = 0`` all remote KV is fetched first and one FFA
call covers ``concat(local KV, remote KV)``. Backward is autodiff of these pieces: FFA's own
VJP, the merge, and ``group_cast``'s adjoint ``group_reduce``, which sums the partial dK/dV
of fetched KV (float32) back onto their owners. By default (``backward_refetch=True`` on the
key) every remote stage is a custom VJP whose backward re-fetches the stage's KV (group-cast
again) rather than keeping it, runs the FFA backward from the saved ``(out, lse)`` and
group-reduces dK/dV — memory stays at local KV plus the stage in flight, and no FFA forward
is re-run (backends without a split VJP, or batched inputs, fall back to rematerialising the
stage). ``backward_refetch=False`` keeps the buffers as residuals instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from magi_jax.sharding.collectives import _cast, _reduce, group_cast
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


def _fetch(kv, cast_arrays, stage, hkv):
    """A stage's K and V: the cast buffer (after the local KV for a combined stage)."""
    buf = _cast(kv, cast_arrays, stage.cast)
    kk, vv = buf[:, :hkv], buf[:, hkv:]
    if stage.combined:
        kk = jnp.concatenate([kv[:, :hkv], kk])
        vv = jnp.concatenate([kv[:, hkv:], vv])
    return kk, vv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _refetch_stage(q, kv, ffa_arrays, cast_arrays, stage, cfg):
    """A remote stage whose backward re-fetches its KV (group-cast again) instead of keeping
    it, and then group-reduces the partial dK/dV (float32) onto the owners; the FFA forward
    is not re-run (the backend's split VJP keeps out and lse)."""
    return _refetch_fwd(q, kv, ffa_arrays, cast_arrays, stage, cfg)[0]


def _refetch_fwd(q, kv, ffa_arrays, cast_arrays, stage, cfg):
    backend, hkv, kw = cfg[0], cfg[1], dict(cfg[2])
    kk, vv = _fetch(kv, cast_arrays, stage, hkv)
    (out, lse), saved = get_backend(backend).split_fwd(q, kk, vv, ffa_arrays, **kw)
    return (out, lse), (q, kv, ffa_arrays, cast_arrays, saved)


def _refetch_bwd(stage, cfg, res, cts):
    backend, hkv, kw = cfg[0], cfg[1], dict(cfg[2])
    q, kv, ffa_arrays, cast_arrays, saved = res
    kk, vv = _fetch(kv, cast_arrays, stage, hkv)                     # the re-fetch
    dq, dk, dv = get_backend(backend).split_bwd(saved, q, kk, vv, ffa_arrays, cts, **kw)
    dbuf = jnp.concatenate([dk, dv], axis=-2)
    t_loc = kv.shape[0]
    dlocal = None
    if stage.combined:
        dlocal, dbuf = dbuf[:t_loc], dbuf[t_loc:]
    dkv = _reduce(dbuf, cast_arrays, stage.cast, t_loc)
    if dlocal is not None:
        dkv = dkv + dlocal.astype(dkv.dtype)
    none = lambda tree: jax.tree.map(lambda _: None, tree)
    return dq, dkv.astype(kv.dtype), none(ffa_arrays), none(cast_arrays)


_refetch_stage.defvjp(_refetch_fwd, _refetch_bwd)


def _local(q, k, v, stage_arrays, key: MagiKey, scale: float, softcap: float):
    """One rank: q/k/v ``[(B,) local_len, H, D]``, ``stage_arrays`` this rank's plan arrays."""
    kv = jnp.concatenate([k, v], axis=-2)         # one collective carries K and V
    outs, lses = [], []
    backend = get_backend(key.ffa_backend)
    for stage, (ffa_arrays, cast_arrays) in zip(key.stages, stage_arrays):
        if (stage.cast is not None and key.backward_refetch and q.ndim == 3
                and backend.split_fwd is not None):
            cfg = (key.ffa_backend, k.shape[-2],
                   (("softmax_scale", scale), ("softcap", softcap),
                    ("block_q", key.block_q), ("block_k", key.block_k)))
            o, l = _refetch_stage(q, kv, ffa_arrays, cast_arrays, stage, cfg)
            outs.append(o)
            lses.append(l)
            continue
        fn = functools.partial(_stage_ffa, stage=stage, key=key, scale=scale,
                               softcap=softcap)
        if stage.cast is not None and key.backward_refetch:
            # Backends without a split VJP (or batched inputs): re-fetch by rematerialising
            # the stage, which also re-runs its FFA forward.
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
