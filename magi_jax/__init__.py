"""magi-jax: exact attention over ultra-long packed sequences with irregular slice masks."""

from magi_jax.ffa import flex_flash_attention, select_backend
from magi_jax.mask import AttnMask, AttnMaskType
from magi_jax.reference import reference_attention

__all__ = ["AttnMask", "AttnMaskType", "flex_flash_attention", "reference_attention",
           "select_backend"]
from magi_jax.sharding import dispatch, magi_attention, make_flex_key, make_varlen_key, position_ids, undispatch; __all__ += ["dispatch", "magi_attention", "make_flex_key", "make_varlen_key", "position_ids", "undispatch"]  # noqa: E402,E501,E702
__version__ = "0.1.0"
