"""How correctness is judged (docs/design.md §5), as reusable test helpers.

For ``out``, ``lse``, ``dq``, ``dk``, ``dv`` (and ``max_logits``):
``‖x − ref64‖∞ ≤ max(floor, 2·‖ref_lp − ref64‖∞)``
where ``ref64`` is the dense reference in float64 and ``ref_lp`` the same reference run in the
inputs' precision. Also: no NaN, rows that see no key give exactly ``out = 0`` and
``lse = -inf`` (heads that see no cell: ``max_logits = -inf``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.ffa.reference import dense_attention
from magi_jax.masks import AttnMask

__all__ = [
    "reference_results",
    "reference_vjp_float64",
    "assert_matches_reference",
    "assert_rows_match_reference",
    "random_inputs",
    "fwd_bwd",
    "FLOORS",
]

# Absolute error floors, relative to max(1, ‖ref64‖∞): what a correct implementation may
# always differ by, even where the low-precision reference happens to be very accurate.
FLOORS = {"float64": 1e-9, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
_NAMES = ("out", "lse", "dq", "dk", "dv", "max_logits")


def random_inputs(
    key: jax.Array,
    mask: AttnMask,
    hq: int,
    hkv: int,
    d: int,
    dtype: jnp.dtype | type,
    batch: int | None = None,
    dv: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Random ``q, k, v, dout, dlse`` for ``mask`` (normal, unit scale), drawn on the host by
    NumPy from a generator seeded with ``key``'s bits, so no program is compiled for them (on
    CPU a compiled random draw per shape costs more than the attention under test). ``dv``:
    v's head dim (default ``d``; multi-head latent attention gives it its own). Shapes
    ``[(batch,) total_q, hq, d]`` (q), ``[(batch,) total_k, hkv, d]`` / ``[..., dv]`` (k /
    v), ``[(batch,) total_q, hq, dv]`` (dout) in ``dtype``, and ``[(batch,) total_q, hq]``
    float32 (dlse)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    rng = np.random.default_rng(np.asarray(key, np.uint32).ravel().tolist())
    lead = () if batch is None else (int(batch),)
    tq, tk, hq, hkv, d = int(mask.total_q), int(mask.total_k), int(hq), int(hkv), int(d)
    dv = d if dv is None else int(dv)
    dtype = jnp.dtype(dtype)

    def normal(shape, dt):
        return jax.device_put(rng.standard_normal(lead + shape, np.float32).astype(dt))

    return (
        normal((tq, hq, d), dtype),
        normal((tk, hkv, d), dtype),
        normal((tk, hkv, dv), dtype),
        normal((tq, hq, dv), dtype),
        normal((tq, hq), np.float32),
    )


def fwd_bwd(
    fwd: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
) -> Callable[..., dict[str, jax.Array]]:
    """``fwd(q, k, v) -> (out, lse)`` as one jitted step ``run(q, k, v, dout, dlse)`` that
    returns ``dict(out, lse, dq, dk, dv)`` — the results :func:`assert_matches_reference`
    takes."""

    @jax.jit
    def run(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(fwd, q, k, v)
        dq, dk, dv = vjp((dout, dlse))
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    return run


def reference_results(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttnMask,
    dout: jax.Array,
    dlse: jax.Array | None = None,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: jax.Array | None = None,
    float64: bool = True,
) -> dict[str, np.ndarray]:
    """The reference's out, lse, dq, dk, dv and max_logits as NumPy arrays, in float64
    (``float64=True``) or in the inputs' precision; with ``sink`` ``[S, Hq]`` the sinks join
    every row's denominator and ``dsink`` is added."""
    dense = mask.to_dense()

    def run(q_, k_, v_, do_, dl_, s_):
        res = _reference_vjp(
            q_, k_, v_, do_, dl_, s_, dense, softmax_scale=softmax_scale, softcap=softcap
        )
        return dict(zip(_NAMES + ("dsink",), res[: len(_NAMES)] + res[len(_NAMES) :]))

    if float64:
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        res = reference_vjp_float64(q, k, v, dense, dout, dlse, scale, softcap, sink)
        return dict(zip(_NAMES + ("dsink",), res))
    res = run(q, k, v, dout, dlse, None if sink is None else jnp.asarray(sink, jnp.float32))
    return {n: np.asarray(x).astype(np.float64) for n, x in res.items()}


def reference_vjp_float64(
    q: jax.typing.ArrayLike,
    k: jax.typing.ArrayLike,
    v: jax.typing.ArrayLike,
    dense: np.ndarray,
    dout: jax.typing.ArrayLike,
    dlse: jax.typing.ArrayLike | None,
    softmax_scale: float,
    softcap: float = 0.0,
    sink: jax.typing.ArrayLike | None = None,
) -> tuple[np.ndarray, ...]:
    """The dense reference and its hand-derived backward in NumPy float64: no program to
    compile, where the tests would compile one per shape. ``tests/ffa/test_reference.py``
    holds it to JAX's autodiff of :func:`~magi_jax.ffa.reference.dense_attention`.

    Shapes as for :func:`reference_results` (``dense`` bool ``[Tq, Tk]``, ``sink``
    ``[S, Hq]``). Returns ``out``, ``lse``, ``dq``, ``dk``, ``dv``, ``max_logits``, then
    ``dsink`` when ``sink`` is given.
    """
    f64 = lambda x: np.asarray(x, np.float64)
    q, k, v, dout = f64(q), f64(k), f64(v), f64(dout)
    lead, hq, (tk, hkv) = q.shape[:-3], q.shape[-2], k.shape[-3:-1]
    group = hq // hkv
    heads = lambda x: np.moveaxis(np.repeat(x, group, axis=-2), -2, -3)  # [..., Hq, T, D]
    qh, kh, vh, doh = np.moveaxis(q, -2, -3), heads(k), heads(v), np.moveaxis(dout, -2, -3)
    allowed = np.asarray(dense, bool)
    s = (qh @ np.swapaxes(kh, -1, -2)) * softmax_scale  # [..., Hq, Tq, Tk]
    max_logits = np.max(np.where(allowed, s, -np.inf), axis=(-2, -1))
    t = np.tanh(s / softcap) if softcap else None
    logits = np.where(allowed, softcap * t if softcap else s, -np.inf)
    m = logits.max(-1, keepdims=True)
    if sink is not None:
        sink = f64(sink)  # [S, Hq] -> [S, ..., Hq, 1, 1]
        sink = sink.reshape(sink.shape[:1] + (1,) * len(lead) + (hq, 1, 1))
        m = np.maximum(m, sink.max(0))
    m = np.where(np.isfinite(m), m, 0)
    e = np.where(allowed, np.exp(logits - m), 0)
    denom = e.sum(-1, keepdims=True)
    if sink is not None:
        e_sink = np.exp(sink - m)  # [S, ..., Hq, Tq, 1]
        denom = denom + e_sink.sum(0)
    has_key = denom > 0
    denom = np.where(has_key, denom, 1)
    p = e / denom
    out = p @ vh  # [..., Hq, Tq, Dv]
    lse = np.where(has_key, m + np.log(denom), -np.inf)[..., 0]
    # Backward: dlogits = p·(dp − δ + dlse) with δ = rowsum(dout·out); the softcap's
    # derivative 1 − tanh²; GQA sums the grouped heads back onto their KV head.
    dl = np.zeros(lse.shape) if dlse is None else np.swapaxes(f64(dlse), -1, -2)
    delta = (doh * out).sum(-1)
    dlogits = p * (doh @ np.swapaxes(vh, -1, -2) - delta[..., None] + dl[..., None])
    ds = dlogits * (1 - t * t) if softcap else dlogits
    kv = lambda x: np.moveaxis(x, -3, -2).reshape(lead + (tk, hkv, group, -1)).sum(-2)
    res = (
        np.moveaxis(out, -3, -2),
        np.swapaxes(lse, -1, -2),
        np.moveaxis(ds @ kh, -3, -2) * softmax_scale,
        kv(np.swapaxes(ds, -1, -2) @ qh) * softmax_scale,
        kv(np.swapaxes(p, -1, -2) @ doh),
        max_logits,
    )
    if sink is None:
        return res
    p_sink = e_sink / denom  # d lse / d sink = p_sink, d out / d sink = −p_sink·out
    dsink = (p_sink * (dl - delta)[..., None]).sum(axis=tuple(range(1, p_sink.ndim - 3)) + (-2, -1))
    return res + (dsink,)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "softcap"))
def _reference_vjp(q, k, v, dout, dlse, sink, dense, *, softmax_scale, softcap):
    """Jitted with the dense mask as an argument, so masks of one size share a compilation.
    Returns out, lse, dq, dk, dv, max_logits, then dsink when ``sink`` is given."""

    def fn(q_, k_, v_, *s_):
        out, lse, max_logits = dense_attention(
            q_,
            k_,
            v_,
            dense,
            softmax_scale=softmax_scale,
            softcap=softcap,
            sink=s_[0] if s_ else None,
            return_max_logits=True,
        )
        return (out, lse), max_logits

    sinks = () if sink is None else (sink,)
    (out, lse), vjp, max_logits = jax.vjp(fn, q, k, v, *sinks, has_aux=True)
    if dlse is None:
        dlse = jnp.zeros(lse.shape, lse.dtype)
    grads = vjp((dout.astype(out.dtype), dlse.astype(lse.dtype)))
    return (out, lse) + grads[:3] + (max_logits,) + grads[3:]


def _max_err(x, ref):
    finite = np.isfinite(ref)
    with np.errstate(invalid="ignore"):
        return float(np.max(np.abs(np.where(finite, x - ref, 0)), initial=0.0))


def assert_matches_reference(
    results: dict,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttnMask,
    dout: jax.Array | None = None,
    dlse: jax.Array | None = None,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: jax.Array | None = None,
    floor: float | None = None,
    ref64: dict | None = None,
    ref_lp: dict | None = None,
) -> dict:
    """Checks ``results`` (any of out, lse, dq, dk, dv, max_logits, and dsink with ``sink``)
    against the correctness rule (docs/design.md §5).

    Returns the per-quantity ``(error, bound)`` table; raises ``AssertionError`` naming every
    quantity that fails. Pass ``ref64``/``ref_lp`` to reuse references across calls.
    """
    if dout is None:
        dout = jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)
    kw = dict(softmax_scale=softmax_scale, softcap=softcap, sink=sink)
    ref64 = ref64 or reference_results(q, k, v, mask, dout, dlse, float64=True, **kw)
    ref_lp = ref_lp or reference_results(q, k, v, mask, dout, dlse, float64=False, **kw)
    base = FLOORS[jnp.dtype(q.dtype).name] if floor is None else floor
    table, failures = {}, []
    for name, x in results.items():
        x = np.asarray(x).astype(np.float64)
        r64 = ref64[name]
        if x.shape != r64.shape:
            failures.append(f"{name}: shape {x.shape} != reference {r64.shape}")
            continue
        if np.isnan(x).any():
            failures.append(f"{name}: {int(np.isnan(x).sum())} NaN values")
            continue
        err = _max_err(x, r64)
        bound = max(
            base * max(1.0, float(np.max(np.abs(np.where(np.isfinite(r64), r64, 0)), initial=0.0))),
            2 * _max_err(ref_lp[name], r64),
        )
        table[name] = (err, bound)
        if err > bound:
            failures.append(f"{name}: max error {err:.3e} > bound {bound:.3e}")
        if name in ("lse", "max_logits") and not np.array_equal(np.isneginf(x), np.isneginf(r64)):
            failures.append(
                f"{name}: -inf exactly where no key is seen: "
                f"{int((np.isneginf(x) != np.isneginf(r64)).sum())} entries differ"
            )
    empty = np.isneginf(ref64["lse"])  # [..., Tq, Hq] rows that see no key
    if "out" in results and empty.any():
        out = np.asarray(results["out"]).astype(np.float64)
        if np.any(out[empty] != 0):
            failures.append("out: rows that see no key are not exactly 0")
    if failures:
        raise AssertionError("; ".join(failures) + f" (errors/bounds: {table})")
    return table


def assert_rows_match_reference(
    results: dict,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    masks: AttnMask | Sequence[AttnMask],
    dout: jax.Array,
    dlse: jax.Array,
    **kw: Any,
) -> None:
    """:func:`assert_matches_reference` for every row of a batch: ``results`` and the inputs
    carry a leading batch axis ``B``, ``masks`` is one mask for every row or one per row;
    ``kw`` goes to each row's check. Everything is read to the host once, then cut into
    rows there (indexing sharded device arrays row by row dispatches a gather per row)."""
    results, q, k, v, dout, dlse = jax.device_get((results, q, k, v, dout, dlse))
    for b in range(q.shape[0]):
        mask = masks if isinstance(masks, AttnMask) else masks[b]
        row = {name: x[b] for name, x in results.items()}
        assert_matches_reference(row, q[b], k[b], v[b], mask, dout[b], dlse[b], **kw)
