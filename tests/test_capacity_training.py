"""A training run that never stops on capacity: the capacity benchmark's run, shrunk (100
steps, cp 4 on CPU host devices, one replica of 256 tokens, a new heavy-tailed packing every
step, a capacity sized on two packings): it grows, every growth is logged, it compiles at
most 4 times, settles within 1.5x of the tightest capacity, and its loss equals the
one-device model's at steps 0 and 99 (the benchmark's own checks)."""

import importlib.util
import pathlib

from tests.xla_options import OPTIMIZED

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "capacity_bench", ROOT / "benchmarks" / "capacity_bench.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_grows_its_capacity_and_matches_one_device():
    bench = _bench()
    args = bench.parse_args(
        ["--steps", "100", "--seqlen", "256", "--dp", "1", "--dim", "16", "--check-steps", "0,99"]
        + ["--no-write"]
    )
    record = bench.run(args, say=lambda *a: None, compiler_options=OPTIMIZED)
    assert record["steps"] == 100
    assert 1 <= len(record["growths"]) == record["logged_growths"]
    assert record["compilations"] == 1 + len(record["growths"]) <= 4
    assert all(v["ratio"] <= 1.5 for v in record["fields"].values()), record["fields"]
    assert [c["step"] for c in record["compared"]] == [0, 99]
    assert all(c["rel"] <= record["tolerance"] for c in record["compared"])
