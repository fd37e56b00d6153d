"""The checks at :func:`~magi_jax.sharding.magi_attention`'s door: its inputs' shapes,
dtypes and head dims (:func:`check_inputs`), one rank's blocks for
:func:`~magi_jax.sharding.magi_attention_local` (:func:`check_local_inputs`), and whether an
input is visibly in the dispatched layout — its length, its sharding type under ``jit`` on
an Explicit mesh, where its rows live when it is concrete — with the "dispatch first"
messages that name the fix. Python at trace time: the compiled program is unchanged.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from magi_jax.ffa.api import check_qkv
from magi_jax.sharding.keys import (
    MagiKey,
    axes_entry,
    check_devices,
    check_key,
    cp_names,
    cp_ranks,
    is_checked,
    rows_desc,
)
from magi_jax.sharding.layout import pod_specs

__all__ = ["check_inputs", "check_local_inputs", "dispatch_fix"]


def check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, key: MagiKey) -> None:
    """The inputs of :func:`~magi_jax.sharding.magi_attention`, checked at the call: arrays
    q ``[(B,) padded_total, Hq, D]``, k ``[(B,) T_kv, Hkv, D]``, v ``[(B,) T_kv, Hkv, Dv]``
    (``T_kv`` the key's ``padded_total``, or ``kv_padded_total`` for cross attention) of one
    floating dtype, heads and batch rows that split over the key's axes, head dims the
    key's FFA backend takes, and each in the dispatched layout as far as it can be seen
    (see below). ``ValueError`` / ``TypeError`` naming the input, the value and the fix."""
    check_key(key, "magi_attention", q, k, v)
    check_qkv(
        q,
        k,
        v,
        caller="magi_attention",
        layout="[padded_total, H, D] or [B, padded_total, H, D] (dispatched tokens)",
    )
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_devices(key, "magi_attention", name, x, one_device=False)  # one: never dispatched
    for name, x in (("q", q), ("k", k), ("v", v)):
        if name != "q" and key.cross:
            if x.shape[-3] != key.kv_padded_total:
                raise ValueError(_kv_length_message(name, x, key))
        elif x.shape[-3] != key.padded_total:
            raise ValueError(_length_message(name, x, key))
    _check_pod_shapes(q, k, key)
    if key.ffa_backend == "pallas":
        from magi_jax.pallas.api import supported

        ok, why = supported(q, k, v, check_device=False)
        if not ok:
            raise ValueError(
                f"magi_attention: the key runs the Mosaic GPU kernels "
                f"(ffa_backend='pallas', the default on sm90 GPUs), which cannot "
                f"take these inputs: {why}; cast q, k, v to bfloat16, or build "
                "the key with ffa_backend='xla'"
            )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if name == "q" or key.kv_layout in ("shared", "dispatched"):
            _check_dispatched_layout(name, x, key, "q" if name == "q" else "kv")


def _axes_size(key: MagiKey, axes) -> int:
    return int(np.prod([key.mesh.shape[a] for a in axes]))


def _check_pod_shapes(q, k, key: MagiKey):
    """Batch rows and heads split evenly over the key's batch and head axes."""
    if key.batched and (q.ndim != 4 or q.shape[0] != key.rows):
        raise ValueError(
            f"magi_attention: q has shape {tuple(q.shape)}, but the key is batched (one plan "
            f"for each of {key.rows} rows): q, k, v must be [{key.rows}, padded_total, H, D] "
            "(mj.dispatch(x, key, seq_axis=1))"
        )
    shards = _axes_size(key, key.batch_axes)
    if q.ndim == 4 and q.shape[0] % shards:
        raise ValueError(
            f"magi_attention: the batch of {q.shape[0]} rows cannot be split over the key's "
            f"batch_axes={key.batch_axes!r} ({shards} shards); use a multiple of {shards} rows"
        )
    shards = _axes_size(key, key.head_axes)
    for name, x in (("q", q), ("k/v", k)):
        if x.shape[-2] % shards:
            raise ValueError(
                f"magi_attention: {name} has {x.shape[-2]} heads, which cannot be split over "
                f"the key's head_axes={key.head_axes!r} ({shards} shards): every shard needs "
                "whole query and key/value heads (use head counts divisible by the "
                "tensor-parallel size)"
            )


def _kv_length_message(name, x, key):
    """Keys/values of a cross-attention key with the wrong number of rows."""
    n = x.shape[-3]
    layout = (
        "every rank holds all of them (replicated)"
        if key.kv_layout == "replicated"
        else f"dispatched: {key.kv_padded_total} rows ({key.total_k} keys + "
        f"{key.kv_padded_total - key.total_k} padding)"
    )
    msg = (
        f"magi_attention: {name} has {n} tokens (shape {tuple(x.shape)}) but the key "
        f"(cross attention, kv_layout={key.kv_layout!r}) takes {key.total_k} keys, "
        f"{layout}"
    )
    if n == key.total_k:
        msg += "; these look like natural-order keys"
    elif n == key.padded_total:
        msg += "; these look like dispatched queries (role='q')"
    seq = ", seq_axis=1" if x.ndim == 4 else ""
    return (
        f"{msg}. dispatch first: {name} = mj.dispatch(x, key{seq}, role='kv') lays out "
        "keys and values as the key wants them"
    )


_DISPATCH_FIRST = (
    "dispatch first: {name} = mj.dispatch(x, key{seq}) turns a natural-order "
    "array into the dispatched layout (rank r holds rows [r·{L}, (r+1)·{L}))"
)


def dispatch_fix(name: str, x: jax.Array, key: MagiKey) -> str:
    """The "dispatch first" fix for input ``name`` (its rank-major layout spelled out)."""
    return _DISPATCH_FIRST.format(
        name=name, seq=", seq_axis=1" if x.ndim == 4 else "", L=key.local_len
    )


def _length_message(name, x, key):
    n, st = x.shape[-3], key.static
    msg = (
        f"magi_attention: {name} has {n} tokens (shape {tuple(x.shape)}) but the key "
        f"dispatches {rows_desc(key)}"
    )
    looks = []
    if n == key.total:
        looks.append("natural-order tokens")
    if is_checked(key) and n == st.padded_total:
        looks.append(
            "tokens dispatched with the key's unchecked twin (make_flex_key without "
            "check_dispatch): dispatch with this key"
        )
    if not is_checked(key) and n == st.padded_total + st.cp:
        looks.append("tokens dispatched with a check_dispatch=True key: use that key here too")
    if looks:
        msg += "; these look like " + ", or ".join(looks)
    return f"{msg}. {dispatch_fix(name, x, key)}"


# ---- the dispatched layout at the door --------------------------------------------------
#
# What magi_attention can see of an input, at no cost to the compiled program:
# - its shape: natural-order arrays have `total` rows, dispatched ones `padded_total`. Equal
#   whenever the sequence needs no padding, so the shape alone is not enough.
# - on a mesh whose cp axis is Explicit, the sharding *type* of a traced array
#   (jax.typeof(x).sharding), under jit too: an array not split over the cp axis along the
#   sequence (replicated, on one device, split over another axis) is no dispatch output and
#   would only fail later inside shard_map. A natural-order array typed P(cp) looks exactly
#   like a dispatched one.
# - for a concrete array (an eager call), where its rows live: rank r's devices must hold
#   rows [r·local_len, (r+1)·local_len). An array that never went through dispatch is
#   usually on one device or replicated; one that is sharded P(cp) in natural order again
#   looks exactly like a dispatched one.
# - under jit on an Auto mesh, nothing: the type carries no sharding.
# Values cannot help (token-wise layers change them; magi_attention is exact on any input),
# so the two cases that stay silent here — natural-order arrays sharded over cp, and any
# array under jit on an Auto mesh, when padded_total == total — need a layout that differs
# in shape: make_flex_key(..., check_dispatch=True) (or MAGI_JAX_CHECK_DISPATCH=1) returns a
# CheckedKey whose dispatched arrays carry one hidden row per rank, so they never have the
# natural length. The checks below are Python at trace time: the compiled program of the
# default path is unchanged.


def _check_dispatched_layout(name, x, key, role="q"):
    seq = x.ndim - 3
    if isinstance(x, jax.core.Tracer):
        _check_type(name, x, key, seq)
    elif isinstance(x, jax.Array):
        _check_placement(name, x, key, seq, key.kv_local_len if role == "kv" else None)


def _entry(e) -> tuple:
    if e is None:
        return ()
    return tuple(e) if isinstance(e, (tuple, list)) else (e,)


def _check_type(name, x, key, seq):
    """A traced input on a mesh whose cp axis is Explicit: its sharding type."""
    types = dict(zip(key.mesh.axis_names, key.mesh.axis_types))
    names = cp_names(key.cp_axis)  # cp over one mesh axis or several
    if all(types[a] != AxisType.Explicit for a in names):
        return  # Auto: the type says nothing
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return
    spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
    got = _entry(spec[seq])
    want = P(*([None] * seq), key.cp_axis)
    if not set(names) <= set(sharding.mesh.axis_names):
        where = "is not on the key's mesh (its type names no mesh axis)"
    elif got == ():
        where = (
            f"is typed {sharding.spec}: not split over {key.cp_axis!r} (replicated along "
            "the sequence)"
        )
    elif got != names:
        where = (
            f"is typed {sharding.spec}: its sequence axis is split over {got}, not "
            f"over ({key.cp_axis!r},)"
        )
    else:
        allowed = {x.ndim - 2: _entry(axes_entry(key.head_axes))}
        if seq == 1:
            allowed[0] = _entry(axes_entry(key.batch_axes))
        others = [
            i for i, e in enumerate(spec) if i != seq and _entry(e) and _entry(e) != allowed.get(i)
        ]
        if not others:
            return
        want = pod_specs(key, x.ndim).q
        raise ValueError(
            f"magi_attention: {name} is typed {sharding.spec}, but this key shards the "
            f"sequence over {key.cp_axis!r}, the batch over batch_axes={key.batch_axes!r} "
            f"and the heads over head_axes={key.head_axes!r} only; reshard {name} to "
            f"{want}: jax.sharding.reshard({name}, NamedSharding(key.mesh, {want})), or "
            "build the key with the axes your arrays use (make_flex_key(..., batch_axes=, "
            "head_axes=))"
        )
    raise ValueError(
        f"magi_attention: {name} {where}, so it is not in the dispatched layout "
        f"{want}. {dispatch_fix(name, x, key)}"
    )


def _check_placement(name, x, key, seq, local=None):
    """A concrete input (eager call): the rows each rank's devices hold (``local`` rows per
    rank; default the queries' ``key.local_len``)."""
    spec = pod_specs(key, x.ndim).q
    want = NamedSharding(key.mesh, spec)
    sharding = x.sharding
    if sharding.is_equivalent_to(want, x.ndim):
        return
    local = key.local_len if local is None else local
    mesh_devices = key.mesh.devices
    rank = cp_ranks(key.mesh, key.cp_axis)
    held = sharding.devices_indices_map(tuple(x.shape))
    n = x.shape[seq]
    if set(held) != set(rank):
        where = (
            f"lives on one device ({next(iter(held))})"
            if len(held) == 1
            else f"lives on {len(held)} devices"
        )
        where += f", not on the key's mesh of {mesh_devices.size} devices"
    else:
        where = None
        for d, index in held.items():
            a, b, _ = index[seq].indices(n)
            r = rank[d]
            if (a, b) != (r * local, (r + 1) * local):
                where = (
                    "is replicated along the sequence"
                    if (a, b) == (0, n)
                    else f"has rows [{a}, {b}) on {d}"
                )
                where += (
                    f", but rank {r} of {key.cp_axis!r} must hold rows "
                    f"[{r * local}, {(r + 1) * local})"
                )
                break
        if where is None:
            return
    raise ValueError(
        f"magi_attention: {name} {where}, so it is not in the dispatched layout. "
        f"{dispatch_fix(name, x, key)}. If {name} already is in dispatched order, shard it: "
        f"jax.device_put({name}, NamedSharding(key.mesh, {spec}))"
    )


def check_local_inputs(q: jax.Array, k: jax.Array, v: jax.Array, key: MagiKey) -> None:
    """The inputs of :func:`~magi_jax.sharding.magi_attention_local`, one rank's blocks:
    q (and k/v of a self-attention key) ``[(B,) local_len, H, D]``, k/v of a cross-attention
    key ``[(B,) kv_local_len, Hkv, D]``; an unbatched key only."""
    check_key(key)
    if key.batched:
        raise ValueError(
            "magi_attention_local: the key is batched (one plan per row, sharded over "
            f"batch_axes={key.batch_axes!r}); call mj.magi_attention, which runs each "
            "device's rows under its own shard_map"
        )
    check_qkv(
        q,
        k,
        v,
        caller="magi_attention_local",
        layout="[local_len, H, D] or [B, local_len, H, D] (one rank's dispatched tokens)",
    )
    for name, x in (("k", k), ("v", v)):
        if key.cross and x.ndim in (3, 4) and x.shape[-3] != key.kv_local_len:
            raise ValueError(
                f"magi_attention_local: {name} has {x.shape[-3]} tokens (shape "
                f"{tuple(x.shape)}) but every rank of this cross-attention key (kv_layout="
                f"{key.kv_layout!r}) holds {key.kv_local_len} keys; pass the rank's keys "
                f"from mj.dispatch(k, key, role='kv') (in_specs "
                f"{'P()' if key.kv_layout == 'replicated' else f'P({key.cp_axis!r})'})"
            )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if key.cross and name != "q":
            continue
        if x.ndim in (3, 4) and x.shape[-3] != key.local_len:
            raise ValueError(
                f"magi_attention_local: {name} has {x.shape[-3]} tokens (shape "
                f"{tuple(x.shape)}) but every rank of the key holds local_len={key.local_len}"
                f"; pass one rank's block of dispatched tokens (shard_map in_specs "
                f"P({key.cp_axis!r}) over arrays from mj.dispatch(x, key)). "
                f"{dispatch_fix(name, x, key)}"
            )
