"""Masks as data on the device: fwd+bwd with a new packing every step against the same
packings compiled one by one, and ``mj.dot_product_attention`` with traced segment ids
against host-planned work lists. Every timed call in the dynamic rows gets the next
packing's plan as an argument of one compiled function.

    python benchmarks/dynamic_device.py --total 32768 --heads 16 --head-dim 128

Rows: ``static`` (each packing a compile-time constant: one compilation per packing),
``dynamic`` (one compilation, the plan an argument: `plan_attention` at a capacity from the
sample), ``segment_ids`` (`dot_product_attention`, the plan built on the device from traced
ids), ``segment_ids_host`` (the same layout, `flex_flash_attention` with host plans). TFLOP/s
from the mean mask area (4·area·H·D per forward, 3.5× for fwd+bwd).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import magi_jax as mj
from benchmarks import harness
from benchmarks.harness import environment, time_interleaved
from magi_jax.mask_zoo import random_doc_lengths


class _Cycle:
    """Calls ``fn_i(*args_i)`` for the next ``i`` at every call: a new packing per step."""

    def __init__(self, calls):
        self.calls, self.i = calls, 0

    def __call__(self):
        fn, args = self.calls[self.i % len(self.calls)]
        self.i += 1
        return fn(*args)


def _fwd_bwd(attn):
    def run(q, k, v, do, *rest):
        out, vjp = jax.vjp(lambda q_, k_, v_: attn(q_, k_, v_, *rest), q, k, v)
        return vjp(do)

    return run


def packings(total: int, count: int, seed: int, num_docs: int = 10):
    """``count`` document-causal packings of ``num_docs`` random lengths (the benchmark
    documents' spread: 1/4 to 4 times the mean)."""
    return [
        mj.AttnMask.varlen(
            np.cumsum([0] + random_doc_lengths(total, num_docs, seed + i)), causal=True
        )
        for i in range(count)
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--packings", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="also time what the segment-id path adds: the device builder alone, "
        "the path without its run-time check, host plans without "
        "persistent schedules",
    )
    ap.add_argument("--out", default=str(harness.RESULTS / "dynamic"))
    args = ap.parse_args(argv)
    t, h, hkv, d = args.total, args.heads, args.kv_heads, args.head_dim
    dtype = jnp.bfloat16
    masks = packings(t, args.packings, args.seed)
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (t, h, d), dtype)
    k = jax.random.normal(ks[1], (t, hkv, d), dtype)
    v = jax.random.normal(ks[2], (t, hkv, d), dtype)
    do = jax.random.normal(ks[3], (t, h, d), dtype)
    area = statistics.mean(m.area for m in masks)
    flops = 3.5 * 4.0 * area * h * d
    rows = []

    # Static: every packing compiled on its own (today's behaviour without a capacity).
    static_fns, compile_s = [], []
    for m in masks:
        fn = jax.jit(_fwd_bwd(lambda q_, k_, v_, m=m: mj.flex_flash_attention(q_, k_, v_, m)[0]))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, k, v, do))
        compile_s.append(time.perf_counter() - t0)
        static_fns.append((fn, (q, k, v, do)))

    # Dynamic: one compilation, the plan an argument.
    cap = mj.PlanCapacity.from_masks(masks)
    t0 = time.perf_counter()
    plans = [mj.plan_attention(m, cap, num_heads=(h, hkv)) for m in masks]
    plan_ms = (time.perf_counter() - t0) / len(masks) * 1e3
    plans = [jax.device_put(p) for p in plans]
    dyn = jax.jit(_fwd_bwd(lambda q_, k_, v_, p: mj.flex_flash_attention(q_, k_, v_, p)[0]))
    t0 = time.perf_counter()
    jax.block_until_ready(dyn(q, k, v, do, plans[0]))
    dyn_compile = time.perf_counter() - t0
    dyn_calls = [(dyn, (q, k, v, do, p)) for p in plans]

    # Segment ids: [1, T] layout, the plan built on the device from traced ids.
    ids = [jnp.asarray(_segment_ids(m, t))[None] for m in masks]
    q4, k4, v4, do4 = (x[None] for x in (q, k, v, do))
    # The same capacity as the host plans (the default bound fits every packing of the
    # length and costs the device builder its sort over that many items).
    seg = jax.jit(
        _fwd_bwd(
            lambda q_, k_, v_, s: mj.dot_product_attention(
                q_, k_, v_, segment_ids=s, is_causal=True, capacity=cap
            )
        )
    )
    jax.block_until_ready(seg(q4, k4, v4, do4, ids[0]))
    seg_calls = [(seg, (q4, k4, v4, do4, s)) for s in ids]
    host_calls = [(dyn, (q, k, v, do, p)) for p in plans]  # same packings, host plans

    entries = [
        (_Cycle(static_fns), ()),
        (_Cycle(dyn_calls), ()),
        (_Cycle(seg_calls), ()),
        (_Cycle(host_calls), ()),
    ]
    names = ["static", "dynamic", "segment_ids", "segment_ids_host"]
    if args.breakdown:
        entries += _breakdown(masks, ids, cap, (q, k, v, do), (q4, k4, v4, do4), (h, hkv))
        names += [
            "seg_builder_only",
            "segment_ids_raising",
            "segment_ids_unchecked",
            "host_not_persistent",
        ]
    times = [t for t, _ in time_interleaved(entries, len(masks), args.reps)]
    for name, sec in zip(names, times):
        rows.append(dict(row=name, ms=sec * 1e3, tflops=flops / sec / 1e12))
    ratio = times[0] / times[1]
    seg_ratio = times[3] / times[2]
    meta = environment(
        argv,
        device=jax.devices()[0].device_kind,
        total=t,
        heads=h,
        kv_heads=hkv,
        head_dim=d,
        dtype="bfloat16",
        packings=len(masks),
        mean_area=area,
        capacity=dict(items=cap.items, persistent=cap.persistent),
        static_compile_s=compile_s,
        dynamic_compile_s=dyn_compile,
        dynamic_compilations=dyn._cache_size(),
        segment_compilations=seg._cache_size(),
        plan_attention_ms=plan_ms,
        dynamic_over_static=ratio,
        segment_ids_over_host=seg_ratio,
    )
    print(json.dumps(meta, indent=1))
    for r in rows:
        print(f"{r['row']:>22}  {r['ms']:8.3f} ms  {r['tflops']:6.1f} TFLOP/s")
    print(
        f"dynamic / static rate {ratio:.3f} (target >= 0.97); segment ids / host-planned "
        f"{seg_ratio:.3f} (target >= 0.9); compilations: dynamic {dyn._cache_size()}, "
        f"segment ids {seg._cache_size()}"
    )
    os.makedirs(args.out, exist_ok=True)
    name = f"dynamic_device_{harness.stamp()}_{meta['device'].replace(' ', '_')}.json"
    path = os.path.join(args.out, name)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("wrote", path)


def _breakdown(masks, ids, cap, inputs3, inputs4, heads):
    """Rows that split the segment-id path's extra time: its device builder alone (both
    lists and the contiguity flag), the path with the raising check (checkify), the
    path without any check, and host plans at the same capacity without persistent
    schedules."""
    import dataclasses

    from jax.experimental import checkify

    from magi_jax.ffa.plan import AttnPlan, PlanStatic
    from magi_jax.ffa.segments import _checked_lists, _work_lists
    from magi_jax.planning.work_list import FFAPlanArrays, backend_blocks

    t = ids[0].shape[1]
    name = "pallas" if jax.default_backend() == "gpu" else "xla"
    fb, bb = backend_blocks(name, t, t)
    per = max(1, fb[0] // bb[0])
    kw = dict(fwd_block=tuple(fb), bwd_block=tuple(bb), fwd_cap=cap.items, bwd_cap=per * cap.items)
    builder = jax.jit(lambda s: _checked_lists(s, t, 0, check_ids=True, **kw))
    # Traced ids are checked through checkify (the step returns the error beside the grads).
    raising = jax.jit(
        checkify.checkify(
            _fwd_bwd(
                lambda q_, k_, v_, s: mj.dot_product_attention(
                    q_, k_, v_, segment_ids=s, is_causal=True, capacity=cap, check_segment_ids=True
                )
            )
        )
    )

    def unchecked(q_, k_, v_, s):
        b = functools.partial(_work_lists, s.reshape(-1), jnp.int32(t), jnp.int32(0), row_len=t)
        *f, _ = b(block_q=fb[0], block_k=fb[1], by="q", capacity_items=cap.items)
        *g, _ = b(block_q=bb[0], block_k=bb[1], by="k", capacity_items=per * cap.items)
        plan = AttnPlan(FFAPlanArrays(*f, *g), (), PlanStatic(cap, name, tuple(fb), tuple(bb)))
        return mj.flex_flash_attention(q_[0], k_[0], v_[0], plan)[0][None]

    unc = jax.jit(_fwd_bwd(unchecked))
    q, k, v, do = inputs3
    q4, k4, v4, do4 = inputs4
    flat = dataclasses.replace(cap, persistent=False)
    plans = [jax.device_put(mj.plan_attention(m, flat, num_heads=heads)) for m in masks]
    dyn = jax.jit(_fwd_bwd(lambda q_, k_, v_, p: mj.flex_flash_attention(q_, k_, v_, p)[0]))
    return [
        (_Cycle([(builder, (s,)) for s in ids]), ()),
        (_Cycle([(raising, (q4, k4, v4, do4, s)) for s in ids]), ()),
        (_Cycle([(unc, (q4, k4, v4, do4, s)) for s in ids]), ()),
        (_Cycle([(dyn, (q, k, v, do, p)) for p in plans]), ()),
    ]


def _segment_ids(mask, total):
    """Segment ids of a document-causal mask: document ``i`` gets id ``i + 1``."""
    ids = np.zeros(total, np.int32)
    sh = mask.shapes
    for i, (a, b) in enumerate(sorted(zip(sh.q0.tolist(), sh.q1.tolist()))):
        ids[a:b] = i + 1
    return ids


if __name__ == "__main__":
    main()
