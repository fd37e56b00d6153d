"""Pods on CPU host devices: per-device FLOPs and fwd+bwd time of ``magi_attention`` with a
batched key at dp x cp against one replica alone, and the host planning time of a process's
own rows.

    PYTHONPATH=. python benchmarks/pods_bench.py                    # 8 host devices
    PYTHONPATH=. python benchmarks/pods_bench.py --tokens 4096 --plan-tokens 131072

FLOPs per device come from XLA's cost analysis of the compiled fwd+bwd step (one device's
program): with the batch sharded over dp, each device does its own row's work, so the ratio
to one replica alone (the same row on a mesh of cp devices) should be 1. Times are medians
of ``--reps`` runs after a warm-up; on a CPU the host devices share the machine's cores, so
a step's time grows with the work of all devices together (dp rows), not with one device's.
Planning: ``make_batch_key`` on a (dp, cp) mesh plans the rows this process holds; per row
it costs one key's host planning, whatever the global batch.

Writes ``pods_<stamp>_cpu.{json,md}`` into ``--out`` (default ``benchmarks/results/pods/``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.harness import describe, environment, host_devices


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per row (attention)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--docs", type=int, default=8, help="documents per packed row")
    ap.add_argument(
        "--meshes", default="1x2,2x2,4x2,1x4,2x4", help="dp x cp meshes (dp·cp <= devices)"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--plan-tokens", type=int, default=131072, help="tokens per row (planning)")
    ap.add_argument("--plan-meshes", default="1x8,2x4,4x2,8x1", help="dp x cp for planning")
    ap.add_argument(
        "--attention-from",
        default="",
        help="take the attention rows from this earlier run's json (plan only)",
    )
    ap.add_argument("--out", default="benchmarks/results/pods")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    host_devices(8)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import magi_jax as mj  # noqa: E402


def packings(rng, n, total, docs):
    """``n`` document-causal packings with random document lengths (1/4x to 4x the mean)."""
    out = []
    for _ in range(n):
        w = np.exp(rng.uniform(np.log(0.25), np.log(4.0), docs))
        lens = np.maximum(1, (w / w.sum() * total).astype(np.int64))
        lens[-1] += total - lens.sum()
        out.append(mj.AttnMask.varlen(np.concatenate([[0], np.cumsum(lens)])))
    return out


def mesh_of(dp, cp):
    if dp == 1:
        devices = jax.devices()[:cp]
        return jax.make_mesh((cp,), ("cp",), devices=devices, axis_types=(AxisType.Auto,))
    devices = jax.devices()[: dp * cp]
    return jax.make_mesh((dp, cp), ("dp", "cp"), devices=devices, axis_types=(AxisType.Auto,) * 2)


def step_fn(key, args, rows):
    """The compiled fwd+bwd of magi_attention on dispatched inputs, and those inputs."""
    lead = (rows,) if rows else ()
    batch = "dp" if rows and key.batch_axes else None
    spec = P(*((batch,) if rows else ()), "cp")
    sharding = NamedSharding(key.mesh, spec)

    def loss(q, k, v, key):
        out, lse = mj.magi_attention(q, k, v, key)
        return (out**2).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    rng = np.random.default_rng(0)
    shape = lambda h: lead + (key.padded_total, h, args.head_dim)
    arrays = [
        jax.device_put(rng.standard_normal(shape(h)).astype(np.float32), sharding)
        for h in (args.heads, args.kv_heads, args.kv_heads)
    ]
    compiled = grad.lower(*arrays, key).compile()
    return compiled, arrays


def flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def timed(compiled, arrays, key, reps):
    jax.block_until_ready(compiled(*arrays, key))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*arrays, key))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_rows(args):
    rng = np.random.default_rng(1)
    meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
    out = []
    alone, caps = {}, {}
    # One sample of packings and one capacity per cp: every mesh of one cp compiles the same
    # shapes, so FLOPs per device compare the rows' work, not their capacities.
    sample = packings(rng, 16, args.tokens, args.docs)
    for dp, cp in meshes:
        masks = sample[:dp]
        if cp not in caps:
            caps[cp] = mj.PlanCapacity.from_masks(sample, mesh_size=cp)
        cap = caps[cp]
        if cp not in alone:  # one replica: its row on cp devices
            one = mj.make_flex_key(masks[0], mesh_of(1, cp), "cp", capacity=cap, ffa_backend="xla")
            compiled, arrays = step_fn(one, args, 0)
            alone[cp] = (flops(compiled), timed(compiled, arrays, one, args.reps))
        mesh = mesh_of(dp, cp)
        if dp == 1:
            key = mj.make_flex_key(masks[0], mesh, "cp", capacity=cap, ffa_backend="xla")
            compiled, arrays = step_fn(key, args, 0)
        else:
            key = mj.make_batch_key(
                masks, mesh, "cp", batch_axes="dp", capacity=cap, ffa_backend="xla"
            )
            compiled, arrays = step_fn(key, args, dp)
        f, t = flops(compiled), timed(compiled, arrays, key, args.reps)
        row = dict(
            dp=dp,
            cp=cp,
            rows=dp,
            flops_per_device=f,
            alone_flops=alone[cp][0],
            flops_ratio=f / alone[cp][0],
            seconds=t,
            alone_seconds=alone[cp][1],
            time_ratio=t / alone[cp][1],
        )
        print(
            f"dp {dp} x cp {cp}: {f / 1e9:.3f} GFLOP/device ({row['flops_ratio']:.3f}x one "
            f"replica), fwd+bwd {t * 1e3:.0f} ms ({row['time_ratio']:.2f}x)",
            flush=True,
        )
        out.append(row)
    return out


def planning_rows(args):
    rng = np.random.default_rng(2)
    meshes = [tuple(int(x) for x in m.split("x")) for m in args.plan_meshes.split(",")]
    out = []
    for dp, cp in meshes:
        masks = packings(rng, dp, args.plan_tokens, 64)
        sample = masks + packings(rng, 8, args.plan_tokens, 64)
        cap = mj.PlanCapacity.from_masks(sample, mesh_size=cp)
        mesh = mesh_of(max(dp, 2), cp) if dp > 1 else mesh_of(2, cp) if cp < 8 else None
        if mesh is None:  # 1 x 8: dp axis of size 1
            mesh = jax.make_mesh((1, 8), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)
        rows = mesh.shape["dp"]
        masks = (masks * rows)[:rows]
        mj.clear_caches()
        mj.make_batch_key(masks, mesh, "cp", batch_axes="dp", capacity=cap, ffa_backend="xla")
        times = []
        for _ in range(args.reps):
            mj.clear_caches()
            t0 = time.perf_counter()
            mj.make_batch_key(masks, mesh, "cp", batch_axes="dp", capacity=cap, ffa_backend="xla")
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        local = len(mj.batch_rows(mesh, "dp", rows))
        row = dict(dp=rows, cp=cp, local_rows=local, seconds=t, seconds_per_row=t / local)
        print(
            f"plan dp {rows} x cp {cp} @ {args.plan_tokens:,} tokens/row: {local} local rows, "
            f"{t * 1e3:.0f} ms ({t / local * 1e3:.0f} ms per row)",
            flush=True,
        )
        out.append(row)
    return out


def main(args):
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d_%H%M")
    env = environment()
    if args.attention_from:
        attn = json.loads(Path(args.attention_from).read_text())["attention"]
        env["attention_from"] = args.attention_from
    else:
        attn = attention_rows(args)
    plan = planning_rows(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"pods_{stamp}_cpu"
    base.with_suffix(".json").write_text(
        json.dumps(dict(environment=env, attention=attn, planning=plan), indent=1)
    )
    lines = [
        f"# Pods on CPU host devices ({stamp} UTC)",
        "",
        f"`python benchmarks/pods_bench.py {' '.join(env['argv'])}`; {describe(env)}. "
        f"Attention: {args.tokens} tokens per row, {args.docs} documents, "
        f"{args.heads}/{args.kv_heads} heads, D {args.head_dim}, float32, xla backend, fwd+bwd.",
        "",
        "| dp x cp | rows | GFLOP per device | one replica | ratio | fwd+bwd ms | one replica ms "
        "| time ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in attn:
        lines.append(
            f"| {r['dp']} x {r['cp']} | {r['rows']} | {r['flops_per_device'] / 1e9:.3f} | "
            f"{r['alone_flops'] / 1e9:.3f} | {r['flops_ratio']:.3f} | {r['seconds'] * 1e3:.0f} "
            f"| {r['alone_seconds'] * 1e3:.0f} | {r['time_ratio']:.2f} |"
        )
    lines += [
        "",
        f"Host planning of a batched key at {args.plan_tokens:,} tokens per row (64 documents, "
        "one process holding every row here; a process plans the rows its devices hold):",
        "",
        "| dp x cp | rows this process plans | ms | ms per row |",
        "|---|---|---|---|",
    ]
    for r in plan:
        lines.append(
            f"| {r['dp']} x {r['cp']} | {r['local_rows']} | {r['seconds'] * 1e3:.0f} | "
            f"{r['seconds_per_row'] * 1e3:.0f} |"
        )
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {base}.{{json,md}}")


if __name__ == "__main__":
    main(ARGS)
