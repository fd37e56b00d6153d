"""Masks of any shape: how many slices they compress to, and how long they take to plan.

For each mask family and length: the mask as :meth:`AttnMask.from_fn` gives it (its
slices are the canonical slices of its cells, :func:`magi_jax.mask_runs.canonical`), its
slice count, then cold planning (every cache cleared):

- one device: ``magi_jax.plan_attention(mask, capacity, backend=...)``, the work lists at
  the capacity the mask needs (``PlanCapacity.from_masks([mask])``, not timed);
- a key at cp 8: ``magi_jax.make_flex_key(mask, mesh)`` on an 8-CPU-device mesh (host
  planning plus the device put of the key's arrays).

Families: random block-sparse (a ``1024 x 1024`` grid of blocks of ``total / 1024``
tokens; 1 % and 10 % of the blocks), documents + causal sliding window + global tokens,
and HSTU (context, causal history, targets), over the zoo's documents
(:func:`magi_jax.mask_zoo.scaled_doc_lengths`); and causal documents of 10 tokens on
average (``total / 10`` slices: 10^5 at 1M). Up to ``--from-fn-max`` tokens (default 1M)
the mask is built by ``from_fn`` from its predicate (with block codes, so that only mixed
blocks are evaluated) and checked to hold the constructor's cells exactly; above it the
constructor's canonical mask is used (the same ``AttnMask``: from_fn's result depends only
on the cells).

Writes ``benchmarks/results/planning/masks_<date>_cpu[_label].{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

import numpy as np

_CP = 8
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={_CP}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402

import magi_jax as mj  # noqa: E402
from benchmarks.harness import environment  # noqa: E402
from magi_jax import mask_zoo as mz  # noqa: E402
from magi_jax.mask import AttnMask  # noqa: E402
from magi_jax.mask_runs import canonical  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "planning")
FAMILIES = ("block-sparse-1%", "block-sparse-10%", "doc-window-global", "hstu", "docs-of-10")
_GRID = 1024  # block-sparse: blocks per axis
_FN_BLOCK = 256  # from_fn's evaluation block (and block codes) for the document families


def parse_tokens(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("km")) * scale


def fmt_tokens(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}k"


# ---- the families: predicate, block codes and constructor ------------------------------------


def _docs(total: int):
    lens = np.asarray(mz.scaled_doc_lengths(total), np.int64)
    doc = np.repeat(np.arange(len(lens)), lens)
    start = np.repeat(np.cumsum(lens) - lens, lens)
    return lens, doc, start


def _block_bounds(total: int, block: int, idx: np.ndarray):
    """First and last token of blocks ``idx``."""
    return idx * block, np.minimum((idx + 1) * block, total) - 1


def block_sparse(total: int, density: float, seed: int):
    b = total // _GRID
    grid = np.random.default_rng(seed).random((_GRID, _GRID)) < density
    fn = lambda q, k: grid[q // b, k // b]  # noqa: E731
    codes = lambda qb, kb: grid[qb, kb].astype(np.int8)  # noqa: E731 (0 or 1: never evaluated)
    return fn, codes, b, lambda: AttnMask.from_block_mask(grid, b, b)


def doc_window_global(total: int, window: int, num_global: int):
    lens, doc, start = _docs(total)
    w, g = window, num_global

    def fn(q, k):
        return (doc[q] == doc[k]) & (k <= q) & ((q - k <= w) | (k - start[k] < g))

    def codes(qb, kb):
        q0, q1 = _block_bounds(total, _FN_BLOCK, qb)
        k0, k1 = _block_bounds(total, _FN_BLOCK, kb)
        one_doc = (doc[q0] == doc[q1]) & (doc[k0] == doc[k1]) & (doc[q0] == doc[k0])
        empty = (k0 > q1) | (doc[k1] < doc[q0]) | (doc[k0] > doc[q1])
        past = k1 <= q0
        glob = k1 - start[k1] < g  # every key of the block is a global token
        no_glob = k0 - start[k0] >= g
        full = one_doc & past & ((q1 - k0 <= w) | glob)
        empty |= one_doc & (q0 - k1 > w) & no_glob
        return np.where(empty, 0, np.where(full, 1, 2))

    return fn, codes, _FN_BLOCK, lambda: mz.doc_window_global(lens, w, g)


def hstu(total: int, num_context: int):
    lens, doc, start = _docs(total)
    targets = lens // 8
    context = np.minimum(num_context, lens // 4)
    hist_end = np.repeat(lens - targets, lens)  # local index of the first target
    ctx = np.repeat(context, lens)
    local = np.arange(total) - start
    kind = np.where(local < ctx, 0, np.where(local >= hist_end, 2, 1))  # ctx, history, target

    def fn(q, k):
        same = doc[q] == doc[k]
        kq, kk = kind[q], kind[k]
        see = (
            ((kq == 0) & (kk != 2))
            | ((kq != 0) & (kk == 0))
            | ((kq == 1) & (kk == 1) & (k <= q))
            | ((kq == 2) & (kk == 1))
            | ((kq == 2) & (k == q))
        )
        return same & see

    def codes(qb, kb):
        q0, q1 = _block_bounds(total, _FN_BLOCK, qb)
        k0, k1 = _block_bounds(total, _FN_BLOCK, kb)
        one_doc = (doc[q0] == doc[q1]) & (doc[k0] == doc[k1]) & (doc[q0] == doc[k0])
        empty = (doc[k1] < doc[q0]) | (doc[k0] > doc[q1])
        qk = kind[q0] == kind[q1]  # rows of one kind
        kk = kind[k0] == kind[k1]  # keys of one kind
        uniform = one_doc & qk & kk
        rq, rk = kind[q0], kind[k0]
        # Rows of one kind and keys of one kind in one document: decide from the rules.
        full = uniform & (
            ((rq == 0) & (rk != 2))
            | ((rq != 0) & (rk == 0))
            | ((rq == 1) & (rk == 1) & (k1 <= q0))
            | ((rq == 2) & (rk == 1))
        )
        none = uniform & (
            ((rq == 0) & (rk == 2))
            | ((rq == 1) & (rk == 2))
            | ((rq == 1) & (rk == 1) & (k0 > q1))
            | ((rq == 2) & (rk == 2) & ((k1 < q0) | (k0 > q1)))
        )
        return np.where(empty | none, 0, np.where(full, 1, 2))

    return fn, codes, _FN_BLOCK, lambda: mz.hstu(lens, targets, context)


def docs_of_10(total: int, seed: int):
    """Causal documents of 10 tokens on average (random lengths): ``total / 10`` slices,
    10^5 at 1M tokens."""
    lens = np.asarray(mz.random_doc_lengths(total, total // 10, seed), np.int64)
    doc = np.repeat(np.arange(len(lens)), lens)
    fn = lambda q, k: (doc[q] == doc[k]) & (k <= q)  # noqa: E731

    def codes(qb, kb):
        q0, q1 = _block_bounds(total, _FN_BLOCK, qb)
        k0, k1 = _block_bounds(total, _FN_BLOCK, kb)
        empty = (k0 > q1) | (doc[k1] < doc[q0]) | (doc[k0] > doc[q1])
        full = (doc[q0] == doc[q1]) & (doc[k0] == doc[q0]) & (doc[k1] == doc[q0]) & (k1 <= q0)
        return np.where(empty, 0, np.where(full, 1, 2))

    return fn, codes, _FN_BLOCK, lambda: AttnMask.varlen(np.r_[0, np.cumsum(lens)])


def family(name: str, total: int, args):
    if name == "docs-of-10":
        return docs_of_10(total, args.seed)
    if name.startswith("block-sparse"):
        return block_sparse(total, float(name.split("-")[-1].rstrip("%")) / 100, args.seed)
    if name == "doc-window-global":
        return doc_window_global(total, args.window, args.num_global)
    return hstu(total, args.num_global)


# ---- timing ----------------------------------------------------------------------------------


def cold():
    mj.clear_caches()
    from magi_jax.planning import solver

    for fn_name in ("_chunk_kv_extents", "_balanced_cached"):
        fn = getattr(solver, fn_name, None)
        if fn is not None:
            fn.cache_clear()
    gc.collect()


def timed(fn, reps: int):
    times, out = [], None
    for _ in range(reps):
        cold()
        t0 = time.perf_counter()
        out = fn()
        if out is not None:
            jax.block_until_ready(jax.tree.leaves(out))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def build(name: str, total: int, args) -> dict:
    fn, codes, block, constructor = family(name, total, args)
    t0 = time.perf_counter()
    ref = constructor()
    t_ctor = time.perf_counter() - t0
    row = dict(mask=name, tokens=total, constructor_s=t_ctor, constructor_slices=ref.num_slices)
    if total <= args.from_fn_max:
        t0 = time.perf_counter()
        mask = AttnMask.from_fn(fn, total, total, block=block, blocks=codes)
        row.update(built_by="from_fn", build_s=time.perf_counter() - t0)
        if mask != canonical(ref):  # the same cells, hence the same canonical slices
            raise AssertionError(f"{name} at {total}: from_fn and the constructor disagree")
    else:
        t0 = time.perf_counter()
        mask = canonical(ref)
        row.update(built_by="canonical(constructor)", build_s=time.perf_counter() - t0)
    row.update(slices=mask.num_slices, area=mask.area, density=mask.area / total**2)
    return row, mask


def plan_row(row: dict, mask: AttnMask, args, mesh) -> dict:
    # The capacity this mask needs (a mask of 10^5 slices cuts more tiles than the default
    # capacity allows for): measured first, then the plan at it is timed.
    cap = mj.PlanCapacity.from_masks([mask])
    t1, plan = timed(
        lambda: mj.plan_attention(mask, cap, backend=args.ffa_backend, num_heads=(8, 8)),
        args.reps,
    )
    row.update(one_device_s=t1, plan_mib=plan.nbytes() / 2**20, items=int(cap.items))
    del plan
    tk, key = timed(
        lambda: mj.make_flex_key(mask, mesh, "cp", ffa_backend=args.ffa_backend), args.reps
    )
    row.update(cp8_key_s=tk, cp8_overlap_degree=int(key.overlap_degree))
    del key
    return row


COLUMNS = (
    ("mask", "mask", "{}"),
    ("tokens", "tokens", None),
    ("built_by", "built by", "{}"),
    ("build_s", "build s", "{:.2f}"),
    ("slices", "slices", "{:,}"),
    ("constructor_slices", "constructor's slices", "{:,}"),
    ("density", "density", "{:.4f}"),
    ("one_device_s", "one device plan s", "{:.2f}"),
    ("plan_mib", "plan MiB", "{:.1f}"),
    ("cp8_key_s", "cp 8 key s", "{:.2f}"),
)


def table(rows) -> str:
    head = "| " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|" + "---|" * len(COLUMNS)
    body = []
    for r in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            v = r.get(key, "")
            cells.append(fmt_tokens(v) if key == "tokens" else (fmt.format(v) if v != "" else ""))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128k,1M", help="lengths, comma-separated")
    ap.add_argument("--masks", default=",".join(FAMILIES), help=f"of {FAMILIES}")
    ap.add_argument("--reps", type=int, default=1, help="cold plans per mask; median")
    ap.add_argument(
        "--from-fn-max",
        type=parse_tokens,
        default=parse_tokens("1M"),
        help="longest mask built by from_fn; longer ones: the constructor's canonical slices",
    )
    ap.add_argument("--window", type=int, default=4096, help="doc-window-global's window")
    ap.add_argument("--num-global", type=int, default=64, help="global / context tokens")
    ap.add_argument("--ffa-backend", default="xla", choices=("xla", "pallas"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    env = environment(argv)
    print(json.dumps(env), flush=True)
    mesh = jax.make_mesh((_CP,), ("cp",), devices=jax.devices()[:_CP])
    rows = []
    cases = [
        (name, parse_tokens(t)) for t in args.tokens.split(",") for name in args.masks.split(",")
    ]
    for i, (name, total) in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {name} at {fmt_tokens(total)}", flush=True)
        row, mask = build(name, total, args)
        print("   ", row, flush=True)
        rows.append(plan_row(row, mask, args, mesh))
        print("   ", rows[-1], flush=True)
        del mask
    env["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    path = os.path.join(args.out, f"masks_{stamp}_cpu" + (f"_{args.label}" if args.label else ""))
    with open(path + ".json", "w") as f:
        json.dump(dict(environment=env, rows=rows), f, indent=1)
    lines = [
        "# Masks of any shape: slices and planning time",
        "",
        f"`python benchmarks/mask_bench.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "argv"),
        "",
        table(rows),
        "",
        f"Built by `from_fn` (block codes, evaluation block {_FN_BLOCK} or the block-sparse "
        "block) up to --from-fn-max tokens, checked cell for cell against the constructor; "
        "above, the constructor's canonical slices (the same mask from_fn returns). "
        "Times: median of cold runs (caches cleared): `plan_attention` at the "
        "capacity the mask needs (`PlanCapacity.from_masks([mask])`, measured before), "
        "and `make_flex_key` on 8 CPU devices, device put included.",
        "",
    ]
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines))
    print("wrote", path + ".json", path + ".md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
