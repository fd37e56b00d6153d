"""The training step the context-parallel tests run over many packings: dispatch q, k, v,
``magi_attention``, undispatch, then the VJP of ``out·dout + lse·dlse`` (rows that see no key
have ``lse = -inf`` and add nothing). Each test jits it with its own compiler options and
counts that wrapper's compilations."""

import jax
import jax.numpy as jnp

import magi_jax as mj


def attention_step(q, k, v, dout, dlse, key):
    """``(out, lse, (dq, dk, dv))`` of the global attention of ``key``'s mask; ``q``, ``k``,
    ``v`` ``[T, H, D]`` in sequence order, ``dout`` like ``out``, ``dlse`` ``[T, Hq]``."""

    def loss(q, k, v):
        o, lse = mj.magi_attention(*(mj.dispatch(x, key) for x in (q, k, v)), key)
        out, lse = mj.undispatch(o, key), mj.undispatch(lse, key)
        total = (out * dout).sum() + (jnp.where(jnp.isfinite(lse), lse, 0) * dlse).sum()
        return total, (out, lse)

    (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, lse, grads
