"""A/B of the forward kernel's key block (the plan's forward block_k) and register split at
one head config, against cuDNN in the same rounds.

    PYTHONPATH=. python benchmarks/fwd_block_ab.py --d 64 --heads 32 --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from kernel_bench import bench_interleaved, case_inputs, make_mask, versions  # noqa: E402

from magi_jax.pallas.ffa_fwd import FwdConfig, ffa_forward  # noqa: E402
from magi_jax.planning.work_list import build_plan_arrays  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--total", type=int, default=16384)
    p.add_argument("--masks", default="full,causal")
    p.add_argument("--variants", default="128:232:40,256:232:40,256:240:24")
    p.add_argument("--out", default=".")
    a = p.parse_args()
    batch = max(1, 32768 // a.total)
    rows = []
    for name in a.masks.split(","):
        mask = make_mask(name, a.total)
        q, k, v, _ = case_inputs(a.total, batch, a.heads, a.heads, a.d, jnp.bfloat16)
        flops = 4.0 * mask.area * a.heads * a.d * batch
        entries = []
        for var in a.variants.split(","):
            bk, r0, r1 = (int(x) for x in var.split(":"))
            plan = build_plan_arrays(mask.shapes, a.total, a.total, (128, bk), (128, 128))
            lists = tuple(jnp.asarray(x) for x in plan.fwd)
            cfg = FwdConfig(scale=a.d ** -0.5, block_k=bk, registers=(r0, r1))
            fn = jax.jit(lambda q, k, v, cfg=cfg, lists=lists: ffa_forward(q, k, v, *lists, cfg)[0])
            entries.append((f"ffa bk={bk} regs={r0}/{r1}", fn))
        causal = name == "causal"
        entries.append(("cudnn", jax.jit(functools.partial(
            jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn"))))
        ok = []
        for label, fn in entries:
            try:
                jax.block_until_ready(fn(q, k, v))
                ok.append((label, fn))
            except Exception as e:   # record and go on
                rows.append(dict(mask=name, variant=label, error=repr(e)[:400]))
        times = bench_interleaved([(fn, (q, k, v)) for _, fn in ok])
        for (label, _), t in zip(ok, times):
            rows.append(dict(mask=name, total=a.total, d=a.d, heads=a.heads, variant=label,
                             ms=t * 1e3, tflops=flops / t / 1e12))
            print(rows[-1], flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    dev = jax.devices()[0].device_kind.replace(" ", "_")
    with open(os.path.join(a.out, f"fwd_block_ab_{stamp}_{dev}.json"), "w") as f:
        json.dump(dict(meta=dict(versions(), device=dev, date=stamp), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
