"""``flex_flash_attention``: the single-device front door (validation, backend choice)."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from magi_jax._log import Retraces
from magi_jax.ffa.backends import BACKENDS, mla_reason, select_backend
from magi_jax.ffa.plan import AttnPlan
from magi_jax.ffa.sinks import apply_sink, check_sink
from magi_jax.ffa.xla import xla_ffa
from magi_jax.masks import AttnMask
from magi_jax.planning.backends import backend_blocks
from magi_jax.planning.work_list import plan_for_mask

__all__ = [
    "flex_flash_attention",
    "BACKENDS",
    "select_backend",
    "check_options",
    "check_qkv",
    "finite_float",
    "MAX_HEAD_DIM",
]

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
MAX_HEAD_DIM = 256
_log = logging.getLogger(__name__)
# Traces with an AttnMask: each new mask is a new constant, so a compilation of the caller.
_MASK_TRACES = Retraces(
    "flex_flash_attention with an AttnMask",
    lambda old, new: "another mask (an AttnMask is a compile-time constant)",
    lambda old, new: True,
    "pass the mask as data, an AttnPlan (mj.plan_attention(mask, mj.PlanCapacity(...))) as "
    "an argument of the jitted function: one compilation for every mask within the capacity",
)


def _check_inputs(q, k, v, mask: AttnMask):
    if not isinstance(mask, AttnMask):
        raise TypeError(
            f"mask must be an AttnMask (e.g. AttnMask.varlen(...)) or an AttnPlan "
            f"(mj.plan_attention); got {type(mask).__name__}"
        )
    check_qkv(q, k, v, tokens=(mask.total_q, mask.total_k, "the mask"))


def finite_float(value: object) -> float | None:
    """``value`` as a finite float; ``None`` for anything else (strings, NaN, inf, arrays of
    several elements, traced values)."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def check_options(
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    block_q: int | None = None,
    block_k: int | None = None,
) -> None:
    """The scalar options of the attention entry points: ``softcap`` a finite number >= 0,
    ``softmax_scale`` ``None`` or a finite number, ``block_q``/``block_k`` ``None`` or
    positive integers. Raises ``ValueError`` naming the option, its value and the fix."""
    cap = finite_float(softcap)
    if cap is None or cap < 0:
        raise ValueError(
            f"softcap={softcap!r} must be a number >= 0 and finite (0 disables soft-capping)"
        )
    if softmax_scale is not None and finite_float(softmax_scale) is None:
        raise ValueError(
            f"softmax_scale={softmax_scale!r} must be a finite number (or None for D ** -0.5)"
        )
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is None:
            continue
        tile = finite_float(value)
        if isinstance(value, bool) or tile is None or tile != int(tile) or tile < 1:
            raise ValueError(
                f"{name}={value!r} must be a positive tile size (or None for the default)"
            )


def check_qkv(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    caller: str = "flex_flash_attention",
    names: tuple[str, str, str] = ("q", "k", "v"),
    layout: str = "[T, H, D] or [B, T, H, D]",
    ranks: tuple[int, ...] | None = (3, 4),
    tokens: tuple[int, int, str] | None = None,
) -> None:
    """The rules every attention entry point holds its ``q``, ``k``, ``v`` to, written once:
    arrays of ``ranks`` dims (``None``: 3 or more, any leading batch axes) all of one rank
    (``layout`` spells it in the caller's words), the same batch axes, k and v the same
    shape up to the head dim (v may have its own, ``Dv``: multi-head latent attention), no
    empty axis, q and k one head dim ``D``, ``D`` and ``Dv`` multiples of 8 in ``[8,
    MAX_HEAD_DIM]``, query heads a multiple of key/value heads (GQA), one dtype among
    bfloat16, float16, float32 and float64. ``tokens = (total_q, total_k, what)``: also the
    token axes (third from last) against ``what``'s lengths. Raises ``TypeError`` /
    ``ValueError`` prefixed with ``caller``, naming the input (``names``), its value and the
    fix. Shapes and dtypes only: nothing is traced or computed."""
    nq, nk, nv = names
    for name, x in zip(names, (q, k, v)):
        if not all(hasattr(x, a) for a in ("ndim", "shape", "dtype")):
            raise TypeError(
                f"{caller}: {name} must be an array (jax.Array or numpy.ndarray); got "
                f"{type(x).__name__}"
            )
    for name, x in zip(names, (q, k, v)):
        rank_ok = x.ndim >= 3 if ranks is None else x.ndim in ranks
        if not rank_ok or x.ndim != q.ndim:
            alike = (
                "they must all have the same number of axes"
                if ranks is None
                else "they must all be " + " or all ".join(f"{r}-D" for r in ranks)
            )
            raise ValueError(
                f"{caller}: {name} must be {layout}; {nq}, {nk} and {nv} must be of one rank "
                f"({alike}); got shapes {nq} {tuple(q.shape)}, {nk} {tuple(k.shape)}, {nv} "
                f"{tuple(v.shape)}"
            )
    if not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        raise ValueError(
            f"{caller}: batch sizes differ: {nq} {tuple(q.shape[:-3])}, {nk} "
            f"{tuple(k.shape[:-3])}, {nv} {tuple(v.shape[:-3])}; the leading (batch) axes of "
            f"{nq}, {nk} and {nv} must be equal"
        )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"{caller}: {nk} {tuple(k.shape)} and {nv} {tuple(v.shape)} must have the same "
            f"shape up to the head dim ({nv} may have its own head dim Dv: multi-head latent "
            "attention)"
        )
    for name, x in ((nq, q), (nk, k)):
        if 0 in x.shape:
            axes = ["B"] * (x.ndim - 3) + ["T", "H", "D"]
            empty = ", ".join(f"{a} = 0" for a, n in zip(axes, x.shape) if n == 0)
            raise ValueError(
                f"{caller}: {name} has shape {tuple(x.shape)} ({empty}): attention needs at "
                "least one token, head and batch row; skip the call for an empty sequence "
                "or batch (its output is empty)"
            )
    tq, hq, d = q.shape[-3:]
    tk, hkv, dk = k.shape[-3:]
    dv = v.shape[-1]
    if tokens is not None:
        total_q, total_k, what = tokens
        if tq != total_q or tk != total_k:
            raise ValueError(
                f"{caller}: {nq} has {tq} tokens and {nk} has {tk}, but {what} is over "
                f"total_q={total_q}, total_k={total_k}; build it for these lengths"
            )
    if dk != d:
        raise ValueError(
            f"{caller}: head dims differ: {nq} has D={d}, {nk} has D={dk}; they must be equal"
        )
    for name, x in (("D", d), (f"Dv ({nv}'s head dim)", dv)):
        if x % 8 or not 8 <= x <= MAX_HEAD_DIM:
            raise ValueError(
                f"{caller}: head dim {name}={x} is not supported: use a multiple of 8 in "
                f"[8, {MAX_HEAD_DIM}]"
            )
    if hq % hkv:
        raise ValueError(
            f"{caller}: {nq} has {hq} heads and {nk}/{nv} have {hkv}: the number of query "
            "heads must be a multiple of the number of key/value heads (GQA)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{caller}: {nq}, {nk}, {nv} dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); "
            "cast them to one dtype"
        )
    if q.dtype not in _DTYPES:
        raise TypeError(
            f"{caller}: {nq}, {nk}, {nv} have dtype {q.dtype}; attention needs floating-point "
            "inputs: bfloat16, float16 or float32 (float64 with jax_enable_x64)"
        )


@jax.named_scope("flex_flash_attention")
def flex_flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttnMask | AttnPlan,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    backend: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    sink: jax.Array | None = None,
    return_max_logits: bool = False,
) -> tuple[jax.Array, ...]:
    """Exact attention of ``q`` over ``k``/``v`` restricted to ``mask``.

    Args:
      q: ``[Tq, Hq, D]`` or ``[B, Tq, Hq, D]``, bfloat16/float16/float32, or float64 (with
        ``jax_enable_x64``; computed in float64 on the ``xla`` backend).
      k: ``[Tk, Hkv, D]`` (or ``[B, Tk, Hkv, D]``), ``Hq % Hkv == 0`` (GQA: query head
        ``h`` uses key head ``h // (Hq / Hkv)``); D a multiple of 8 up to 256.
      v: ``[Tk, Hkv, Dv]`` (or batched): ``Dv`` is ``D`` or, for multi-head latent
        attention (e.g. D 192, Dv 128), its own multiple of 8 up to 256 (``xla`` backend).
      mask: an :class:`AttnMask` over ``total_q = Tq``, ``total_k = Tk`` (one mask for the
        whole batch; a compile-time constant: a new mask under ``jit`` compiles anew), or an
        :class:`~magi_jax.ffa.plan.AttnPlan` from :func:`~magi_jax.ffa.plan.plan_attention`
        (the mask as data: a jitted function taking the plan as an argument compiles once
        for every mask within the plan's capacity; the plan fixes the backend).
      softmax_scale: defaults to ``D ** -0.5``.
      softcap: tanh soft-capping of the scores (``c·tanh(s/c)``); 0 disables it.
      backend: ``"auto"``, ``"xla"`` (portable), ``"pallas"`` (Mosaic GPU, Hopper) or
        ``"cudnn"`` (cuDNN's packed layout, for per-document full or causal masks);
        :func:`~magi_jax.ffa.backends.select_backend` says which ``"auto"`` takes and why.
      block_q, block_k: tile sizes of the ``xla`` backend (default: 128, smaller for
        short sequences).

      sink: optional attention-sink logits ``[S, Hq]`` (float32, 1 <= S <= 8): they join
        every row's softmax denominator and add nothing to the output; differentiable
        (:mod:`magi_jax.ffa.sinks`). ``lse`` then includes them.
      return_max_logits: also return each head's largest logit (for QK-clip).

    Returns:
      ``(out, lse)``: ``out`` ``[(B,) Tq, Hq, Dv]`` in q's dtype; ``lse`` ``[(B,) Tq, Hq]``
      float32 (float64 for float64 inputs, computed in float64), natural log.
      Rows that see no key get ``out = 0``, ``lse = -inf`` and zero gradients.
      Differentiable in q, k, v; works under ``jit``, ``grad`` and ``vmap``.
      With ``return_max_logits=True``, ``(out, lse, max_logits)``: ``max_logits``
      ``[(B,) Hq]`` float32 is, per batch row and query head, the largest scaled logit
      ``softmax_scale·q·k`` over the mask's cells, taken before the softcap (the quantity
      QK-clip bounds; ``max_logits.max(0)`` is the per-head figure over a batch). Sink
      logits are not logits of a key and do not enter it. ``-inf`` for a head that sees no
      cell. The kernels take it from the forward's running row maxima (no second pass over
      the scores); it has no gradient.
    """
    return_max_logits = bool(return_max_logits)
    check_qkv(q, k, v)  # again below with the mask's or the plan's token counts
    if sink is not None:
        check_sink(sink, q.shape[-2])
        if backend == "auto" and isinstance(mask, AttnMask):
            # The engine that takes sinks (they are added to the result afterwards).
            _check_inputs(q, k, v, mask)
            backend, _ = select_backend(backend, q, k, v, mask, sink=True, softcap=softcap)
        res = flex_flash_attention(
            q,
            k,
            v,
            mask,
            softmax_scale=softmax_scale,
            softcap=softcap,
            backend=backend,
            block_q=block_q,
            block_k=block_k,
            return_max_logits=return_max_logits,
        )
        return apply_sink(*res[:2], sink) + tuple(res[2:])
    check_options(softmax_scale, softcap, block_q, block_k)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if isinstance(mask, AttnPlan):
        return _attend_plan(
            q, k, v, mask, scale, float(softcap), backend, block_q, block_k, return_max_logits
        )
    _check_inputs(q, k, v, mask)
    if isinstance(q, jax.core.Tracer):
        _MASK_TRACES.note((q.shape[-2:], k.shape[-2:]), mask.fingerprint, "masks of any shape")
    name, reason = select_backend(
        backend, q, k, v, mask, softcap=float(softcap), max_logits=return_max_logits
    )
    _log.debug("flex_flash_attention: backend %s (%s)", name, reason)
    if name == "cudnn":
        from magi_jax.ffa.cudnn import cudnn_attention

        return cudnn_attention(q, k, v, mask, softmax_scale=scale)
    if name == "pallas":
        from magi_jax.pallas import ffa_pallas

        return ffa_pallas(
            q,
            k,
            v,
            plan_for_mask(mask, "pallas"),
            softmax_scale=scale,
            softcap=float(softcap),
            return_max_logits=return_max_logits,
        )
    (bq, bk), _ = backend_blocks("xla", mask.total_q, mask.total_k, block_q, block_k)
    plan = plan_for_mask(mask, "xla", bq, bk)
    return xla_ffa(
        q,
        k,
        v,
        plan,
        softmax_scale=scale,
        softcap=float(softcap),
        block_q=bq,
        block_k=bk,
        return_max_logits=return_max_logits,
    )


def _attend_plan(
    q, k, v, plan: AttnPlan, scale, softcap, backend, block_q, block_k, return_max_logits
):
    """:func:`flex_flash_attention` from an :class:`AttnPlan` (masks as data)."""
    st = plan.static
    cap = st.capacity
    if block_q is not None or block_k is not None:
        raise ValueError(
            "block_q/block_k are fixed by the plan's tiles; leave them None when "
            "passing an AttnPlan"
        )
    if backend not in ("auto", st.backend):
        raise ValueError(
            f"backend={backend!r} but the plan was built for {st.backend!r}; "
            f"pass backend='auto' or plan_attention(..., backend={backend!r})"
        )
    check_qkv(q, k, v, tokens=(cap.total_q, cap.total_k, "the plan's capacity"))
    if st.backend == "pallas":
        from magi_jax import pallas

        why = mla_reason(q, v)
        ok = not why
        if ok:
            ok, why = pallas.supported(q, k, v)
        if not ok:
            raise ValueError(
                f"the plan was built for backend 'pallas', which cannot run these "
                f"inputs: {why}; build it with plan_attention(..., "
                "backend='xla')"
            )
        groups = _groups(q, k)
        if st.groups is not None and st.groups != groups:
            raise ValueError(
                f"the plan's persistent schedules are for (B·Hq, B·Hkv) = "
                f"{st.groups} but the inputs have {groups}; pass num_heads="
                "(Hq, Hkv) and batch=B of these inputs to plan_attention"
            )
        return pallas.ffa_pallas(
            q,
            k,
            v,
            plan.item_lists(),
            softmax_scale=scale,
            softcap=softcap,
            schedules=plan.schedules,
            return_max_logits=return_max_logits,
        )
    return xla_ffa(
        q,
        k,
        v,
        plan.item_lists(),
        softmax_scale=scale,
        softcap=softcap,
        block_q=st.fwd_block[0],
        block_k=st.fwd_block[1],
        lane_len=st.lane_len,
        return_max_logits=return_max_logits,
    )


def _groups(q, k):
    batch = q.shape[0] if q.ndim == 4 else 1
    return batch * q.shape[-2], batch * k.shape[-2]
