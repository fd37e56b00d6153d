"""Where the FFA pallas time goes: the forward, the delta preprocess, the dQ kernel and the
dK/dV kernel timed one at a time; the forward and dK/dV each with one program per unit and
persistent, dQ (which has no persistent mode) with one program per unit.

    PYTHONPATH=. python benchmarks/kernel_parts.py --masks causal,swa_causal_1024 --out DIR

Same inputs and timing as ``kernel_bench.py`` (bf16, Hq = Hkv = 16, D = 128 unless ``--heads`` /
``--head-dim`` say otherwise, B = 32768 / length). TFLOP/s of a part from the matmuls it runs,
2·area·H·D·B each: forward two (S, P·V), dQ three (S, dP, dS·K), dK/dV four (Sᵀ, dPᵀ, Pᵀ·dO,
dSᵀ·Q) — the backward recomputes S and dP in both kernels, so it runs 3.5× the forward's matmuls
where the usual FLOP rule (and ``kernel_bench.py``) counts 2.5×. The delta preprocess has no
TFLOP/s. Writes ``kernel_parts_<stamp>_<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.harness import describe, environment  # noqa: E402
from benchmarks.kernel_bench import bench, make_mask  # noqa: E402
from magi_jax.pallas import plan_for_mask  # noqa: E402
from magi_jax.pallas.common import LOG2E  # noqa: E402
from magi_jax.pallas.ffa_bwd import ffa_dkv, ffa_dq  # noqa: E402
from magi_jax.pallas.ffa_fwd import ffa_forward  # noqa: E402
from magi_jax.pallas.tuning import (  # noqa: E402
    DkvConfig,
    DqConfig,
    FwdConfig,
    default_num_stages,
    default_steps_per_wait,
)
from magi_jax.planning.work_list import (  # noqa: E402
    BAND,
    GENERAL,
    FFAPlanArrays,
    persistent_schedule,
)


def general_kinds(work):
    """``work`` with its band items demoted to general ones (three range checks per cell
    instead of one), to time what the band predicate saves."""
    items = work.items.copy()
    items[:, -1] = np.where(items[:, -1] == BAND, GENERAL, items[:, -1])
    return work._replace(items=items)


def parts(name, total, heads, d, programs, bands=True, stages=None, registers=(232, 40)):
    """Rows of (part, programs, ms, TFLOP/s) for one mask; ``bands=False``: band items
    treated as general; ``stages``, ``registers``: of the backward kernels (DqConfig, DkvConfig;
    ``stages=None``: every kernel's ring and dK/dV's query blocks per wait as
    :func:`magi_jax.pallas.ffa_pallas` picks them by default); ``programs=0``: no
    persistent rows."""
    mask = make_mask(name, total)
    batch = max(1, 32768 // total)
    plan = plan_for_mask(mask, "pallas")
    if not bands:
        plan = FFAPlanArrays(*general_kinds(plan.fwd), *general_kinds(plan.bwd))
    ks = jax.random.split(jax.random.key(0), 5)
    shape = (batch, total, heads, d)
    q, k, v, do = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in ks[:4])
    scale = d**-0.5
    fwd_lists = tuple(jnp.asarray(a) for a in plan.fwd)
    dkv_lists = tuple(jnp.asarray(a) for a in plan.bwd)
    flops = 4.0 * mask.area * heads * d * batch
    rows = []
    for progs in (0, programs) if programs else (0,):

        def sched(work):
            if not progs:
                return ()
            return tuple(jnp.asarray(a) for a in persistent_schedule(work, batch * heads, progs))

        default = default_num_stages(d, bool(progs), bool(progs))
        fcfg = FwdConfig(
            scale=scale,
            persistent=progs,
            # --stages sets the backward's rings; the forward then keeps the configs' default.
            **({"num_stages": default[0]} if stages is None else {}),
        )
        fwd = jax.jit(lambda q, k, v: ffa_forward(q, k, v, *fwd_lists, fcfg, sched(plan.fwd)))
        out, lse = fwd(q, k, v)
        rows.append(
            dict(part="forward", programs=progs, ms=bench(fwd, (q, k, v)) * 1e3, flops=flops)
        )
        lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf)
        prep = jax.jit(
            lambda out, do: jnp.einsum(
                "bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32)
            )
        )
        delta = prep(out, do)
        args = (q, k, v, do, lse2, delta)
        bcfg = DqConfig(
            scale=scale, num_stages=default[1] if stages is None else stages, registers=registers
        )
        if not progs:
            rows.append(dict(part="delta", programs=0, ms=bench(prep, (out, do)) * 1e3, flops=0.0))
            dq = jax.jit(lambda *a: ffa_dq(*a, *fwd_lists, bcfg))
            rows.append(dict(part="dq", programs=0, ms=bench(dq, args) * 1e3, flops=1.5 * flops))
        dkv_stages = default[2] if stages is None else stages
        bcfg = DkvConfig(
            scale=scale,
            registers=registers,
            persistent=progs,
            num_stages=dkv_stages,
            steps_per_wait=default_steps_per_wait(d, dkv_stages, bool(progs))
            if stages is None
            else 1,
        )
        dkv = jax.jit(lambda *a: ffa_dkv(*a, *dkv_lists, bcfg, sched(plan.bwd)))
        rows.append(dict(part="dkv", programs=progs, ms=bench(dkv, args) * 1e3, flops=2.0 * flops))
    for r in rows:
        r.update(
            mask=name,
            length=total,
            heads=heads,
            head_dim=d,
            bands=bands,
            bwd_stages="default" if stages is None else stages,
            bwd_registers=list(registers),
            tflops=r["flops"] / r["ms"] * 1e-9 if r["flops"] else None,
        )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--masks", default="full,causal,doc_causal,swa_causal_1024")
    p.add_argument("--lengths", default="16384")
    p.add_argument(
        "--programs",
        type=int,
        default=None,
        help="persistent programs (default: the GPU's SM count; 0: no persistent rows)",
    )
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--band-ab",
        action="store_true",
        help="also time every part with band items treated as general ones",
    )
    p.add_argument(
        "--bwd-stages",
        default="default",
        help="ring slots of the backward kernels, comma-separated (each a separate "
        "set of rows); 'default': every kernel's default ring",
    )
    p.add_argument(
        "--bwd-registers",
        default="232/40",
        help="consumer/producer registers of the backward kernels, comma-separated "
        "pairs (each a separate set of rows)",
    )
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "kernel"))
    a = p.parse_args(argv)
    dev = jax.devices()[0]
    programs = int(getattr(dev, "core_count", 0) or 132) if a.programs is None else a.programs
    rows = []
    for t in a.lengths.split(","):
        for m in a.masks.split(","):
            for bands in (True, False) if a.band_ab else (True,):
                for stages in (None if x == "default" else int(x) for x in a.bwd_stages.split(",")):
                    for regs in a.bwd_registers.split(","):
                        registers = tuple(int(x) for x in regs.split("/"))
                        rows += parts(
                            m, int(t), a.heads, a.head_dim, programs, bands, stages, registers
                        )
                        print(json.dumps(rows[-1]), flush=True)
    meta = environment(
        argv,
        device=getattr(dev, "device_kind", str(dev)),
        programs=programs,
        core_count=getattr(dev, "core_count", None),
        heads=a.heads,
        head_dim=a.head_dim,
    )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    os.makedirs(a.out, exist_ok=True)
    write(
        os.path.join(a.out, f"kernel_parts_{stamp}_{meta['device'].replace(' ', '_')}"), rows, meta
    )


def write(base, rows, meta):
    """``base.json`` and ``base.md`` of a run."""
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [
        f"# FFA pallas parts {meta['date']} on {meta['device']}",
        "",
        f"{describe(meta)}; persistent programs: {meta['programs']} "
        f"(core_count {meta['core_count']}); bf16, Hq = Hkv = "
        f"{meta.get('heads', 16)}, D = {meta.get('head_dim', 128)}, "
        "B = 32768 / length; TFLOP/s from the matmuls each part runs (forward 2, dQ 3, "
        "dK/dV 4 per tile pair)",
        "",
        "band predicate: no = band items run the general one; bwd stages / registers: "
        "ring slots and consumer/producer registers of dQ and dK/dV (default: each "
        "kernel's default ring and dK/dV blocks per wait)",
        "",
        "| mask | length | part | programs | band predicate | bwd stages | bwd registers "
        "| ms | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tf = f"{r['tflops']:.1f}" if r["tflops"] else "-"
        lines.append(
            f"| {r['mask']} | {r['length']} | {r['part']} | {r['programs']} | "
            f"{'yes' if r['bands'] else 'no'} | {r['bwd_stages']} | "
            f"{'/'.join(map(str, r['bwd_registers']))} | {r['ms']:.3f} | {tf} |"
        )
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
