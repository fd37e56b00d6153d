"""Overlap degrees on 8 CPU devices: every fixed degree against the calibrated choice.

For each mask and length: ``mj.calibrate_overlap`` chooses the forward's and the backward's
degrees (its own timing rounds); then, in separate rounds, the forward (as training runs it,
with the backward's residuals) and the backward alone are timed at every fixed degree and
on the calibrated key (its two stage plans), every program once per round, the order
rotated from round to round so that load from other jobs falls on all alike; medians. A
chosen degree *holds* when its fixed-degree median is within 5 % of the fastest fixed
degree's.

    PYTHONPATH=. python benchmarks/overlap_cpu_bench.py      # ~25 minutes on 2 busy cores

8 host devices of one process, ``xla`` FFA and the ``xla`` transport; float32 by default
(bfloat16 is emulated on CPUs). Writes ``<out>/overlap_cpu_<stamp>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import magi_jax as mj  # noqa: E402
from benchmarks.harness import describe, environment  # noqa: E402
from benchmarks.kernel_bench import make_mask  # noqa: E402
from magi_jax.sharding.calibrate import timed_programs  # noqa: E402

WITHIN = 0.05


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--masks", default="doc_causal,causal,swa_causal_512")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--degrees", default="0,1,2,3,4")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of the comparison")
    p.add_argument("--cal-rounds", type=int, default=3, help="rounds of the calibration")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results", "overlap"))
    return p.parse_args(argv)


def _time(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return (time.perf_counter() - t0) * 1e3


def run_case(mesh, name: str, total: int, a) -> dict:
    mask = make_mask(name, total)
    degrees = [int(d) for d in a.degrees.split(",")]
    shape = dict(num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=a.dtype)
    opts = dict(ffa_backend="xla", comm_backend="xla")
    cal = mj.calibrate_overlap(
        mask, mesh, "cp", candidates=degrees, rounds=a.cal_rounds, **shape, **opts
    )
    keys = {d: mj.make_flex_key(mask, mesh, "cp", overlap_degree=d, **opts) for d in degrees}
    keys["calibrated"] = mj.make_flex_key(mask, mesh, "cp", overlap_degree=cal.degrees, **opts)
    programs = {}
    for i, (label, key) in enumerate(keys.items()):
        programs[label] = timed_programs(key, seed=i, **shape)
        for fn in programs[label]:  # compile and warm up
            jax.block_until_ready(fn())
    labels = list(programs)
    times = {label: ([], []) for label in labels}
    for r in range(a.rounds):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            for fn, out in zip(programs[label], times[label]):
                out.append(_time(fn))
    med = {label: tuple(float(np.median(t)) for t in times[label]) for label in labels}
    fwd = {d: med[d][0] for d in degrees}
    bwd = {d: med[d][1] for d in degrees}
    best_f, best_b = min(fwd, key=fwd.get), min(bwd, key=bwd.get)
    row = dict(
        mask=name,
        tokens=total,
        forward_ms=fwd,
        backward_ms=bwd,
        best_forward=best_f,
        best_backward=best_b,
        chosen=list(cal.degrees),
        forward_ratio=fwd[cal.forward] / fwd[best_f],
        backward_ratio=bwd[cal.backward] / bwd[best_b],
        calibrated_key_ms=list(med["calibrated"]),
        calibrated_key_forward_ratio=med["calibrated"][0] / fwd[best_f],
        calibrated_key_backward_ratio=med["calibrated"][1] / bwd[best_b],
        calibration_forward_ms=cal.forward_ms,
        calibration_backward_ms=cal.backward_ms,
        calibration_s=cal.seconds,
        cost_model=list(_model(mask, keys[degrees[0]])),
        rounds=a.rounds,
    )
    row["forward_holds"] = row["forward_ratio"] <= 1 + WITHIN
    row["backward_holds"] = row["backward_ratio"] <= 1 + WITHIN
    return row


def _model(mask, key) -> tuple[int, int]:
    """The H200 cost model's degrees for the same dispatch, for comparison."""
    from magi_jax.planning.defaults import default_overlap_degrees

    return tuple(default_overlap_degrees(mask, key.plan.meta))


def _fmt_ms(times: dict, mark: int, chosen: int) -> str:
    cells = []
    for d, t in times.items():
        s = f"{t:.0f}"
        if d == mark:
            s = f"**{s}**"
        if d == chosen:
            s += " ←"
        cells.append(s)
    return " / ".join(cells)


def write(rows: list, a, stamp: str, meta: dict) -> str:
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"overlap_cpu_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    degrees = a.degrees.replace(",", " / ")
    lines = [
        "# Overlap degrees on 8 CPU devices: fixed degrees against the calibrated choice",
        "",
        f"{describe(meta)}; 8 host devices of one process, shared with other jobs. "
        f"`benchmarks/overlap_cpu_bench.py`: {a.dtype}, Hq = {a.heads}, Hkv = "
        f"{a.kv_heads}, D = {a.head_dim}, `xla` FFA and transport; medians of {a.rounds} "
        f"interleaved rounds (calibration: {a.cal_rounds} rounds of its own). Forward: as "
        "training runs it (with the backward's residuals); backward: alone, from them.",
        "",
        f"Times in ms per degree {degrees}; **bold** the fastest fixed degree, ← the "
        "calibrated choice. *ratio*: the chosen degree's time over the fastest's (holds "
        f"within {WITHIN:.0%}); *key*: the calibrated key itself (its own stage plans) over "
        "the fastest fixed degree. *model*: the H200 cost model's (fwd, bwd) for comparison.",
        "",
        "| mask | tokens | fwd ms | bwd ms | chosen (fwd, bwd) | fwd ratio | bwd ratio | "
        "key fwd / bwd | model | calibration s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = lambda x: "✓" if x else "✗"
        lines.append(
            f"| {r['mask']} | {r['tokens']} | "
            f"{_fmt_ms(r['forward_ms'], r['best_forward'], r['chosen'][0])} | "
            f"{_fmt_ms(r['backward_ms'], r['best_backward'], r['chosen'][1])} | "
            f"({r['chosen'][0]}, {r['chosen'][1]}) | "
            f"{r['forward_ratio']:.3f} {ok(r['forward_holds'])} | "
            f"{r['backward_ratio']:.3f} {ok(r['backward_holds'])} | "
            f"{r['calibrated_key_forward_ratio']:.3f} / "
            f"{r['calibrated_key_backward_ratio']:.3f} | "
            f"({r['cost_model'][0]}, {r['cost_model'][1]}) | {r['calibration_s']:.0f} |"
        )
    held = sum(r["forward_holds"] for r in rows), sum(r["backward_holds"] for r in rows)
    lines += [
        "",
        f"Within {WITHIN:.0%} of the fastest fixed degree: forward {held[0]} of {len(rows)}, "
        f"backward {held[1]} of {len(rows)}.",
    ]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return base


def main(argv=None) -> None:
    a = _parse(argv)
    if len(jax.devices()) < 8:
        raise SystemExit(f"needs 8 devices; found {len(jax.devices())} ({_FLAG})")
    mesh = jax.make_mesh(
        (8,), ("cp",), devices=jax.devices()[:8], axis_types=(jax.sharding.AxisType.Auto,)
    )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    meta = environment(argv, args=vars(a))
    rows = []
    for total in [int(x) for x in a.lengths.split(",")]:
        for name in a.masks.split(","):
            t0 = time.perf_counter()
            rows.append(run_case(mesh, name, total, a))
            r = rows[-1]
            print(
                f"{name:>15} {total:>6}: chosen {tuple(r['chosen'])}, best "
                f"({r['best_forward']}, {r['best_backward']}), ratios "
                f"{r['forward_ratio']:.3f} / {r['backward_ratio']:.3f} "
                f"[{time.perf_counter() - t0:.0f} s]",
                flush=True,
            )
            write(rows, a, stamp, meta)  # what is done so far survives an interruption
    print(write(rows, a, stamp, meta) + ".md")


if __name__ == "__main__":
    main()
