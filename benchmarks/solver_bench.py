"""Dispatch-solver benchmark (CPU, host NumPy): balance, remote KV and planning time.

For every zoo mask at the given lengths and cp sizes, and every dispatch algorithm (the magi
solver and the contiguous / zigzag / striped / greedy baselines): max/mean per-rank area,
remote-KV tokens per rank (max) and in total, and planning time; next to the KV volume ring
attention moves (every rank receives every other rank's KV). With ``--dist_plan`` it also
times the distributed part of the plan for the magi dispatch (per-rank stages and the
group-cast tables, without the per-rank FFA tiling).

Writes ``benchmarks/results/solver/solver_<date>.{json,md}``.

    PYTHONPATH=. python benchmarks/solver_bench.py                       # S1 sweep
    PYTHONPATH=. python benchmarks/solver_bench.py --lengths 262144 --cps 8 --masks causal
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from benchmarks import harness
from benchmarks.harness import describe, environment
from magi_jax.mask import AttnMask
from magi_jax.mask_zoo import make_mask as zoo_mask
from magi_jax.planning import solver as S
from magi_jax.planning import stages as D
from magi_jax.planning.cast_table import build_cast_table

# The zoo of magi_jax.mask_zoo under this benchmark's names (mask_zoo.DOC_LENGTHS documents).
ZOO = (
    "full",
    "causal",
    "doc_causal",
    "doc_full",
    "swa_causal_4096",
    "block_causal",
    "prefix_lm",
    "shared_question",
    "causal_blockwise",
    "global_sliding_window",
    "many_docs_causal",
)
ALGORITHMS = ("magi", "greedy", "contiguous", "zigzag", "striped")


def make_mask(name: str, total: int) -> AttnMask:
    """A mask of :data:`ZOO` (``magi_jax.mask_zoo``; documents in multiples of 128, blocks of
    2048, windows of 4096, 64 global tokens, 64 random documents)."""
    if name not in ZOO:
        raise ValueError(f"unknown mask {name!r}; choose from {ZOO}")
    zoo_name = {"swa_causal_4096": "sliding-window", "many_docs_causal": "many-docs"}.get(
        name, name.replace("_", "-")
    )
    return zoo_mask(zoo_name, total, block=2048, num_global=64, multiple=128)


def time_dist_plan(mask: AttnMask, meta: S.DispatchMeta, degree: int = 1) -> float:
    """Seconds for the per-rank stages and cast tables of one overlap degree."""
    t0 = time.process_time()
    views = D.rank_views(mask, meta, degree)
    stage_len = np.array([v.stage_len for v in views]).reshape(meta.cp, degree)
    buf = np.maximum(stage_len.max(axis=0), 1)
    for s in range(degree):
        build_cast_table(meta, [v.remote[v.remote[:, 3] == s] for v in views], int(buf[s]))
    return time.process_time() - t0


def run_case(name: str, total: int, cp: int, dist_plan: bool) -> list[dict]:
    mask = make_mask(name, total)
    rows = []
    chunk = None
    for alg in ALGORITHMS:
        S.solve_dispatch.cache_clear()
        t0, c0 = time.perf_counter(), time.process_time()
        # Baselines use the chunk size the magi solver chose (same granularity).
        meta = S.solve_dispatch(mask, cp, chunk if alg != "magi" else None, alg)
        plan_s, plan_cpu = time.perf_counter() - t0, time.process_time() - c0
        if alg == "magi":
            chunk = meta.chunk_size
        remote = S.remote_kv_tokens(mask, meta)
        ring = meta.padded_total - meta.local_len
        row = dict(
            mask=name,
            total=total,
            cp=cp,
            algorithm=alg,
            chunk_size=meta.chunk_size,
            chunks_per_rank=meta.chunks_per_rank,
            imbalance=meta.imbalance(),
            remote_kv_max=int(remote.max()),
            remote_kv_total=int(remote.sum()),
            ring_kv_per_rank=int(ring),
            ring_kv_total=int(ring * cp),
            remote_vs_ring=float(remote.max() / ring) if ring else 0.0,
            plan_seconds=plan_s,
            plan_cpu_seconds=plan_cpu,
        )
        if dist_plan and alg == "magi":
            row["dist_plan_seconds"] = time_dist_plan(mask, meta)
        rows.append(row)
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    out = [
        f"# Dispatch solver benchmark — {meta['date']}",
        "",
        f"{describe(meta)}. "
        "Per-rank area balance (max/mean), remote KV tokens per rank (max) as a fraction "
        "of ring attention's (every rank receives all other KV), remote KV in total, and "
        "planning time (dispatch solve, wall and CPU seconds — CPU time is the robust figure on a "
        "shared machine; `dist` = CPU seconds of the per-rank stages + cast tables, "
        "degree 1).",
        "",
        "S1 targets: magi max/mean ≤ 1.02, remote KV ≤ ring, 1M × cp 64 planned < 1 s.",
        "",
    ]
    header = (
        "| mask | T | cp | chunk | "
        + " | ".join(f"{a} max/mean" for a in ALGORITHMS)
        + " | "
        + " | ".join(f"{a} KV/ring" for a in ALGORITHMS)
        + " | magi KV total / ring total | magi plan s (wall) | magi plan s (CPU) | "
        "dist s (CPU) |"
    )
    out += [header, "|" + "---|" * (header.count("|") - 1)]
    keyed = {}
    for r in rows:
        keyed.setdefault((r["mask"], r["total"], r["cp"]), {})[r["algorithm"]] = r
    for (mask, total, cp), by in keyed.items():
        m = by["magi"]
        cells = [mask, f"{total // 1024}k", str(cp), str(m["chunk_size"])]
        cells += [f"{by[a]['imbalance']:.3f}" for a in ALGORITHMS]
        cells += [f"{by[a]['remote_vs_ring']:.3f}" for a in ALGORITHMS]
        cells += [
            f"{m['remote_kv_total'] / m['ring_kv_total']:.3f}",
            f"{m['plan_seconds']:.3f}",
            f"{m['plan_cpu_seconds']:.3f}",
            f"{m.get('dist_plan_seconds', float('nan')):.3f}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    magi = [r for r in rows if r["algorithm"] == "magi"]
    worst = max(magi, key=lambda r: r["imbalance"])
    slowest = max(magi, key=lambda r: r["plan_cpu_seconds"])
    out += [
        "",
        f"Worst magi imbalance: {worst['imbalance']:.4f} ({worst['mask']}, "
        f"{worst['total']}, cp {worst['cp']}). Worst remote KV / ring: "
        f"{max(r['remote_vs_ring'] for r in magi):.3f}. Slowest magi plan: "
        f"{slowest['plan_cpu_seconds']:.3f} s CPU, {slowest['plan_seconds']:.3f} s wall "
        f"({slowest['mask']}, {slowest['total']}, cp {slowest['cp']}).",
    ]
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="262144,1048576", help="comma-separated sequence lengths")
    p.add_argument("--cps", default="8,16,32,64", help="comma-separated cp sizes")
    p.add_argument("--masks", default=",".join(ZOO), help=f"comma-separated, from {ZOO}")
    p.add_argument(
        "--dist_plan",
        action="store_true",
        help="also time the per-rank stages and cast tables (magi only)",
    )
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "solver"))
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    cps = [int(x) for x in args.cps.split(",")]
    masks = args.masks.split(",")
    cases = [(m, t, c) for t in lengths for m in masks for c in cps]
    rows = []
    start = time.perf_counter()
    for i, (m, t, c) in enumerate(cases, 1):
        rows += run_case(m, t, c, args.dist_plan)
        magi = rows[-len(ALGORITHMS)]
        print(
            f"[{i}/{len(cases)} {time.perf_counter() - start:6.1f}s] {m:22s} T={t:8d} "
            f"cp={c:3d} magi {magi['imbalance']:.4f} KV/ring {magi['remote_vs_ring']:.3f} "
            f"plan {magi['plan_seconds']:.3f}s wall {magi['plan_cpu_seconds']:.3f}s CPU",
            file=sys.stderr,
            flush=True,
        )
    record = harness.Run("solver", args.out, environment(argv), to_markdown)
    record.add(*rows)
    print(f"wrote {record.base}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    main()
