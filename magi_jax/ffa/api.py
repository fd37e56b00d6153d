"""``flex_flash_attention``: the single-device front door (validation, backend choice)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from magi_jax.mask import AttnMask
from magi_jax.ffa.xla import xla_ffa
from magi_jax.planning.lanes import default_block_sizes, plan_for_mask

__all__ = ["flex_flash_attention", "BACKENDS", "select_backend"]

BACKENDS = ("auto", "xla", "pallas")
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
_MAX_HEAD_DIM = 256
_log = logging.getLogger(__name__)


def select_backend(backend: str = "auto", q=None, k=None, v=None,
                   mask: AttnMask | None = None) -> tuple[str, str]:
    """The backend ``flex_flash_attention`` would use and why: ``(name, reason)``.

    ``auto`` picks ``pallas`` (Mosaic GPU kernels) on an sm90 GPU when the inputs, if given,
    are supported (bf16/fp16, D 64 or 128), else ``xla``, with the reason. An explicit
    ``pallas`` that cannot run raises ``NotImplementedError`` saying why."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "xla":
        return "xla", "requested explicitly"
    from magi_jax import pallas
    if q is not None:
        ok, why = pallas.supported(q, k, v, mask)
    else:
        ok, why = pallas.device_supported()
    if backend == "pallas":
        if not ok:
            raise NotImplementedError(
                f"backend='pallas': the Mosaic GPU FFA kernels are not available for this "
                f"call: {why}; use backend='xla' (or 'auto', which falls back to it)")
        return "pallas", "requested explicitly"
    if ok:
        return "pallas", "sm90 GPU" + (" and supported inputs" if q is not None else "")
    return "xla", f"pallas (Mosaic GPU) not used: {why}"


def _check_inputs(q, k, v, mask: AttnMask):
    if not isinstance(mask, AttnMask):
        raise TypeError(f"mask must be an AttnMask (e.g. AttnMask.varlen(...)); got "
                        f"{type(mask).__name__}")
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be [T, H, D] or [B, T, H, D]; got shape {q.shape}")
    for name, x in (("k", k), ("v", v)):
        if x.ndim != q.ndim:
            raise ValueError(f"{name} has shape {x.shape} but q has shape {q.shape}; q, k and v "
                             "must all be [T, H, D] or all [B, T, H, D]")
    if q.ndim == 4 and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
    tq, hq, d = q.shape[-3:]
    tk, hkv, dk = k.shape[-3:]
    if tq != mask.total_q or tk != mask.total_k:
        raise ValueError(f"q has {tq} tokens and k has {tk}, but the mask is over "
                         f"total_q={mask.total_q}, total_k={mask.total_k}; build the mask for "
                         "these lengths")
    if dk != d:
        raise ValueError(f"head dims differ: q has D={d}, k/v have D={dk}")
    if d % 8 or not 8 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"head dim D={d} is not supported: use a multiple of 8 in "
                         f"[8, {_MAX_HEAD_DIM}]")
    if hq % hkv:
        raise ValueError(f"q has {hq} heads and k/v have {hkv}: the number of query heads "
                         "must be a multiple of the number of key/value heads (GQA)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them "
                        "to one dtype")
    if q.dtype not in _DTYPES:
        raise TypeError(f"dtype {q.dtype} is not supported; use bfloat16, float16 or float32")


def flex_flash_attention(q, k, v, mask: AttnMask, *, softmax_scale: float | None = None,
                         softcap: float = 0.0, backend: str = "auto",
                         block_q: int | None = None, block_k: int | None = None):
    """Exact attention of ``q`` over ``k``/``v`` restricted to ``mask``.

    Args:
      q: ``[Tq, Hq, D]`` or ``[B, Tq, Hq, D]``, bfloat16/float16/float32.
      k, v: ``[Tk, Hkv, D]`` (or ``[B, Tk, Hkv, D]``), ``Hq % Hkv == 0`` (GQA: query head
        ``h`` uses key head ``h // (Hq / Hkv)``); D a multiple of 8 up to 256.
      mask: an :class:`AttnMask` over ``total_q = Tq``, ``total_k = Tk``; one mask for the
        whole batch.
      softmax_scale: defaults to ``D ** -0.5``.
      softcap: tanh soft-capping of the scores (``c·tanh(s/c)``); 0 disables it.
      backend: ``"auto"``, ``"xla"`` (portable) or ``"pallas"`` (Mosaic GPU, Hopper).
      block_q, block_k: tile sizes of the ``xla`` backend (default: 128, smaller for
        short sequences).

    Returns:
      ``(out, lse)``: ``out`` like ``q``; ``lse`` ``[(B,) Tq, Hq]`` float32, natural log.
      Rows that see no key get ``out = 0``, ``lse = -inf`` and zero gradients.
      Differentiable in q, k, v; works under ``jit``, ``grad`` and ``vmap``.
    """
    _check_inputs(q, k, v, mask)
    name, reason = select_backend(backend, q, k, v, mask)
    _log.debug("flex_flash_attention: backend %s (%s)", name, reason)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if softcap < 0:
        raise ValueError(f"softcap={softcap} must be >= 0 (0 disables soft-capping)")
    if name == "pallas":
        from magi_jax.pallas import ffa_pallas, kernel_plan_for_mask
        return ffa_pallas(q, k, v, kernel_plan_for_mask(mask).arrays(), softmax_scale=scale,
                          softcap=float(softcap))
    auto_q, auto_k = default_block_sizes(mask.total_q, mask.total_k)
    bq, bk = block_q or auto_q, block_k or auto_k
    plan = plan_for_mask(mask, bq, bk)
    arrays = jax.tree.map(jnp.asarray, plan.arrays())
    return xla_ffa(q, k, v, arrays, softmax_scale=scale, softcap=float(softcap),
                   block_q=bq, block_k=bk)
