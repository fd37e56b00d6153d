"""The host planning layer is pure NumPy: importing every module of magi_jax.planning (and
magi_jax.mask) imports no JAX, directly or through any import chain."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import magi_jax.planning

ROOT = Path(__file__).resolve().parents[2]
MODULES = ["magi_jax.mask", "magi_jax.planning"] + sorted(
    f"magi_jax.planning.{m.name}" for m in pkgutil.iter_modules(magi_jax.planning.__path__)
)


def _loaded_after(modules):
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(','.join(sorted(n for n in sys.modules if n == 'jax' or "
        "n.startswith(('jax.', 'jaxlib')))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [n for n in out.stdout.strip().split(",") if n]


def test_planning_modules_are_found():
    for name in ("tiling", "work_list", "capacity", "backends", "solver", "cast_table", "stages"):
        assert f"magi_jax.planning.{name}" in MODULES


def test_planning_imports_no_jax():
    loaded = _loaded_after(MODULES)
    assert "jax" not in loaded, f"importing {MODULES} imported {loaded}"
    assert not loaded, loaded


def test_the_check_can_fail():
    # The same check sees JAX where a module does import it.
    assert "jax" in _loaded_after(["magi_jax.ffa"])
