"""The logic of the ``pallas`` backend (:mod:`magi_jax.pallas`): input checks, the
``custom_vjp`` over the forward, dQ and dK/dV kernels, persistent schedules and defaults.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from magi_jax.masks import AttnMask
from magi_jax.pallas.bwd_common import DKV_SPLIT_ALIGN
from magi_jax.pallas.common import LOG2E, MAX_NARROW_D
from magi_jax.pallas.ffa_bwd import ffa_dkv, ffa_dq
from magi_jax.pallas.ffa_dkv_wide import ffa_dkv_wide
from magi_jax.pallas.ffa_dq_wide import ffa_dq_wide
from magi_jax.pallas.ffa_fwd import ffa_forward
from magi_jax.pallas.tuning import (
    KernelConfigs,
    default_persistence,
    kernel_configs,
    on_host,
)
from magi_jax.planning.work_list import (
    DKV_BLOCK_K,
    FWD_BLOCK_K,
    FWD_BLOCK_Q,
    FFAPlanArrays,
    WorkList,
    persistent_schedule,
    plan_for_mask,
)

__all__ = [
    "flex_flash_attention_pallas",
    "ffa_pallas",
    "ffa_pallas_backward",
    "supported",
    "device_supported",
    "DKV_SPLIT_ALIGN",
    "FFAPlanArrays",
    "plan_for_mask",
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_MLA_HEAD_DIMS",
    "SUPPORTED_DTYPES",
    "head_dims_problem",
]

# Head dims of q, k and v where they are one.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# (Dqk, Dv): the query/key head dim and a value head dim of its own (multi-head latent
# attention). Dqk <= 128 runs the narrow kernels, above it the forward's half key tiles and
# the wide backward (whose head-dim halves need Dv a multiple of 128).
SUPPORTED_MLA_HEAD_DIMS = ((128, 64), (192, 128), (256, 128))
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
_MAX_GRID_TILES = 65535  # tiles sit on a grid dimension limited to 2**16 - 1 blocks


def device_supported() -> tuple[bool, str]:
    """Whether the default JAX device is an sm90 (Hopper) GPU: ``(ok, reason)``."""
    try:
        dev = jax.devices()[0]
    except RuntimeError as e:  # pragma: no cover - no backend at all
        return False, f"no JAX device ({e})"
    if dev.platform != "gpu":
        return False, f"the default device is {dev.platform}, not an NVIDIA GPU"
    cc = getattr(dev, "compute_capability", None)
    if cc is None or not str(cc).startswith("9"):
        return False, (
            f"the GPU {dev.device_kind} has compute capability {cc}; the Mosaic GPU "
            "FFA kernels are written for Hopper (9.0)"
        )
    return True, ""


def head_dims_problem(dqk: int, dv: int) -> str:
    """Why the kernels do not take a query/key head dim ``dqk`` with a value head dim ``dv``
    (empty when they do): one head dim in :data:`SUPPORTED_HEAD_DIMS`, or a pair of
    :data:`SUPPORTED_MLA_HEAD_DIMS`."""
    if dqk == dv:
        if dqk in SUPPORTED_HEAD_DIMS:
            return ""
        return f"head dim {dqk}: the pallas kernels support D in {SUPPORTED_HEAD_DIMS}"
    if (dqk, dv) in SUPPORTED_MLA_HEAD_DIMS:
        return ""
    return (
        f"v's head dim Dv={dv} differs from the query/key head dim D={dqk} (multi-head "
        f"latent attention): the pallas kernels take (Dqk, Dv) in {SUPPORTED_MLA_HEAD_DIMS} "
        f"(or one D in {SUPPORTED_HEAD_DIMS})"
    )


def supported(
    q: jax.Array, k: jax.Array, v: jax.Array, *, check_device: bool = True
) -> tuple[bool, str]:
    """Whether the pallas kernels take these inputs: ``(ok, reason)`` (reason empty when ok).

    q ``[(B,) Tq, Hq, Dqk]``, k ``[(B,) Tk, Hkv, Dqk]``, v ``[(B,) Tk, Hkv, Dv]``; bf16 or
    fp16, ``Dqk = Dv`` in :data:`SUPPORTED_HEAD_DIMS` or ``(Dqk, Dv)`` in
    :data:`SUPPORTED_MLA_HEAD_DIMS` (:func:`head_dims_problem`), ``Hq % Hkv == 0``.
    ``check_device`` also requires that the default device is an sm90 GPU, and is checked
    first: off such a GPU that is the reason, whatever the inputs."""
    if check_device:
        ok, why = device_supported()
        if not ok:
            return False, why
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False, (
            f"dtype {q.dtype}/{k.dtype}/{v.dtype}: the pallas kernels take "
            "bfloat16 or float16 q, k, v of one dtype"
        )
    d = q.shape[-1]
    if k.shape[-1] != d:
        return False, f"q has head dim {d} and k {k.shape[-1]}: q and k take one head dim"
    if why := head_dims_problem(d, v.shape[-1]):
        return False, why
    if q.shape[-2] % k.shape[-2]:
        return False, f"Hq={q.shape[-2]} is not a multiple of Hkv={k.shape[-2]}"
    tq, tk = q.shape[-3], k.shape[-3]
    if not tq or not tk:
        return False, f"empty sequence (Tq={tq}, Tk={tk})"
    if max(-(-tq // FWD_BLOCK_Q), -(-tk // DKV_BLOCK_K)) > _MAX_GRID_TILES:
        return False, (
            f"Tq={tq}/Tk={tk} give more than {_MAX_GRID_TILES} tiles of 128 tokens "
            "(a CUDA grid dimension); split the work (context parallelism)"
        )
    return True, ""


def _pad_rows(x, multiple):
    t = x.shape[1]
    pad = -t % multiple
    if not pad:
        return x
    return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))


class _Schedules(NamedTuple):
    """Host schedules of the persistent kernels (forward, dK/dV): ``(offsets, units)`` of
    :func:`~magi_jax.planning.work_list.persistent_schedule`, or ``()`` where a kernel is not
    persistent."""

    fwd: tuple
    dkv: tuple


_NO_SCHEDULES = _Schedules((), ())


def _schedules(
    plan: FFAPlanArrays, cfg: KernelConfigs, batch: int, hq: int, hkv: int
) -> _Schedules:
    fwd, dkv = cfg.fwd_programs, cfg.dkv_programs
    if not (fwd or dkv):
        return _NO_SCHEDULES
    if not on_host(plan):
        raise ValueError(
            f"persistent={fwd}, dkv_persistent={dkv}: the persistent kernels "
            "schedule their units on the host, so the plan must be NumPy arrays "
            "(not traced or device arrays); pass 0 here"
        )
    fwd_list = WorkList(plan.q_order, plan.q_offsets, plan.q_items)
    dkv_list = WorkList(plan.k_order, plan.k_offsets, plan.k_items)
    sched = lambda work, groups, n: persistent_schedule(work, groups, n) if n else ()
    return _Schedules(sched(fwd_list, batch * hq, fwd), sched(dkv_list, batch * hkv, dkv))


def _forward(q, k, v, plan: FFAPlanArrays, sched: _Schedules, cfg: KernelConfigs):
    tq = q.shape[1]
    qp = _pad_rows(q, FWD_BLOCK_Q)
    kp, vp = _pad_rows(k, FWD_BLOCK_K), _pad_rows(v, FWD_BLOCK_K)
    out, lse_bht, *res = ffa_forward(
        qp, kp, vp, plan.q_order, plan.q_offsets, plan.q_items, cfg.fwd, sched.fwd
    )
    # With cfg.fwd.row_max the kernel's per-row maxima become per-head ones: [B, Hq].
    return (out[:, :tq], lse_bht[:, :, :tq]) + tuple(
        jax.lax.stop_gradient(r[:, :, :tq].max(axis=-1)) for r in res
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ffa(q, k, v, plan, sched, cfg):
    out, lse_bht, *max_logits = _forward(q, k, v, plan, sched, cfg)
    return (out, jnp.swapaxes(lse_bht, 1, 2), *max_logits)


def _ffa_fwd(q, k, v, plan, sched, cfg):
    out, lse_bht, *max_logits = _forward(q, k, v, plan, sched, cfg)
    return ((out, jnp.swapaxes(lse_bht, 1, 2), *max_logits), (q, k, v, plan, sched, out, lse_bht))


def _ffa_bwd(cfg, res, cts, between_dkv_dq=None, split_kv_at=0):
    q, k, v, plan, sched, out, lse_bht = res
    dout, dlse = cts[:2]  # the max logits, if returned, have no gradient
    tq, tk = q.shape[1], k.shape[1]
    finite = jnp.isfinite(lse_bht)
    # delta = rowsum(out·dout) − dlse: d lse / d s = p, so the lse cotangent shifts delta.
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), dout.astype(jnp.float32))
    delta = delta - jnp.where(finite, jnp.swapaxes(dlse, 1, 2).astype(jnp.float32), 0.0)
    # Rows that see no key: lse = +inf makes P = 0 there, so their gradients are 0.
    lse2 = jnp.where(finite, lse_bht * LOG2E, jnp.inf)
    pad_q = lambda x: _pad_rows(x, FWD_BLOCK_Q)
    pad_k = lambda x: _pad_rows(x, max(FWD_BLOCK_K, DKV_BLOCK_K))
    pad_stat = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, -tq % FWD_BLOCK_Q)))
    args = (
        pad_q(q),
        pad_k(k),
        pad_k(v),
        pad_q(dout.astype(q.dtype)),
        pad_stat(lse2),
        pad_stat(delta),
    )
    wide = q.shape[-1] > MAX_NARROW_D
    dq_fn, dkv_fn = (ffa_dq_wide, ffa_dkv_wide) if wide else (ffa_dq, ffa_dkv)
    dq_kernel = lambda args: dq_fn(*args, plan.q_order, plan.q_offsets, plan.q_items, cfg.dq)
    if between_dkv_dq is None:
        dq = dq_kernel(args)
    dkv_kernel = functools.partial(
        dkv_fn, *args, plan.k_order, plan.k_offsets, plan.k_items, cfg.dkv, sched.dkv
    )
    if split_kv_at and split_kv_at % DKV_SPLIT_ALIGN == 0:
        # Each tile stored straight into its part: no slicing copy of the first part.
        dk0, dv0, dk1, dv1 = dkv_kernel(split=split_kv_at)
        rest = tk - split_kv_at
        dk, dv = (dk0, dk1[:, :rest]), (dv0, dv1[:, :rest])
    else:
        dk, dv = dkv_kernel()
        dk, dv = dk[:, :tk], dv[:, :tk]
        if split_kv_at:
            dk, dv = (
                (dk[:, :split_kv_at], dk[:, split_kv_at:]),
                (dv[:, :split_kv_at], dv[:, split_kv_at:]),
            )
    if between_dkv_dq is None:
        return dq[:, :tq], dk, dv, None, None
    # dK/dV first, then the hook (e.g. a started collective of dK/dV), then dQ. Only the
    # hook's token carries the order: through a barrier with dQ's inputs (so the dQ kernel
    # comes after the hook) and one with dQ's output (so what ends the hook's work comes
    # after the dQ kernel). dK/dV themselves pass through no barrier.
    token = between_dkv_dq(dk, dv)
    token, args = jax.lax.optimization_barrier((token, args))
    dq = dq_kernel(args)
    token, dq = jax.lax.optimization_barrier((token, dq))
    return dq[:, :tq], dk, dv, token


_ffa.defvjp(_ffa_fwd, _ffa_bwd)


@jax.named_scope("ffa_pallas")
def ffa_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    plan: FFAPlanArrays,
    *,
    softmax_scale: float,
    softcap: float = 0.0,
    interpret: bool = False,
    num_stages: int | None = None,
    dq_num_stages: int | None = None,
    dkv_num_stages: int | None = None,
    persistent: int | None = None,
    dkv_persistent: int | None = None,
    dkv_steps_per_wait: int | None = None,
    fma_exp_cols: int | None = None,
    schedules: tuple | None = None,
    return_max_logits: bool = False,
) -> tuple[jax.Array, ...]:
    """Flexible-mask attention from plan arrays (no mask): the per-rank entry point.

    q ``[(B,) Tq, Hq, Dqk]``, k ``[(B,) Tk, Hkv, Dqk]``, v ``[(B,) Tk, Hkv, Dv]`` (bf16/fp16;
    one head dim 64, 128 or 256, or ``(Dqk, Dv)`` of :data:`SUPPORTED_MLA_HEAD_DIMS`);
    ``plan``: the work lists of :func:`~magi_jax.planning.work_list.plan_for_mask`
    (``"pallas"``) for these ``Tq``/``Tk``, as int32 arrays.
    Returns ``out [(B,) Tq, Hq, Dv]`` (q's dtype) and ``lse [(B,) Tq, Hq]`` float32 (natural log,
    ``-inf`` for rows that see no key). Differentiable in q, k, v, also through lse.
    ``interpret=True`` runs the kernels in Mosaic GPU interpret mode (CPU, tests only).

    Tuning (results do not depend on it beyond rounding; each knob ``None`` takes the
    default of :mod:`magi_jax.pallas.tuning`, whose measurements are in
    benchmarks/results/kernel/LATEST.md):

    * ``num_stages`` (forward), ``dq_num_stages``, ``dkv_num_stages``: shared-memory slots of
      the producer rings (:func:`~magi_jax.pallas.tuning.default_num_stages`). At D = 128 the
      forward fits 3 only with one program per unit, dQ 2, dK/dV 3; above D = 128 each
      takes 2. The query/key head dim ``Dqk`` picks the defaults and the kernels.
    * ``persistent``: 0 (one program per q-tile and head) or the number of programs (the SM
      count) that walk the (q-tile, batch, head) units of a host schedule
      (:func:`~magi_jax.planning.work_list.persistent_schedule`), so the plan must be NumPy
      arrays; ``dkv_persistent``: the same for the dK/dV kernel (units: k-tile, batch, key
      head). By default each is persistent on short rows where its output buffers fit
      (:func:`~magi_jax.pallas.tuning.default_persistence`); never above D = 128, and the dQ
      kernel always runs one program per unit.
    * ``dkv_steps_per_wait``: query blocks each dK/dV consumer takes between two waits, 1 or
      2 (D = 64 and ``dkv_num_stages`` >= 4 only).
    * ``fma_exp_cols``: of each forward score block's 128 keys (64 above D = 128), how many are
      exponentiated by a cubic on the FMA pipes instead of the ``ex2`` unit (a multiple of 8;
      relative error 7.5e-5, under half an fp16 ulp).

    ``schedules``: schedules built beforehand (a plan as data, whose arrays may be traced:
    :func:`magi_jax.ffa.plan.plan_attention`): ``()`` runs one program per unit, ``(fwd
    offsets, fwd units, dK/dV offsets, dK/dV units)`` the persistent forward and dK/dV
    kernels over them; the tuning knobs then take their defaults.

    ``return_max_logits=True`` adds a third output, ``max_logits [(B,) Hq]`` float32: each
    head's largest ``softmax_scale·q·k`` (before the softcap) over the allowed cells,
    ``-inf`` where a head sees none. No gradient."""
    if schedules is not None:
        if len(schedules) not in (0, 4):
            raise ValueError(
                "schedules must be () or (fwd_offsets, fwd_units, dkv_offsets, "
                f"dkv_units); got {len(schedules)} arrays"
            )
        return _ffa_scheduled(
            q,
            k,
            v,
            plan,
            tuple(schedules),
            float(softmax_scale),
            float(softcap),
            bool(interpret),
            bool(return_max_logits),
        )
    d = q.shape[-1]
    default_fwd, default_dkv = default_persistence(
        plan, d, interpret, num_stages=num_stages, dkv_num_stages=dkv_num_stages
    )
    cfg = kernel_configs(
        d,
        softmax_scale,
        softcap,
        interpret,
        persistent=default_fwd if persistent is None else persistent,
        dkv_persistent=default_dkv if dkv_persistent is None else dkv_persistent,
        num_stages=num_stages,
        dq_num_stages=dq_num_stages,
        dkv_num_stages=dkv_num_stages,
        dkv_steps_per_wait=dkv_steps_per_wait,
        fma_exp_cols=fma_exp_cols,
        row_max=return_max_logits,
    )
    batched = q.ndim == 4
    sched = _schedules(plan, cfg, q.shape[0] if batched else 1, q.shape[-2], k.shape[-2])
    sched = jax.tree.map(lambda a: jnp.asarray(a, jnp.int32), sched)
    plan = FFAPlanArrays(*(jnp.asarray(a, jnp.int32) for a in plan))
    if not batched:
        return tuple(x[0] for x in _ffa(q[None], k[None], v[None], plan, sched, cfg))
    return _ffa(q, k, v, plan, sched, cfg)


def _ffa_scheduled(q, k, v, plan, schedules, scale, softcap, interpret, max_logits):
    """:func:`ffa_pallas` over schedules that travel with the plan (the default kernels'
    tuning; dQ one program per unit). Above D = 128 the schedules are not used: every kernel
    runs one program per unit there."""
    if q.shape[-1] > MAX_NARROW_D:
        schedules = ()  # no persistent kernel above D = 128 (the wide backward has none)
    programs = (
        (int(schedules[0].shape[0]) - 1, int(schedules[2].shape[0]) - 1) if schedules else (0, 0)
    )
    cfg = kernel_configs(
        q.shape[-1],
        scale,
        softcap,
        interpret,
        persistent=programs[0],
        dkv_persistent=programs[1],
        row_max=max_logits,
    )
    as_i32 = lambda a: jnp.asarray(a, jnp.int32)
    sched = (
        _Schedules(
            (as_i32(schedules[0]), as_i32(schedules[1])),
            (as_i32(schedules[2]), as_i32(schedules[3])),
        )
        if schedules
        else _NO_SCHEDULES
    )
    plan = FFAPlanArrays(*(as_i32(a) for a in plan))
    if q.ndim == 3:
        return tuple(x[0] for x in _ffa(q[None], k[None], v[None], plan, sched, cfg))
    return _ffa(q, k, v, plan, sched, cfg)


@jax.named_scope("ffa_pallas_bwd")
def ffa_pallas_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    plan: FFAPlanArrays,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    dlse: jax.Array,
    *,
    softmax_scale: float,
    softcap: float = 0.0,
    interpret: bool = False,
    between_dkv_dq: Callable | None = None,
    split_kv_at: int = 0,
) -> tuple:
    """The backward of :func:`ffa_pallas` from a forward's ``(out, lse)``, which may be the
    merged result of several calls (context parallelism runs each stage's backward against
    the merged output). Shapes as :func:`ffa_pallas`: q ``[(B,) Tq, Hq, Dqk]``, out/dout
    ``[(B,) Tq, Hq, Dv]``, k ``[(B,) Tk, Hkv, Dqk]``, v ``[(B,) Tk, Hkv, Dv]``, lse/dlse
    ``[(B,) Tq, Hq]`` float32. Returns ``(dq, dk, dv)``. The kernels run one program per unit
    (the plan may be traced).

    ``between_dkv_dq(dk, dv) -> token`` (an array): the dK/dV kernel runs first, then this
    hook, then the dQ kernel; the token comes back as a fourth output, ordered after dQ.
    Context parallelism starts the group-reduce of dK/dV there, to move beside the dQ
    kernel, and ends it with the token. ``split_kv_at=n`` (with the hook): the hook gets,
    and the call returns, dK and dV each as two arrays, rows ``[:n]`` and ``[n:]``; where
    ``n`` is a multiple of ``DKV_SPLIT_ALIGN`` the kernel stores them apart (no copy)."""
    cfg = kernel_configs(q.shape[-1], softmax_scale, softcap, interpret)
    plan = FFAPlanArrays(*(jnp.asarray(a, jnp.int32) for a in plan))
    lift = (lambda x: x) if q.ndim == 4 else (lambda x: x[None])
    unlift = (lambda x: x) if q.ndim == 4 else (lambda x: x[0])
    res = (lift(q), lift(k), lift(v), plan, _NO_SCHEDULES, lift(out), jnp.swapaxes(lift(lse), 1, 2))
    if between_dkv_dq is None:
        if split_kv_at:
            raise ValueError("ffa_pallas_backward: split_kv_at goes with between_dkv_dq")
        dq, dk, dv, _, _ = _ffa_bwd(cfg, res, (lift(dout), lift(dlse)))
        return unlift(dq), unlift(dk), unlift(dv)
    # The hook's dK/dV are the ones returned (one value each: a started collective's inputs
    # must reach its end as the same buffers).
    held = []

    def hook(dk, dv):
        held.extend(jax.tree.map(unlift, (dk, dv)))
        return between_dkv_dq(*held)

    dq, _, _, token = _ffa_bwd(cfg, res, (lift(dout), lift(dlse)), hook, split_kv_at)
    return unlift(dq), held[0], held[1], token


def flex_flash_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttnMask,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    interpret: bool = False,
    **tuning: Any,
) -> tuple[jax.Array, ...]:
    """:func:`magi_jax.flex_flash_attention` on the Mosaic GPU kernels. Same contract;
    raises ``ValueError`` naming the reason when the inputs are not supported."""
    ok, why = supported(q, k, v, check_device=not interpret)
    if not ok:
        raise ValueError(f"backend='pallas' cannot run these inputs: {why}; use backend='xla'")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    plan = plan_for_mask(mask, "pallas")
    return ffa_pallas(
        q, k, v, plan, softmax_scale=scale, softcap=softcap, interpret=interpret, **tuning
    )
