"""benchmarks/harness.py: the environment record (keys, commit, host-only, no git), result
files, tables, timing, the cuDNN packed operands."""

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import harness
from benchmarks.harness import describe, environment

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
        cwd=harness.ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    env = environment([])
    assert env["commit"] == head and isinstance(env["dirty"], bool)
    line = describe(env)
    assert f"commit `{head}`" in line and env["host"] in line


def test_outside_a_git_checkout_commit_and_dirty_are_none(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "ROOT", tmp_path)
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
        "import sys; from benchmarks.harness import environment; e = environment([]); "
        "assert 'jax' not in sys.modules and 'jax' not in e, sorted(e)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=harness.ROOT, check=True)


def test_xla_flags_only_when_set(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert "xla_flags" not in environment([])
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    env = environment([])
    assert env["xla_flags"] == "--xla_dump_to=/tmp/x" and "XLA_FLAGS" in describe(env)


def test_package_version():
    assert harness.package_version("numpy") is not None
    assert harness.package_version("no-such-distribution-here") is None


def test_run_writes_json_and_markdown_after_every_row(tmp_path):
    meta = environment([], device="Dev 1")
    run = harness.Run("demo", tmp_path, meta, lambda rows, m: f"{len(rows)} rows\n", tag="x")
    run.add(dict(a=1.5, b=np.int64(3)))
    assert run.base.name.startswith("demo_") and run.base.name.endswith("_Dev_1_x")
    assert json.loads(run.base.with_suffix(".json").read_text())["rows"] == [dict(a=1.5, b=3)]
    run.add(dict(a=2.0))
    assert run.base.with_suffix(".md").read_text() == "2 rows\n"


def test_table_and_attempt(capsys):
    lines = harness.table([dict(x=0.12345, y=1234.5), dict(x="s")], [("X", "x"), ("Y", "y")])
    assert lines == ["| X | Y |", "|---|---|", "| 0.123 | 1234.5 |", "| s | - |"]
    assert harness.attempt("ok", lambda v: v + 1, 1) == (2, None)
    got, err = harness.attempt("bad", lambda: 1 / 0)
    assert got is None and err.startswith("ZeroDivisionError")
    assert "--- bad failed" in capsys.readouterr().err


def test_time_interleaved_medians_every_entry():
    import jax.numpy as jnp

    x = jnp.ones((8,))
    got = harness.time_interleaved([(lambda a: a + 1, (x,)), (lambda a: a * 2, (x,))], 2, 3)
    assert len(got) == 2 and all(len(r) == 3 and t == sorted(r)[1] for t, r in got)


def test_cudnn_packed_args_pad_with_minus_one():
    seqlen, offsets = harness.cudnn_packed_args(np.array([3, 1, 2]), batch=2, max_docs=5)
    assert seqlen.tolist() == [[3, 1, 2, -1, -1]] * 2 and seqlen.dtype == np.int32
    assert offsets.tolist() == [[0, 3, 4, -1, -1, -1]] * 2
    with pytest.raises(ValueError, match="max_docs"):
        harness.cudnn_packed_args(np.array([1, 1]), 1, 1)


def test_backend_missing_names_why():
    assert harness.backend_missing("xla") is None
    assert "no backend 'nope'" in harness.backend_missing("nope")
