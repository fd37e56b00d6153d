"""One process of a multi-process test (tests/sharding/test_multiprocess.py starts two).

    python multiprocess_worker.py SCENARIO COORDINATOR NUM_PROCESSES PROCESS_ID

Every process has 4 CPU host devices; ``jax.distributed`` joins them on the loopback
address. Each scenario prints ``OK <scenario> <details>`` on success and raises otherwise.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import magi_jax as mj  # noqa: E402
from magi_jax.ffa.testing import reference_results  # noqa: E402

T, HQ, HKV, D = 128, 2, 1, 16


def packings(seed, n, total=T, docs=4):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cuts = np.sort(rng.choice(np.arange(4, total - 3), docs - 1, replace=False))
        out.append(mj.AttnMask.varlen([0, *cuts.tolist(), total]))
    return out


def host_inputs(seed, batch=None):
    """The same q, k, v, dout on every process (NumPy, float32)."""
    rng = np.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    shapes = [(T, HQ, D), (T, HKV, D), (T, HKV, D), (T, HQ, D)]
    return [rng.standard_normal(lead + s).astype(np.float32) for s in shapes]


def global_array(x, mesh, spec=P()):
    """A host value every process holds -> a global array (each process fills its shards)."""
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def gathered(x):
    """A global array's full value on this process (replicated first, then read)."""
    full = jax.jit(lambda a: a, out_shardings=NamedSharding(x.sharding.mesh, P()))(x)
    return np.asarray(full.addressable_data(0))


def vjp_step(seq_axis):
    def fwd(q, k, v, key):
        d = lambda x: mj.dispatch(x, key, seq_axis=seq_axis)
        out, lse = mj.magi_attention(d(q), d(k), d(v), key)
        return mj.undispatch(out, key, seq_axis=seq_axis)

    @jax.jit
    def step(q, k, v, dout, key):
        out, vjp = jax.vjp(lambda q_, k_, v_: fwd(q_, k_, v_, key), q, k, v)
        return (out,) + vjp(dout)

    return step


def check_row(results, q, k, v, dout, mask, what):
    """out, dq, dk, dv of one row against the float64 reference (float32 rule)."""
    ref = reference_results(q, k, v, mask, dout)
    for name, x in zip(("out", "dq", "dk", "dv"), results):
        err = float(np.max(np.abs(np.asarray(x, np.float64) - ref[name])))
        if not err <= 2e-5 * max(1.0, float(np.abs(ref[name]).max())):
            raise AssertionError(f"{what}: {name} differs from the reference by {err:.3g}")


def cp_across_processes():
    """CP over all 8 devices of both processes; a key at a capacity as a jit argument, three
    packings, one compilation; a key closed over by a jitted function is refused clearly."""
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,))
    masks = packings(1, 3)
    cap = mj.PlanCapacity.from_masks(masks + packings(2, 8), mesh_size=8)
    step = vjp_step(0)
    host = host_inputs(3)
    args = [global_array(x, mesh) for x in host]
    for mask in masks:
        key = mj.make_flex_key(mask, mesh, "cp", capacity=cap, ffa_backend="xla")
        check_row([gathered(x) for x in step(*args, key)], *host, mask, "cp across processes")
    assert step._cache_size() == 1, step._cache_size()
    try:
        jax.jit(lambda q, k, v: mj.magi_attention(q, k, v, key)[0])(*args[:3])
    except ValueError as e:
        assert "pass the key as an argument" in str(e), e
    else:
        raise AssertionError("a closed-over key spanning processes was not refused")
    return f"3 packings, 1 compilation, process {jax.process_index()}"


def dp_across_processes():
    """(dp 2, cp 4): each process holds one dp replica (its 4 devices are one CP group) and
    plans only its own row; 4 steps with new packings, one compilation."""
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)
    rows = mj.batch_rows(mesh, "dp", 2)
    assert rows.tolist() == [jax.process_index()], rows
    steps = [packings(10 + s, 2) for s in range(4)]
    cap = mj.PlanCapacity.from_masks([m for s in steps for m in s] + packings(9, 8), mesh_size=4)
    step = vjp_step(1)
    host = host_inputs(4, batch=2)
    spec = P("dp")
    args = [global_array(x, mesh, spec) for x in host]
    mine = int(rows[0])
    for masks in steps:

        def only_mine(row, masks=masks):
            if row != mine:
                raise AssertionError(f"process {mine} was asked to plan row {row}")
            return masks[row]

        key = mj.make_batch_key(
            only_mine, mesh, "cp", batch_axes="dp", capacity=cap, batch=2, ffa_backend="xla"
        )
        res = step(*args, key)
        local = [np.asarray(x.addressable_shards[0].data)[0] for x in res]
        row_in = [x[mine] for x in host]
        check_row(local, *row_in, masks[mine], f"dp row {mine}")
    assert step._cache_size() == 1, step._cache_size()
    return f"row {mine} of 2, 4 packings, 1 compilation"


def plan_mismatch():
    """The two processes of one CP group plan different masks: NaN, never a finite answer."""
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,))
    mine, other = packings(20, 2)
    mask = mine if jax.process_index() == 0 else other
    cap = mj.PlanCapacity.from_masks([mine, other] + packings(21, 8), mesh_size=8)
    key = mj.make_flex_key(mask, mesh, "cp", capacity=cap, ffa_backend="xla")
    args = [global_array(x, mesh) for x in host_inputs(5)]
    out = gathered(vjp_step(0)(*args, key)[0])
    assert np.isnan(out).all(), "a plan mismatch gave finite values"
    return "NaN on mismatch"


SCENARIOS = dict(
    cp_across_processes=cp_across_processes,
    dp_across_processes=dp_across_processes,
    plan_mismatch=plan_mismatch,
)

if __name__ == "__main__":
    scenario, coordinator, n, i = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    jax.distributed.initialize(coordinator, n, i, initialization_timeout=60)
    jnp.zeros(())  # start the backend
    print(f"OK {scenario} {SCENARIOS[scenario]()}", flush=True)
    jax.distributed.shutdown()
