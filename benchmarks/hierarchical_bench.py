"""Inter-node KV volume of the flat and the two-hop group-cast (host planner, no devices).

For each mask, the dispatch and distributed plan of ``--total`` tokens over ``cp = nodes ×
local`` ranks are built exactly as ``make_flex_key`` builds them (magi dispatch, default
chunk size; overlap degree ``default`` = the cost model's choice, or the integers given);
every remote stage's flat cast table is turned into its two-hop tables
(:func:`magi_jax.planning.hierarchy.build_relay_table`), and the rows whose sender and
receiver sit in different nodes are counted:

- *real rows*: rows that carry KV (no padding). Flat: every (row, receiver) pair across
  nodes. Two-hop: every distinct (row, receiving node) pair, once.
- *wire rows*: what the ``xla`` transport (one ``lax.ppermute`` per slot, each slot as wide
  as its widest block on any rank) puts on inter-node links, padding included.

Bytes are rows × ``2 (K and V) × Hkv × D × itemsize`` (default bf16, Hkv 8, D 128: 4 KiB a
row) per forward cast; a training step with ``backward_refetch`` casts twice and reduces
once in float32 (the same rows each time), so its inter-node bytes are 4× those of one
forward cast in bf16 terms, and the reduction factor is the same.

With ``--capacity-packings N`` (default 4) each mask is also planned as a key at
``PlanCapacity.from_masks`` over ``N`` packings of its generator (``wire_bench.generate``),
as ``make_flex_key(..., capacity=...)`` plans it: every slot as wide as the capacity, moved
in gated pieces (:func:`magi_jax.planning.defaults.cast_pieces`), two-hop tables planned by
runs (:func:`magi_jax.planning.relay_runs.build_relay_runs`). Counted: inter-node wire of
the flat cast as it was (whole slots), gated, and of the gated two-hop cast; the host
time of the whole key (dispatch, plan, two-hop tables) and the MiB of its host arrays (work
lists as runs padded to the capacity, two-hop tables).

Writes ``benchmarks/results/wire/hierarchical_<date>.{json,md}`` (earlier runs, before
gated slots and tables by runs: ``benchmarks/results/collectives/``).

    PYTHONPATH=. python benchmarks/hierarchical_bench.py                 # 1M, 8 x 8
    PYTHONPATH=. python benchmarks/hierarchical_bench.py --total 131072 --nodes 2 --local 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.harness import describe, environment  # noqa: E402
from magi_jax.mask_zoo import MASKS, make_mask  # noqa: E402
from magi_jax.planning import solver as S  # noqa: E402
from magi_jax.planning import stages as D  # noqa: E402
from magi_jax.planning.capacity import PlanCapacity  # noqa: E402
from magi_jax.planning.cast_table import cast_moves  # noqa: E402
from magi_jax.planning.defaults import cast_pieces, default_overlap_degree  # noqa: E402
from magi_jax.planning.hierarchy import (  # noqa: E402
    NodeLayout,
    inter_node_rows,
    inter_node_wire_rows,
)
from magi_jax.planning.relay_runs import build_relay_runs, pad_runs, relay_run_bounds  # noqa: E402
from magi_jax.planning.wire import plan_wire  # noqa: E402
from magi_jax.planning.work_list import default_block_sizes  # noqa: E402

_DEFAULT_MASKS = ("doc-causal", "causal", "sliding-window", "shared-question")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def _relay_ingress(rt) -> np.ndarray:
    """Real rows each rank receives across the node boundary (as a relay)."""
    rt = rt.dense()
    lay, got = rt.layout, np.zeros(rt.cp, np.int64)
    for j, (dn, dl) in enumerate(rt.inter_shifts):
        real = (rt.inter_send[:, j] >= 0).sum(axis=1)
        for s in range(rt.cp):
            got[
                ((s // lay.local + dn) % lay.nodes) * lay.local + (s % lay.local + dl) % lay.local
            ] += real[s]
    return got


def run_case(name: str, total: int, layout: NodeLayout, degree, row_bytes: int) -> dict:
    t0 = time.perf_counter()
    mask = make_mask(name, total, multiple=128)
    meta = S.solve_dispatch(mask, layout.cp, None, "magi")
    deg = default_overlap_degree(mask, meta) if degree == "default" else int(degree)
    bq, bk = default_block_sizes(meta.local_len, meta.local_len)
    plan = D.build_dist_plan(mask, meta, deg, bq, bk)
    t_plan = time.perf_counter() - t0
    flat = hier = flat_wire = hier_wire = intra = moved = 0
    ingress = np.zeros(layout.cp, np.int64)
    flat_ingress = np.zeros(layout.cp, np.int64)
    t_relay = 0.0
    for st in plan.stages:
        if st.cast is None:
            continue
        t0 = time.perf_counter()
        rt = build_relay_runs(st.cast, layout)
        t_relay += time.perf_counter() - t0
        moved += st.cast.tokens_moved()
        flat += inter_node_rows(st.cast, layout)
        hier += rt.inter_node_rows()
        intra += int(rt.intra_rows().sum())
        flat_wire += inter_node_wire_rows(st.cast, layout)
        hier_wire += rt.inter_node_wire_rows()
        ingress += _relay_ingress(rt)
        dst, _, src, _ = cast_moves(st.cast)
        cross = dst // layout.local != src // layout.local
        flat_ingress += np.bincount(dst[cross], minlength=layout.cp)
    gib = lambda rows: rows * row_bytes / 2**30
    return dict(
        mask=name,
        total=total,
        nodes=layout.nodes,
        local=layout.local,
        chunk_size=meta.chunk_size,
        overlap_degree=plan.overlap_degree,
        rows_moved=moved,
        flat_rows=flat,
        two_hop_rows=hier,
        two_hop_intra_rows=intra,
        flat_gib=gib(flat),
        two_hop_gib=gib(hier),
        factor=flat / hier if hier else float("inf"),
        flat_wire_rows=flat_wire,
        two_hop_wire_rows=hier_wire,
        wire_factor=flat_wire / hier_wire if hier_wire else float("inf"),
        relay_ingress_max=int(ingress.max(initial=0)),
        flat_ingress_max=int(flat_ingress.max(initial=0)),
        relay_ingress_mean=float(ingress[ingress > 0].mean()) if ingress.any() else 0.0,
        plan_s=t_plan,
        relay_s=t_relay,
    )


def run_capacity_case(name: str, total: int, layout: NodeLayout, packings: int) -> dict:
    """A key at a capacity (from ``packings`` packings of the generator), packing 0 planned
    at it as make_flex_key plans it; inter-node wire of the flat and the two-hop cast."""
    from wire_bench import generate

    masks = [generate(name, total, s) for s in range(packings)]
    t0 = time.perf_counter()
    cap = PlanCapacity.from_masks(masks, mesh_size=layout.cp)
    t_cap = time.perf_counter() - t0
    mask, pieces = masks[0], cast_pieces(cap)
    t0 = time.perf_counter()
    meta = S.solve_dispatch(mask, layout.cp, cap.chunk_size, "magi")
    bq, bk = default_block_sizes(meta.local_len, meta.local_len)
    t1 = time.perf_counter()
    plan = D.build_dist_plan(mask, meta, cap.overlap_degree, bq, bk, "xla", cap)
    t2 = time.perf_counter()
    relays, table_bytes = [], 0
    for st in plan.stages:
        if st.cast is None:
            continue
        c = st.cast
        rt = build_relay_runs(c, layout, inter_width=c.slot_len, intra_width=c.buffer_len)
        # As the key holds them (sharding/two_hop.relay_stage): padded to the capacity's runs.
        bounds = relay_run_bounds(layout, c.slot_len, c.buffer_len, cap.send_runs, cap.recv_runs)
        for runs, size in zip((rt.inter_runs, rt.intra_runs, rt.recv_runs), bounds):
            table_bytes += pad_runs(runs, size, "two-hop").nbytes
        relays.append(rt)
    t3 = time.perf_counter()
    # The key's host arrays: every stage's work lists (runs, order, offsets) and the two-hop
    # tables (the casts travel as these in place of the flat tables).
    list_bytes = sum(a.nbytes for st in plan.stages for a in st.ffa)
    whole = plan_wire(plan, "ppermute", layout.local)
    gated = plan_wire(plan, "ppermute", layout.local, pieces=pieces)
    two_hop = plan_wire(plan, "ppermute", layout.local, relays, pieces)
    return dict(
        mask=name,
        packings=packings,
        cast_width=cap.cast_width,
        overlap_degree=cap.overlap_degree,
        pieces=pieces,
        flat_real_inter=int(whole.real_inter.sum()),
        two_hop_real_inter=int(two_hop.real_inter.sum()),
        flat_wire_inter=int(whole.wire_inter.sum()),
        flat_gated_wire_inter=int(gated.wire_inter.sum()),
        two_hop_gated_wire_inter=int(two_hop.wire_inter.sum()),
        two_hop_gated_wire_intra=int(two_hop.wire_intra.sum()),
        reduction=whole.wire_inter.sum() / max(int(two_hop.wire_inter.sum()), 1),
        capacity_s=t_cap,
        solve_s=t1 - t0,
        plan_s=t2 - t1,
        relay_s=t3 - t2,
        key_s=t3 - t0,
        lists_mib=list_bytes / 2**20,
        tables_mib=table_bytes / 2**20,
        host_k_runs=cap.runs(host=True)[1],
        k_runs=cap.k_runs,
    )


def capacity_markdown(rows: list[dict], meta: dict) -> str:
    rb = meta["row_bytes"] / 2**30
    out = [
        "",
        f"## Keys at a capacity ({meta['total']:,} tokens, {meta['nodes']} × {meta['local']})",
        "",
        "`PlanCapacity.from_masks` over the generator's packings (default headroom), "
        "packing 0 planned at it. Inter-node GiB per forward cast: the flat cast with "
        "whole slots (before gated pieces), gated, and the gated two-hop cast (tables "
        "planned by runs). *Key s*: dispatch + distributed plan + two-hop tables, host. "
        "*Key MiB*: the key's host arrays, work lists (all stages, as runs padded to the "
        "capacity) / two-hop tables; *k runs*: the capacity's bound on a k-tile list's runs, "
        "host stage / remote stages.",
        "",
        "| mask | packings | real flat / two-hop GiB | flat wire (whole) | flat wire (gated) "
        "| two-hop wire (gated) | reduction vs whole flat | two-hop intra GiB | solve / plan "
        "/ two-hop s | key s | key MiB | k runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['mask']} | {r['packings']} | {r['flat_real_inter'] * rb:.2f} / "
            f"{r['two_hop_real_inter'] * rb:.2f} | {r['flat_wire_inter'] * rb:.2f} | "
            f"{r['flat_gated_wire_inter'] * rb:.2f} | {r['two_hop_gated_wire_inter'] * rb:.2f} "
            f"| **{r['reduction']:.2f}×** | {r['two_hop_gated_wire_intra'] * rb:.2f} | "
            f"{r['solve_s']:.2f} / {r['plan_s']:.2f} / {r['relay_s']:.2f} | "
            f"**{r['key_s']:.2f}** | {r['lists_mib']:.1f} / {r['tables_mib']:.1f} | "
            f"{r['host_k_runs']:,} / {r['k_runs']:,} |"
        )
    return "\n".join(out) + "\n"


def to_markdown(rows: list[dict], meta: dict) -> str:
    lay = f"{meta['nodes']} nodes × {meta['local']} ranks"
    out = [
        f"# Inter-node KV volume: flat vs two-hop group-cast ({meta['total']:,} tokens, {lay})",
        "",
        f"{describe(meta)}; host planner only, no devices. `{meta['command']}`",
        "",
        f"One row = K and V of one token: 2 × Hkv {meta['hkv']} × D {meta['d']} × "
        f"{meta['dtype']} = {meta['row_bytes']:,} B. GiB per forward cast, summed over "
        "the remote stages; a training step moves the same rows again in the backward "
        "(re-fetch cast in bf16, reduce in float32): 4× these bytes, same factor. "
        "*Real*: rows carrying KV; *wire*: what the `xla` transport "
        "(one `ppermute` per slot at the slot's widest block) sends between nodes, "
        "padding included. *In max*: the most real rows one rank receives across the "
        "node boundary (flat; two-hop, as a relay), and the two-hop mean over the ranks "
        "that receive any: a relay is always a rank that needs the row, so the spread "
        "follows the ranks' own demand.",
        "",
        "| mask | degree | KV rows cast | flat inter-node GiB | two-hop GiB | reduction "
        "(real) | flat wire GiB | two-hop wire GiB | reduction (wire) | in max flat / "
        "two-hop (mean) rows | two-hop intra-node rows | plan s | two-hop tables s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rb = meta["row_bytes"] / 2**30
    for r in rows:
        out.append(
            f"| {r['mask']} | {r['overlap_degree']} | {r['rows_moved']:,} | "
            f"{r['flat_gib']:.2f} | {r['two_hop_gib']:.2f} | **{r['factor']:.2f}×** | "
            f"{r['flat_wire_rows'] * rb:.2f} | {r['two_hop_wire_rows'] * rb:.2f} | "
            f"{r['wire_factor']:.2f}× | {r['flat_ingress_max']:,} / "
            f"{r['relay_ingress_max']:,} ({r['relay_ingress_mean']:,.0f}) | "
            f"{r['two_hop_intra_rows']:,} | "
            f"{r['plan_s']:.1f} | {r['relay_s']:.1f} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--total", type=int, default=1 << 20)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--local", type=int, default=8, help="ranks (GPUs) per node")
    p.add_argument("--masks", nargs="+", default=list(_DEFAULT_MASKS), choices=MASKS)
    p.add_argument(
        "--degrees",
        nargs="+",
        default=["default", "1"],
        help="overlap degrees: 'default' (the cost model's) and/or integers",
    )
    p.add_argument(
        "--capacity-packings",
        type=int,
        default=4,
        help="packings of each mask's generator for its key at a capacity (0: none)",
    )
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_ITEMSIZE))
    p.add_argument("--out", default="benchmarks/results/wire")
    args = p.parse_args(argv)
    layout = NodeLayout(args.nodes, args.local)
    row_bytes = 2 * args.hkv * args.d * _ITEMSIZE[args.dtype]
    work = [(m, d) for m in args.masks for d in args.degrees]
    try:
        from tqdm import tqdm

        work = tqdm(work, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        pass
    rows = []
    for name, degree in work:
        rows.append(run_case(name, args.total, layout, degree, row_bytes))
        if hasattr(work, "set_postfix_str"):
            work.set_postfix_str(f"{name} {rows[-1]['factor']:.2f}x")
    cap_rows = []
    if args.capacity_packings > 0:
        for name in args.masks:
            cap_rows.append(run_capacity_case(name, args.total, layout, args.capacity_packings))
            print(f"capacity {name}: {cap_rows[-1]['key_s']:.2f} s", file=sys.stderr)
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = environment(
        argv,
        total=args.total,
        nodes=args.nodes,
        local=args.local,
        hkv=args.hkv,
        d=args.d,
        dtype=args.dtype,
        row_bytes=row_bytes,
        command="python benchmarks/hierarchical_bench.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"hierarchical_{now.strftime('%Y%m%d_%H%M')}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows, capacity_rows=cap_rows), f, indent=1)
    md = to_markdown(rows, meta) + (capacity_markdown(cap_rows, meta) if cap_rows else "")
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {stem}.json and {stem}.md", file=sys.stderr)


if __name__ == "__main__":
    main()
