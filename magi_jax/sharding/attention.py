"""``magi_attention``: context-parallel flexible-mask attention under ``shard_map``.

Per rank (DESIGN.md §3): stage 0 runs FFA on the local KV while remote stage 0 is
group-cast; every remote stage runs FFA on its fetched KV buffer; the partial ``(out, lse)``
are merged in float32. With ``overlap_degree = 0`` all remote KV is fetched first and one FFA
call covers ``concat(local KV, remote KV)``. The backward is one custom VJP per rank: every
stage's FFA backward runs against the merged ``(out, lse)`` (no backward through the merge;
only the final output and lse are kept), remote stages first, and ``group_cast``'s adjoint
``group_reduce`` sums their partial dK/dV (float32) back onto the owners. By default
(``backward_refetch=True`` on the key) the backward re-fetches each remote stage's KV
(group-cast again) rather than keeping it — memory stays at local KV plus the stage in
flight; ``backward_refetch=False`` keeps the buffers instead. Batched inputs take autodiff
through the stages and the merge (remote stages rematerialised when re-fetching).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from magi_jax.sharding import native
from magi_jax.sharding.collectives import _cast, _reduce, _start_reduce, group_cast
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


def _stage_ffa(q, k_local, v_local, ffa_arrays, cast_arrays, stage, key, scale, softcap):
    ffa = get_backend(key.ffa_backend).call
    seq = q.ndim - 3                                   # 1 with a leading batch axis
    if stage.cast is None:
        kk, vv = k_local, v_local
    else:
        # The cast moves rows of its first axis: put the sequence first for batched inputs.
        # A combined stage's KV is the local rows followed by the fetched ones (prefix).
        kk, vv = group_cast((jnp.moveaxis(k_local, seq, 0), jnp.moveaxis(v_local, seq, 0)),
                            cast_arrays, stage.cast, stage.combined)
        kk, vv = jnp.moveaxis(kk, 0, seq), jnp.moveaxis(vv, 0, seq)
        # The values FFA keeps for its backward are named, so the stage's checkpoint policy
        # (backward_refetch) re-fetches them instead of holding every stage's KV buffer.
        kk, vv = checkpoint_name(kk, _REMOTE_KV), checkpoint_name(vv, _REMOTE_KV)
    return ffa(q, kk, vv, ffa_arrays, softmax_scale=scale, softcap=softcap,
               block_q=key.block_q, block_k=key.block_k)


def _fetch(kv, cast_arrays, stage):
    """A stage's K and V: the cast buffers (after the local ``kv = (k, v)`` for a combined
    stage)."""
    return _cast(kv, cast_arrays, stage.cast, prefix=stage.combined)


def _add(a, b):
    return b if a is None else jax.tree.map(jnp.add, a, b)


class _StagesCfg(NamedTuple):
    """Static configuration of one rank's stages (hashable: a custom-VJP static argument)."""

    backend: str
    kw: tuple                  # (("softmax_scale", s), ("softcap", c), ("block_q", ..), ..)
    stages: tuple
    refetch: bool
    # Start the last remote stage's reduce where the transport can (CudaTuning.started_reduce
    # when the call was traced; part of the static configuration, so of trace caches' keys).
    start_reduce: bool = False


def stages_forward(q, kv, stage_arrays, cfg: _StagesCfg, fetch):
    """Every stage's FFA on the local ``kv = (k, v)`` or on ``fetch(i)`` (remote stage
    ``i``'s K, V) and the float32 merge -> ``(out, lse)``, plus the KV each remote stage used
    (for a backward that keeps it)."""
    be, kw = get_backend(cfg.backend), dict(cfg.kw)
    outs, lses, used = [], [], []
    for i, (stage, (ffa_arrays, _)) in enumerate(zip(cfg.stages, stage_arrays)):
        kk, vv = kv if stage.cast is None else fetch(i)
        (o, l), _ = be.split_fwd(q, kk, vv, ffa_arrays, **kw)
        outs.append(o)
        lses.append(l)
        used.append(None if stage.cast is None else (kk, vv))
    out, lse = merge_partials(outs, lses, q.dtype)
    return (out, lse), used


def stages_backward(q, kv, stage_arrays, cfg: _StagesCfg, out, lse, cts, fetch, send_back):
    """The backward of :func:`stages_forward` without differentiating the merge: each stage's
    FFA backward runs against the *merged* ``(out, lse)`` — its probabilities are then the
    final softmax's, restricted to the stage's keys, so the stages' dQ and dK/dV partials sum
    to the exact gradients (and the lse cotangent enters every stage's delta alike). Remote
    stages go first so their ``send_back(i, dkv_rows, final)`` (the group-reduce; a combined
    stage's rows start with the local ones, which it adds; ``final``: nothing else adds to
    the result, so it may come in the inputs' dtype) can overlap the host stage's backward.
    A ``send_back`` with a ``start(i, final)`` method (:func:`group_send_back`) may start the
    last remote stage's reduce instead: ``start`` returns ``(rows, own) -> (token, done)``
    (or ``None``), the stage's backward computes dK/dV first, starts it, runs dQ, and
    ``done(token)`` comes after the host stage's backward. A combined stage's dK/dV come
    from the kernel in two parts, the local rows (``own``, which the done call sums into in
    place) and the fetched ones (``rows``). Returns ``dq`` (float32) and the local
    ``(dk, dv)`` (float32, or kv's dtype when one stage made them)."""
    be, kw = get_backend(cfg.backend), dict(cfg.kw)
    acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    up = lambda tree: jax.tree.map(lambda a: a.astype(acc), tree)
    dq, dkv = None, None
    order = sorted(range(len(cfg.stages)), key=lambda i: cfg.stages[i].cast is None)
    final = len(order) == 1
    remote = [i for i in order if cfg.stages[i].cast is not None]
    starter = (send_back.start(remote[-1], final)
               if remote and cfg.start_reduce and hasattr(send_back, "start") else None)
    finish = None                      # ends the started reduce
    for i in order:
        stage, (ffa_arrays, _) = cfg.stages[i], stage_arrays[i]
        kk, vv = kv if stage.cast is None else fetch(i)
        args = ((out, lse), q, kk, vv, ffa_arrays, cts)
        if starter is not None and i == remote[-1]:
            pending = {}
            own_rows = kv[0].shape[0] if stage.combined else 0

            def between(dk, dv):
                if own_rows:     # (local rows, fetched rows) each
                    rows, own = (dk[1], dv[1]), (dk[0], dv[0])
                else:
                    rows, own = (dk, dv), None
                pending["token"], pending["done"] = starter(rows, own)
                return pending["token"]

            dq_i, _, _, token = be.split_bwd(*args, between_dkv_dq=between,
                                             split_kv_at=own_rows, **kw)
            finish = functools.partial(pending["done"], token)
        else:
            dq_i, dk_i, dv_i = be.split_bwd(*args, **kw)
            rows = (dk_i, dv_i)
            dkv = _add(dkv, up(rows) if stage.cast is None else send_back(i, rows, final))
        dq = _add(dq, dq_i.astype(acc))
    if finish is not None:
        dkv = _add(dkv, finish())
    return dq, dkv


def group_fetch(kv, stage_arrays, cfg):
    """``fetch(i)`` of :func:`rank_stages`: remote stage ``i``'s KV by group-cast."""
    return lambda i: _fetch(kv, stage_arrays[i][1], cfg.stages[i])


class group_send_back:
    """``send_back(i, rows, final)`` of :func:`rank_stages`: group-reduce onto the owners.
    ``start(i, final)``: where the native transport can start stage ``i``'s reduce
    (:func:`magi_jax.sharding.native.can_start_reduce`), ``(rows, own) -> (token, done)`` (``own``:
    a combined stage's local rows, apart from its fetched ``rows``); else ``None``."""

    def __init__(self, kv, stage_arrays, cfg):
        self.rows, self.stage_arrays, self.cfg = kv[0].shape[0], stage_arrays, cfg

    def _args(self, i, final):
        stage = self.cfg.stages[i]
        return (self.stage_arrays[i][1], stage.cast, self.rows), dict(
            prefix=stage.combined, round_to_input=final)

    def __call__(self, i, rows, final):
        args, kw = self._args(i, final)
        return _reduce(rows, *args, **kw)

    def start(self, i, final):
        spec = self.cfg.stages[i].cast
        if spec.transport != "native" or not native.can_start_reduce(spec):
            return None
        args, _ = self._args(i, final)
        return lambda rows, own: _start_reduce(rows, *args, own=own, round_to_input=final)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def rank_stages(q, kv, stage_arrays, cfg: _StagesCfg, fetcher=group_fetch,
                sender=group_send_back):
    """One rank's stages and merge -> ``(out, lse)``. Backward (DESIGN.md §2.5): re-fetch
    each remote stage's KV (``cfg.refetch``; else keep the forward's buffers), FFA backward
    per stage from the merged ``(out, lse)``, partial dK/dV sent back to the owners.
    ``fetcher`` / ``sender`` (static) make the ``fetch`` / ``send_back`` of
    :func:`stages_forward` / :func:`stages_backward` from ``(kv, stage_arrays, cfg)``: the
    group collectives here; the timing probe swaps in local stand-ins."""
    return stages_forward(q, kv, stage_arrays, cfg, fetcher(kv, stage_arrays, cfg))[0]


def _rank_stages_fwd(q, kv, stage_arrays, cfg, fetcher, sender):
    (out, lse), used = stages_forward(q, kv, stage_arrays, cfg,
                                      fetcher(kv, stage_arrays, cfg))
    kept = None if cfg.refetch else used
    return (out, lse), (q, kv, stage_arrays, out, lse, kept)


def _rank_stages_bwd(cfg, fetcher, sender, res, cts):
    q, kv, stage_arrays, out, lse, kept = res
    fetch = fetcher(kv, stage_arrays, cfg) if kept is None else kept.__getitem__
    dq, dkv = stages_backward(q, kv, stage_arrays, cfg, out, lse, cts, fetch,
                              sender(kv, stage_arrays, cfg))
    return (dq.astype(q.dtype), jax.tree.map(lambda d, x: d.astype(x.dtype), dkv, kv),
            jax.tree.map(lambda _: None, stage_arrays))


rank_stages.defvjp(_rank_stages_fwd, _rank_stages_bwd)


def stages_cfg(key: MagiKey, scale: float, softcap: float) -> _StagesCfg:
    kw = (("softmax_scale", scale), ("softcap", softcap), ("block_q", key.block_q),
          ("block_k", key.block_k))
    return _StagesCfg(key.ffa_backend, kw, tuple(key.stages), key.backward_refetch,
                      native.cuda_tuning().started_reduce)


def _local(q, k, v, stage_arrays, key: MagiKey, scale: float, softcap: float):
    """One rank: q/k/v ``[(B,) local_len, H, D]``, ``stage_arrays`` this rank's plan arrays."""
    if q.ndim == 3 and get_backend(key.ffa_backend).split_fwd is not None:
        return rank_stages(q, (k, v), tuple(stage_arrays), stages_cfg(key, scale, softcap))
    # Batched inputs: autodiff through the stages and the merge; with backward_refetch the
    # remote stages are rematerialised (which also re-runs their FFA forward).
    outs, lses = [], []
    for stage, (ffa_arrays, cast_arrays) in zip(key.stages, stage_arrays):
        fn = functools.partial(_stage_ffa, stage=stage, key=key, scale=scale,
                               softcap=softcap)
        if stage.cast is not None and key.backward_refetch:
            fn = jax.checkpoint(
                fn, policy=jax.checkpoint_policies.save_any_names_but_these(_REMOTE_KV))
        o, l = fn(q, k, v, ffa_arrays, cast_arrays)
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
