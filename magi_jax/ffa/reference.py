"""Dense reference attention over a slice mask: the truth the kernels are judged against.

Materialises the ``[Tq, Tk]`` mask and scores, so it is for tests and small problems only.
It runs in the inputs' dtype (``float64`` too, with ``jax_enable_x64``), which makes it both
the float64 oracle and the "straightforward low-precision computation" of the correctness
rule (docs/design.md §5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from magi_jax.masks import AttnMask

__all__ = ["reference_attention", "reference_attention_vjp", "dense_attention"]


def _attend(q, k, v, dense, scale, softcap, sink=None):
    """q [..., Tq, Hq, D], k/v [..., Tk, Hkv, D], dense bool [Tq, Tk] -> out, lse [..., Tq, Hq]
    and the max logits [..., Hq]. ``sink`` [S, Hq]: logits that join every row's softmax
    denominator and add nothing to the output."""
    hq, hkv = q.shape[-2], k.shape[-2]
    group = hq // hkv
    k = jnp.repeat(k, group, axis=-2)
    v = jnp.repeat(v, group, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", q, k) * jnp.asarray(scale, q.dtype)
    allowed = jnp.asarray(dense)
    # Before the softcap, over the allowed cells only; a statistic, never differentiated.
    max_logits = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, s, -jnp.inf), axis=(-2, -1)))
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(allowed, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sink is not None:
        sink = jnp.asarray(sink, s.dtype)  # [S, Hq] -> [S, ..., Hq, 1, 1], beside every batch row
        sink = sink.reshape(sink.shape[:1] + (1,) * (s.ndim - 3) + sink.shape[1:] + (1, 1))
        m = jnp.maximum(m, jnp.max(sink, axis=0))
    m = jnp.where(jnp.isfinite(m), m, 0)
    e = jnp.where(allowed, jnp.exp(s - m), 0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.sum(jnp.exp(sink - m), axis=0)
    has_key = denom > 0
    p = e / jnp.where(has_key, denom, 1)
    out = jnp.einsum("...hqk,...khd->...qhd", p, v)
    lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, denom, 1)), -jnp.inf)[..., 0]
    return out, jnp.swapaxes(lse, -1, -2), max_logits


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttnMask,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: jax.Array | None = None,
    return_max_logits: bool = False,
) -> tuple[jax.Array, ...]:
    """Dense attention ``(out, lse)`` over ``mask``, computed in ``q``'s dtype.

    q: ``[Tq, Hq, D]`` or ``[B, Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]`` (same leading batch).
    Returns ``out`` like ``q`` and ``lse`` ``[(B,) Tq, Hq]`` float32 (float64 for float64
    inputs). Rows that see no key give ``out = 0``, ``lse = -inf`` and zero gradients.
    Differentiable with ``jax.grad`` / ``jax.vjp``. ``sink`` ``[S, Hq]``: attention-sink
    logits in every row's denominator (then a row that sees no key has ``out = 0`` and
    ``lse = logsumexp(sink)``).

    ``return_max_logits=True`` returns ``(out, lse, max_logits)``: per query head, the
    largest scaled logit ``softmax_scale·q·k`` (before any softcap; sinks are not logits of
    a key) over the mask's cells, ``[(B,) Hq]`` in ``lse``'s dtype, ``-inf`` for a head that
    sees no cell; not differentiated.
    """
    return dense_attention(
        q,
        k,
        v,
        mask.to_dense(),
        softmax_scale=softmax_scale,
        softcap=softcap,
        sink=sink,
        return_max_logits=return_max_logits,
    )


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dense: ArrayLike,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: jax.Array | None = None,
    return_max_logits: bool = False,
) -> tuple[jax.Array, ...]:
    """:func:`reference_attention` with the mask given as a bool ``[Tq, Tk]`` array (may be
    traced, so one compilation serves every mask of a size)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse, max_logits = _attend(q, k, v, dense, scale, softcap, sink)
    lse_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    if return_max_logits:
        return out.astype(q.dtype), lse.astype(lse_dtype), max_logits.astype(lse_dtype)
    return out.astype(q.dtype), lse.astype(lse_dtype)


def reference_attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttnMask,
    dout: jax.Array,
    dlse: jax.Array | None = None,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """``(out, lse, (dq, dk, dv))`` of the reference, with cotangents ``dout`` (and ``dlse``,
    zero when omitted), all computed in ``q``'s dtype. Shapes as for
    :func:`reference_attention`: ``dout`` like ``out``, ``dlse`` like ``lse``; ``dq``, ``dk``,
    ``dv`` like ``q``, ``k``, ``v``."""
    fn = lambda q_, k_, v_: reference_attention(
        q_, k_, v_, mask, softmax_scale=softmax_scale, softcap=softcap
    )
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    if dlse is None:
        dlse = jnp.zeros(lse.shape, lse.dtype)
    return out, lse, vjp((dout.astype(out.dtype), jnp.asarray(dlse, lse.dtype)))
