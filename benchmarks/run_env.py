"""The environment of a benchmark run: when, on what machine, with what software, at what
commit. Every script here records :func:`environment` in its JSON and :func:`describe` in its
markdown, so runs of different scripts name the same facts by the same keys.

    env = environment(reps=3)  # the common keys and the script's own
    print(describe(env))  # one line for the markdown

JAX's versions are recorded only when the script has imported JAX: a host-only script
(``wire_bench.py``, ``hierarchical_bench.py``) pays no JAX start-up for its record.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_GIT_TIMEOUT_S = 10


def _git(*args: str) -> str | None:
    """``git args`` in the repository, its stdout stripped; None without git or a repository."""
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _cpu_model() -> str:
    """The CPU's model name as Linux reports it, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (e.g. ``"tokamax"``), without importing
    it; None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(argv: Sequence[str] | None = None, **extra: object) -> dict[str, object]:
    """The run's environment, then ``extra`` (the script's own keys, in its order).

    Keys: ``date`` (UTC, ISO 8601 to the second), ``host`` (host name), ``machine``
    (architecture), ``cpu`` (the CPU's model), ``system`` (OS and release), ``cpu_count``,
    ``load_average`` (1, 5 and 15 minutes), ``python``, ``numpy``, ``jax`` and ``jaxlib``
    (only when JAX is imported), ``magi_jax``, ``commit`` (short hash; None outside a git
    checkout), ``dirty`` (tracked files changed; None outside a checkout), ``argv`` (default
    the command line's arguments) and ``xla_flags`` (only when ``XLA_FLAGS`` is set).

    Raises ``ValueError`` when a key of ``extra`` is one of these.
    """
    import magi_jax  # imports only the mask module: no JAX

    env: dict[str, object] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(),
        machine=platform.machine(),
        cpu=_cpu_model(),
        system=f"{platform.system()} {platform.release()}",
        cpu_count=os.cpu_count(),
        load_average=[round(x, 2) for x in os.getloadavg()],
        python=platform.python_version(),
        numpy=np.__version__,
    )
    if "jax" in sys.modules:
        env["jax"] = sys.modules["jax"].__version__
        env["jaxlib"] = sys.modules["jaxlib"].__version__
    status = _git("status", "--porcelain", "--untracked-files=no")
    env.update(
        magi_jax=magi_jax.__version__,
        commit=_git("rev-parse", "--short", "HEAD"),
        dirty=None if status is None else bool(status),
        argv=list(sys.argv[1:] if argv is None else argv),
    )
    if os.environ.get("XLA_FLAGS"):
        env["xla_flags"] = os.environ["XLA_FLAGS"].strip()
    clash = sorted(set(extra) & set(env))
    if clash:
        raise ValueError(
            f"environment(**extra) got {clash}, which the environment records itself; "
            "give the script's own value another name"
        )
    env.update(extra)
    return env


def describe(env: dict[str, object]) -> str:
    """The common keys of :func:`environment` as one markdown line (no trailing period)."""
    load = ", ".join(f"{x:.2f}" for x in env["load_average"])
    software = [f"Python {env['python']}", f"NumPy {env['numpy']}"]
    if "jax" in env:
        software.append(f"jax {env['jax']} (jaxlib {env['jaxlib']})")
    software.append(f"magi_jax {env['magi_jax']}")
    commit = "no git checkout" if env["commit"] is None else f"commit `{env['commit']}`"
    if env["dirty"]:
        commit += " (dirty)"
    line = (
        f"{env['date']}, {env['host']} ({env['cpu']}, {env['cpu_count']} CPUs, load "
        f"{load}); {', '.join(software)}; {commit}"
    )
    if "xla_flags" in env:
        line += f"; XLA_FLAGS `{env['xla_flags']}`"
    return line
