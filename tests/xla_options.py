"""XLA compiler options for the few test programs that run long enough for optimising them to
pay for itself.

The suite compiles at LLVM -O0 (tests/conftest.py): that halves the compilation of its many
small programs, which is most of its time on a CPU, but runs the code several times slower. A
program that runs many steps (twenty packings through one compiled step, a long row) asks for
the default optimisation back with ``jax.jit(f, compiler_options=OPTIMIZED)``.
"""

__all__ = ["OPTIMIZED"]

OPTIMIZED = {"xla_backend_optimization_level": 3}
