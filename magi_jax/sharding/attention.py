"""``magi_attention``: context-parallel flexible-mask attention under ``shard_map``.

Per rank: stage 0 runs FFA on the local KV while remote stage 0 is
group-cast; every remote stage runs FFA on its fetched KV buffer; the partial ``(out, lse)``
are merged in float32. With ``overlap_degree = 0`` all remote KV is fetched first and one FFA
call covers ``concat(local KV, remote KV)``. The backward is one custom VJP per rank: every
stage's FFA backward runs against the merged ``(out, lse)`` (no backward through the merge;
only the final output and lse are kept), remote stages first, and ``group_cast``'s adjoint
``group_reduce`` sums their partial dK/dV (float32) back onto the owners. By default
(``backward_refetch=True`` on the key) the backward re-fetches each remote stage's KV
(group-cast again) rather than keeping it — memory stays at local KV plus the stage in
flight; ``backward_refetch=False`` keeps the buffers instead. Since the backward only needs
the merged ``(out, lse)``, it may cut the remote KV into stages of its own: a key whose
``backward_overlap_degree`` differs from its ``overlap_degree`` carries a second stage plan
(``key.backward_stage_arrays``), which the backward fetches, computes and reduces by. Batched inputs
``[B, T, H, D]`` take the same pipeline with the batch folded into the heads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from magi_jax._log import Retraces, changed_fields
from magi_jax.ffa.backends import get_backend
from magi_jax.ffa.plan import expand_lists
from magi_jax.ffa.sinks import apply_sink, check_sink
from magi_jax.sharding.attention_checks import check_inputs, check_local_inputs
from magi_jax.sharding.keys import MagiKey, is_checked
from magi_jax.sharding.layout import (
    DispatchedArray,
    PodSpecs,
    layout_tag,
    open_dispatched,
    pod_specs,
    poison,
)
from magi_jax.sharding.transport import cast_rows, native, reduce_rows, start_reduce_rows

# One rank's keys and values, [T, Hkv, D] and [T, Hkv, Dv] (or their gradients).
KV = tuple[jax.Array, jax.Array]

__all__ = ["magi_attention", "magi_attention_local", "merge_partials", "PodSpecs", "pod_specs"]


@jax.named_scope("merge_partials")
def merge_partials(
    outs: Sequence[jax.Array], lses: Sequence[jax.Array], dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """Exact merge of partial attention over disjoint key sets, in float32:
    ``lse = log Σ exp(lse_i)``, ``out = Σ out_i · exp(lse_i − lse)``. Rows with no key in any
    part give ``out = 0``, ``lse = -inf`` (and finite, zero gradients). ``outs[i]``
    ``[T, H, Dv]``, ``lses[i]`` ``[T, H]``; returns ``out [T, H, Dv]`` in ``dtype`` and ``lse
    [T, H]`` float32 (float64 for float64)."""
    if len(outs) == 1:
        return outs[0].astype(dtype), lses[0]
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
    lse = jnp.stack([x.astype(acc) for x in lses])  # [n, T, H]
    m = jax.lax.stop_gradient(jnp.max(lse, axis=0))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)  # 0 where lse = -inf
    total = w.sum(axis=0)
    has = total > 0
    safe = jnp.where(has, total, 1.0)
    merged_lse = jnp.where(has, m + jnp.log(safe), -jnp.inf)
    out = sum(o.astype(acc) * (wi / safe)[..., None] for o, wi in zip(outs, w))
    return out.astype(dtype), merged_lse.astype(lses[0].dtype)


def _fetch(kv, cast_arrays, stage):
    """A stage's K and V: the cast buffers (after the local ``kv = (k, v)`` for a combined
    stage)."""
    return cast_rows(kv, cast_arrays, stage.cast, prefix=stage.combined)


def _add(a, b):
    return b if a is None else jax.tree.map(jnp.add, a, b)


class _StagesCfg(NamedTuple):
    """Static configuration of one rank's stages (hashable: a custom-VJP static argument)."""

    backend: str
    kw: tuple  # (("softmax_scale", s), ("softcap", c), ("block_q", ..), ..)
    stages: tuple
    refetch: bool
    # Start the last remote stage's reduce where the transport can (CudaTuning.started_reduce
    # when the call was traced; part of the static configuration, so of trace caches' keys).
    start_reduce: bool = False
    # Also return the rank's per-head max logits (the max over its stages').
    max_logits: bool = False
    # The backward's own stages (a key whose backward overlap degree differs), else None.
    backward_stages: tuple | None = None

    def for_backward(self) -> _StagesCfg:
        """The configuration the backward runs: its own stages where it has them."""
        if self.backward_stages is None:
            return self
        return self._replace(stages=self.backward_stages, backward_stages=None)


def _stage_name(i: int, stage) -> str:
    """A stage's name in a profiler trace: ``stage0_host``, ``stage1_remote``, ..."""
    return f"stage{i}_{'host' if stage.cast is None else 'remote'}"


def stages_forward(
    q: jax.Array, kv: KV, stage_arrays: tuple, cfg: _StagesCfg, fetch: Callable[[int], KV]
) -> tuple[tuple[jax.Array, ...], list[KV | None]]:
    """Every stage's FFA on the local ``kv = (k, v)`` or on ``fetch(i)`` (remote stage
    ``i``'s K, V) and the float32 merge -> ``(out, lse)`` (``(out, lse, max_logits [Hq])``
    with ``cfg.max_logits``: the stages' key sets are disjoint, so the rank's max is the
    max of theirs), plus the KV each remote stage used (for a backward that keeps it)."""
    be, kw = get_backend(cfg.backend), dict(cfg.kw)
    if cfg.max_logits:
        kw["return_max_logits"] = True
    outs, lses, peaks, used = [], [], [], []
    for i, (stage, (ffa_arrays, _)) in enumerate(zip(cfg.stages, stage_arrays)):
        with jax.named_scope(_stage_name(i, stage)):
            kk, vv = kv if stage.cast is None else fetch(i)
            lists = expand_lists(ffa_arrays, stage.items)
            (o, l, *peak), _ = be.split_fwd(q, kk, vv, lists, **kw)
        outs.append(o)
        lses.append(l)
        peaks += peak
        used.append(None if stage.cast is None else (kk, vv))
    out, lse = merge_partials(outs, lses, q.dtype)
    if cfg.max_logits:
        return (out, lse, functools.reduce(jnp.maximum, peaks)), used
    return (out, lse), used


def stages_backward(
    q: jax.Array,
    kv: KV,
    stage_arrays: tuple,
    cfg: _StagesCfg,
    out: jax.Array,
    lse: jax.Array,
    cts: tuple[jax.Array, jax.Array],
    fetch: Callable[[int], KV],
    send_back: Callable[[int, KV, bool], KV],
) -> tuple[jax.Array, KV]:
    """The backward of :func:`stages_forward` without differentiating the merge: each stage's
    FFA backward runs against the *merged* ``(out, lse)`` — its probabilities are then the
    final softmax's, restricted to the stage's keys, so the stages' dQ and dK/dV partials sum
    to the exact gradients (and the lse cotangent enters every stage's delta alike). Remote
    stages go first so their ``send_back(i, dkv_rows, final)`` (the group-reduce; a combined
    stage's rows start with the local ones, which it adds; ``final``: nothing else adds to
    the result, so it may come in the inputs' dtype) can overlap the host stage's backward.
    A ``send_back`` with a ``start(i, final)`` method (:class:`GroupSendBack`) may start the
    last remote stage's reduce instead: ``start`` returns ``(rows, own) -> (token, done)``
    (or ``None``), the stage's backward computes dK/dV first, starts it, runs dQ, and
    ``done(token)`` comes after the host stage's backward. A combined stage's dK/dV come
    from the kernel in two parts, the local rows (``own``, which the done call sums into in
    place) and the fetched ones (``rows``). Returns ``dq`` (float32) and the local
    ``(dk, dv)`` (float32, or kv's dtype when one stage made them). Shapes as in
    :func:`stages_forward`: ``q``, ``out`` ``[T, Hq, D]`` / ``[T, Hq, Dv]``, ``lse`` ``[T, Hq]``,
    ``kv`` ``([Tk, Hkv, D], [Tk, Hkv, Dv])``; ``cts = (dout, dlse)`` like ``(out, lse)``."""
    be, kw = get_backend(cfg.backend), dict(cfg.kw)
    acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    up = lambda tree: jax.tree.map(lambda a: a.astype(acc), tree)
    dq, dkv = None, None
    order = sorted(range(len(cfg.stages)), key=lambda i: cfg.stages[i].cast is None)
    final = len(order) == 1
    remote = [i for i in order if cfg.stages[i].cast is not None]
    starter = (
        send_back.start(remote[-1], final)
        if remote and cfg.start_reduce and hasattr(send_back, "start")
        else None
    )
    finish = None  # ends the started reduce
    for i in order:
        stage, (ffa_arrays, _) = cfg.stages[i], stage_arrays[i]
        with jax.named_scope(_stage_name(i, stage) + "_bwd"):
            kk, vv = kv if stage.cast is None else fetch(i)
            args = ((out, lse), q, kk, vv, expand_lists(ffa_arrays, stage.items), cts)
            if starter is not None and i == remote[-1]:
                pending = {}
                own_rows = kv[0].shape[0] if stage.combined else 0

                def between(dk, dv):
                    if own_rows:  # (local rows, fetched rows) each
                        rows, own = (dk[1], dv[1]), (dk[0], dv[0])
                    else:
                        rows, own = (dk, dv), None
                    pending["token"], pending["done"] = starter(rows, own)
                    return pending["token"]

                dq_i, _, _, token = be.split_bwd(
                    *args, between_dkv_dq=between, split_kv_at=own_rows, **kw
                )
                finish = functools.partial(pending["done"], token)
            else:
                dq_i, dk_i, dv_i = be.split_bwd(*args, **kw)
                rows = (dk_i, dv_i)
                dkv = _add(dkv, up(rows) if stage.cast is None else send_back(i, rows, final))
            dq = _add(dq, dq_i.astype(acc))
    if finish is not None:
        dkv = _add(dkv, finish())
    return dq, dkv


def group_fetch(kv: KV, stage_arrays: tuple, cfg: _StagesCfg) -> Callable[[int], KV]:
    """``fetch(i)`` of :func:`rank_stages`: remote stage ``i``'s KV by group-cast, ``(k, v)``
    ``[buffer_len, Hkv, D]`` / ``[buffer_len, Hkv, Dv]`` from the local ``kv``."""
    return lambda i: _fetch(kv, stage_arrays[i][1], cfg.stages[i])


class GroupSendBack:
    """``send_back(i, rows, final)`` of :func:`rank_stages`: group-reduce onto the owners.
    ``start(i, final)``: where the native transport can start stage ``i``'s reduce
    (:func:`magi_jax.sharding.native.can_start_reduce`), ``(rows, own) -> (token, done)`` (``own``:
    a combined stage's local rows, apart from its fetched ``rows``); else ``None``."""

    def __init__(self, kv: KV, stage_arrays: tuple, cfg: _StagesCfg) -> None:
        self.rows, self.stage_arrays, self.cfg = kv[0].shape[0], stage_arrays, cfg

    def _args(self, i, final):
        stage = self.cfg.stages[i]
        return (self.stage_arrays[i][1], stage.cast, self.rows), dict(
            prefix=stage.combined, round_to_input=final
        )

    def __call__(self, i: int, rows: KV, final: bool) -> KV:
        args, kw = self._args(i, final)
        return reduce_rows(rows, *args, **kw)

    def start(self, i: int, final: bool) -> Callable[[KV, KV | None], tuple] | None:
        spec = self.cfg.stages[i].cast
        if spec.transport != "native" or not native.can_start_reduce(spec):
            return None
        args, _ = self._args(i, final)
        return lambda rows, own: start_reduce_rows(rows, *args, own=own, round_to_input=final)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def rank_stages(
    q: jax.Array,
    kv: KV,
    stage_arrays: tuple,
    backward_arrays: tuple | None,
    cfg: _StagesCfg,
    fetcher: Callable[..., Callable[[int], KV]] = group_fetch,
    sender: Callable[..., Callable[[int, KV, bool], KV]] = GroupSendBack,
) -> tuple[jax.Array, ...]:
    """One rank's stages and merge -> ``(out, lse)`` (and the rank's max logits, with
    ``cfg.max_logits``; they get no gradient). Backward (docs/design.md §3.2): re-fetch
    each remote stage's KV (``cfg.refetch``; else keep the forward's buffers), FFA backward
    per stage from the merged ``(out, lse)``, partial dK/dV sent back to the owners. The
    backward runs ``backward_arrays`` (this rank's plan rows of the backward's own stages,
    ``cfg.backward_stages``) where the key has them (``None`` otherwise: the forward's).
    ``fetcher`` / ``sender`` (static) make the ``fetch`` / ``send_back`` of
    :func:`stages_forward` / :func:`stages_backward` from ``(kv, stage_arrays, cfg)``: the
    group collectives here; the timing probe swaps in local stand-ins. ``q`` ``[T, Hq, D]``
    and ``kv = (k, v)`` ``[T, Hkv, D]`` / ``[T, Hkv, Dv]`` are the rank's local tokens
    (``T = local_len``, a batch folded into the heads); ``out [T, Hq, Dv]``, ``lse [T, Hq]``
    float32, max logits ``[Hq]``."""
    return stages_forward(q, kv, stage_arrays, cfg, fetcher(kv, stage_arrays, cfg))[0]


def _rank_stages_fwd(q, kv, stage_arrays, backward_arrays, cfg, fetcher, sender):
    res, used = stages_forward(q, kv, stage_arrays, cfg, fetcher(kv, stage_arrays, cfg))
    kept = None if cfg.refetch else used
    # The backward's own stages replace the forward's (their arrays are not kept twice).
    arrays = stage_arrays if cfg.backward_stages is None else backward_arrays
    return res, (q, kv, arrays, res[0], res[1], kept)


def _rank_stages_bwd(cfg, fetcher, sender, res, cts):
    q, kv, arrays, out, lse, kept = res
    cts = cts[:2]  # the max logits, if returned, have no gradient
    bcfg = cfg.for_backward()
    if kept is not None and bcfg is not cfg:
        raise ValueError("a key with backward stages of its own needs backward_refetch=True")
    fetch = fetcher(kv, arrays, bcfg) if kept is None else kept.__getitem__
    dq, dkv = stages_backward(q, kv, arrays, bcfg, out, lse, cts, fetch, sender(kv, arrays, bcfg))
    no_grad = lambda tree: jax.tree.map(lambda _: None, tree)
    return (
        dq.astype(q.dtype),
        jax.tree.map(lambda d, x: d.astype(x.dtype), dkv, kv),
        # Cotangents shaped like the primal arrays (one of the two was kept as residual).
        no_grad(arrays) if cfg.backward_stages is None else None,
        None if cfg.backward_stages is None else no_grad(arrays),
    )


rank_stages.defvjp(_rank_stages_fwd, _rank_stages_bwd)


def stages_cfg(key: MagiKey, scale: float, softcap: float, max_logits: bool = False) -> _StagesCfg:
    kw = (
        ("softmax_scale", scale),
        ("softcap", softcap),
        ("block_q", key.block_q),
        ("block_k", key.block_k),
    )
    return _StagesCfg(
        key.ffa_backend,
        kw,
        tuple(key.stages),
        key.backward_refetch,
        native.cuda_tuning().started_reduce,
        bool(max_logits),
        key.static.backward_stages,
    )


def _local(
    q,
    k,
    v,
    stage_arrays,
    backward_arrays,
    key: MagiKey,
    scale: float,
    softcap: float,
    max_logits: bool = False,
):
    """One rank: q/k/v ``[(B,) local_len, H, D]``, ``stage_arrays`` this rank's plan arrays
    (``backward_arrays``: of the backward's own stages, or ``None``).
    One pipeline for both layouts: a batch is folded into the heads (query head ``b·Hq + h``
    keeps key head ``b·Hkv + h // G``), so the sequence stays the first axis the casts move
    and every stage runs the same custom VJP. With ``max_logits`` a third output, the max
    logits ``[(B,) Hq]`` over all ranks (``pmax`` over the cp axis)."""
    cfg = stages_cfg(key, scale, softcap, max_logits)
    if q.ndim == 3:
        res = rank_stages(q, (k, v), tuple(stage_arrays), backward_arrays, cfg)
    else:
        b, t, hq, _ = q.shape
        fold = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], b * x.shape[2], x.shape[3])
        res = rank_stages(fold(q), (fold(k), fold(v)), tuple(stage_arrays), backward_arrays, cfg)
        res = (
            jnp.moveaxis(res[0].reshape(t, b, hq, v.shape[-1]), 1, 0),
            jnp.moveaxis(res[1].reshape(t, b, hq), 1, 0),
        ) + tuple(x.reshape(b, hq) for x in res[2:])
    # stop_gradient: a custom VJP's outputs all carry tangents, and pmax has no JVP.
    return res[:2] + tuple(jax.lax.pmax(jax.lax.stop_gradient(x), key.cp_axis) for x in res[2:])


def _check_options(softmax_scale, softcap):
    from magi_jax.ffa.api import check_options

    check_options(softmax_scale, softcap)


def _strip_hidden(x, key):
    """A :class:`CheckedKey`'s local rows without the hidden one (sequence axis ``-3``)."""
    return jax.lax.slice_in_dim(x, 0, key.static.local_len, axis=x.ndim - 3)


def _add_hidden(out, lse):
    """The hidden row back: ``out = 0``, ``lse = -inf`` (like padding)."""
    pad = lambda a, axis, value: jnp.pad(
        a, [(0, 1) if i == axis else (0, 0) for i in range(a.ndim)], constant_values=value
    )
    return pad(out, out.ndim - 3, 0), pad(lse, lse.ndim - 2, -jnp.inf)


def _plan_guard(res, plan_id, key: MagiKey):
    """NaN rows where the ranks of a CP group hold different plans (``plan_id``, this rank's
    ``[(B,) 1]``: the processes planned different masks — a loader bug, another seed): never
    a finite wrong answer. Two scalar collectives over the cp axis per call."""
    ident = plan_id[..., 0]
    agree = jax.lax.pmin(ident, key.cp_axis) == jax.lax.pmax(ident, key.cp_axis)
    if not key.batched:
        return tuple(jnp.where(agree, x, jnp.nan) for x in res)
    return tuple(jnp.where(agree.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.nan) for x in res)


@jax.named_scope("magi_attention")
def magi_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key: MagiKey,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: jax.Array | None = None,
    return_max_logits: bool = False,
) -> tuple[jax.Array, ...]:
    """Context-parallel attention of dispatched tokens.

    Args:
      q: ``[padded_total, Hq, D]``, k/v: ``[padded_total, Hkv, D]`` (v may have its own
        head dim ``Dv``, multi-head latent attention: ``out`` then has it) — outputs of
        :func:`~magi_jax.sharding.layout.dispatch` (or computed from dispatched activations),
        sharded over ``key.cp_axis``; or ``[B, padded_total, H, D]`` (one mask for the
        batch; dispatch with ``seq_axis=1``). Cross-attention keys (``key.kv_layout``
        ``"replicated"`` or ``"dispatched"``): k/v are ``[(B,) key.kv_padded_total, Hkv, D]``
        from ``dispatch(k, key, role="kv")`` (replicated: all ``total_k`` keys on every
        rank, whose dK/dV are summed over the ranks); q and the outputs stay as above.
      key: from :func:`make_flex_key` / :func:`make_varlen_key`.
      softmax_scale: default ``D ** -0.5``; softcap: tanh soft-capping (0 = off).

    ``sink``: optional attention-sink logits ``[S, Hq]`` (float32), applied once to the
    merged result (:mod:`magi_jax.ffa.sinks`); their gradient sums over every rank.

    Returns ``(out, lse)`` in dispatched order: ``out`` like ``q``, ``lse``
    ``[(B,) padded_total, Hq]`` float32; padding rows give ``out = 0``, ``lse = -inf``.
    Differentiable in q, k, v; works under ``jax.jit``. ``return_max_logits=True`` returns
    ``(out, lse, max_logits)``, ``max_logits [(B,) Hq]`` float32 replicated over the mesh:
    as for :func:`~magi_jax.flex_flash_attention` (before the softcap, sinks not included,
    no gradient), each rank's from its stages' forwards, then the max over ranks.

    Inputs that are visibly not dispatched raise ``ValueError`` ("dispatch first"): the
    wrong number of rows, a sharding type that does not split the sequence over the cp axis
    (meshes with Explicit axes, under ``jit`` too), or concrete arrays whose rows are not
    where the dispatched layout puts them (eager calls). A natural-order array sharded over
    the cp axis, or any array under ``jit`` on an Auto mesh, cannot be told from a dispatched
    one when the sequence needs no padding; a key made with ``check_dispatch=True`` (or
    ``MAGI_JAX_CHECK_DISPATCH=1``) rejects those too (:class:`~magi_jax.sharding.keys.CheckedKey`).
    """
    typed = isinstance(q, DispatchedArray)
    q, k, v, ok = _open_inputs(q, k, v, key)
    check_inputs(q, k, v, key)
    _check_options(softmax_scale, softcap)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    _note_trace(q, k, v, key, sink, float(scale), float(softcap), bool(return_max_logits))
    res = _global_attention(
        q,
        k,
        v,
        key,
        sink,
        scale=float(scale),
        softcap=float(softcap),
        max_logits=bool(return_max_logits),
    )
    if ok is None and not typed:
        return res
    res = poison(res, ok)
    if typed:  # the output stays in the key's layout: it keeps the key's plan id
        out = DispatchedArray(res[0], key.plan_id, layout_tag(key, "q", q.ndim - 3))
        res = (out,) + tuple(res[1:])
    return res


def _open_inputs(q, k, v, key: MagiKey):
    """q, k, v as arrays, each :class:`~magi_jax.sharding.layout.DispatchedArray` among them
    checked against ``key``; and the traced verdict (``None``: nothing left to check)."""
    arrays, ok = [], None
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, DispatchedArray):
            role = "kv" if name != "q" else "q"
            x, verdict = open_dispatched(x, key, "magi_attention", name, role)
            if verdict is not None:
                ok = verdict if ok is None else ok & verdict
        arrays.append(x)
    return (*arrays, ok)


class _Traced(NamedTuple):
    """What one trace of :func:`_global_attention` was specialised to (its jit cache key)."""

    key_type: str
    static: object  # KeyStatic
    shapes: tuple
    dtype: str
    options: tuple


def _describe_change(old: _Traced, new: _Traced) -> str:
    parts = []
    if old.key_type != new.key_type:
        parts.append(f"key type {old.key_type} -> {new.key_type}")
    if old.static != new.static:
        fields = changed_fields(old.static, new.static)
        part = "key fields changed: " + ", ".join(fields)
        if "fingerprint" in fields:
            part += (
                " (a key of another mask: keys of one mask compile once per mask, keys built "
                "at one PlanCapacity share one compilation)"
            )
        elif "capacity" in fields:
            part += " (a key at another capacity)"
        parts.append(part)
    if old.shapes != new.shapes or old.dtype != new.dtype:
        parts.append(f"inputs {old.shapes} {old.dtype} -> {new.shapes} {new.dtype}")
    if old.options != new.options:
        parts.append(f"options (scale, softcap, sink, max_logits) {old.options} -> {new.options}")
    return "; ".join(parts) or "nothing visible changed"


_RETRACES = Retraces(
    "magi_attention",
    _describe_change,
    lambda old, new: (
        old.static != new.static
        and old.static.capacity is None
        and new.static.capacity is None
        and old.static.fingerprint != new.static.fingerprint
    ),
    "build the keys at one PlanCapacity (make_flex_key(..., capacity=cap)) and pass the key "
    "to the jitted step as an argument: one compilation for every mask within it",
)


def _note_trace(q, k, v, key, sink, scale, softcap, max_logits):
    """Logs a new structure of :func:`_global_attention`'s call (a compilation: of the
    caller's function when traced, of its own program when eager), and, when traced, a trace
    of one seen before (the caller's function traced again)."""
    traced = any(isinstance(x, jax.core.Tracer) for x in (q, k, v))
    _RETRACES.note(
        (key.mesh, key.cp_axis),
        _Traced(
            type(key).__name__,
            key.static,
            (tuple(q.shape), tuple(k.shape), tuple(v.shape)),
            str(q.dtype),
            (scale, softcap, sink is not None, max_logits),
        ),
        f"mesh {dict(key.mesh.shape)} over {key.cp_axis!r}",
        repeat=traced,
    )


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "max_logits"))
def _global_attention(q, k, v, key: MagiKey, sink, *, scale: float, softcap: float, max_logits):
    """:func:`magi_attention` past its checks, as one program: under a caller's ``jit`` it is
    inlined; called eagerly it compiles once per key structure and shapes (the key is an
    argument, as in a jitted training step), where an eager ``shard_map`` would run its body
    op by op and compile again at every call."""
    specs = pod_specs(key, q.ndim)
    hidden = is_checked(key)

    def body(q, k, v, stage_arrays, backward_arrays, plan_id):
        if hidden:
            q, k, v = (_strip_hidden(x, key) for x in (q, k, v))
        if key.batched:  # one plan per row: each local row runs its own
            rows = [
                _local(
                    q[i],
                    k[i],
                    v[i],
                    *jax.tree.map(lambda a, i=i: a[i, 0], (stage_arrays, backward_arrays)),
                    key,
                    scale,
                    float(softcap),
                    max_logits,
                )
                for i in range(q.shape[0])
            ]
            res = tuple(jnp.stack(parts) for parts in zip(*rows))
        else:
            mine = jax.tree.map(lambda a: a[0], (stage_arrays, backward_arrays))
            res = _local(q, k, v, *mine, key, scale, float(softcap), max_logits)
        res = _plan_guard(res, plan_id, key)
        return (_add_hidden(*res[:2]) + res[2:]) if hidden else res

    fn = jax.shard_map(
        body,
        mesh=key.mesh,
        in_specs=(
            specs.q,
            specs.kv,
            specs.kv,
            jax.tree.map(lambda _: specs.plan, key.stage_arrays),
            jax.tree.map(lambda _: specs.plan, key.backward_stage_arrays),
            specs.plan,
        ),
        out_specs=(specs.q, specs.lse) + ((specs.max_logits,) if max_logits else ()),
        check_vma=False,
    )
    plan_id = key.plan_id
    if plan_id is None:  # a key built before plan ids (e.g. by hand): nothing to compare
        plan_id = jnp.zeros(((key.rows,) if key.batched else ()) + (key.cp,), jnp.int32)
    if sink is None:
        return fn(q, k, v, key.stage_arrays, key.backward_stage_arrays, plan_id)
    check_sink(sink, q.shape[-2])
    res = fn(q, k, v, key.stage_arrays, key.backward_stage_arrays, plan_id)
    return apply_sink(*res[:2], sink) + tuple(res[2:])


@jax.named_scope("magi_attention_local")
def magi_attention_local(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key: MagiKey,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: jax.Array | None = None,
    return_max_logits: bool = False,
) -> tuple[jax.Array, ...]:
    """The per-rank body, for callers already inside ``shard_map`` over ``key.cp_axis``:
    q/k/v are this rank's ``[local_len, H, D]`` tokens; the rank's plan rows are picked with
    ``lax.axis_index`` from the (replicated) stacked plan. Returns ``(out, lse)`` local
    (with ``return_max_logits``, also the max logits ``[(B,) Hq]``, already the max over the
    cp axis). Cross-attention keys: k/v are the rank's ``[kv_local_len, Hkv, D]`` block of
    ``dispatch(k, key, role="kv")`` (``"dispatched"``), or all ``total_k`` keys unmapped
    (``P()`` in ``in_specs``, so that ``shard_map`` sums their gradients: ``"replicated"``).

    ``sink``: optional attention-sink logits ``[S, Hq]`` (float32), as for
    :func:`magi_attention`: a rank's rows are final after its stages, so the sinks join them
    here; pass ``sink`` replicated (``P()`` in ``in_specs``), and ``shard_map`` sums its
    gradient over the ranks."""
    check_local_inputs(q, k, v, key)
    _check_options(softmax_scale, softcap)
    if sink is not None:
        check_sink(sink, q.shape[-2])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    r = jax.lax.axis_index(key.cp_axis)
    mine = jax.tree.map(lambda a: jnp.asarray(a)[r], (key.stage_arrays, key.backward_stage_arrays))
    max_logits = bool(return_max_logits)
    if not is_checked(key):
        res = _local(q, k, v, *mine, key, scale, float(softcap), max_logits)
    else:
        q, k, v = (_strip_hidden(x, key) for x in (q, k, v))
        res = _local(q, k, v, *mine, key, scale, float(softcap), max_logits)
        res = _add_hidden(*res[:2]) + res[2:]
    return res if sink is None else apply_sink(*res[:2], sink) + tuple(res[2:])
