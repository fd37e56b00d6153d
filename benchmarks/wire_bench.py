"""Rows on the wire against the rows the plan needs (host planner, no devices).

For each mask generator, at ``--total`` tokens over ``--cp`` ranks on one node, counted by
:mod:`magi_jax.planning.wire` per forward cast of every remote stage (the backward moves the
same rows again):

- *one-mask key*: ``make_flex_key(mask, ...)`` without a capacity (default chunk and overlap
  degree; the ``xla`` transport ``choose_transport`` picks per stage), on packing 0: its
  slots whole (``cast_gating="slot"``, the transport before pairs) and pair by pair (each
  pair's rows in at most :data:`~magi_jax.planning.defaults.PAIR_CAST_LEVELS` levels a
  slot: what such a key now moves);
- *key at a capacity*: ``PlanCapacity.from_masks`` over ``--packings`` packings of the same
  generator (default headroom), every packing planned at it; the worst packing is reported.
  Columns: the slots moved whole (the transport before gated pieces), with the gated
  pieces keys at a capacity use by default (:func:`magi_jax.planning.defaults.cast_pieces`),
  and with gated pieces per pair (``cast_gating="pair"``), the worst packing and packing 0;
- ``native``: the FFI transport, which sends real rows only (1.00x by construction).

*per rank*: the busiest rank's wire over the busiest rank's real rows (the bottleneck of a
collective); *total*: wire over real summed over ranks. Ring attention sends
``(cp - 1) · local_len`` rows per rank.

Writes ``benchmarks/results/wire/wire_<date>.{json,md}``.

    PYTHONPATH=. python benchmarks/wire_bench.py                  # 128k, cp 8, 16 packings
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks import harness
from benchmarks.harness import describe, environment
from magi_jax.mask import AttnMask
from magi_jax.mask_zoo import make_mask, random_doc_lengths
from magi_jax.planning.capacity import PlanCapacity
from magi_jax.planning.defaults import PAIR_CAST_LEVELS, cast_pieces, default_overlap_degree
from magi_jax.planning.solver import solve_dispatch
from magi_jax.planning.stages import build_dist_plan
from magi_jax.planning.wire import plan_wire, ring_rows
from magi_jax.planning.work_list import default_block_sizes

GENERATORS = ("doc-causal", "sliding-window", "many-docs", "shared-question", "causal")


def generate(name: str, total: int, seed: int) -> AttnMask:
    """Packing ``seed`` of a generator: random document lengths where the mask has documents
    (10 for doc-causal and shared-question, 128 short ones for many-docs); sliding-window
    and causal are the same mask every time."""
    if name == "many-docs":
        return make_mask(name, total, num_docs=128, seed=seed)
    if name == "doc-causal":
        lens = random_doc_lengths(total, 10, seed)
        return AttnMask.varlen(np.cumsum([0] + lens), causal=True)
    if name == "shared-question":
        return AttnMask.shared_question(random_doc_lengths(total, 10, seed))
    return make_mask(name, total)


def _plan(mask, cp, capacity=None):
    chunk = None if capacity is None else capacity.chunk_size
    meta = solve_dispatch(mask, cp, chunk, "magi")
    bq, bk = default_block_sizes(meta.local_len, meta.local_len)
    degree = default_overlap_degree(mask, meta) if capacity is None else capacity.overlap_degree
    return build_dist_plan(mask, meta, degree, bq, bk, "xla", capacity), meta


def _ratios(w) -> dict:
    return dict(
        per_rank=round(w.per_rank_ratio(), 3),
        total=round(w.total_ratio(), 3),
        real_max=int(w.real.max(initial=0)),
        wire_max=int(w.wire.max(initial=0)),
        real_total=int(w.real.sum()),
        wire_total=int(w.wire.sum()),
        transports=list(w.transports),
    )


def run_generator(name: str, total: int, cp: int, packings: int) -> dict:
    t0 = time.perf_counter()
    masks = [generate(name, total, s) for s in range(packings)]
    plan, meta = _plan(masks[0], cp)
    one = plan_wire(plan, "auto")
    one_pairs = plan_wire(plan, "auto", gating="pair")
    cap = PlanCapacity.from_masks(masks, mesh_size=cp)
    pieces, pair_pieces = cast_pieces(cap), cast_pieces(cap, "pair")
    whole, gated, pairs = [], [], []
    for mask in masks:
        p, _ = _plan(mask, cp, cap)
        whole.append(plan_wire(p, "auto"))
        gated.append(plan_wire(p, "auto", pieces=pieces))
        pairs.append(plan_wire(p, "auto", pieces=pair_pieces, gating="pair"))
    worst = lambda ws: max(ws, key=lambda w: w.per_rank_ratio())
    return dict(
        mask=name,
        ring_per_rank=ring_rows(cp, meta.local_len),
        one_mask=_ratios(one),
        one_mask_pairs=dict(_ratios(one_pairs), levels=PAIR_CAST_LEVELS),
        capacity=dict(
            cast_width=cap.cast_width,
            overlap_degree=cap.overlap_degree,
            chunk_size=cap.chunk_size,
            pieces=pieces,
            whole=_ratios(worst(whole)),
            gated=_ratios(worst(gated)),
            gated_worst_total=round(max(w.total_ratio() for w in gated), 3),
            # Packing 0: what `python -m magi_jax.cli --mask NAME --capacity-packings N`
            # prints (with --docs as generate() sets them).
            gated_packing0=_ratios(gated[0]),
            pair_pieces=pair_pieces,
            pairs=_ratios(worst(pairs)),
            pairs_worst_total=round(max(w.total_ratio() for w in pairs), 3),
            pairs_packing0=_ratios(pairs[0]),
        ),
        seconds=round(time.perf_counter() - t0, 2),
    )


def table(rows) -> str:
    out = [
        "| mask | one-mask key, slots whole | one-mask key, pairs | at a capacity, slots whole "
        "| at a capacity, gated slots | gated slots, packing 0 | at a capacity, gated pairs "
        "| gated pairs, packing 0 | native | ring (rows/rank) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["capacity"]
        f = lambda x: f"{x['per_rank']:.2f}× / {x['total']:.2f}×"
        out.append(
            f"| {r['mask']} | {f(r['one_mask'])} | {f(r['one_mask_pairs'])} "
            f"(≤ {r['one_mask_pairs']['levels']} levels) | {f(c['whole'])} | {f(c['gated'])} "
            f"(×{c['pieces']}) | {f(c['gated_packing0'])} | {f(c['pairs'])} "
            f"(×{c['pair_pieces']}; worst total {c['pairs_worst_total']:.2f}×) | "
            f"{f(c['pairs_packing0'])} | 1.00× / 1.00× | {r['ring_per_rank']:,} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", type=int, default=128 * 1024)
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--packings", type=int, default=16)
    ap.add_argument("--masks", default=",".join(GENERATORS))
    ap.add_argument("--out", default="benchmarks/results/wire")
    args = ap.parse_args(argv)
    rows = []
    names = [m for m in args.masks.split(",") if m]
    for i, name in enumerate(names):
        rows.append(run_generator(name, args.total, args.cp, args.packings))
        print(f"[{i + 1}/{len(names)}] {name}: {rows[-1]['seconds']} s", file=sys.stderr)
    meta = environment(argv, total=args.total, cp=args.cp, packings=args.packings)
    md = lambda rows, m: (
        f"# Wire rows against real rows, {m['total']:,} tokens, cp {m['cp']} (one node)\n\n"
        f"{describe(m)}; host planner only. Per forward cast, all "
        f"remote stages; busiest rank's wire / busiest rank's real rows, then total wire / "
        f"total real. Capacity: `PlanCapacity.from_masks` over {m['packings']} packings "
        "(default headroom), the worst packing (by per rank) shown.\n\n" + table(rows) + "\n"
    )
    record = harness.Run("wire", args.out, meta, md)
    record.add(*rows)
    print(md(rows, meta))
    print(f"wrote {record.base}.json and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
