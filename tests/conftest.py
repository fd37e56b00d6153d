"""Test set-up shared by the whole suite.

Multi-device tests run on 8 CPU host devices; the flag must be set before JAX starts, so it is
set here, before anything imports jax (as is the CPU compiler's optimisation level, below).
Single-device tests use device 0 as usual.
"""

import os

# The test programs are small and run a few times each, so on CPU their compilation, not their
# execution, is the suite's time: LLVM's -O0 halves it (XLA's own passes still run, and
# without fast-math the results obey the same IEEE rules). An XLA_FLAGS that sets either flag
# wins, e.g. XLA_FLAGS=--xla_backend_optimization_level=3 to test the optimised CPU code.
_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _interpret_callbacks_without_device_put() -> None:
    """Mosaic GPU interpret mode runs each kernel as an XLA program that calls back into
    Python for every shared-memory access, barrier and wgmma: tens of thousands of callbacks
    per kernel. ``io_callback`` wraps every callback's NumPy arguments into ``jax.Array``s
    (one ``device_put`` each) and the interpreter reads them straight back with ``.item()``
    or ``np.array``; on CPU that round trip was more than half of the interpreted kernels' time.
    For the interpreter's own callbacks only, the suite hands it copies of the NumPy
    arguments instead. The interpreter computes the same values either way: every kernel
    test still checks its results against the float64 reference. Where these JAX internals
    differ (another JAX version) nothing is changed and the tests are only slower."""
    import numpy as np

    try:
        from jax._src import callback
        from jax._src.pallas.mosaic_gpu.interpret import shared_memory
    except ImportError:
        return
    impl, to_int = (
        getattr(callback, "io_callback_impl", None),
        getattr(shared_memory, "_to_int", None),
    )
    if impl is None or to_int is None:
        return
    package = "jax._src.pallas.mosaic_gpu.interpret"

    def numpy_to_int(x):
        return int(x) if isinstance(x, (np.ndarray, np.generic)) else to_int(x)

    def io_callback_impl(*args, callback, **params):
        f = getattr(callback, "callback_func", None)
        while hasattr(f, "func"):  # functools.partial
            f = f.func
        if getattr(f, "__module__", "").startswith(package):
            return [np.asarray(x) for x in callback(*(np.array(a) for a in args))]
        return impl(*args, callback=callback, **params)

    callback.io_callback_impl = io_callback_impl
    shared_memory._to_int = numpy_to_int


_interpret_callbacks_without_device_put()
