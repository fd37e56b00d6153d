"""Which FFA backend runs a call, and why: ``"auto"`` resolved one way for every entry point.

The names are :data:`magi_jax.planning.backends.FFA_BACKENDS` (``xla``, ``pallas``; the host
list every entry point checks); the pick needs the device, so it lives here, on the device
side: ``pallas`` on an sm90 GPU whose kernels take the inputs (when given), else ``xla``,
with the reason. The per-rank halves that context parallelism runs are
:mod:`magi_jax.sharding.ffa_backends`.
"""

from __future__ import annotations

import jax

from magi_jax.masks import AttnMask
from magi_jax.planning.backends import AUTO, BACKEND_CHOICES, check_backend

__all__ = ["BACKENDS", "auto_backend", "select_backend", "mla_reason"]

# What ``backend=`` takes at the front door.
BACKENDS = BACKEND_CHOICES


def mla_reason(q: jax.Array, v: jax.Array) -> str:
    """Why the pallas kernels do not take ``v`` of its own head dim (multi-head latent
    attention; empty when they could, or when ``v`` has q's head dim): the pairs
    ``(Dqk, Dv)`` of :data:`magi_jax.pallas.SUPPORTED_MLA_HEAD_DIMS` run there, the others
    on ``xla``."""
    if v.shape[-1] == q.shape[-1]:
        return ""
    from magi_jax.pallas.api import head_dims_problem

    why = head_dims_problem(q.shape[-1], v.shape[-1])
    return f"{why}; the xla backend takes any" if why else ""


def _pallas_problem(q: jax.Array | None, k: jax.Array | None, v: jax.Array | None) -> str:
    """Why the pallas kernels cannot run here (these inputs, when given); empty when they
    can."""
    from magi_jax import pallas

    if q is not None and v is not None and (why := mla_reason(q, v)):
        return why
    ok, why = pallas.device_supported() if q is None else pallas.supported(q, k, v)
    return "" if ok else why


def auto_backend(
    q: jax.Array | None = None, k: jax.Array | None = None, v: jax.Array | None = None
) -> tuple[str, str]:
    """What ``"auto"`` picks, ``(name, reason)``: ``"pallas"`` when the default device is an
    sm90 GPU (and the kernels take ``q``, ``k``, ``v`` when given:
    :func:`magi_jax.pallas.supported`), else ``"xla"`` with why not pallas."""
    why = _pallas_problem(q, k, v)
    if not why:
        return "pallas", "sm90 GPU" + (" and supported inputs" if q is not None else "")
    return "xla", f"pallas (Mosaic GPU) not used: {why}"


def select_backend(
    backend: str = AUTO,
    q: jax.Array | None = None,
    k: jax.Array | None = None,
    v: jax.Array | None = None,
    mask: AttnMask | None = None,
) -> tuple[str, str]:
    """The backend ``flex_flash_attention`` would use and why: ``(name, reason)``.

    ``auto`` picks ``pallas`` (Mosaic GPU kernels) on an sm90 GPU when the inputs, if given,
    are supported (bf16/fp16, D 64, 128 or 256, or a value head dim of its own, multi-head
    latent attention, at the ``(Dqk, Dv)`` of :data:`magi_jax.pallas.SUPPORTED_MLA_HEAD_DIMS`:
    128/64, 192/128, 256/128; other pairs run on ``xla``), else ``xla``, with the reason
    (:func:`auto_backend`). An explicit ``pallas`` that cannot run raises
    ``NotImplementedError`` saying why. ``mask`` is not needed to choose."""
    del mask
    if check_backend(backend) == AUTO:
        return auto_backend(q, k, v)
    if backend == "pallas" and (why := _pallas_problem(q, k, v)):
        raise NotImplementedError(
            f"backend='pallas': the Mosaic GPU FFA kernels are not available for this "
            f"call: {why}; use backend='xla' (or 'auto', which falls back to it)"
        )
    return backend, "requested explicitly"
