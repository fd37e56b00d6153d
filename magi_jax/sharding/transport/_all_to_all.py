"""The ``all_to_all`` transport: every slot's block in one padded ``lax.all_to_all``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from magi_jax.sharding.transport._collectives import CastSpec


def exchange(blocks: jax.Array, spec: CastSpec, reverse: bool) -> jax.Array:
    """``blocks [n_slots, S, ...]``: block ``j`` goes to ``r + shifts[j]`` (``r - shifts[j]``
    when ``reverse``) in one padded ``all_to_all``; returns the received blocks in the same
    slot layout."""
    cp = spec.cp
    me = jax.lax.axis_index(spec.axis_name)
    sign = -1 if reverse else 1
    full = jnp.zeros((cp,) + blocks.shape[1:], blocks.dtype)
    for j, shift in enumerate(spec.shifts):
        full = full.at[(me + sign * shift) % cp].set(blocks[j])
    got = jax.lax.all_to_all(full, spec.axis_name, 0, 0)
    return jnp.stack([got[(me - sign * shift) % cp] for shift in spec.shifts])
