"""Learnable attention sinks as a post-process of sink-free attention.

Sink logits ``sink [S, Hq]`` (fp32) join every row's softmax denominator and contribute
nothing to the output (GPT-OSS-style models). Given the sink-free ``(out, lse)``:

    lse' = logaddexp(lse, logsumexp(sink))        out' = out · exp(lse − lse')

Autodiff of these two lines gives the sink's gradient, ``dsink_s = −Σ_i exp(sink_s −
lse'_i)·Δ_i``, and passes the rest back into the attention's ``(dout, dlse)``. Under
context parallelism the correction runs once, on the merged ``(out, lse)``, and the sink's
gradient is summed over every token of every rank. Rows that see no key get ``out = 0``,
``lse = logsumexp(sink)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

__all__ = ["apply_sink", "check_sink"]

MAX_SINKS = 8


def check_sink(sink: jax.Array, num_heads: int) -> None:
    """Raises ``ValueError`` unless ``sink`` is a float ``[S, Hq]`` array, 1 <= S <= 8."""
    shape = getattr(sink, "shape", None)
    if shape is None or len(shape) != 2 or not 1 <= shape[0] <= MAX_SINKS or shape[1] != num_heads:
        raise ValueError(
            f"sink must be a [S, Hq] array of sink logits with 1 <= S <= "
            f"{MAX_SINKS} and Hq = {num_heads} (q's heads); got shape {shape}"
        )
    if not jnp.issubdtype(sink.dtype, jnp.floating):
        raise TypeError(f"sink has dtype {sink.dtype}; pass float32 sink logits")


def apply_sink(out: jax.Array, lse: jax.Array, sink: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(out', lse')`` with the sinks in the denominator. ``out [..., T, Hq, D]``, ``lse
    [..., T, Hq]`` (float32), ``sink [S, Hq]``; differentiable in all three."""
    acc = jnp.float64 if lse.dtype == jnp.float64 else jnp.float32
    sink_lse = logsumexp(sink.astype(acc), axis=0)  # [Hq]
    new_lse = jnp.logaddexp(lse.astype(acc), sink_lse)
    scale = jnp.exp(lse.astype(acc) - new_lse)  # 0 where lse = -inf
    return (out.astype(acc) * scale[..., None]).astype(out.dtype), new_lse.astype(lse.dtype)
