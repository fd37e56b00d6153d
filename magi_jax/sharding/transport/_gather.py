"""Rows moved by gathers, the padding convention of every transport: a row index out of range
reads zeros (:func:`take`), and a table is inverted by a scatter of int32 positions
(:func:`inverse`) so that the data itself moves by gathers, never by a scatter."""

import jax
import jax.numpy as jnp


def take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """Rows ``x[idx]``, zero where ``idx`` is out of range (the padding convention)."""
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


def inverse(index: jax.Array, size: int, fill: int) -> jax.Array:
    """``inv [size]`` with ``inv[index[i]] = i`` (entries of ``index`` unique or < 0) and
    ``fill`` elsewhere: a scatter of int32 positions, so that data moves by gathers."""
    pos = jnp.arange(index.shape[0], dtype=jnp.int32)
    # Padding entries point past the end, each to its own place: truly unique, then dropped.
    return (
        jnp.full((size,), fill, jnp.int32)
        .at[jnp.where(index < 0, size + pos, index)]
        .set(pos, mode="drop", unique_indices=True)
    )


def acc_dtype(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.float64 if dtype == jnp.float64 else jnp.float32
