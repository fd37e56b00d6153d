"""The native transport on 2 GPUs with 2 processes (one per GPU, NVSHMEM): group_cast /
group_reduce vs the NumPy model and magi_attention forward+backward vs the XLA transport and
a float64 reference (tests/native/gpu_worker.py). Skipped without 2 GPUs and the CUDA
library."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from magi_jax.sharding.native import library


def _gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 NVIDIA GPUs"),
    pytest.mark.skipif(
        library.find_library("_magi_native_cuda.so") is None,
        reason="the CUDA/NVSHMEM library was not built",
    ),
]

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_cast_reduce_and_attention():
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            CUDA_VISIBLE_DEVICES=str(rank),
            PYTHONUNBUFFERED="1",
            XLA_PYTHON_CLIENT_MEM_FRACTION="0.5",
            NVSHMEM_DISABLE_NVLS="1",
            NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo",
            JAX_PLATFORMS="cuda",
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        env.pop("XLA_FLAGS", None)  # no forced host devices in the workers
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.native.gpu_worker", str(rank), "2", str(port)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("GPU workers timed out:\n" + "\n".join(outs))
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"PASS {rank}" in out, f"rank {rank}:\n{out[-6000:]}"
