"""Does communication overlap compute in ``magi_attention``? (docs/design.md §3.2.)

For each case, three separately jitted programs over the mesh (``benchmarks.probe``):
``comm`` alone (the group-casts; with the backward also the group-reduces), ``compute`` alone
(FFA stages and merge on pre-fetched KV) and ``both`` (``magi_attention`` itself), each the
median of ``--iters`` blocked calls after warm-up. ``hidden = comm + compute − both`` is the
communication that overlapped.

    python3 benchmarks/overlap_bench.py --out $OUT           # 2 GPUs, ~2 minutes

Cases: masks × lengths × overlap degrees × backward re-fetch × {fwd, fwd+bwd}, bf16,
Hq = Hkv = 16, D = 128, pallas FFA per rank when supported. Writes
``<out>/overlap_<date>_<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import time
import traceback

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.baselines.common import pick_backend  # noqa: E402
from benchmarks.harness import Run, describe, environment  # noqa: E402
from benchmarks.kernel_bench import make_mask  # noqa: E402
from benchmarks.probe import measure_overlap, overlap_probe  # noqa: E402
from magi_jax.sharding import make_flex_key  # noqa: E402


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--masks", default="doc_causal,causal")
    p.add_argument("--lengths", default="131072")
    p.add_argument("--degrees", default="0,1,2")
    p.add_argument("--refetch", default="1,0", help="backward_refetch values, e.g. 1,0")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--comm", default="auto", help="comm_backend of the keys")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument(
        "--schedule",
        action="store_true",
        help="also write the order in which XLA scheduled the collectives and the "
        "FFA kernels of magi_attention (<out>/overlap_..._schedule.txt)",
    )
    p.add_argument("--out", default="benchmarks/results/overlap")
    return p.parse_args(argv)


_SCHEDULE_OPS = ("collective-permute", "all-to-all", "custom-call", "all-gather", "reduce-scatter")


def schedule(key, q, k, v, backward: bool) -> list[str]:
    """The entry computation of the compiled ``magi_attention`` (forward, or its VJP) in
    XLA's schedule order, kept to collectives and custom calls (the FFA kernels): shows
    whether a collective's start and done bracket a kernel, i.e. whether overlap is possible."""
    fns = overlap_probe(key, q, k, v, backward=backward)
    text = fns["both"].lower(q, k, v).compile().as_text()
    lines, entry = [], False
    for line in text.splitlines():
        entry = entry or line.startswith("ENTRY")
        if entry and "=" in line and any(op in line for op in _SCHEDULE_OPS):
            lhs, rhs = line.strip().split("=", 1)
            op = rhs.split("(", 1)[0].split()[-1]
            target = (
                rhs.split('custom_call_target="', 1)[1].split('"')[0]
                if ("custom_call_target" in rhs)
                else ""
            )
            lines.append(f"{lhs.strip()} = {op} {target}".rstrip())
        if entry and line.startswith("}"):
            break
    return lines


def markdown(meta, rows) -> str:
    lines = [
        f"# Overlap probe {meta['date']}",
        "",
        f"{meta['num_devices']} × {meta['device']}; {describe(meta)}; H={meta['heads']}, "
        f"D={meta['head_dim']}, bf16, ffa {meta['ffa_backend']}, comm {meta['comm']}.",
        "",
        "`comm`: group collectives alone; `compute`: FFA stages + merge on pre-fetched KV; "
        "`both`: magi_attention; `hidden` = comm + compute − both (≥ 0); TFLOP/s per GPU "
        "of `both` on the most loaded rank's area.",
        "",
        "| mask | tokens | mode | degree | refetch | comm ms | compute ms | both ms | "
        "hidden ms | hidden % | TFLOP/s/GPU | remote KV max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['mask']} | {r['length']} | {r['mode']} | {r['degree']} | {r['refetch']} |"
        if "error" in r or "skipped" in r:
            lines.append(f"{head} {r.get('error') or r.get('skipped')} |||||||")
            continue
        lines.append(
            f"{head} {r['comm_ms']:.2f} | {r['compute_ms']:.2f} | {r['both_ms']:.2f} "
            f"| {r['hidden_ms']:.2f} | {100 * r['hidden_fraction']:.0f} | "
            f"{r['tflops_per_device']:.1f} | {r['remote_kv_max']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    a = _parse(argv)
    t_start = time.perf_counter()
    devices = jax.devices()
    mesh = jax.make_mesh(
        (len(devices),), ("cp",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,)
    )
    dtype = jnp.bfloat16
    ffa, _ = pick_backend("auto", dtype, a.head_dim)
    meta = environment(
        device=getattr(devices[0], "device_kind", str(devices[0])),
        num_devices=len(devices),
        heads=a.heads,
        head_dim=a.head_dim,
        ffa_backend=ffa,
        comm=a.comm,
    )
    run = Run("overlap", a.out, meta, lambda rows, meta: markdown(meta, rows))
    rows, sched = run.rows, []
    shard = NamedSharding(mesh, P("cp"))
    for name in a.masks.split(","):
        for total in (int(x) for x in a.lengths.split(",")):
            mask = make_mask(name, total)
            for degree in (int(x) for x in a.degrees.split(",")):
                for refetch in (bool(int(x)) for x in a.refetch.split(",")):
                    for mode in a.modes.split(","):
                        row = dict(
                            mask=name, length=total, mode=mode, degree=degree, refetch=refetch
                        )
                        rows.append(row)
                        if refetch is False and mode == "fwd":
                            row["skipped"] = "re-fetch only changes the backward"
                            continue
                        if time.perf_counter() - t_start > a.budget_s:
                            row["skipped"] = "time budget"
                            continue
                        try:
                            key = make_flex_key(
                                mask,
                                mesh,
                                "cp",
                                overlap_degree=degree,
                                ffa_backend=ffa,
                                comm_backend=a.comm,
                                backward_refetch=refetch,
                            )
                            n = key.padded_total
                            ks = jax.random.split(jax.random.key(0), 3)
                            q, k, v = (
                                jax.device_put(
                                    jax.random.normal(kk, (n, a.heads, a.head_dim), dtype), shard
                                )
                                for kk in ks
                            )
                            row.update(
                                measure_overlap(key, q, k, v, backward=mode != "fwd", iters=a.iters)
                            )
                            if a.schedule:
                                sched.append(
                                    f"## {name} {total} {mode} degree {degree} refetch {refetch}"
                                )
                                sched += schedule(key, q, k, v, mode != "fwd")
                        except Exception as e:
                            traceback.print_exc()
                            row["error"] = repr(e)[:300]
                        print(f"[{time.perf_counter() - t_start:.0f}s] {row}", flush=True)
                        run.save()
    if sched:
        with open(f"{run.base}_schedule.txt", "w") as f:
            f.write("\n".join(sched) + "\n")
    run.save()
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
