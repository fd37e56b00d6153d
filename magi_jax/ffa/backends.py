"""The attention engines on the device: one registry, tried in order, every entry point's
choice and its reason.

:data:`IMPLEMENTATIONS` holds one :class:`Backend` per engine of
:data:`magi_jax.planning.backends.HOST_SPECS` (its host half), in the order ``"auto"``
prefers them: ``cudnn`` (cuDNN's fused attention over packed documents, for the masks its
packed layout expresses: :mod:`magi_jax.planning.packed`), ``pallas`` (the Mosaic GPU FFA
kernels, sm90 only) and ``xla`` (portable, every mask). Each says whether it runs a call
(:meth:`Backend.supported`: empty, or the reason not) and which engine takes the call when
it cannot (its ``fallback``); the engines that read work lists also carry the per-rank
halves context parallelism runs (``split_fwd`` / ``split_bwd``).

``"auto"`` walks the registry and takes the first engine that runs the call, except where
both ``cudnn`` and ``pallas`` do: then the committed table of measurements
(:mod:`magi_jax.ffa.engine_table`) picks the faster one for the mask's class and size on
this device. :func:`select_backend` returns the choice and why.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from magi_jax.masks import AttnMask
from magi_jax.planning.backends import AUTO, BACKENDS, HOST_SPECS, HostSpec, check_backend

__all__ = [
    "BACKENDS",
    "Call",
    "Backend",
    "IMPLEMENTATIONS",
    "get_backend",
    "select_backend",
    "auto_backend",
    "mla_reason",
]


@dataclasses.dataclass(frozen=True)
class Call:
    """What an engine needs to know to say whether it runs a call: ``q``, ``k``, ``v``
    (arrays or ``jax.ShapeDtypeStruct``; ``None``: not known yet), the mask (``None``: not
    known), and the options that not every engine has."""

    q: object = None
    k: object = None
    v: object = None
    mask: AttnMask | None = None
    softcap: float = 0.0
    sink: bool = False
    max_logits: bool = False


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


def _default_device():
    try:
        return jax.devices()[0]
    except RuntimeError:  # pragma: no cover - no backend at all
        return None


def _pallas_supported(call: Call) -> str:
    from magi_jax import pallas

    if call.q is not None and call.v is not None and (why := mla_reason(call.q, call.v)):
        return why
    ok, why = (
        pallas.device_supported() if call.q is None else pallas.supported(call.q, call.k, call.v)
    )
    return "" if ok else why


def _xla_supported(call: Call) -> str:
    del call
    return ""


def _cudnn_supported(call: Call) -> str:
    from magi_jax.ffa.cudnn import cudnn_problem

    return cudnn_problem(call)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One engine on the device: its host spec, whether it runs a call
    (:meth:`supported`), the engine ``auto`` falls back to where it cannot (``fallback``;
    ``None``: it runs every call), and, for the engines that read work lists, the per-rank
    halves of context parallelism.

    ``split_fwd(q, k, v, plan, **cfg) -> ((out, lse), saved)`` (``((out, lse, max_logits
    [Hq]), saved)`` with ``return_max_logits=True``) and ``split_bwd(saved, q, k, v, plan,
    (dout, dlse), **cfg) -> (dq, dk, dv)`` split the FFA VJP so that K and V need not be
    kept between forward and backward (context parallelism re-fetches remote KV instead),
    for ``[T, H, D]`` inputs; ``cfg`` = ``softmax_scale, softcap, block_q, block_k``.
    ``saved`` is ``(out [T, H, D], lse [T, H])``, and ``split_bwd`` takes any such pair —
    also the merged result of several calls, whose backward each call can then run on its
    own. With ``between_dkv_dq=fn`` it returns ``(dq, dk, dv, token)``, ``token = fn(dk,
    dv)``: the pallas engine computes dK/dV, calls ``fn``, then runs its dQ kernel and
    orders the token after it, so that a collective started in ``fn`` moves beside the dQ
    kernel. With ``split_kv_at=n`` too, ``fn`` gets (and the call returns) dK and dV each as
    a pair of arrays, rows ``[:n]`` and ``[n:]`` (the pallas kernel stores them apart)."""

    host: HostSpec
    check: Callable[[Call], str]
    fallback: str | None
    split_fwd: Callable | None = None
    split_bwd: Callable | None = None

    @property
    def name(self) -> str:
        return self.host.name

    def supported(self, call: Call) -> str:
        """Why this engine cannot run ``call`` (empty when it can)."""
        return self.check(call)


def _xla_split_fwd(q, k, v, plan, **kw):
    # xla_ffa's own forward and backward, so the arithmetic is exactly that of xla_ffa;
    # tests/sharding checks it end to end.
    from magi_jax.ffa import xla as X

    res = X.xla_ffa_forward(q, k, v, plan, **kw)
    return res, res[:2]


def _xla_split_bwd(saved, q, k, v, plan, cts, *, between_dkv_dq=None, split_kv_at=0, **kw):
    from magi_jax.ffa import xla as X

    out, lse = saved
    dq, dk, dv = X.xla_ffa_backward(q, k, v, out, lse, *cts, plan, **kw)
    if between_dkv_dq is None:
        return dq, dk, dv
    if split_kv_at:
        dk, dv = (dk[:split_kv_at], dk[split_kv_at:]), (dv[:split_kv_at], dv[split_kv_at:])
    return dq, dk, dv, between_dkv_dq(dk, dv)


def _pallas_halves(interpret: bool) -> tuple[Callable, Callable]:
    # Split VJP: the forward saves its (out, lse); each stage's backward runs against the
    # merged (out, lse). Plans are traced here, so the kernels run one program per unit.
    def split_fwd(
        q, k, v, plan, *, softmax_scale, softcap, block_q, block_k, return_max_logits=False
    ):
        from magi_jax.pallas import ffa_pallas

        del block_q, block_k
        res = ffa_pallas(
            q,
            k,
            v,
            plan,
            softmax_scale=softmax_scale,
            softcap=softcap,
            interpret=interpret,
            persistent=0,
            return_max_logits=return_max_logits,
        )
        return res, res[:2]

    def split_bwd(
        saved,
        q,
        k,
        v,
        plan,
        cts,
        *,
        softmax_scale,
        softcap,
        block_q,
        block_k,
        between_dkv_dq=None,
        split_kv_at=0,
    ):
        from magi_jax.pallas import ffa_pallas_backward

        del block_q, block_k
        return ffa_pallas_backward(
            q,
            k,
            v,
            plan,
            *saved,
            *cts,
            softmax_scale=softmax_scale,
            softcap=softcap,
            interpret=interpret,
            between_dkv_dq=between_dkv_dq,
            split_kv_at=split_kv_at,
        )

    return split_fwd, split_bwd


IMPLEMENTATIONS: dict[str, Backend] = {
    "cudnn": Backend(HOST_SPECS["cudnn"], _cudnn_supported, fallback="pallas"),
    "pallas": Backend(HOST_SPECS["pallas"], _pallas_supported, "xla", *_pallas_halves(False)),
    "xla": Backend(HOST_SPECS["xla"], _xla_supported, None, _xla_split_fwd, _xla_split_bwd),
}
assert tuple(IMPLEMENTATIONS) == tuple(HOST_SPECS), tuple(HOST_SPECS)


# What an explicit engine that cannot run a call says it is.
_ENGINE_WORDS = {
    "cudnn": "cuDNN's fused attention over packed documents is",
    "pallas": "the Mosaic GPU FFA kernels are",
}


@functools.cache
def get_backend(name: str, interpret: bool = False) -> Backend:
    """The engine ``name`` as a rank of context parallelism runs it (an engine with the
    per-rank halves; ``interpret``: the pallas kernels in Mosaic GPU interpret mode)."""
    check_backend(name, "ffa_backend", auto=False, context_parallel=True)
    if interpret and name == "pallas":
        return Backend(HOST_SPECS["pallas"], _pallas_supported, "xla", *_pallas_halves(True))
    return IMPLEMENTATIONS[name]


def _chain(name: str) -> list[str]:
    """The engines ``name`` falls back to, in order."""
    out = []
    while (name := IMPLEMENTATIONS[name].fallback) is not None:
        out.append(name)
    return out


def _call(q, k, v, mask, softcap, sink, max_logits) -> Call:
    return Call(q, k, v, mask, float(softcap or 0.0), bool(sink), bool(max_logits))


def auto_backend(
    q: jax.Array | None = None,
    k: jax.Array | None = None,
    v: jax.Array | None = None,
    mask: AttnMask | None = None,
    *,
    softcap: float = 0.0,
    sink: bool = False,
    max_logits: bool = False,
    context_parallel: bool = False,
) -> tuple[str, str]:
    """What ``"auto"`` picks, ``(name, reason)`` (see the module docstring); with
    ``context_parallel`` only among the engines a rank of context parallelism runs."""
    call = _call(q, k, v, mask, softcap, sink, max_logits)
    skipped = []
    runs = {}
    for name, be in IMPLEMENTATIONS.items():
        if context_parallel and not be.host.context_parallel:
            continue
        why = be.supported(call)
        if why:
            skipped.append(f"{name}: {why}")
        else:
            runs[name] = be
    if "cudnn" in runs and "pallas" in runs:
        from magi_jax.ffa.engine_table import choose

        return choose(mask)
    name = next(iter(runs))
    if name == "cudnn":
        return name, "cuDNN expresses this mask; " + "; ".join(skipped)
    lead = "sm90 GPU" + (" and supported inputs" if q is not None else "")
    if name == "pallas":
        return name, lead if not skipped else f"{lead} ({'; '.join(skipped)})"
    return name, "; ".join(
        s.replace("pallas:", "pallas (Mosaic GPU) not used:", 1) for s in skipped
    )


def select_backend(
    backend: str = AUTO,
    q: jax.Array | None = None,
    k: jax.Array | None = None,
    v: jax.Array | None = None,
    mask: AttnMask | None = None,
    *,
    softcap: float = 0.0,
    sink: bool = False,
    max_logits: bool = False,
) -> tuple[str, str]:
    """The engine ``flex_flash_attention`` would use and why: ``(name, reason)``.

    ``auto`` (:func:`auto_backend`): ``cudnn`` or ``pallas`` where both run the call, as the
    committed table of measurements says is faster for the mask's class and size on this
    device (:mod:`magi_jax.ffa.engine_table`); else the first of ``cudnn`` (masks of
    per-document full or causal blocks, optionally a causal window; bf16/fp16, one head dim
    up to 256; no sinks, max logits or softcap; sm90 or later), ``pallas`` (sm90 GPU,
    bf16/fp16, D 64, 128 or 256, or the ``(Dqk, Dv)`` pairs of
    :data:`magi_jax.pallas.SUPPORTED_MLA_HEAD_DIMS`) and ``xla`` that runs it, with the
    reasons the others do not. An explicit engine that cannot run the call raises
    ``NotImplementedError`` saying why. ``q``, ``k``, ``v`` and ``mask`` may be left out
    (the choice then knows less: ``cudnn`` needs the mask)."""
    if check_backend(backend) == AUTO:
        return auto_backend(q, k, v, mask, softcap=softcap, sink=sink, max_logits=max_logits)
    be = IMPLEMENTATIONS[backend]
    if backend != "cudnn" or mask is not None:
        why = be.supported(_call(q, k, v, mask, softcap, sink, max_logits))
        if why:
            raise NotImplementedError(
                f"backend={backend!r}: {_ENGINE_WORDS[backend]} not available for this "
                f"call: {why}; use backend={_chain(backend)[0]!r} (or 'auto', which falls back "
                f"to {' then '.join(map(repr, _chain(backend)))})"
            )
    return backend, "requested explicitly"
