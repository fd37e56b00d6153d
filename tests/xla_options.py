"""XLA compiler options for the few test programs that run long enough for optimising them to
pay for itself.

The suite compiles at LLVM -O0 (tests/conftest.py): that halves the compilation of its many
small programs, which is most of its time on a CPU, but runs the code several times slower. A
program that runs many steps (twenty packings through one compiled step, a long row) asks for
the default optimisation back with ``jax.jit(f, compiler_options=OPTIMIZED)``.
"""

__all__ = ["OPTIMIZED", "OPTIMIZED_FLAG", "with_flags"]

OPTIMIZED = {"xla_backend_optimization_level": 3}


def with_flags(flags: str, *more: str) -> str:
    """``XLA_FLAGS`` text ``flags`` with ``more`` added, a flag of ``more`` replacing the one
    of the same name (for a child process: its device count, its optimisation level)."""
    merged = {}
    for flag in flags.split() + [f for group in more for f in group.split()]:
        merged[flag.split("=")[0]] = flag
    return " ".join(merged.values())


# A training run in a child process executes many steps: its programs are worth optimising.
OPTIMIZED_FLAG = "--xla_backend_optimization_level=3"
