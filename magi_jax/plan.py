"""``python -m magi_jax.plan``: the planner command line, :func:`magi_jax.cli.main`."""

import sys

from magi_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
