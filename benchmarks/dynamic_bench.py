"""Per-step planning of masks as data (host, CPU): what building one context-parallel key
costs on the host, stage by stage, and how large its plan arrays are next to the KV they
plan for.

Keys are built per training step when masks are data (``mj.make_flex_key(mask, mesh, "cp",
capacity=...)``), so their host planning sits on the critical path (or on the prefetch
thread of :func:`magi_jax.prefetch_keys`). For each case (packed tokens x cp) and each kind
of key — ``one`` (a key of one mask, sized for it) and ``capacity`` (a key at a tight
:class:`~magi_jax.planning.capacity.PlanCapacity` from ``PlanCapacity.from_masks`` over a
sample of document-causal packings, ``mesh_size=cp``) — it times every step of
``make_flex_key``'s host work except putting the arrays on devices:

    solver          solve_dispatch (chunks -> ranks)
    overlap_degree  the cost model's degree (keys of one mask; a capacity fixes it)
    rank_views      per rank: needed keys, remote pieces, stages   } build_dist_plan,
    stage_shapes    per rank and stage: local-coordinate slices    } by its phases
    work_lists      per rank and stage: the FFA work lists         } (stages.phase_times)
    cast_tables     per stage: the group-cast tables               }
    stack_pad       stacking over ranks, padding to the capacity   }
    key_rest        transports, the chunk permutation (key.py's host part)
    total           wall clock of all of it (``other`` = total - the phases)

Every timed key is planned cold (``magi_jax.clear_caches()`` first: a new mask per step);
medians over ``--reps``. Masks: ``doc-causal`` (``magi_jax.mask_zoo``, the benchmark
documents) and, at a capacity, the sample's packings (``--packings``: random document
lengths, the spread of ``benchmarks/dynamic_device.py``). Plan bytes per rank are the
key's ``[cp, ...]`` stage arrays (work lists, cast tables) over ``cp``, next to the rank's
KV bytes ``local_len·Hkv·D·bytes·2`` (K and V); the replicated dispatch permutation (the
key's ``chunk_order`` / ``chunk_inverse``, int32 ``[num_chunks]`` each) is listed apart.

    python benchmarks/dynamic_bench.py                          # 128k x cp 8, 1M x cp 64
    python benchmarks/dynamic_bench.py --cases 32k:8 --reps 3 --label quick
    python benchmarks/dynamic_bench.py --via-key                # through make_flex_key

Writes ``benchmarks/results/planning/dynamic_<YYYYMMDD>_<HHMM>_cpu[_<label>].{json,md}``.

Adding rows (e.g. GPU ones): a *section* is a function ``rows(args) -> list[dict]`` and a
list of ``(column, header, format)``; register it in :data:`SECTIONS` (``--sections host,gpu``
picks them). Every section's rows land in the JSON under ``sections[name]`` and as their own
table in the MD; :func:`environment` is the run's shared header. Host planning here needs
no device (no JAX import unless ``--via-key``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.harness import environment  # noqa: E402
from magi_jax.caches import clear_caches  # noqa: E402
from magi_jax.mask import AttnMask  # noqa: E402
from magi_jax.mask_zoo import make_mask, random_doc_lengths  # noqa: E402
from magi_jax.planning import stages as ST  # noqa: E402
from magi_jax.planning.capacity import PlanCapacity  # noqa: E402
from magi_jax.planning.cast_table import choose_transport  # noqa: E402
from magi_jax.planning.defaults import (  # noqa: E402
    capacity_chunk_size,
    capacity_overlap_degree,
    default_overlap_degree,
)
from magi_jax.planning.solver import solve_dispatch  # noqa: E402
from magi_jax.planning.work_list import default_block_sizes  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "planning")
PHASES = ("solver", "overlap_degree") + ST.PHASES + ("key_rest",)
# Budgets (this repository's targets for per-step keys on the 2-core CPU host).
TIME_BUDGET_S = {131072: 0.050, 1048576: 1.0}
BYTES_BUDGET = 0.05  # plan bytes per rank / KV bytes per rank


def parse_tokens(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"128k:8,1M:64"`` -> ``[(131072, 8), (1048576, 64)]``."""
    out = []
    for item in text.split(","):
        total, cp = item.split(":")
        out.append((parse_tokens(total), int(cp)))
    return out


def fmt_tokens(n: int) -> str:
    for unit, div in (("M", 1 << 20), ("k", 1 << 10)):
        if n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def packings(total: int, count: int, seed: int, num_docs: int = 10) -> list[AttnMask]:
    """Document-causal packings of ``num_docs`` random lengths (as dynamic_device.py)."""
    return [
        AttnMask.varlen(np.cumsum([0] + random_doc_lengths(total, num_docs, seed + i)), causal=True)
        for i in range(count)
    ]


# ---- the host part of make_flex_key, phase by phase ------------------------------------------


def host_key(mask: AttnMask, cp: int, capacity: PlanCapacity | None, ffa_backend: str):
    """What ``make_flex_key(mask, mesh, capacity=capacity, ffa_backend=ffa_backend)`` does
    on the host (magi_jax/sharding/make_key.py ``_make_key``), the device put left out. Returns
    ``(plan, chunk_order, chunk_inverse, seconds per phase)``."""
    times = dict.fromkeys(PHASES, 0.0)
    t_start = time.perf_counter()
    chunk = degree = None
    if capacity is not None:  # key._capacity_options (the degree is cached per capacity)
        chunk = capacity.chunk_size or capacity_chunk_size(capacity.total_q, cp)
        degree = (
            capacity.overlap_degree
            if capacity.overlap_degree is not None
            else capacity_overlap_degree(capacity.total_q, cp, chunk).forward
        )
    t0 = time.perf_counter()
    meta = solve_dispatch(mask, cp, chunk, "magi")
    times["solver"] = time.perf_counter() - t0
    bq, bk = default_block_sizes(meta.local_len, meta.local_len)
    t0 = time.perf_counter()
    if degree is None:
        degree = default_overlap_degree(mask, meta)
    times["overlap_degree"] = time.perf_counter() - t0
    with ST.phase_times() as phases:
        plan = ST.build_dist_plan(mask, meta, degree, bq, bk, ffa_backend, capacity)
    times.update(phases)
    t0 = time.perf_counter()
    for st in plan.stages:
        if st.cast is not None:
            choose_transport(st.cast)
    order = meta.rank_chunks.reshape(-1)  # key._chunk_permutation
    inverse = np.empty(meta.num_chunks, np.int64)
    inverse[order] = np.arange(meta.num_chunks)
    order, inverse = (np.ascontiguousarray(a, np.int32) for a in (order, inverse))
    times["key_rest"] = time.perf_counter() - t0
    times["total"] = time.perf_counter() - t_start
    return plan, order, inverse, times


class ViaKey:
    """``--via-key``: the same keys through ``make_flex_key`` itself on forced CPU devices,
    its device put replaced by a host copy (total only: cross-checks :func:`host_key`)."""

    def __init__(self, max_cp: int):
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max_cp}"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        import magi_jax.sharding.make_key as key_mod

        self.jax, self.key_mod = jax, key_mod
        key_mod.put_global = lambda a, sharding: np.ascontiguousarray(a, np.int32)
        self.meshes = {}

    def total(self, mask, cp, capacity, ffa_backend) -> float:
        if cp not in self.meshes:
            self.meshes[cp] = self.jax.make_mesh((cp,), ("cp",), devices=self.jax.devices()[:cp])
        t0 = time.perf_counter()
        self.key_mod.make_flex_key(
            mask,
            self.meshes[cp],
            "cp",
            capacity=capacity,
            ffa_backend=ffa_backend,
            comm_backend="xla",
        )
        return time.perf_counter() - t0


def plan_bytes(plan, order, inverse, kv_heads: int, head_dim: int, dtype_bytes: int) -> dict:
    """Bytes per rank of the key's arrays, by kind, and the rank's KV bytes."""
    cp = plan.cp
    items = lists = send = recv = 0
    for st in plan.stages:
        # The work lists' items (or their runs, FFAPlanRuns) and their tile arrays.
        listed = sum(
            a.nbytes for f, a in zip(st.ffa._fields, st.ffa) if f.endswith(("_items", "_runs"))
        )
        items += listed
        lists += sum(a.nbytes for a in st.ffa) - listed
        if st.cast is not None:
            # The cast tables as the key ships them: runs (CastTable.send_runs/recv_runs).
            send += st.cast.send_runs.nbytes
            recv += st.cast.recv_runs.nbytes
    per_rank = dict(
        items=items // cp, tile_lists=lists // cp, cast_send=send // cp, cast_recv=recv // cp
    )
    stage_total = sum(per_rank.values())
    kv = plan.meta.local_len * kv_heads * head_dim * dtype_bytes * 2
    return dict(
        per_rank,
        plan=stage_total,
        dispatch=order.nbytes + inverse.nbytes,
        kv=kv,
        ratio=stage_total / kv,
        ratio_with_dispatch=(stage_total + order.nbytes + inverse.nbytes) / kv,
    )


def cold():
    """A new mask's planning from scratch: every plan cache (``magi_jax.clear_caches``) and
    the planning modules' pure caches keyed by masks or their chunk areas (not the
    per-capacity overlap degree: a training run computes it once)."""
    clear_caches()
    from magi_jax.planning import solver

    for name in ("_chunk_kv_extents", "_balanced_cached"):
        fn = getattr(solver, name, None)
        if fn is not None:
            fn.cache_clear()
    gc.collect()


def time_keys(mask, cp, capacity, args, via=None) -> tuple[dict, dict, dict]:
    """Cold keys of ``mask``, ``args.reps`` times: (median seconds per phase, all reps,
    bytes)."""
    reps, via_totals, info = [], [], None
    for _ in range(args.reps):
        cold()
        plan, order, inverse, times = host_key(mask, cp, capacity, args.ffa_backend)
        reps.append(times)
        if info is None:
            info = plan_bytes(plan, order, inverse, args.kv_heads, args.head_dim, args.dtype_bytes)
            info.update(
                overlap_degree=plan.overlap_degree,
                chunk_size=plan.meta.chunk_size,
                local_len=plan.meta.local_len,
                items_q=[int(st.items[0]) for st in plan.stages],
                items_k=[int(st.items[1]) for st in plan.stages],
                runs_q=[int(st.ffa[2].shape[1]) for st in plan.stages],
                runs_k=[int(st.ffa[5].shape[1]) for st in plan.stages],
            )
        del plan, order, inverse
        if via is not None:
            cold()
            via_totals.append(via.total(mask, cp, capacity, args.ffa_backend))
    med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    med["other"] = max(0.0, med["total"] - sum(med[p] for p in PHASES))
    if via_totals:
        med["via_key"] = statistics.median(via_totals)
    return med, {k: [r[k] for r in reps] for k in reps[0]}, info


def host_rows(args) -> list[dict]:
    via = ViaKey(max(cp for _, cp in args.cases)) if args.via_key else None
    rows = []
    for total, cp in args.cases:
        case = f"{fmt_tokens(total)} x cp {cp}"
        doc = make_mask("doc-causal", total)
        budget = TIME_BUDGET_S.get(total)
        kinds = args.kinds.split(",")
        cap = None
        if "capacity" in kinds:
            sample = [doc] + packings(total, args.packings, args.seed)
            clear_caches()
            t0 = time.perf_counter()
            cap = PlanCapacity.from_masks(sample, mesh_size=cp)
            from_masks_s = time.perf_counter() - t0
        for kind in kinds:
            capacity = cap if kind == "capacity" else None
            masks = [("doc-causal", doc)]
            if kind == "capacity" and args.packings:
                masks += [
                    (f"packing {i}", m)
                    for i, m in enumerate(packings(total, args.packings, args.seed))
                ]
            for name, mask in masks:
                reps_here = args
                if name != "doc-causal":  # each packing: one cold key
                    reps_here = argparse.Namespace(**{**vars(args), "reps": 1})
                med, every, info = time_keys(mask, cp, capacity, reps_here, via)
                row = dict(
                    case=case,
                    tokens=total,
                    cp=cp,
                    key=kind,
                    mask=name,
                    **med,
                    reps=every,
                    bytes=info,
                    budget_s=budget,
                    time_ok=None if budget is None else med["total"] <= budget,
                    bytes_ok=info["ratio"] <= BYTES_BUDGET,
                )
                if capacity is not None:
                    row["capacity"] = {
                        k: getattr(capacity, k)
                        for k in (
                            "items",
                            "q_runs",
                            "k_runs",
                            "remote_kv",
                            "cast_width",
                            "overlap_degree",
                            "chunk_size",
                        )
                    }
                    row["from_masks_s"] = from_masks_s
                rows.append(row)
                print(_line(row), flush=True)
            if kind == "capacity" and args.packings:
                rows.append(_summary(rows[-args.packings :], case, total, cp, kind, budget))
                print(_line(rows[-1]), flush=True)
    return rows


def _summary(rows, case, total, cp, kind, budget) -> dict:
    med = {k: statistics.median(r[k] for r in rows) for k in PHASES + ("total", "other")}
    ratio = max(r["bytes"]["ratio"] for r in rows)
    return dict(
        case=case,
        tokens=total,
        cp=cp,
        key=kind,
        mask=f"{len(rows)} packings (median)",
        **med,
        bytes=dict(rows[0]["bytes"], ratio=ratio),
        budget_s=budget,
        time_ok=None if budget is None else med["total"] <= budget,
        bytes_ok=ratio <= BYTES_BUDGET,
    )


def _line(r) -> str:
    ph = " ".join(f"{p} {r[p] * 1e3:.1f}" for p in PHASES)
    return (
        f"{r['case']:>14} {r['key']:>8} {r['mask']:>22}: total {r['total'] * 1e3:8.1f} ms"
        f" ({ph}); plan {r['bytes']['plan'] / 2**20:.2f} MiB/rank = "
        f"{100 * r['bytes']['ratio']:.1f}% of KV"
    )


MB = lambda x: f"{x / 2**20:.2f}"  # noqa: E731
KB = lambda x: f"{x / 2**10:.1f}"  # noqa: E731
MS = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
OK = lambda x: "" if x is None else ("yes" if x else "**no**")  # noqa: E731
HOST_COLUMNS = (
    [("case", "case", str), ("key", "key", str), ("mask", "mask", str), ("total", "total ms", MS)]
    + [(p, f"{p} ms", MS) for p in PHASES]
    + [("other", "other ms", MS), ("via_key", "make_flex_key ms", MS)]
    + [
        ("bytes.plan", "plan MiB/rank", MB),
        ("bytes.kv", "KV MiB/rank", MB),
        ("bytes.ratio", "plan/KV %", lambda x: f"{100 * x:.1f}"),
        ("bytes.dispatch", "chunk order+inverse KiB (replicated)", KB),
        ("time_ok", "time budget", OK),
        ("bytes_ok", "5 % budget", OK),
    ]
)

# name -> (rows(args) -> list[dict], columns); the lead's GPU section registers itself here.
SECTIONS = {"host": (host_rows, HOST_COLUMNS)}


def _get(row, path):
    for part in path.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


def table(rows, columns) -> str:
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "---|" * len(columns)
    body = []
    for r in rows:
        cells = []
        for path, _, fmt in columns:
            v = _get(r, path)
            cells.append("" if v is None and fmt is not OK else fmt(v))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, rule] + body)


def memory_probe(mib: int = 256) -> dict:
    """Seconds per GiB to fill fresh memory, twice: on a VM whose host backs guest pages
    lazily the first fill can cost 20x the second (the plans' arrays are fresh memory)."""
    out = {}
    for name in ("first", "second"):
        t0 = time.perf_counter()
        a = np.ones(mib << 18, np.int32)
        out[f"fill_{name}_s_per_gib"] = (time.perf_counter() - t0) * 1024 / mib
        del a
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cases",
        type=parse_cases,
        default="128k:8,1M:64",
        help="packed tokens:cp, comma-separated (default 128k:8,1M:64)",
    )
    ap.add_argument("--kinds", default="one,capacity", help="keys: one, capacity")
    ap.add_argument("--reps", type=int, default=5, help="cold keys per (case, kind); median")
    ap.add_argument(
        "--packings",
        type=int,
        default=3,
        help="random packings in the capacity's sample (each timed once)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ffa-backend",
        default="pallas",
        choices=("pallas", "xla"),
        help="work lists of this backend (default pallas: what H200 keys use)",
    )
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype-bytes", type=int, default=2, help="2: bf16")
    ap.add_argument(
        "--via-key",
        action="store_true",
        help="also time make_flex_key itself (CPU devices, no device put)",
    )
    ap.add_argument("--sections", default="host", help=f"of {sorted(SECTIONS)}")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if isinstance(args.cases, str):
        args.cases = parse_cases(args.cases)
    env = environment(
        argv,
        **memory_probe(),
        ffa_backend=args.ffa_backend,
        malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype_bytes=args.dtype_bytes,
        reps=args.reps,
        packings=args.packings,
    )
    print(json.dumps(env))
    sections = {}
    for name in args.sections.split(","):
        sections[name] = SECTIONS[name][0](args)
    env["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    env.update({f"{k}_end": v for k, v in memory_probe().items()})
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    path = os.path.join(args.out, f"dynamic_{stamp}_cpu" + (f"_{args.label}" if args.label else ""))
    with open(path + ".json", "w") as f:
        json.dump(dict(environment=env, sections=sections), f, indent=1, default=_json)
    lines = [
        "# Per-step host planning: "
        + ", ".join(f"{fmt_tokens(t)} x cp {c}" for t, c in args.cases),
        "",
        f"`python benchmarks/dynamic_bench.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "argv"),
        "",
    ]
    for name, rows in sections.items():
        lines += [f"## {name}", "", table(rows, SECTIONS[name][1]), ""]
    lines += [
        "Times: median of cold keys (caches cleared) on the host; `other` = total minus "
        "the phases. Plan MiB/rank: the key's stage arrays (work lists + cast tables) "
        f"over cp; KV: local_len x Hkv {args.kv_heads} x D {args.head_dim} x "
        f"{args.dtype_bytes} B x 2; budgets: 128k x cp 8 <= 50 ms, 1M x cp 64 <= 1 s, "
        "plan <= 5 % of KV.",
        "",
    ]
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines))
    print("wrote", path + ".json", path + ".md")
    return 0


def _json(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    raise TypeError(type(x))


if __name__ == "__main__":
    sys.exit(main())
