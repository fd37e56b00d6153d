"""Flax layers and ``attention_fn`` adapters (see :mod:`magi_jax.nn.attention`)."""

from magi_jax.nn.attention import (
    SelfAttention,
    apply_rope,
    attend,
    make_attention_fn,
    rope_positions,
)

__all__ = ["SelfAttention", "apply_rope", "attend", "make_attention_fn", "rope_positions"]
