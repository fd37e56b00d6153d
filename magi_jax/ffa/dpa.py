"""``dot_product_attention``: the whole interface of ``jax.nn.dot_product_attention`` on the
exact flexible-mask attention.

Every argument of ``jax.nn.dot_product_attention`` (jax 0.11) is taken with its meaning; the
ones that have no exact, memory-light equivalent here (an additive ``bias``, a traced dense
``mask``, a mask that differs between heads) raise ``NotImplementedError`` naming what to use.
How each input becomes a mask:

- nothing but ``is_causal`` / ``local_window_size``: one host mask for the whole batch
  (at most three slices, :func:`magi_jax.masks.shape_to_slices`);
- ``segment_ids`` and/or ``query_seq_lengths`` / ``key_value_seq_lengths`` (may be traced):
  the batch rows are packed into one sequence and the plan is built on the device
  (:func:`magi_jax.ffa.device_planner.device_plan`), one compilation for every value;
- a concrete boolean ``mask``: its rectangles (:func:`magi_jax.ffa.dense_mask.
  dense_rectangles`), each cut by the causal / window diagonals and by concrete lengths, as
  slices of one host mask (per batch row when the mask or the lengths differ between rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.ffa.api import check_qkv, finite_float, flex_flash_attention, select_backend
from magi_jax.ffa.dense_mask import dense_rectangles
from magi_jax.ffa.device_planner import device_plan, pack_rows, unpack_rows
from magi_jax.masks import AttnMask, shape_to_slices

if TYPE_CHECKING:  # annotations only
    from magi_jax.planning.capacity import PlanCapacity

__all__ = [
    "dot_product_attention",
    "packed_attention",
    "check_segment_ids_shape",
    "IMPLEMENTATIONS",
]

# jax.nn's `implementation` and the backend each one means here: "xla" the portable backend,
# "cudnn" (a fused GPU kernel that raises when it cannot take the inputs) the Mosaic GPU
# kernels, None the `backend` argument (default "auto").
IMPLEMENTATIONS = {None: None, "xla": "xla", "cudnn": "pallas"}


def _window_of(is_causal: bool, local_window_size):
    """jax.nn's ``local_window_size`` as ``(left, right)`` (``None`` = unbounded)."""
    if local_window_size is None:
        return None, (0 if is_causal else None)
    if isinstance(local_window_size, (int, np.integer)):
        left = right = int(local_window_size)
    else:
        try:
            left, right = (int(w) for w in local_window_size)
        except (TypeError, ValueError):
            raise ValueError(
                f"local_window_size must be an int or a (left, right) pair; got "
                f"{local_window_size!r}"
            ) from None
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size=({left}, {right}) must be >= 0")
    return left, (0 if is_causal else right)


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _lengths(name: str, x, batch: int, bound: int):
    """A ``[B]`` integer length array: NumPy when concrete, the tracer when traced."""
    if x is None:
        return None
    if not _is_traced(x):
        x = np.asarray(x)
    if tuple(x.shape) != (batch,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be an int32 [B] = [{batch}] array of lengths in [0, {bound}]; got "
            f"{x.dtype} {tuple(x.shape)}"
        )
    return x


def _dense_mask(mask, b: int, n: int, t: int, s: int) -> np.ndarray:
    """A concrete jax.nn mask (broadcastable to ``[B, N, T, S]``, the same for every head)
    as bool ``[B or 1, T, S]``."""
    if _is_traced(mask):
        raise NotImplementedError(
            "mask: a traced boolean mask would need the [T, S] scores this library never "
            "builds; pass it concretely (a NumPy array: its rectangles become slices), or "
            "express it as segment_ids= (packed documents, traced) or query_seq_lengths= / "
            "key_value_seq_lengths= (padding, traced), or build a magi_jax.AttnMask (or an "
            "AttnPlan from magi_jax.plan_attention, data under jit) for "
            "magi_jax.flex_flash_attention"
        )
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise ValueError(
            f"mask must be boolean (True: the cell takes part); got dtype {m.dtype}; "
            "pass an additive mask as bias (not supported here) or compare it to 0"
        )
    if m.ndim > 4:
        raise ValueError(f"mask must have at most 4 dims ([B, N, T, S]); got shape {m.shape}")
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    try:
        ok = np.broadcast_shapes(m.shape, (b, n, t, s)) == (b, n, t, s)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"mask has shape {m.shape}, which does not broadcast to [B, N, T, S] = {(b, n, t, s)}"
        )
    if m.shape[1] != 1 and not (m == m[:, :1]).all():
        raise NotImplementedError(
            "mask differs between heads: one mask serves all heads here; call "
            "dot_product_attention once per group of heads that share a mask"
        )
    return np.broadcast_to(m[:, 0], (m.shape[0], t, s))


def _host_mask(dense, q_len, kv_len, b: int, t: int, s: int, left, right) -> AttnMask:
    """The mask of ``rows`` packed rows (``rows`` = 1: one row shared by the batch): row
    ``r``'s rectangles of ``dense[r]`` cut to its lengths and by the window, shifted to
    ``[r·T, (r+1)·T) x [r·S, (r+1)·S)``."""
    rows = max(1 if dense is None else dense.shape[0], 1 if q_len is None else b)
    rows = max(rows, 1 if kv_len is None else b)
    slices = []
    for r in range(rows):
        if dense is None:
            rects = np.array([[0, t, 0, s]])
        else:
            rects = dense_rectangles(dense[min(r, dense.shape[0] - 1)])
        lq = t if q_len is None else int(np.clip(q_len[r], 0, t))
        lk = s if kv_len is None else int(np.clip(kv_len[r], 0, s))
        off = r * (s - t)  # the row's diagonal j - i in packed positions is k - q - off
        for q0, q1, k0, k1 in rects:
            slices += shape_to_slices(
                r * t + q0,
                r * t + min(q1, lq),
                r * s + k0,
                r * s + min(k1, lk),
                None if left is None else off - left,
                None if right is None else off + right,
            )
    arr = np.array([x[:4] for x in slices], np.int64).reshape(-1, 4)
    types = np.array([int(x[4]) for x in slices], np.int64)
    return AttnMask.from_ranges(arr[:, :2], arr[:, 2:], types, rows * t, rows * s)


def check_segment_ids_shape(
    segment_ids: jax.Array | np.ndarray, batch: int, tokens: int, *, caller: str
) -> jax.Array | np.ndarray:
    """``segment_ids`` as ``[batch, tokens]`` integers: NumPy when concrete (so that they can
    be checked on the host at the call; inside a trace ``jnp.asarray`` would stage them),
    the tracer when traced. ``ValueError`` naming the shape or dtype otherwise."""
    if not _is_traced(segment_ids):
        segment_ids = np.asarray(segment_ids)
    if tuple(segment_ids.shape) != (batch, tokens):
        raise ValueError(
            f"{caller}: segment_ids must be [B, T] = {(batch, tokens)} (one id per token of "
            f"every row); got shape {tuple(segment_ids.shape)}"
        )
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"{caller}: segment_ids must be integers (positive: documents, 0 or negative: "
            f"padding); got dtype {segment_ids.dtype}"
        )
    return segment_ids


def packed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    *,
    window: tuple[int | None, int | None] = (None, None),
    capacity: int | PlanCapacity | None = None,
    backend: str = "auto",
    check_segment_ids: bool = False,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: jax.Array | None = None,
    return_max_logits: bool = False,
    caller: str = "dot_product_attention",
) -> tuple[jax.Array, ...]:
    """Attention of ``B`` rows whose mask is data: segment ids and/or per-row lengths, the
    plan built on the device (:func:`~magi_jax.ffa.device_planner.device_plan`), so one
    compilation serves every value. What :func:`dot_product_attention` and the Flax layers
    (:mod:`magi_jax.nn`) run for ``segment_ids``.

    ``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, Hv]``; ``segment_ids`` int ``[B,
    T]`` (``T == S``): each maximal run of one positive id in a row is a document, ids 0
    and below are padding; ``q_lengths`` / ``kv_lengths`` int ``[B]``; ``window = (left,
    right)`` (``None``: unbounded) inside each document. ``capacity``, ``check_segment_ids``
    as for :func:`dot_product_attention`; ``softmax_scale``, ``softcap``, ``sink``,
    ``return_max_logits`` as for :func:`~magi_jax.flex_flash_attention`.

    Returns ``(out [B, T, N, Hv], lse [B, T, N])``, with ``return_max_logits`` also
    ``max_logits [N]``: the rows are packed into one sequence, so it is the max over the
    batch. Inputs the plan cannot represent (an id in two runs of a row, more work than
    ``capacity``) make every output NaN unless ``check_segment_ids`` raises first."""
    b, t = q.shape[:2]
    s = k.shape[1]
    if segment_ids is not None:
        if t != s:
            raise ValueError(
                f"{caller}: segment_ids need self-attention over packed rows (T == S); got "
                f"T={t}, S={s}: for other masks build an AttnMask and call "
                "magi_jax.flex_flash_attention"
            )
        segment_ids = check_segment_ids_shape(segment_ids, b, t, caller=caller)
    name, _ = select_backend(backend, q, k, v)
    if name == "cudnn":
        raise NotImplementedError(
            f"{caller}: backend='cudnn' runs masks known on the host (an AttnMask through "
            "magi_jax.flex_flash_attention); segment ids and sequence lengths are planned "
            "on the device for the FFA engines: use backend='auto', 'pallas' or 'xla'"
        )
    plan, bad = device_plan(
        segment_ids,
        q_lengths,
        kv_lengths,
        shape=(b, t, s),
        window=window,
        backend=name,
        capacity=capacity,
        raise_now=bool(check_segment_ids),
    )
    res = flex_flash_attention(
        pack_rows(q),
        pack_rows(k),
        pack_rows(v),
        plan,
        softmax_scale=softmax_scale,
        softcap=softcap,
        sink=sink,
        return_max_logits=return_max_logits,
    )
    bad = jax.lax.stop_gradient(bad)
    nan = lambda x: jnp.where(bad, jnp.asarray(jnp.nan, x.dtype), x)
    return (unpack_rows(nan(res[0]), b), unpack_rows(nan(res[1]), b)) + tuple(
        nan(x) for x in res[2:]
    )


@jax.named_scope("dot_product_attention")
def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    segment_ids: jax.Array | None = None,
    softcap: float = 0.0,
    capacity: int | PlanCapacity | None = None,
    backend: str = "auto",
    check_segment_ids: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``jax.nn.dot_product_attention`` on the exact flexible-mask kernels: code written
    against ``jax.nn`` runs unchanged wherever the arguments are supported.

    Shapes as ``jax.nn`` names them (``B`` batch, ``T``/``S`` query/key length, ``N``/``K``
    query/key heads, ``H`` head dim):

    Args:
      query: ``[B, T, N, H]`` or ``[T, N, H]``; bfloat16/float16/float32 (float64 computed
        in float64).
      key: ``[B, S, K, H]`` (or ``[S, K, H]``), ``N % K == 0`` (GQA/MQA).
      value: like ``key``, or ``[B, S, K, Hv]`` with its own head dim ``Hv`` (multi-head
        latent attention: the output then has ``Hv``).
      bias: not supported (``NotImplementedError``): an additive bias needs the ``[T, S]``
        scores, which are never built; express a boolean pattern as ``mask``.
      mask: boolean, broadcastable to ``[B, N, T, S]`` (``True``: the cell takes part), the
        same for every head, **concrete** (NumPy or a committed array: its rectangles become
        slices of a host mask, a compile-time constant under ``jit``). A traced mask or one
        that differs between heads raises ``NotImplementedError`` naming the alternatives.
      scale: defaults to ``H ** -0.5``.
      is_causal: query ``i`` sees keys ``j <= i`` (top-left aligned, as ``jax.nn``).
      query_seq_lengths, key_value_seq_lengths: int ``[B]``: only a row's first
        ``query_seq_lengths[b]`` queries and ``key_value_seq_lengths[b]`` keys take part
        (clipped to ``[0, T]`` / ``[0, S]``). May be traced: the rows are packed and the
        plan is built on the device, one compilation for every value. With a ``mask`` they
        must be concrete.
      local_window_size: ``w`` or ``(left, right)``: query ``i`` sees keys
        ``i - left <= j <= i + right``.
      implementation: ``None`` (use ``backend``), ``"xla"`` (the portable ``xla`` backend)
        or ``"cudnn"`` (the fused GPU kernels, here the Mosaic GPU ``pallas`` backend,
        raising ``NotImplementedError`` when they cannot take the inputs, as ``jax.nn``'s
        cuDNN path raises). It must agree with an explicit ``backend``.
      return_residual: also return the log-sum-exp ``[B, T, N]`` (``[T, N]`` for 3-D
        inputs), as ``jax.nn`` defines it: ``log Σ_j exp(scale·q·k_j)`` over the cells that
        take part, natural log, in ``key``'s dtype, without gradient.
      segment_ids: int ``[B, T]`` (``[T]`` for 3-D inputs; ``T == S``; may be traced,
        also under ``vmap``): each maximal run of one positive id in a row is a document
        that attends only to itself; ids 0 and below (0 or -1, as pipelines pad) are
        padding: those rows see no key, give output 0 and are seen by no query. One id must
        not appear in two separate runs of a row (see ``check_segment_ids``). ``jax.nn``
        differs here: it treats every id, 0 and -1 included, as a document.
      softcap: tanh soft-capping of the scores (0: off).
      capacity: work items of the device-built plan (an int or a
        :class:`~magi_jax.planning.capacity.PlanCapacity` over ``B·T x B·S``); default a
        bound that every value fits. Used with ``segment_ids`` or lengths only.
      backend: ``"auto"``, ``"xla"`` or ``"pallas"``, as
        :func:`magi_jax.flex_flash_attention`.
      check_segment_ids: inputs the device plan cannot represent — an id in two separate
        runs of a row, or more work items than ``capacity`` holds — make the whole output
        NaN (never a wrong finite answer). With ``True`` they raise instead, naming the id
        and positions or ``PlanCapacity.items`` and the value needed: concrete inputs
        (NumPy or committed arrays, also inside a ``jit`` that closes over them) on the host
        at the call, a ``ValueError`` (``CapacityError`` for the capacity); traced ones
        through ``jax.experimental.checkify``, JAX's way of raising from compiled code:
        ``err, out = checkify.checkify(step)(...)`` then ``err.throw()`` raises a
        ``ValueError`` (``checkify.JaxRuntimeError``) with the message (staged by ``jit``
        without ``checkify``, JAX refuses when it compiles the step and names checkify).

    Returns:
      The output, ``query``'s shape with ``Hv`` for ``H``, in ``query``'s dtype; with
      ``return_residual``, ``(output, lse)``. Rows that see no key give output 0 and
      ``lse = -inf``; ``jax.nn`` gives 0 only for rows past ``query_seq_lengths`` and
      otherwise averages the values with a large finite ``lse`` there.
    """
    q, k, v = query, key, value
    check_qkv(
        q,
        k,
        v,
        caller="dot_product_attention",
        names=("query", "key", "value"),
        layout="[B, T, N, H] or [T, N, H]",
    )
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    if bias is not None:
        raise NotImplementedError(
            "bias: an additive bias needs the [T, S] scores, which this library never "
            "builds; pass a boolean pattern as mask= (or segment_ids= / sequence lengths), "
            "use softcap= for tanh capping, or call jax.nn.dot_product_attention for biases"
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is not one of {tuple(IMPLEMENTATIONS)}"
        )
    if implementation is not None:
        want = IMPLEMENTATIONS[implementation]
        if backend not in ("auto", want):
            raise ValueError(
                f"implementation={implementation!r} means backend={want!r}, but "
                f"backend={backend!r} was passed; give one of the two"
            )
        backend = want
    b, t, n, h = q.shape
    s = k.shape[1]
    if scale is not None and finite_float(scale) is None:
        raise ValueError(f"scale={scale!r} must be a finite number (or None for H ** -0.5)")
    scale = h**-0.5 if scale is None else float(scale)
    left, right = _window_of(is_causal, local_window_size)
    q_len = _lengths("query_seq_lengths", query_seq_lengths, b, t)
    kv_len = _lengths("key_value_seq_lengths", key_value_seq_lengths, b, s)
    name, _ = select_backend(backend, q, k, v)

    dense = None
    if mask is not None:
        dense = _dense_mask(mask, b, n, t, s)
        if segment_ids is not None:
            raise NotImplementedError(
                "mask and segment_ids together: give the documents in the mask (a concrete "
                "mask can hold them) or drop the mask"
            )
        if _is_traced(q_len) or _is_traced(kv_len):
            raise NotImplementedError(
                "a mask with traced query_seq_lengths / key_value_seq_lengths: pass the "
                "lengths concretely, fold them into the mask, or drop the mask (traced "
                "lengths alone are planned on the device)"
            )
    elif segment_ids is not None or q_len is not None or kv_len is not None:
        if segment_ids is not None and not _is_traced(segment_ids):
            segment_ids = np.asarray(segment_ids)
        if segment_ids is not None and unbatched and segment_ids.ndim == 1:
            segment_ids = segment_ids[None]  # [T] beside [T, N, H] inputs
        out, lse = packed_attention(
            q,
            k,
            v,
            segment_ids,
            q_len,
            kv_len,
            window=(left, right),
            capacity=capacity,
            backend=name,
            check_segment_ids=check_segment_ids,
            softmax_scale=scale,
            softcap=softcap,
        )
    if mask is not None or (segment_ids is None and q_len is None and kv_len is None):
        host = _host_mask(dense, q_len, kv_len, b, t, s, left, right)
        if host.total_q == t:  # one mask for the whole batch
            out, lse = flex_flash_attention(
                q, k, v, host, softmax_scale=scale, softcap=softcap, backend=backend
            )
        else:
            out, lse = flex_flash_attention(
                pack_rows(q),
                pack_rows(k),
                pack_rows(v),
                host,
                softmax_scale=scale,
                softcap=softcap,
                backend=backend,
            )
            out, lse = unpack_rows(out, b), unpack_rows(lse, b)
    if unbatched:
        out, lse = out[0], lse[0]
    if return_residual:
        return out, jax.lax.stop_gradient(lse).astype(k.dtype)
    return out
