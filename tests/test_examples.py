"""The examples and tools a newcomer runs: the training example (a few steps, a new packing
every step and one compilation, loss falls, step-0 check passes), the shard_map notebook
(executes), the pictures (non-empty PNGs of the expected size) and the command-line planner
(1M tokens over cp 64; the user's own masks)."""

import json
import os
import pathlib
import re
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest

import magi_jax as mj
from tests.xla_options import OPTIMIZED_FLAG, with_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env(optimized=False):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if optimized:
        env["XLA_FLAGS"] = with_flags(env.get("XLA_FLAGS", ""), OPTIMIZED_FLAG)
    return env


def _png_size(path) -> tuple[int, int]:
    data = pathlib.Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def _assert_picture(path, size):
    assert _png_size(path) == size
    import matplotlib.image

    img = matplotlib.image.imread(path)
    # Not blank: many distinct colours, not one flat background.
    assert img.std() > 0.05 and len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 8


def test_train_example_runs_loss_falls_and_matches_single_device(tmp_path):
    out = tmp_path / "train.json"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "train.py"),
        "--steps",
        "12",
        "--seqlen",
        "1024",
        "--docs",
        "6",
        "--layers",
        "1",
        "--dim",
        "64",
        "--devices",
        "4",
        "--lr",
        "1e-2",
        "--json",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(True), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "-> OK" in res.stdout, res.stdout  # step-0 check vs one device
    log = json.loads(out.read_text())
    loss = log["loss"]
    assert len(loss) == 12 and np.isfinite(loss).all()
    assert np.mean(loss[-3:]) < np.mean(loss[:3]) - 0.1, loss
    assert log["devices"] == 4 and log["tokens_per_second"] > 0
    # A new packing every step, one compilation of the train step (keys at one capacity).
    layouts = log["layouts"]
    assert len(layouts) == 12 and all(sum(x) == 1024 and len(x) == 6 for x in layouts)
    assert len({tuple(x) for x in layouts}) == 12, layouts
    assert log["compilations"] == 1
    assert "train step compiled 1 time for 12 steps with 12 different layouts" in res.stdout
    assert log["attn_dtype"] == "float32" and log["ffa_backend"] == "xla"  # CPU


def test_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "examples" / "shard_map_cp.ipynb", as_version=4)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + env_path  # for the kernel
    try:
        nbclient.NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "max |out - single device|" in text
    images = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(images) == 2
    _assert_picture(tmp_path / "mask.png", (700, 700))
    _assert_picture(tmp_path / "plan.png", (1200, 1000))


def test_plots_are_images_of_the_expected_size(tmp_path):
    mask = mj.AttnMask.shared_question([40, 30, 50])
    mask.plot(tmp_path / "small.png", figsize=(6, 5), dpi=80)
    _assert_picture(tmp_path / "small.png", (480, 400))
    big = mj.AttnMask.varlen(np.cumsum([0, 30000, 5000, 65072]), causal=True)
    big.plot(tmp_path / "big.png")  # drawn as polygons
    _assert_picture(tmp_path / "big.png", (700, 700))
    mesh = jax.make_mesh(
        (4,), ("cp",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
    )
    key = mj.make_flex_key(
        mj.AttnMask.varlen([0, 50, 90, 200], causal=True), mesh, "cp", overlap_degree=2
    )
    key.plot(tmp_path / "plan.png")
    _assert_picture(tmp_path / "plan.png", (1200, 1000))


def test_planner_cli_million_tokens_cp64(tmp_path):
    out = tmp_path / "plan.png"
    cmd = [
        sys.executable,
        "-m",
        "magi_jax.plan",
        "--mask",
        "doc-causal",
        "--seqlen",
        "1M",
        "--cp",
        "64",
        "--overlap-degree",
        "1",
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for expected in ("1,048,576 tokens", "per rank", "max/mean", "remote KV", "stages", "time"):
        assert expected in res.stdout, res.stdout
    imbalance = float(re.search(r"magi\s+max/mean\s+([\d.]+)", res.stdout).group(1))
    assert imbalance < 1.02, res.stdout
    _assert_picture(out, (1200, 1000))


def test_planner_cli_plans_the_users_mask(tmp_path, capsys):
    from magi_jax.cli import main

    assert main(["--cu-seqlens", "0,3000,8k,20000", "--cp", "4", "--out", ""]) == 0
    out = capsys.readouterr().out
    assert "3 documents (--cu-seqlens): 3 slices over 20,000 tokens" in out, out
    assert re.search(r"magi\s+max/mean\s+1\.0", out), out

    mask = mj.AttnMask.varlen([0, 700, 2048], causal=False)
    path = tmp_path / "mask.npz"
    mask.save(path)
    assert mj.AttnMask.load(path) == mask
    assert main(["--slices", str(path), "--cp", "2", "--out", ""]) == 0
    out = capsys.readouterr().out
    assert f"{mask.num_slices} slices over 2,048 tokens" in out, out
    assert f"area {mask.area / 1e6:.3g}M cells" in out, out

    np.savez(tmp_path / "bad.npz", q_ranges=np.zeros((1, 2), np.int32))
    for argv, message in (
        (["--slices", str(tmp_path / "bad.npz")], "k_ranges"),
        (["--cu-seqlens", "0,10,5"], "cu_seqlens"),
        (["--cu-seqlens", "0,x"], "--cu-seqlens"),
        (["--bidirectional"], "--cu-seqlens only"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--out", ""])
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def _train_argv(out, *extra):
    return [
        sys.executable,
        str(ROOT / "examples" / "train.py"),
        "--steps",
        "10",
        "--seqlen",
        "512",
        "--docs",
        "4",
        "--layers",
        "1",
        "--dim",
        "64",
        "--heads",
        "2",
        "--kv-heads",
        "2",
        "--json",
        str(out),
        *extra,
    ]


def _check_pod_run(log, dp, steps=10):
    assert np.isfinite(log["loss"]).all() and log["compilations"] == 1
    # a new packing for every replica of every step
    assert len(log["layouts"]) == dp * steps
    assert len({tuple(x) for x in log["layouts"]}) == dp * steps


def test_train_example_on_a_pod_mesh(tmp_path):
    """dp 2 x cp 2 x tp 2 on 8 host devices: every replica its own packing every step, one
    compilation, the step-0 check per row against the one-device model."""
    out = tmp_path / "train.json"
    cmd = _train_argv(out, "--devices", "8", "--dp", "2", "--tp", "2")
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(True), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "over 2 rows" in res.stdout and "-> OK" in res.stdout, res.stdout
    log = json.loads(out.read_text())
    assert log["mesh"] == dict(dp=2, cp=2, tp=2)
    _check_pod_run(log, 2)


def test_train_example_two_processes(tmp_path):
    """``--distributed`` with 2 processes x 4 CPU devices: dp 2 spans the processes (each
    plans its own replica's rows), cp 4 inside each."""
    from tests.sharding.test_multiprocess import free_port, run_processes

    coordinator = f"127.0.0.1:{free_port()}"
    outs = run_processes(
        lambda i: (
            _train_argv(tmp_path / f"train{i}.json", "--devices", "8", "--dp", "2")
            + ["--distributed", "--coordinator", coordinator, "--num-processes", "2"]
            + ["--process-id", str(i)]
        ),
        env={"XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {OPTIMIZED_FLAG}"},
    )
    assert "-> OK" in outs[0] and "2 process(es)" in outs[0], outs[0][-3000:]
    _check_pod_run(json.loads((tmp_path / "train0.json").read_text()), 2)
