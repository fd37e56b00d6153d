"""Two processes with 4 CPU devices each, joined by ``jax.distributed`` on the loopback
address: CP spanning both processes, DP spanning both (each plans only its own rows), and
the plan-mismatch guard. Each scenario runs ``multiprocess_worker.py`` twice; every wait is
bounded and the processes are killed on timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xla_options import with_flags

WORKER = Path(__file__).with_name("multiprocess_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(argv_of, n=2, timeout=TIMEOUT, env=None) -> list[str]:
    """Starts ``n`` processes (``argv_of(i)``), waits for all (bounded), returns their
    outputs; fails with every process's output if one fails or times out. ``env``: more
    environment variables (by default each process sets its own device count). The
    processes compile as the suite does (its XLA flags, less the device count)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = dict(env or {})
    env["XLA_FLAGS"] = with_flags(" ".join(flags), env.get("XLA_FLAGS", ""))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **env}
    procs = [
        subprocess.Popen(
            argv_of(i),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for i in range(n)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail("a process did not finish in time:\n" + "\n---\n".join(outs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        pytest.fail(f"process(es) {failed} failed:\n" + "\n---\n".join(o[-4000:] for o in outs))
    return outs


@pytest.mark.parametrize(
    "scenario", ["cp_across_processes", "dp_across_processes", "plan_mismatch"]
)
def test_two_processes(scenario):
    coordinator = f"127.0.0.1:{free_port()}"
    outs = run_processes(
        lambda i: [sys.executable, str(WORKER), scenario, coordinator, "2", str(i)]
    )
    for out in outs:
        assert f"OK {scenario}" in out, out[-2000:]
