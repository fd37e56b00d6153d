"""The ``cudnn`` engine: cuDNN's fused attention over packed documents, under our contract.

The masks it runs are those cuDNN's packed ("THD") layout expresses
(:func:`magi_jax.planning.packed.packed_docs`): per-document full or causal blocks,
optionally one causal sliding window. They go to JAX's cuDNN call
(``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``) with per-document
offsets and lengths (``q_offsets``, ``kv_offsets``, ``q_seqlen``, ``kv_seqlen``; a mask of
one document over all tokens without them), and come back as our contract has them:

- ``out`` like ``q``; ``lse`` ``[(B,) T, Hq]`` float32, natural log: cuDNN returns its
  softmax statistics (the log-sum-exp of the scaled scores) when asked for its residual,
  one row of ``T`` per document (documents are its batch), which we gather back to token
  order — no second pass over the scores;
- rows outside every document see no key: ``out = 0``, ``lse = -inf`` and zero gradients
  (cuDNN leaves those rows unwritten, so they are set here);
- the backward is cuDNN's, from the saved statistics. cuDNN's backward has no input for
  the cotangent of ``lse``; when the caller's gradient flows through ``lse`` (it is not a
  symbolic zero), its part (``dS += P · dlse``) is added by the ``xla`` engine's backward
  on the same mask, which is exact but slower. Training losses on ``out`` alone never pay
  it.

Sinks, max logits, softcap and a value head dim of its own (MLA) are not cuDNN's; those
calls go to the FFA kernels (:func:`cudnn_problem` says why).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.masks import AttnMask
from magi_jax.planning.packed import CAUSAL_DOCS, PackedDocs, packed_arrays, packed_docs

_LOG = logging.getLogger(__name__)

if TYPE_CHECKING:
    from magi_jax.ffa.backends import Call

__all__ = ["cudnn_problem", "cudnn_attention", "device_problem", "MAX_HEAD_DIM"]

# cuDNN's flash attention on sm90 and later: head dims multiples of 8 up to 256.
MAX_HEAD_DIM = 256
_DTYPES = (jnp.bfloat16, jnp.float16)


def device_problem(device: jax.Device | None = None) -> str:
    """Why cuDNN's packed layout cannot run on ``device`` (default: the default device);
    empty when it can: an NVIDIA GPU of compute capability 9.0 or later with cuDNN."""
    dev = device
    if dev is None:
        try:
            dev = jax.devices()[0]
        except RuntimeError as e:  # pragma: no cover - no backend at all
            return f"no JAX device ({e})"
    if dev.platform != "gpu":
        return f"the default device is {dev.platform}, not an NVIDIA GPU"
    cc = str(getattr(dev, "compute_capability", "") or "")
    try:
        major = int(cc.split(".")[0])
    except ValueError:
        return f"the GPU {dev.device_kind} reports no CUDA compute capability ({cc!r})"
    if major < 9:
        return (
            f"the GPU {dev.device_kind} has compute capability {cc}; cuDNN's packed layout "
            "needs 9.0 (Hopper) or later"
        )
    from jax._src.lib import cuda_versions

    if cuda_versions is None:  # pragma: no cover - a GPU jaxlib always has it
        return "this jaxlib has no cuDNN"
    return ""


def _inputs_problem(q, k, v) -> str:
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return (
            f"dtype {q.dtype}/{k.dtype}/{v.dtype}: cuDNN's fused attention takes bfloat16 "
            "or float16 q, k, v of one dtype"
        )
    d, dv = q.shape[-1], v.shape[-1]
    if dv != d:
        return (
            f"v's head dim Dv={dv} differs from D={d} (multi-head latent attention): the "
            "cudnn engine takes one head dim; the FFA kernels take MLA"
        )
    if d % 8 or d > MAX_HEAD_DIM:
        return f"head dim {d}: cuDNN takes multiples of 8 up to {MAX_HEAD_DIM}"
    return ""


def cudnn_problem(call: Call) -> str:
    """Why the ``cudnn`` engine cannot run ``call`` (a :class:`magi_jax.ffa.backends.Call`);
    empty when it can."""
    if call.sink:
        return "attention sinks are not cuDNN's; the FFA engines take them"
    if call.max_logits:
        return "max logits are not cuDNN's; the FFA engines return them"
    if call.softcap:
        return "softcap is not cuDNN's; the FFA engines take it"
    if call.q is not None and (why := _inputs_problem(call.q, call.k, call.v)):
        return why
    if call.mask is None:
        return "the choice needs the mask (cuDNN runs only masks of its packed layout)"
    _, why = packed_docs(call.mask)
    if why:
        return f"the mask is not one of cuDNN's packed layout: {why}"
    return device_problem()


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What the traced call needs of the documents, hashable (the custom VJP's static
    argument): the documents, their capacity, the batch, the scale, and the ``xla``
    engine's mask for the ``lse`` cotangent."""

    docs: PackedDocs
    mask: AttnMask
    batch: int
    scale: float

    def __hash__(self):
        return hash((self.mask.fingerprint, self.batch, self.scale))

    def __eq__(self, other):
        return isinstance(other, _Layout) and (
            self.mask.fingerprint,
            self.batch,
            self.scale,
        ) == (other.mask.fingerprint, other.batch, other.scale)

    @functools.cached_property
    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(doc [T], local [T], q_valid [T], k_valid [Tk])``: each query's document and its
        place there (0 for padding rows), and the query rows and keys inside a document."""
        d = self.docs
        doc = np.zeros(d.total_q, np.int32)
        local = np.zeros(d.total_q, np.int32)
        q_valid = np.zeros(d.total_q, bool)
        k_valid = np.zeros(d.total_k, bool)
        for j, (s, n, ks, m) in enumerate(zip(d.q_starts, d.q_lens, d.k_starts, d.k_lens)):
            doc[s : s + n] = j
            local[s : s + n] = np.arange(n)
            q_valid[s : s + n] = True
            k_valid[ks : ks + m] = True
        return doc, local, q_valid, k_valid


def _raw(layout: _Layout, q, k, v):
    """cuDNN's call on ``[B, T, H, D]`` inputs: ``(out, stats)``."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import (
        dot_product_attention as cudnn_dot_product_attention,
    )

    d = layout.docs
    causal = d.kind == CAUSAL_DOCS
    window = d.window or None
    if d.dense:
        return cudnn_dot_product_attention(
            q,
            k,
            v,
            scale=layout.scale,
            mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK,
            sliding_window_length=window,
            return_residual=True,
        )
    # A capacity of at least two documents: one row of offsets with one entry reads as an
    # unpacked call.
    arrays = packed_arrays(d, max(2, d.num_docs))
    b = layout.batch
    q_off, k_off, q_len, k_len = (jnp.asarray(np.tile(a[None], (b, 1))) for a in arrays)
    return cudnn_dot_product_attention(
        q,
        k,
        v,
        q_seqlen=q_len,
        kv_seqlen=k_len,
        q_offsets=q_off,
        kv_offsets=k_off,
        scale=layout.scale,
        mask_type=MaskType.PADDING_CAUSAL if causal else MaskType.PADDING,
        sliding_window_length=window,
        return_residual=True,
    )


def _lse_of(layout: _Layout, stats):
    """``lse [B, T, H]`` from cuDNN's statistics ``[B·n, H, T]``: document ``j`` of batch
    row ``b`` is cuDNN's sequence ``b·n + j`` (documents shifted together across rows), and
    its ``i``-th query is at place ``i`` of that sequence."""
    doc, local, _, _ = layout.rows
    if layout.docs.dense:
        return jnp.swapaxes(stats, 1, 2)
    n = layout.docs.num_docs
    seq = np.arange(layout.batch, dtype=np.int32)[:, None] * n + doc[None, :]
    return stats[seq, :, np.broadcast_to(local[None, :], seq.shape)]


def _finish(layout: _Layout, out, stats):
    """Our ``(out, lse)`` from cuDNN's: rows outside every document get 0 and -inf."""
    _, _, q_valid, _ = layout.rows
    rows = jnp.asarray(q_valid)[None, :, None]
    out = jnp.where(rows[..., None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(rows, _lse_of(layout, stats).astype(jnp.float32), -jnp.inf)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(layout: _Layout, q, k, v):
    return _finish(layout, *_raw(layout, q, k, v))


def _fwd(layout, q, k, v):
    q, k, v = (x.value for x in (q, k, v))
    # cuDNN's own VJP holds its residuals (q, k, v, out, statistics): a pytree of arrays.
    (raw_out, stats), vjp = jax.vjp(functools.partial(_raw, layout), q, k, v)
    out, lse = _finish(layout, raw_out, stats)
    return (out, lse), (vjp, stats, q, k, v, out, lse)


def _bwd(layout, res, cts):
    vjp, stats, q, k, v, out, lse = res
    dout, dlse = cts
    _, _, q_valid, k_valid = layout.rows
    qrow = jnp.asarray(q_valid)[None, :, None, None]
    krow = jnp.asarray(k_valid)[None, :, None, None]
    if isinstance(dout, jax.custom_derivatives.SymbolicZero):
        dq, dk, dv = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    else:
        dout = jnp.where(qrow, dout, jnp.zeros((), dout.dtype))
        dq, dk, dv = vjp((dout, jnp.zeros_like(stats)))
        dq = jnp.where(qrow, dq, jnp.zeros((), dq.dtype))
        dk = jnp.where(krow, dk, jnp.zeros((), dk.dtype))
        dv = jnp.where(krow, dv, jnp.zeros((), dv.dtype))
    if not isinstance(dlse, jax.custom_derivatives.SymbolicZero):
        extra = _lse_cotangent(layout, q, k, v, out, lse, dlse)
        dq, dk, dv = (a + b.astype(a.dtype) for a, b in zip((dq, dk, dv), extra))
    return dq, dk, dv


def _lse_cotangent(layout, q, k, v, out, lse, dlse):
    """The gradients that flow through ``lse`` alone (``dout = 0``), by the ``xla`` engine's
    backward on the same mask: cuDNN's backward has no input for them."""
    from magi_jax.ffa.xla import xla_ffa_backward
    from magi_jax.planning.backends import backend_blocks
    from magi_jax.planning.work_list import plan_for_mask

    m = layout.mask
    # Said once per trace: this part runs on the portable engine, slower than the kernels.
    _LOG.warning(
        "cudnn engine: a loss that differentiates lse runs lse's part of the backward on "
        "the xla engine (cuDNN's backward takes no lse cotangent); backend='pallas' keeps "
        "the whole backward on the kernels"
    )
    (bq, bk), _ = backend_blocks("xla", m.total_q, m.total_k)
    plan = plan_for_mask(m, "xla", bq, bk)
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0).astype(jnp.float32)

    def one(q, k, v, out, lse, dlse):
        return xla_ffa_backward(
            q,
            k,
            v,
            out,
            lse,
            jnp.zeros_like(out),
            dlse,
            plan,
            softmax_scale=layout.scale,
            softcap=0.0,
            block_q=bq,
            block_k=bk,
        )

    return jax.vmap(one)(q, k, v, out, lse, dlse)


_attend.defvjp(_fwd, _bwd, symbolic_zeros=True)


def cudnn_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: AttnMask, *, softmax_scale: float
) -> tuple[jax.Array, jax.Array]:
    """Attention of ``q`` over ``k``/``v`` restricted to ``mask`` through cuDNN's packed
    layout (see the module docstring): ``q [(B,) Tq, Hq, D]``, ``k``/``v [(B,) Tk, Hkv,
    D]``, bfloat16/float16, ``Hq % Hkv == 0``; ``mask`` one of cuDNN's packed layout
    (:func:`~magi_jax.planning.packed.packed_docs`; ``ValueError`` with the reason
    otherwise), the same for every batch row. Returns ``(out [(B,) Tq, Hq, D] in q's
    dtype, lse [(B,) Tq, Hq] float32)``; differentiable in ``q``, ``k``, ``v``."""
    docs, why = packed_docs(mask)
    if docs is None:
        raise ValueError(f"mask: not a mask of cuDNN's packed layout: {why}")
    batched = q.ndim == 4
    q4, k4, v4 = (x if batched else x[None] for x in (q, k, v))
    layout = _Layout(docs, mask, int(q4.shape[0]), float(softmax_scale))
    out, lse = _attend(layout, q4, k4, v4)
    return (out, lse) if batched else (out[0], lse[0])
