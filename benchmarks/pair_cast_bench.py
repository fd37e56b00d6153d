"""Slot gating against pair gating of the ``ppermute`` casts on this machine's CPU (8 host
devices): the compile time and the step time of one key's forward + backward at cp 8, the
collectives and conditionals in its HLO, and the wire the key counts.

Two keys of the same document-causal packing (``--packings`` packings size the capacity):

- *at a capacity*: ``cast_gating="slot"`` (the default: one conditional per slot, moving the
  pieces the slot's fullest rank fills) against ``cast_gating="pair"`` (each sender-receiver
  pair moves its own pieces: ``cp · (cp − 1)`` pairs, a conditional per binary digit of the
  piece count);
- *one mask*: ``cast_gating="slot"`` (whole slots, the transport before pairs) against the
  default (each pair's exact rows, a few ``ppermute`` levels a slot, no conditional).

A CPU times XLA:CPU's compiler and its host-device collectives, not a GPU's; the figures say
what the conditionals cost to compile and what they cost where collectives are cheap.

Writes ``benchmarks/results/wire/pair_cast_<date>.{json,md}``.

    PYTHONPATH=. python benchmarks/pair_cast_bench.py                 # 4k tokens, 3 steps
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import datetime
import json
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import magi_jax as mj  # noqa: E402
from benchmarks.harness import describe, environment  # noqa: E402
from magi_jax.mask_zoo import random_doc_lengths  # noqa: E402
from magi_jax.sharding.key_wire import key_wire  # noqa: E402


def _step(q, k, v, key):
    def loss(q, k, v):
        o, _ = mj.magi_attention(*(mj.dispatch(x, key) for x in (q, k, v)), key)
        return (mj.undispatch(o, key) ** 2).sum()

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def measure(key, q, k, v, steps: int) -> dict:
    """Compile seconds (trace, lower, compile), median step seconds, HLO counts, wire."""
    fn = jax.jit(_step)
    t0 = time.perf_counter()
    compiled = fn.trace(q, k, v, key).lower().compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    jax.block_until_ready(compiled(q, k, v, key))  # warm
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, key))
        times.append(time.perf_counter() - t0)
    w = key_wire(key)
    return dict(
        compile_s=round(compile_s, 2),
        step_s=round(statistics.median(times), 4),
        step_all_s=[round(t, 4) for t in times],
        collective_permutes=len(re.findall(r"\scollective-permute(?:-start)?\(", hlo)),
        conditionals=len(re.findall(r"\sconditional\(", hlo)),
        all_gathers=len(re.findall(r"\sall-gather(?:-start)?\(", hlo)),
        wire_per_rank=round(w.per_rank_ratio(), 3),
        wire_total=round(w.total_ratio(), 3),
        stages=sum(s.cast is not None for s in key.stages),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", type=int, default=4096)
    ap.add_argument("--docs", type=int, default=10)
    ap.add_argument("--packings", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--heads", default="4,2,64", help="query heads, KV heads, head dim")
    ap.add_argument("--out", default="benchmarks/results/wire")
    args = ap.parse_args(argv)
    cp = 8
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    mesh = jax.make_mesh(
        (cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,)
    )
    masks = [
        mj.AttnMask.varlen(np.cumsum([0] + random_doc_lengths(args.total, args.docs, s)))
        for s in range(args.packings)
    ]
    cap = mj.PlanCapacity.from_masks(masks, mesh_size=cp)
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal((args.total, h, d)), jnp.float32) for h in (hq, hkv, hkv)
    )
    rows = []
    for kind, opts in (
        ("capacity", dict(capacity=cap)),
        ("one mask", {}),
    ):
        for gating in ("slot", "pair" if kind == "capacity" else "auto"):
            key = mj.make_flex_key(
                masks[0], mesh, "cp", ffa_backend="xla", comm_backend="xla",
                cast_gating=gating, **opts,
            )  # fmt: skip
            got = measure(key, q, k, v, args.steps)
            rows.append(dict(key=kind, cast_gating=gating, **got))
            print(rows[-1], file=sys.stderr, flush=True)
    env = environment(argv, devices=f"{len(jax.devices())} {jax.default_backend()} devices")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"pair_cast_{stamp}")
    with open(base + ".json", "w") as fh:
        out = dict(env=env, args=vars(args), cast_width=cap.cast_width, rows=rows)
        json.dump(out, fh, indent=1)
    lines = [
        "| key | cast_gating | compile s | step s (median) | collective-permutes | "
        "conditionals | all-gathers | wire per rank / total | remote stages |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['key']} | {r['cast_gating']} | {r['compile_s']:.2f} | {r['step_s']:.4f} | "
            f"{r['collective_permutes']} | {r['conditionals']} | {r['all_gathers']} | "
            f"{r['wire_per_rank']:.2f}× / {r['wire_total']:.2f}× | {r['stages']} |"
        )
    md = (
        f"# Slot against pair gating, {args.total:,} tokens, cp {cp} on CPU host devices\n\n"
        f"{describe(env)}; {env['devices']}. Document-causal ({args.docs} random "
        "documents, packing 0); "
        f"capacity from {args.packings} packings (cast width {cap.cast_width}); q/k/v "
        f"float32 [{args.total}, {hq}/{hkv}, {d}]; one forward + backward of the sum of "
        f"squares, {args.steps} timed steps after a warm one.\n\n" + "\n".join(lines) + "\n"
    )
    with open(base + ".md", "w") as fh:
        fh.write(md)
    print(md)
    print(f"wrote {base}.json, {base}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
