"""Single-device flexible-mask attention: the front door :func:`flex_flash_attention`
(:mod:`~magi_jax.ffa.api`), the portable ``xla`` backend (:mod:`~magi_jax.ffa.xla`), the dense
reference (:mod:`~magi_jax.ffa.reference`), the correctness rule of the tests
(:mod:`~magi_jax.ffa.testing`) and ``jax.nn.dot_product_attention``'s interface
(:mod:`~magi_jax.ffa.dpa`, with device-built plans from :mod:`~magi_jax.ffa.device_planner`).
The ``pallas`` backend is :mod:`magi_jax.pallas`."""

from magi_jax import _moved
from magi_jax.ffa.api import BACKENDS, flex_flash_attention, select_backend
from magi_jax.ffa.reference import dense_attention, reference_attention, reference_attention_vjp
from magi_jax.masks import refuse_as_jit_argument

refuse_as_jit_argument()  # JAX is imported now

__all__ = [
    "flex_flash_attention",
    "select_backend",
    "BACKENDS",
    "reference_attention",
    "reference_attention_vjp",
    "dense_attention",
]

# The modules that moved away, by their old names.
__getattr__ = _moved.old_children(__name__)
