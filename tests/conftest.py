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
