"""The per-rank FFA engines under their former path: they are the device registry's
(:mod:`magi_jax.ffa.backends`), whose engines with work lists carry the split VJP halves
that context parallelism runs (``xla``, and ``pallas``: the Mosaic GPU kernels, run only on
GPUs under a multi-device ``shard_map``, their interpret mode's barrier bookkeeping being
per device)."""

from __future__ import annotations

from magi_jax.ffa.backends import Backend as FFABackend
from magi_jax.ffa.backends import get_backend

__all__ = ["FFABackend", "get_backend"]
