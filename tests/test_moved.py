"""The import paths of modules that moved (``magi_jax/_moved.py``) keep working for one
release: each old path gives the moved module itself, not a copy, so a name set on it (a
test's monkeypatch) reaches the code that reads it."""

import importlib
import pathlib
import subprocess
import sys

import pytest

import magi_jax
from magi_jax import _moved


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_path_is_the_moved_module(old):
    new = _moved.MOVED[old]
    module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new  # its own spec, kept
    parent, _, child = old.rpartition(".")
    assert getattr(importlib.import_module(parent), child) is module


def test_from_an_old_package_import_its_old_child():
    from magi_jax.sharding.native import library, transport

    assert transport is importlib.import_module("magi_jax.sharding.transport.native._calls")
    assert library is importlib.import_module("magi_jax.sharding.transport.native._library")


def test_a_name_set_on_an_old_path_reaches_the_module(monkeypatch):
    import magi_jax.sharding.collectives as old
    from magi_jax.sharding.transport import _collectives

    monkeypatch.setattr(old, "_GATHER_MAX_SLOTS", 0)
    assert _collectives._GATHER_MAX_SLOTS == 0


def test_the_old_names_of_renamed_functions_and_moved_names():
    from magi_jax.ffa.ragged import expand_index_runs
    from magi_jax.planning import cast_table, work_list
    from magi_jax.sharding import collectives, keys, make_key

    assert cast_table.expand_runs is cast_table.expand_index_runs
    assert work_list.expand_runs is work_list.expand_plan_runs
    assert collectives.expand_runs is expand_index_runs
    assert make_key.ffa_backend_reason is keys.ffa_backend_reason
    assert make_key.CHECK_DISPATCH_ENV == "MAGI_JAX_CHECK_DISPATCH"
    assert magi_jax.mask_zoo.make_mask is magi_jax.masks.make_mask


def test_no_old_path_is_left_as_a_file():
    """A module or folder left at an old path would be found before the moved one."""
    root = pathlib.Path(magi_jax.__path__[0]).parent
    for old in _moved.MOVED:
        rel = root.joinpath(*old.split("."))
        assert not rel.with_suffix(".py").exists() and not (rel / "__init__.py").exists(), old


def test_an_old_child_is_an_attribute_of_its_package():
    """``mj.sharding.key`` without importing it first, as when the package imported it
    itself: in a fresh interpreter, so that no earlier import has set the attribute."""
    code = (
        "import magi_jax as mj\n"
        "assert mj.sharding.key.axes_entry is mj.sharding.keys.axes_entry\n"
        "assert mj.planning.defaults is mj.planning.cost_model\n"
        "assert mj.ffa.segments is mj.ffa.device_planner\n"
        "assert mj.sharding.native.transport.__name__.endswith('native._calls')\n"
        "assert not hasattr(mj.sharding, 'no_such_module')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
