"""Flax integration: ``attention_fn`` adapters and an NNX self-attention layer.

Two ways into a Flax model:

- :func:`make_attention_fn` turns a mask into an ``attention_fn`` for
  ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)`` or
  ``flax.nnx.MultiHeadAttention(attention_fn=...)``: the layer's projections stay as they are,
  the attention itself becomes :func:`~magi_jax.flex_flash_attention` or
  :func:`~magi_jax.magi_attention`.
- :class:`SelfAttention` is an NNX layer with grouped-query attention and rotary position
  embeddings; called with a mask it runs on one device, called with a key it runs context
  parallel and takes its RoPE positions from :func:`~magi_jax.position_ids`.

What a mask may be, in both (the one-device forms first):

- an :class:`~magi_jax.AttnMask`: a compile-time constant (a new mask under ``jit``
  compiles anew);
- an :class:`~magi_jax.AttnPlan` (:func:`~magi_jax.plan_attention` at a
  :class:`~magi_jax.PlanCapacity`): the mask as data, one compilation for every mask within
  the capacity;
- ``segment_ids`` (int ``[..., T]``, may be traced; with ``causal`` and ``window``): the
  plan is built on the device from the ids, as :func:`~magi_jax.dot_product_attention` does,
  one compilation for every packing; positive ids are documents, 0 and negative ids padding;
- a :class:`~magi_jax.sharding.MagiKey` (context parallel; one built at a
  :class:`~magi_jax.PlanCapacity` is data too, also on a one-device mesh).

Token layout: with a mask, the layer sees the packed sequence in natural order
(``[..., T, H, D]``); with a key, it sees *dispatched* tokens (``mj.dispatch(x, key)``,
``[..., padded_total, H, D]``), and only token-wise layers (projections, MLPs, norms) may sit
between dispatch and undispatch — which is every layer of a transformer but attention.
Leading batch axes share one mask; under context parallelism they are folded into the head
axis (query head ``b·Hq + h`` keeps using key head ``b·Hkv + h // (Hq/Hkv)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from magi_jax.ffa import flex_flash_attention
from magi_jax.ffa.api import check_qkv
from magi_jax.ffa.dpa import check_segment_ids_shape, packed_attention
from magi_jax.ffa.plan import AttnPlan
from magi_jax.ffa.sinks import MAX_SINKS, check_sink
from magi_jax.masks import AttnMask, window_bounds
from magi_jax.sharding.attention import magi_attention, magi_attention_local
from magi_jax.sharding.keys import MagiKey
from magi_jax.sharding.layout import position_ids

if TYPE_CHECKING:  # annotations only
    from magi_jax.planning.capacity import PlanCapacity

__all__ = ["make_attention_fn", "SelfAttention", "apply_rope", "rope_positions"]


_MASK_TYPES = (AttnMask, AttnPlan, MagiKey)
_WHAT = "an AttnMask, an AttnPlan (mj.plan_attention) or a MagiKey (mj.make_flex_key)"


def _check_target(mask_or_key, caller: str) -> None:
    if mask_or_key is not None and not isinstance(mask_or_key, _MASK_TYPES):
        extra = ""
        if hasattr(mask_or_key, "dtype") and jnp.issubdtype(mask_or_key.dtype, jnp.integer):
            extra = "; integer per-token ids go in segment_ids="
        raise TypeError(
            f"{caller} needs {_WHAT}, or segment_ids=; got {type(mask_or_key).__name__}{extra}"
        )


def _is_segment_ids(x) -> bool:
    """Integer arrays passed as the layer's ``mask=`` are segment ids (Flax's masks are
    boolean)."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer)


def make_attention_fn(
    mask_or_key: AttnMask | AttnPlan | MagiKey | None = None,
    *,
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    window: int | tuple[int, int] | None = None,
    capacity: int | PlanCapacity | None = None,
    check_segment_ids: bool = False,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    backend: str = "auto",
    local: bool = False,
) -> Callable[..., jax.Array]:
    """An ``attention_fn`` for Flax's multi-head attention layers.

    Args:
      mask_or_key: the mask of every call: an :class:`AttnMask` (one device, natural-order
        tokens; a compile-time constant), an :class:`AttnPlan` (one device, the mask as
        data: build it in the jitted step or pass it in), or a :class:`MagiKey`
        (context-parallel :func:`magi_attention` over dispatched tokens). ``None`` (and no
        ``segment_ids``): the mask comes with every call, through the layer's ``mask=``
        argument — any of the three, or integer segment ids ``[..., T]`` (Flax's own
        masks are boolean and stay refused) — so a stock Flax layer takes a new packing
        every step with one compilation.
      segment_ids: int ``[..., T]`` (x's batch axes and tokens, or ``[T]`` for all rows; may
        be traced), for every call: each maximal run of one positive id in a row is a
        document, ids 0 and below are padding; the plan is built on the device as
        :func:`~magi_jax.dot_product_attention` builds it.
      causal, window: the documents' mask with segment ids, as
        :meth:`AttnMask.from_segment_ids`; the layer's ``is_causal=True`` makes them causal.
      capacity, check_segment_ids: with segment ids, as for
        :func:`~magi_jax.dot_product_attention` (ids the plan cannot represent give a NaN
        output unless ``check_segment_ids`` raises).
      softmax_scale: default ``head_dim ** -0.5`` (Flax's own scaling).
      softcap: tanh soft-capping of the logits (0 = off).
      backend: FFA backend for the single-device path (``"auto"``, ``"xla"``, ...).
      local: with a key, the layer runs *inside* the caller's ``shard_map`` over the key's
        cp axis and sees one rank's ``[..., local_len, H, D]`` tokens.

    Returns ``fn(query, key, value, bias=None, mask=None, ...)`` with query
    ``[..., T, Hq, D]``, key ``[..., T, Hkv, D]`` and value ``[..., T, Hkv, Dv]`` returning
    ``[..., T, Hq, Dv]`` (``Dv`` is ``D`` in Flax's layers). ``bias=``, a boolean ``mask=``,
    ``mask=`` beside a mask given here, attention dropout, and ``is_causal=True`` without
    segment ids are rejected (dropout on the layer's output works as usual).
    """
    caller = "make_attention_fn"
    _check_target(mask_or_key, caller)
    if segment_ids is not None and mask_or_key is not None:
        raise ValueError(
            f"{caller}: got both mask_or_key ({type(mask_or_key).__name__}) and segment_ids=; "
            "the mask is one of the two"
        )
    window_bounds(window, causal)  # checked now, used at the call
    if local and (segment_ids is not None or isinstance(mask_or_key, (AttnMask, AttnPlan))):
        got = "segment_ids" if segment_ids is not None else f"an {type(mask_or_key).__name__}"
        raise ValueError(
            "local=True needs a MagiKey (it selects the per-rank body of context-parallel "
            f"attention); got {got}"
        )
    fixed = mask_or_key is not None or segment_ids is not None

    def attention_fn(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=True,
        dtype=None,
        precision=None,
        module=None,
        **kwargs,
    ):
        del broadcast_dropout, dropout_rng, precision, module
        if bias is not None:
            raise ValueError(
                f"magi-jax attention_fn got bias= (shape {tuple(jnp.shape(bias))}); an additive "
                "bias needs the [T, S] scores, which are never built: call the layer without "
                "bias="
            )
        target, ids = mask_or_key, segment_ids
        if mask is not None:
            if fixed:
                raise ValueError(
                    f"magi-jax attention_fn got mask= ({type(mask).__name__}); the mask comes "
                    "from the AttnMask/AttnPlan/MagiKey or segment_ids given to "
                    "make_attention_fn: call the layer without mask=, "
                    "or build the attention_fn with make_attention_fn() to pass the mask "
                    "per call"
                )
            if isinstance(mask, _MASK_TYPES):
                target = mask
            elif _is_segment_ids(mask):
                ids = mask
            else:
                raise ValueError(
                    f"magi-jax attention_fn got mask= of {type(mask).__name__} "
                    f"{getattr(mask, 'dtype', '')} {tuple(jnp.shape(mask))}: a dense boolean "
                    f"mask needs the [T, S] scores this library never builds; pass {_WHAT}, "
                    "or integer segment ids [..., T], as mask="
                )
        elif not fixed:
            raise ValueError(
                "magi-jax attention_fn: no mask; this attention_fn (make_attention_fn() with "
                f"no mask) takes it per call: pass {_WHAT}, or integer segment ids [..., T], "
                "as the layer's mask="
            )
        is_causal = bool(kwargs.get("is_causal"))
        if is_causal and ids is None:
            raise ValueError(
                "magi-jax attention_fn got is_causal=True; the mask comes from the "
                "AttnMask/AttnPlan/MagiKey (use AttnMask.causal(T) for plain causal)"
            )
        if dropout_rate > 0.0 and not deterministic:
            raise NotImplementedError(
                f"attention-weight dropout (dropout_rate={dropout_rate}) is not supported by "
                "flexible-mask flash attention; set the layer's dropout_rate=0 or call it "
                "with deterministic=True"
            )
        out = attend(
            query,
            key,
            value,
            target,
            segment_ids=ids,
            causal=causal or is_causal,
            window=window,
            capacity=capacity,
            check_segment_ids=check_segment_ids,
            softmax_scale=softmax_scale,
            softcap=softcap,
            backend=backend,
            local=local,
        )
        return out if dtype is None else out.astype(dtype)

    return attention_fn


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask_or_key: AttnMask | AttnPlan | MagiKey | None = None,
    *,
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    window: int | tuple[int, int] | None = None,
    capacity: int | PlanCapacity | None = None,
    check_segment_ids: bool = False,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    backend: str = "auto",
    local: bool = False,
    sink: jax.Array | None = None,
    return_max_logits: bool = False,
    caller: str = "magi-jax attention",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of ``q [..., T, Hq, D]``, ``k [..., T, Hkv, D]``, ``v [..., T, Hkv, Dv]``
    (``Dv`` may differ from ``D``: multi-head latent attention) under a mask: an
    :class:`AttnMask` or an :class:`AttnPlan` (natural order, one device), ``segment_ids``
    ``[..., T]`` or ``[T]`` (natural order, one device, the plan built on the device; with
    ``causal``, ``window``, ``capacity``, ``check_segment_ids`` as in
    :func:`make_attention_fn`) or a :class:`MagiKey` (dispatched tokens, context parallel);
    returns ``out [..., T, Hq, Dv]``. This is what the adapters and :class:`SelfAttention`
    call; q, k, v are promoted to one dtype first (as Flax's layers do).

    ``sink``: attention-sink logits ``[S, Hq]`` (:mod:`magi_jax.ffa.sinks`), shared by every
    batch row. ``return_max_logits=True`` returns ``(out, max_logits)``, the per-head max
    logits of :func:`~magi_jax.flex_flash_attention` shaped ``[..., Hq]`` (q's batch axes;
    under context parallelism already the max over ranks; with segment ids the rows are
    packed into one sequence, so each row holds the max over the batch)."""
    _check_target(mask_or_key, caller)
    if (mask_or_key is None) == (segment_ids is None):
        raise ValueError(
            f"{caller}: give the mask as one of {_WHAT}, or as segment_ids=; got "
            + ("neither" if mask_or_key is None else "both")
        )
    dtype = jnp.result_type(q, k, v)
    q, k, v = (x.astype(dtype) if hasattr(x, "astype") else x for x in (q, k, v))
    _check_layout(q, k, v, mask_or_key, local, caller)
    if sink is not None:
        check_sink(sink, q.shape[-2])
    batch, hq = q.shape[:-3], q.shape[-2]
    opts = dict(
        softmax_scale=softmax_scale, softcap=softcap, return_max_logits=bool(return_max_logits)
    )
    flat = lambda x: x.reshape((-1,) + x.shape[-3:]) if len(batch) > 1 else x
    if segment_ids is not None:
        if local:
            raise ValueError(f"{caller}: local=True needs a MagiKey; segment ids run on one device")
        res = _attend_segments(
            q,
            k,
            v,
            segment_ids,
            causal,
            window,
            capacity,
            check_segment_ids,
            backend,
            sink,
            caller,
            opts,
        )
        out = res[0].reshape(q.shape[:-1] + v.shape[-1:])
        if return_max_logits:
            return out, jnp.broadcast_to(res[2], batch + (hq,))
        return out
    if isinstance(mask_or_key, (AttnMask, AttnPlan)):
        res = flex_flash_attention(
            flat(q), flat(k), flat(v), mask_or_key, backend=backend, sink=sink, **opts
        )
        out = res[0].reshape(q.shape[:-1] + v.shape[-1:])
    else:
        key = mask_or_key
        _check_mesh(key, q, k, v)
        if local:
            # The batch is folded into the heads (query head b·Hq + h), so the sinks repeat.
            folded_sink = None if sink is None else jnp.tile(sink, (1, _fold(q).shape[1] // hq))
            res = magi_attention_local(_fold(q), _fold(k), _fold(v), key, sink=folded_sink, **opts)
            out = _unfold(res[0], q.shape[:-1] + v.shape[-1:])
        else:
            # One batch axis, kept: magi_attention shards it over the key's batch axes (and
            # a batched key gives each row its own plan).
            res = magi_attention(flat(q), flat(k), flat(v), key, sink=sink, **opts)
            out = res[0].reshape(q.shape[:-1] + v.shape[-1:])
    if not return_max_logits:
        return out
    return out, res[2].reshape(batch + (hq,))


def _attend_segments(
    q, k, v, segment_ids, causal, window, capacity, check, backend, sink, caller, opts
):
    """:func:`attend` with segment ids: q's batch axes flattened into ``[B, T]`` rows for
    :func:`~magi_jax.ffa.dpa.packed_attention`; returns its ``(out [B, T, Hq, Dv], lse,
    [max_logits [Hq]])``."""
    batch, t = q.shape[:-3], q.shape[-3]
    ids = segment_ids
    if not isinstance(ids, jax.core.Tracer):
        ids = np.asarray(ids)  # concrete ids stay on the host (checked at the call)
    if batch and tuple(ids.shape) == (t,):
        ids = (np.broadcast_to if isinstance(ids, np.ndarray) else jnp.broadcast_to)(
            ids, batch + (t,)
        )
    rows = int(np.prod(batch, dtype=np.int64))
    if tuple(ids.shape) != batch + (t,):
        raise ValueError(
            f"{caller}: segment_ids must be [..., T] = {batch + (t,)} (the layer's batch axes "
            f"and tokens) or [T] = ({t},) for every row; got shape {tuple(ids.shape)}"
        )
    ids = check_segment_ids_shape(ids.reshape(rows, t), rows, t, caller=caller)
    rows4 = lambda x: x.reshape((rows,) + x.shape[-3:])
    return packed_attention(
        rows4(q),
        rows4(k),
        rows4(v),
        ids,
        window=window_bounds(window, causal),
        capacity=capacity,
        backend=backend,
        check_segment_ids=check,
        sink=sink,
        caller=caller,
        **opts,
    )


def _fold(x):
    """``[B..., T, H, D]`` -> ``[T, B·H, D]`` (batch folded into heads)."""
    if x.ndim == 3:
        return x
    t, h, d = x.shape[-3:]
    x = x.reshape((-1, t, h, d))
    return jnp.moveaxis(x, 0, 1).reshape(t, -1, d)


def _unfold(x, shape):
    if len(shape) == 3:
        return x
    t, h, d = shape[-3:]
    return jnp.moveaxis(x.reshape(t, -1, h, d), 1, 0).reshape(shape)


def _check_layout(q, k, v, mask_or_key, local, caller="magi-jax attention"):
    check_qkv(
        q,
        k,
        v,
        caller=caller,
        names=("query", "key", "value"),
        layout="[..., T, heads, head_dim]",
        ranks=None,
    )
    if q.shape[-3] != k.shape[-3]:
        raise ValueError(
            f"{caller}: query {tuple(q.shape)}, key {tuple(k.shape)} and value "
            f"{tuple(v.shape)} must share their token axis (self-attention over one packed "
            "sequence)"
        )
    if mask_or_key is None:  # segment ids: any number of tokens
        return
    if isinstance(mask_or_key, (AttnMask, AttnPlan)):
        tq, tk = (
            (mask_or_key.total_q, mask_or_key.total_k)
            if isinstance(mask_or_key, AttnMask)
            else (mask_or_key.capacity.total_q, mask_or_key.capacity.total_k)
        )
        noun = "mask" if isinstance(mask_or_key, AttnMask) else "plan's capacity"
        want, what = tq, f"the {noun} has total_q={tq} tokens"
        if tq != tk:
            raise ValueError(
                f"magi-jax attention layers are self-attention: the {noun} must have "
                f"total_q == total_k; got {tq} and {tk}"
            )
    else:
        key = mask_or_key
        if local:
            want = key.local_len
            what = f"the key gives every rank local_len={key.local_len} tokens"
        else:
            want = key.padded_total
            what = (
                f"the key dispatches padded_total={key.padded_total} tokens "
                f"({key.total} real + padding)"
            )
    t = q.shape[-3]
    if t == want:
        return
    hint = ""
    if q.ndim >= 4 and q.shape[-4] == want:
        hint = (
            " The token axis must be third from last ([batch, T, heads, head_dim]); "
            "yours looks like [T, batch, ...]."
        )
    elif isinstance(mask_or_key, MagiKey):
        key = mask_or_key
        if t == key.total and not local:
            hint = (
                " These look like natural-order tokens: dispatch the layer's input "
                "first (x = mj.dispatch(x, key)) and undispatch its output."
            )
        elif t == key.local_len and not local:
            hint = (
                " These look like one rank's tokens (inside shard_map): build the "
                "attention_fn with local=True, or call the layer outside shard_map."
            )
        elif t == key.padded_total and local:
            hint = (
                " These look like all dispatched tokens: local=True is only for layers "
                "called inside shard_map over the key's cp axis."
            )
    raise ValueError(
        f"{caller}: the layer sees {t} tokens (query shape {tuple(q.shape)}) but {what}.{hint}"
    )


def _check_mesh(key: MagiKey, *xs):
    """A concrete input sharded over devices other than the key's mesh is a mistake that
    would otherwise surface as an obscure shard_map error."""
    mesh_devices = set(key.mesh.devices.flat)
    for x in xs:
        if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
            continue
        devices = x.sharding.device_set
        if len(devices) > 1 and devices != mesh_devices:
            raise ValueError(
                f"magi-jax attention: an input is sharded over {len(devices)} devices that are "
                f"not the key's mesh ({len(mesh_devices)} devices, axes "
                f"{key.mesh.axis_names}); build the key on the mesh the model runs on, or "
                "dispatch the input with mj.dispatch(x, key)"
            )


# ---- rotary position embeddings -------------------------------------------------------------


def rope_positions(mask_or_key: AttnMask | AttnPlan | MagiKey | None, num_tokens: int) -> jax.Array:
    """Positions for RoPE: ``arange(T)`` for a mask, a plan or segment ids (``None``; natural
    order), the global position of every dispatched token for a key
    (:func:`~magi_jax.position_ids`)."""
    if isinstance(mask_or_key, MagiKey):
        return position_ids(mask_or_key)
    return jnp.arange(num_tokens, dtype=jnp.int32)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary embedding (rotate-half form) of ``x [..., T, H, D]`` at integer ``positions
    [T]`` (or ``[..., T]``); computed in float32, returned in ``x``'s dtype. RoPE only sees
    position differences, so global positions over a packed sequence give each document the
    same rotations as positions restarting at 0 would."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"RoPE needs an even head_dim; got {d}")
    freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    ang = positions.astype(jnp.float32)[..., None] * freq  # [..., T, D/2]
    sin, cos = jnp.sin(ang)[..., None, :], jnp.cos(ang)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ---- NNX layer ------------------------------------------------------------------------------


class SelfAttention(nnx.Module):
    """Multi-head self-attention with grouped-query attention and RoPE, over a packed sequence.

    Args:
      in_features: model width ``F``.
      num_heads: query heads ``Hq``; num_kv_heads: key/value heads ``Hkv`` (default ``Hq``;
        ``Hq % Hkv == 0``).
      head_dim: default ``F // Hq``.
      v_head_dim: the value head dim (default ``head_dim``); another value gives multi-head
        latent attention's shapes (e.g. ``head_dim=192, v_head_dim=128``): queries and keys
        of ``head_dim``, values and the attention output of ``v_head_dim``.
      rope_theta: RoPE base; ``None`` disables RoPE.
      softmax_scale, softcap: as for :func:`~magi_jax.flex_flash_attention`.
      use_bias, dtype, param_dtype, kernel_init: as for :class:`flax.nnx.Linear`.
      num_sinks: learnable attention sinks (0 = none, at most 8): a parameter ``sink``
        ``[num_sinks, num_heads]`` float32 of sink logits that join every row's softmax
        denominator and add nothing to the output (:mod:`magi_jax.ffa.sinks`), on one
        device and under context parallelism alike.
      sink_init: initialiser of the sink logits (default zeros: each sink starts with the
        weight of a key whose logit is 0).

    Call ``layer(x, mask_or_key, positions=None)`` with ``x [..., T, F]``: natural-order
    tokens and an :class:`AttnMask` or an :class:`AttnPlan` (one device), or dispatched
    tokens and a :class:`MagiKey` (context parallel; positions default to
    ``position_ids(key)``); or ``layer(x, segment_ids=ids, causal=True, window=None)``
    with natural-order tokens and int ids ``[..., T]`` (or ``[T]`` for every row; may be
    traced): positive ids are documents, 0 and negative ids padding, the plan is built on
    the device, one compilation for every packing (``capacity``, ``check_segment_ids`` as
    for :func:`~magi_jax.dot_product_attention`). Positions default to ``arange(T)`` on one
    device (RoPE sees only differences inside a document).
    Returns ``[..., T, F]`` in the same order; with ``return_max_logits=True``, ``(y,
    max_logits)``: the per-head max logits (before the softcap, sinks not included;
    ``[..., num_heads]`` float32 over x's batch axes, no gradient), what QK-clip needs.
    """

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        rope_theta: float | None = 10000.0,
        softmax_scale: float | None = None,
        softcap: float = 0.0,
        use_bias: bool = False,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
        kernel_init: Callable[..., jax.Array] = nnx.initializers.lecun_normal(),
        backend: str = "auto",
        num_sinks: int = 0,
        sink_init: Callable[..., jax.Array] = nnx.initializers.zeros_init(),
        rngs: nnx.Rngs,
    ) -> None:
        if (
            isinstance(num_sinks, bool)
            or not isinstance(num_sinks, int)
            or not 0 <= num_sinks <= MAX_SINKS
        ):
            raise ValueError(
                f"num_sinks={num_sinks!r} must be an int in [0, {MAX_SINKS}] "
                "(0: no attention sinks)"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of "
                f"num_kv_heads={num_kv_heads} (grouped-query attention)"
            )
        if head_dim is None:
            if in_features % num_heads:
                raise ValueError(
                    f"in_features={in_features} is not divisible by "
                    f"num_heads={num_heads}; pass head_dim explicitly"
                )
            head_dim = in_features // num_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.rope_theta, self.softmax_scale, self.softcap = rope_theta, softmax_scale, softcap
        self.backend = backend
        # Sink logits stay float32 whatever param_dtype is (they enter the fp32 softmax).
        self.sink = (
            nnx.Param(
                jnp.asarray(
                    sink_init(rngs.params(), (num_sinks, num_heads), jnp.float32), jnp.float32
                )
            )
            if num_sinks
            else None
        )
        lin = lambda i, o: nnx.Linear(
            i,
            o,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            rngs=rngs,
        )
        self.q_proj = lin(in_features, num_heads * head_dim)
        self.k_proj = lin(in_features, num_kv_heads * head_dim)
        self.v_proj = lin(in_features, num_kv_heads * self.v_head_dim)
        self.o_proj = lin(num_heads * self.v_head_dim, in_features)

    def __call__(
        self,
        x: jax.Array,
        mask_or_key: AttnMask | AttnPlan | MagiKey | None = None,
        positions: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        causal: bool = True,
        window: int | tuple[int, int] | None = None,
        capacity: int | PlanCapacity | None = None,
        check_segment_ids: bool = False,
        return_max_logits: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``x [..., T, F]`` -> ``[..., T, F]`` in ``x``'s order (with ``return_max_logits``,
        also the max logits ``[..., num_heads]`` float32); see the class."""
        _check_target(mask_or_key, "SelfAttention")
        if (mask_or_key is None) == (segment_ids is None):
            raise ValueError(
                f"SelfAttention needs its mask as one of {_WHAT}, or as segment_ids=; got "
                + ("neither" if mask_or_key is None else "both")
            )
        if x.ndim < 2:
            raise ValueError(
                f"SelfAttention: x must be [..., T, features]; got shape {tuple(x.shape)}"
            )
        split = lambda y, h, d: y.reshape(y.shape[:-1] + (h, d))
        q = split(self.q_proj(x), self.num_heads, self.head_dim)
        k = split(self.k_proj(x), self.num_kv_heads, self.head_dim)
        v = split(self.v_proj(x), self.num_kv_heads, self.v_head_dim)
        if self.rope_theta is not None:
            _check_layout(q, k, v, mask_or_key, False, "SelfAttention")
            if positions is None:
                positions = rope_positions(mask_or_key, q.shape[-3])
            q = apply_rope(q, positions, self.rope_theta)
            k = apply_rope(k, positions, self.rope_theta)
        sink = None if self.sink is None else self.sink[...]
        out = attend(
            q,
            k,
            v,
            mask_or_key,
            segment_ids=segment_ids,
            causal=causal,
            window=window,
            capacity=capacity,
            check_segment_ids=check_segment_ids,
            caller="SelfAttention",
            softmax_scale=self.softmax_scale,
            softcap=self.softcap,
            backend=self.backend,
            sink=sink,
            return_max_logits=return_max_logits,
        )
        if not return_max_logits:
            return self.o_proj(out.reshape(out.shape[:-2] + (-1,)))
        out, max_logits = out
        return self.o_proj(out.reshape(out.shape[:-2] + (-1,))), max_logits
