"""The environment the benchmarks record: its keys, the commit, a host-only run, no git."""

import subprocess
import sys

import pytest

from benchmarks import run_env
from benchmarks.run_env import describe, environment

_COMMON = (
    "date",
    "host",
    "machine",
    "cpu",
    "system",
    "cpu_count",
    "load_average",
    "python",
    "numpy",
    "magi_jax",
    "commit",
    "dirty",
    "argv",
)


def test_common_keys_then_the_scripts_own_in_order():
    env = environment(["--reps", "1"], reps=1, label="x")
    assert set(_COMMON) <= set(env)
    assert list(env)[-2:] == ["reps", "label"]
    assert env["argv"] == ["--reps", "1"] and env["date"].endswith("+00:00")
    assert len(env["load_average"]) == 3


def test_commit_is_the_repositorys_head():
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=run_env.ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    env = environment([])
    assert env["commit"] == head and isinstance(env["dirty"], bool)
    line = describe(env)
    assert f"commit `{head}`" in line and env["host"] in line


def test_outside_a_git_checkout_commit_and_dirty_are_none(tmp_path, monkeypatch):
    monkeypatch.setattr(run_env, "ROOT", tmp_path)
    env = environment([])
    assert env["commit"] is None and env["dirty"] is None
    assert "no git checkout" in describe(env)


def test_a_key_of_the_environment_is_refused_as_an_extra():
    with pytest.raises(ValueError, match=r"\['date'\]"):
        environment([], date="today")


def test_jax_is_recorded_when_imported_and_never_imported_for_it():
    import jax

    env = environment([])
    assert (
        env["jax"] == jax.__version__
        and "jaxlib" in env
        and f"jax {jax.__version__}" in (describe(env))
    )
    code = (
        "import sys; from benchmarks.run_env import environment; e = environment([]); "
        "assert 'jax' not in sys.modules and 'jax' not in e, sorted(e)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=run_env.ROOT, check=True)


def test_xla_flags_only_when_set(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert "xla_flags" not in environment([])
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    env = environment([])
    assert env["xla_flags"] == "--xla_dump_to=/tmp/x" and "XLA_FLAGS" in describe(env)


def test_package_version():
    assert run_env.package_version("numpy") is not None
    assert run_env.package_version("no-such-distribution-here") is None
