"""Command-line planner: how a mask would be spread over ``cp`` ranks, without any devices.

    python -m magi_jax.cli --mask doc-causal --seqlen 1M --cp 64 --out plan.png
    python -m magi_jax.cli --cu-seqlens 0,3000,8192 --cp 4     # your own packed documents
    python -m magi_jax.cli --slices mask.npz --cp 8            # any mask (AttnMask.save)

Prints the dispatch (chunks per rank), the balance of attention work (max/mean mask cells per
rank, next to the contiguous / zigzag / striped baselines), the remote-KV volume (next to what
ring attention moves), the rows each transport puts on the wire, padding included (per rank
and in total, inside and between nodes), the overlap stages and the planning time; writes
the picture of :func:`magi_jax.plot.plot_plan` (and, with ``--mask-out``, of the mask). The
plan is the one :func:`magi_jax.make_flex_key` builds on a real mesh with the same options.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from magi_jax.masks import MASKS, AttnMask, make_mask  # the zoo of --mask (re-exported)
from magi_jax.planning.cost_model import default_overlap_degree
from magi_jax.planning.solver import ALGORITHMS, remote_kv_tokens, solve_dispatch
from magi_jax.planning.stages import build_dist_plan
from magi_jax.planning.wire import plan_wire, ring_rows
from magi_jax.planning.work_list import default_block_sizes

__all__ = ["MASKS", "make_mask", "parse_tokens", "parse_cu_seqlens", "main"]


def parse_tokens(text: str) -> int:
    """``"1M"`` -> 1048576, ``"128k"`` -> 131072, ``"5000"`` -> 5000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 4096, 128k, 1M)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def parse_cu_seqlens(text: str) -> list[int]:
    """``"0,1000,4096"`` -> ``[0, 1000, 4096]`` (token counts may use k / M)."""
    try:
        return [parse_tokens(t) for t in str(text).split(",") if t.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"--cu-seqlens {text!r} is not a comma-separated list of cumulative lengths "
            "(e.g. 0,1000,4096)"
        ) from None


def _fmt(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.4g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m magi_jax.cli", description=__doc__.split("\n\n")[0]
    )
    which = ap.add_mutually_exclusive_group()
    which.add_argument(
        "--mask",
        default="doc-causal",
        choices=MASKS,
        help="a mask of the built-in zoo (default doc-causal)",
    )
    which.add_argument(
        "--cu-seqlens",
        type=parse_cu_seqlens,
        default=None,
        help="your packed documents, cumulative lengths 0,n0,n0+n1,... "
        "(AttnMask.varlen; --seqlen, --docs do not apply)",
    )
    which.add_argument(
        "--slices",
        default=None,
        metavar="NPZ",
        help="any mask, from a .npz of q_ranges / k_ranges / types (AttnMask.save writes one)",
    )
    ap.add_argument(
        "--bidirectional",
        action="store_true",
        help="with --cu-seqlens: documents attend both ways (default causal)",
    )
    ap.add_argument(
        "--seqlen",
        type=parse_tokens,
        default="128k",
        help="packed tokens, e.g. 32768, 128k, 1M (default 128k)",
    )
    ap.add_argument("--cp", type=int, default=8, help="context-parallel ranks (default 8)")
    ap.add_argument(
        "--window",
        type=parse_tokens,
        default="4k",
        help="window / block size of the windowed masks (default 4k)",
    )
    ap.add_argument(
        "--docs",
        type=int,
        default=None,
        help="number of random-length documents (default: the benchmark's 10, "
        "mask_zoo.DOC_LENGTHS)",
    )
    ap.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="dispatch chunk in tokens (default: the solver's choice)",
    )
    ap.add_argument(
        "--overlap-degree",
        type=int,
        default=None,
        help="remote stages (default: the cost model's choice, as in make_flex_key)",
    )
    ap.add_argument(
        "--local",
        type=int,
        default=None,
        help="ranks per node (default: all --cp ranks on one node); the wire is then "
        "split into rows inside nodes and between nodes, and the two-hop cast is counted",
    )
    ap.add_argument(
        "--capacity-packings",
        type=int,
        default=0,
        metavar="N",
        help="also count the wire of a key at PlanCapacity.from_masks over N packings of "
        "--mask (seeds --seed, --seed + 1, ...; the mask itself for --cu-seqlens/--slices), "
        "its slots in gated pieces as make_flex_key makes them",
    )
    ap.add_argument("--algorithm", default="magi", choices=ALGORITHMS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="plan.png", help="picture of the plan (PNG); '' for none")
    ap.add_argument("--mask-out", default="", help="also draw the mask to this PNG")
    args = ap.parse_args(argv)
    if args.cp < 1:
        ap.error(f"--cp {args.cp} must be >= 1")
    if args.local is not None and (args.local < 1 or args.cp % args.local):
        ap.error(f"--local {args.local} must divide --cp {args.cp} (ranks per node)")

    if args.bidirectional and args.cu_seqlens is None:
        ap.error("--bidirectional applies to --cu-seqlens only")
    t0 = time.perf_counter()
    try:
        if args.cu_seqlens is not None:
            name = f"{len(args.cu_seqlens) - 1} documents (--cu-seqlens)"
            mask = AttnMask.varlen(args.cu_seqlens, causal=not args.bidirectional)
        elif args.slices is not None:
            name = args.slices
            mask = AttnMask.load(args.slices)
        else:
            name = args.mask
            mask = make_mask(
                args.mask, args.seqlen, window=args.window, num_docs=args.docs, seed=args.seed
            )
    except (ValueError, OSError) as e:
        ap.error(str(e))
    if mask.total_q != mask.total_k:
        ap.error(
            f"{name}: total_q={mask.total_q} != total_k={mask.total_k}; the planner "
            "spreads self-attention masks (total_q == total_k)"
        )
    if mask.total_q == 0:
        ap.error(f"{name}: the mask has no tokens")
    t_mask = time.perf_counter() - t0
    print(
        f"mask      {name}: {mask.num_slices} slices over {mask.total_q:,} tokens, "
        f"area {_fmt(mask.area)} cells ({100 * mask.area / mask.total_q**2:.2f}% of dense)"
        f"  [{t_mask:.2f} s]"
    )

    t0 = time.perf_counter()
    meta = solve_dispatch(mask, args.cp, args.chunk_size, args.algorithm)
    t_solve = time.perf_counter() - t0
    bq, bk = default_block_sizes(meta.local_len, meta.local_len)
    t0 = time.perf_counter()
    degree = (
        default_overlap_degree(mask, meta) if args.overlap_degree is None else args.overlap_degree
    )
    t_degree = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = build_dist_plan(mask, meta, degree, bq, bk)
    t_plan = time.perf_counter() - t0

    pad = meta.padded_total - meta.total
    print(
        f"dispatch  '{meta.algorithm}': {meta.num_chunks} chunks of {meta.chunk_size:,} tokens,"
        f" {meta.chunks_per_rank} per rank = {meta.local_len:,} tokens per rank"
        + (f" ({pad:,} padding tokens)" if pad else "")
    )
    ring = (args.cp - 1) * meta.local_len
    print("balance   work per rank (mask cells), max/mean; remote KV tokens per rank, max:")
    rows = [(meta.algorithm, meta.imbalance(), int(plan.remote_tokens.max()))]
    for alg in ("contiguous", "zigzag", "striped"):
        if alg == meta.algorithm:
            continue
        try:
            other = solve_dispatch(mask, args.cp, meta.chunk_size, alg)
        except ValueError:
            continue
        rows.append((alg, other.imbalance(), int(remote_kv_tokens(mask, other).max())))
    for alg, imb, rem in rows:
        print(
            f"          {alg:<11} max/mean {imb:7.4f}   remote KV {_fmt(rem):>7} "
            f"({100 * rem / max(ring, 1):5.1f}% of ring attention's {_fmt(ring)})"
        )
    rem = plan.remote_tokens
    print(
        f"remote KV per rank: max {_fmt(int(rem.max()))}, mean {_fmt(float(rem.mean()))}; "
        f"total {_fmt(int(rem.sum()))} tokens over the network"
    )
    _print_wire(plan, args.local, ring_rows(args.cp, meta.local_len))
    if args.capacity_packings > 0:
        _print_capacity_wire(mask, args, name)
    print(
        f"stages    overlap degree {plan.overlap_degree}: {len(plan.stages)} FFA call(s) per "
        f"rank (tiles {bq}x{bk})"
    )
    for i, st in enumerate(plan.stages):
        kind = (
            "host (local KV)"
            if st.cast is None
            else "local + all remote KV"
            if len(plan.stages) == 1
            else f"remote {i - 1}"
        )
        moved = "" if st.cast is None else f", {_fmt(st.cast.tokens_moved())} KV tokens cast"
        print(
            f"          stage {i}: {kind:<22} max area {_fmt(int(st.area.max()))} cells, "
            f"KV length {st.kv_len:,}{moved}"
        )
    print(
        f"time      solve {t_solve:.2f} s, overlap-degree model {t_degree:.2f} s, "
        f"distributed plan {t_plan:.2f} s (total {t_solve + t_degree + t_plan:.2f} s)"
    )

    if args.out or args.mask_out:
        from magi_jax.plot import plot_mask, plot_plan

        if args.out:
            plot_plan(
                plan,
                args.out,
                mask=mask,
                title=f"{name}, {mask.total_q:,} tokens over cp = {args.cp}",
            )
            print(f"wrote     {args.out}")
        if args.mask_out:
            plot_mask(mask, args.mask_out)
            print(f"wrote     {args.mask_out}")
    return 0


def _print_capacity_wire(mask, args, name):
    """The wire of ``mask`` planned at a capacity from ``--capacity-packings`` packings."""
    from magi_jax.planning.capacity import PlanCapacity
    from magi_jax.planning.cost_model import cast_pieces

    if args.cu_seqlens is None and args.slices is None:
        masks = [
            make_mask(
                args.mask, args.seqlen, window=args.window, num_docs=args.docs, seed=args.seed + i
            )
            for i in range(args.capacity_packings)
        ]
    else:
        masks = [mask]
    t0 = time.perf_counter()
    cap = PlanCapacity.from_masks(masks, mesh_size=args.cp)
    meta = solve_dispatch(mask, args.cp, cap.chunk_size, args.algorithm)
    bq, bk = default_block_sizes(meta.local_len, meta.local_len)
    plan = build_dist_plan(mask, meta, cap.overlap_degree, bq, bk, "xla", cap)
    host_runs = (
        ""
        if cap.host_q_runs is None and cap.host_k_runs is None
        else f"host stage {_fmt(cap.host_q_runs)} / {_fmt(cap.host_k_runs)}, "
    )
    print(
        f"capacity  from_masks over {len(masks)} packing(s) of {name}: cast_width "
        f"{_fmt(cap.cast_width)}, overlap degree {cap.overlap_degree}, slots in "
        f"{cast_pieces(cap)} gated pieces (cast_gating='pair': {cast_pieces(cap, 'pair')} "
        f"per pair); runs per q / k list: {host_runs}stages on "
        f"fetched KV {_fmt(cap.q_runs)} / {_fmt(cap.k_runs)}  [{time.perf_counter() - t0:.2f} s]"
    )
    _print_wire(
        plan,
        args.local,
        ring_rows(args.cp, meta.local_len),
        cast_pieces(cap),
        cast_pieces(cap, "pair"),
    )


def _print_wire(plan, local, ring: int, pieces: int = 1, pair_pieces: int = 1):
    """The wire counts of ``plan``'s casts (:mod:`magi_jax.planning.wire`), per transport:
    ``ppermute`` gated by slot (``pieces``: gated pieces, a key at a capacity; 1: whole
    slots) and by pair (``pair_pieces``: gated pieces per pair at a capacity, with
    ``cast_gating="pair"``; 1: each pair's rows in a few levels, a key of one mask's
    default)."""
    # The key's default (cast_gating="auto"): pairs for one mask, gated slots at a capacity.
    mark = ("", " *") if pieces == 1 else (" *", "")
    counts = [
        ("ppermute, slots" + mark[0], plan_wire(plan, "ppermute", local, pieces=pieces)),
        (
            "ppermute, pairs" + mark[1],
            plan_wire(plan, "ppermute", local, pieces=pair_pieces, gating="pair"),
        ),
    ] + [(name, plan_wire(plan, name, local, pieces=pieces)) for name in ("all_to_all", "native")]
    if local is not None and local < plan.cp and plan.cp // local > 1:
        from magi_jax.planning.relay_runs import build_relay_runs
        from magi_jax.planning.relay_table import NodeLayout

        layout = NodeLayout(plan.cp // local, local)
        widths = (
            (lambda c: {})
            if pieces == 1
            else (lambda c: dict(inter_width=c.slot_len, intra_width=c.buffer_len))
        )
        relays = [
            build_relay_runs(st.cast, layout, **widths(st.cast))
            for st in plan.stages
            if st.cast is not None
        ]
        counts.append(("two-hop", plan_wire(plan, "ppermute", local, relays, pieces)))
    real = counts[0][1]
    print(
        "wire      rows each rank sends per cast, busiest rank (and all ranks), padding "
        f"included; ring attention sends {_fmt(ring)} per rank (* the flat xla transport's "
        "default)"
    )
    split = local is not None and local < plan.cp
    print(
        f"          {'real (the plan)':<17} {_fmt(int(real.real.max(initial=0))):>7} "
        f"({_fmt(int(real.real.sum()))})"
        + (f"   between nodes {_fmt(int(real.real_inter.sum()))}" if split else "")
    )
    for name, w in counts:
        print(
            f"          {name:<17} {_fmt(int(w.wire.max(initial=0))):>7} "
            f"({_fmt(int(w.wire.sum()))})   {w.per_rank_ratio():5.2f}x per rank, "
            f"{w.total_ratio():5.2f}x in total, {100 * w.wire.max(initial=0) / max(ring, 1):5.1f}% "
            "of ring"
            + (
                f"   between nodes {_fmt(int(w.wire_inter.sum()))} "
                f"(real {_fmt(int(w.real_inter.sum()))})"
                if split
                else ""
            )
        )


if __name__ == "__main__":
    sys.exit(main())
