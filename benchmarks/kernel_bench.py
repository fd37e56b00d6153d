"""Kernel benchmark: FFA (pallas, xla) against cuDNN, tokamax and dense XLA over the mask zoo.

TFLOP/s are counted from the mask area: ``2·area·Hq·(Dqk + Dv)·B`` forward (``4·area·Hq·D·B``
where v has q's head dim), 3.5× that for forward+backward, 2.5× for the backward alone
(``--modes bwd``). Writes ``benchmarks/results/kernel/kernel_<date>_<device>.{json,md}``.

``--v-head-dim`` gives v (and the output) a head dim of its own (multi-head latent attention,
e.g. ``--head-dim 192 --v-head-dim 128``). Where cuDNN refuses it, the cuDNN row times the
same shapes at ``Dv = Dqk`` instead, as impl ``cudnn[Dv=Dqk]`` (its FLOPs counted at that
``Dv``).

    PYTHONPATH=. python benchmarks/kernel_bench.py --lengths 16384 --masks full,causal
    PYTHONPATH=. python benchmarks/kernel_bench.py --preset acceptance
    PYTHONPATH=. python benchmarks/kernel_bench.py \
        --judge benchmarks/results/kernel/kernel_<...>.json

The markdown ends with the kernel targets (``TARGET_LINES``: FFA against cuDNN, absolute
TFLOP/s, and each mask against FFA's own causal rate) that the run measured.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.run_env import describe, environment, package_version  # noqa: E402
from magi_jax.mask import AttnMask  # noqa: E402
from magi_jax.mask_zoo import make_mask as zoo_mask  # noqa: E402

# The zoo of magi_jax.mask_zoo under this benchmark's names (mask_zoo.DOC_LENGTHS documents).
ZOO = (
    "full",
    "causal",
    "doc_causal",
    "doc_full",
    "swa_causal_1024",
    "swa_causal_4096",
    "block_causal",
    "shared_question",
    "prefix_lm",
    "causal_blockwise",
)
IMPLS = ("ffa_pallas", "ffa_xla", "cudnn", "tokamax", "xla_dense")
# The pipeline knobs of the pallas kernels (results/kernel/kernel_notes.md, "Knobs"): the
# forward alone, the default against 3 slots (one program per tile) and one program per
# tile; the dK/dV kernel's 3 slots, fwd+bwd at full/causal 16k.
_FWD_KNOB_IMPLS = ("ffa_pallas", "ffa_pallas:num_stages=3:persistent=0", "ffa_pallas:persistent=0")
# Persistent kernels (one program per H200 SM; by default on a GPU the forward's and the
# dK/dV kernel's on short rows) against one program per tile, forward and dK/dV separately.
_PERSISTENT_IMPLS = (
    "ffa_pallas:persistent=0:dkv_persistent=0",
    "ffa_pallas:persistent=132",
    "ffa_pallas:dkv_persistent=132",
    "ffa_pallas:persistent=132:dkv_persistent=132",
)
_BWD_KNOB_IMPLS = ("ffa_pallas", "ffa_pallas:dkv_num_stages=3")
# (mask, length, impls or None for --impls[, modes instead of --modes]).
PRESETS = {
    # The kernel targets at Hq = Hkv = 16, D = 128 (TARGET_LINES["default"]): full and
    # causal at 16k and 32k against the anchors, doc-causal 32k (absolute); short documents (8k,
    # and 128 documents in 32k) and every other zoo mask at 16k for FFA itself, beside FFA's
    # causal at the same length. GQA, D = 64 and D = 256 are runs of their own
    # (``--heads 64 --kv-heads 8``, ``--heads 32 --head-dim 64``, ``--head-dim 256``).
    "acceptance": [(m, t, None) for t in (16384, 32768) for m in ("full", "causal")]
    + [
        ("doc_causal", 32768, ("ffa_pallas",)),
        ("causal", 8192, ("ffa_pallas",)),
        ("doc_causal", 8192, ("ffa_pallas",)),
        ("many_docs_128", 32768, ("ffa_pallas",)),
    ]
    + [(m, 16384, ("ffa_pallas",)) for m in ZOO if m not in ("full", "causal")],
    "smoke": [("causal", 4096, None), ("doc_causal", 4096, None)],
    # Masks of 10^4+ slices at 32k built by ``AttnMask.from_fn`` against the same masks built
    # from their own slice lists (``from_block_mask``, ``varlen``) and against causal.
    "any_mask": [
        (m, 32768, ("ffa_pallas",))
        for m in (
            "causal",
            "fn_block_sparse_64_5",
            "block_sparse_64_5",
            "fn_docs_3",
            "docs_3",
        )
    ],
    "knobs": [
        (m, t, ("cudnn",) * (m != "doc_causal") + _FWD_KNOB_IMPLS, ("fwd",))
        for m, t in (
            ("full", 16384),
            ("causal", 16384),
            ("doc_causal", 16384),
            ("doc_causal", 32768),
        )
    ]
    + [(m, 16384, _BWD_KNOB_IMPLS, ("fwd+bwd",)) for m in ("full", "causal")],
    "persistent": [
        (m, t, _PERSISTENT_IMPLS)
        for m, t in (
            ("full", 16384),
            ("causal", 16384),
            ("doc_causal", 32768),
            ("doc_causal", 16384),
            ("swa_causal_1024", 16384),
            ("prefix_lm", 16384),
        )
    ],
}


# The kernel targets on FFA pallas, by head configuration (:func:`_config` of a row):
# (mask, length, mode, against, target), against "cudnn" (a ratio to cuDNN in the same run)
# or "tflops" (absolute). Besides these, every other mask's forward+backward against FFA's
# own causal rate at the same length: ZOO_LINE, or SHORT_DOC_LINE for SHORT_DOC_MASKS.
_AGAINST_CUDNN = lambda target: tuple(
    (m, t, mode, "cudnn", target)
    for t in (16384, 32768)
    for m in ("full", "causal")
    for mode in ("fwd", "fwd+bwd")
)
TARGET_LINES = {
    "default": _AGAINST_CUDNN(1.0)
    + (
        ("doc_causal", 32768, "fwd", "tflops", 600.0),
        ("doc_causal", 32768, "fwd+bwd", "tflops", 540.0),
    ),
    "gqa": _AGAINST_CUDNN(1.0),
    "d64": _AGAINST_CUDNN(0.95),
    "d256": tuple(("causal", t, "fwd+bwd", "cudnn", 0.85) for t in (8192, 16384)),
}
ZOO_LINE = 0.9
SHORT_DOC_LINE = 0.8
SHORT_DOC_MASKS = (("doc_causal", 8192), ("many_docs_128", 32768))


def make_mask(name: str, total: int) -> AttnMask:
    """A mask of :data:`ZOO` (``magi_jax.mask_zoo``; documents in multiples of 128 from 16k
    on, blocks of 2048, any ``swa_causal_<window>``), ``many_docs_<n>`` (``n`` documents of
    random lengths), or aligned full blocks ``block_full_<block>``."""
    if name.startswith(("fn_", "block_sparse_", "docs_")):
        return any_mask(name, total)
    if name.startswith("block_full_"):
        # Aligned full blocks (the last one shorter): rows as short as a sliding window's
        # without a single masked tile — what short rows cost apart from the predicate.
        block = int(name.rsplit("_", 1)[1])
        return AttnMask.varlen(np.append(np.arange(0, total, block), total), causal=False)
    if name.startswith("many_docs_"):  # many-docs with this many random lengths
        return zoo_mask("many-docs", total, num_docs=int(name.rsplit("_", 1)[1]))
    if name.startswith("swa_causal_"):
        return zoo_mask("sliding-window", total, window=int(name.rsplit("_", 1)[1]))
    if name not in ZOO:
        raise ValueError(f"unknown mask {name!r}; one of {ZOO}")
    return zoo_mask(
        name.replace("_", "-"), total, block=2048, multiple=128 if total >= 16384 else 1
    )


def any_mask(name: str, total: int) -> AttnMask:
    """Masks of many slices, each built two ways: ``fn_<form>`` by ``AttnMask.from_fn`` from a
    NumPy predicate, ``<form>`` from the mask's own slice list. ``block_sparse_<block>_<pct>``:
    random ``block``-square blocks at ``pct`` % density (``from_block_mask``);
    ``docs_<mean>``: causal documents of random lengths 1 .. 2·mean - 1 (``varlen``). Seeded,
    so both builds of a form are the same mask (checked cell for cell by set difference)."""
    rng = np.random.default_rng(0)
    by_fn = name.startswith("fn_")
    form = name.removeprefix("fn_")
    if form.startswith("block_sparse_"):
        block, pct = (int(x) for x in form.removeprefix("block_sparse_").split("_"))
        nb = -(-total // block)
        blocks = rng.random((nb, nb)) < pct / 100
        if not by_fn:
            return AttnMask.from_block_mask(blocks, block, block, total, total)
        fn = lambda q, k: blocks[q // block, k // block]
        return _same_cells(AttnMask.from_fn(fn, total, total, block=block), form, total)
    if form.startswith("docs_"):
        mean = int(form.removeprefix("docs_"))
        lens = rng.integers(1, 2 * mean, size=2 * total // mean)
        cu = np.concatenate([[0], np.cumsum(lens)])
        cu = np.append(cu[cu < total], total)
        if not by_fn:
            return AttnMask.varlen(cu, causal=True)
        doc = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
        fn = lambda q, k: (doc[q] == doc[k]) & (k <= q)
        return _same_cells(AttnMask.from_fn(fn, total, total), form, total)
    raise ValueError(f"unknown mask {name!r}")


def _same_cells(built: AttnMask, form: str, total: int) -> AttnMask:
    own = any_mask(form, total)
    if (built - own).area or (own - built).area:
        raise AssertionError(f"from_fn's {form} differs from its slice list's")
    return built


def row_intervals(mask: AttnMask):
    """Per query row, the visible keys as one interval ``[lo, hi)`` if they form one
    (tokamax's k_start/k_end); None otherwise."""
    sh = mask.shapes
    t = mask.total_q
    lo = np.full(t, np.iinfo(np.int64).max)
    hi = np.full(t, -1)
    count = np.zeros(t, np.int64)
    for s in np.nonzero(sh.nonempty)[0]:
        rows = np.arange(sh.q0[s], sh.q1[s])
        a, b = sh.lo(rows, s), sh.hi(rows, s)
        lo[rows] = np.minimum(lo[rows], a)
        hi[rows] = np.maximum(hi[rows], b)
        count[rows] += b - a + 1
    seen = count > 0
    if not np.array_equal(count[seen], (hi - lo + 1)[seen]) or not seen.all():
        return None
    return lo.astype(np.int32), (hi + 1).astype(np.int32)


def attention_fn(impl: str, mask: AttnMask, name: str):
    """``f(q, k, v) -> out`` for one implementation, or raises NotImplementedError."""
    t = mask.total_q
    if impl.startswith("ffa_pallas"):
        # "ffa_pallas" or with tuning, e.g. "ffa_pallas:num_stages=3:persistent=0".
        from magi_jax.pallas import flex_flash_attention_pallas

        tuning = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in impl.split(":")[1:]}
        return lambda q, k, v: flex_flash_attention_pallas(q, k, v, mask, **tuning)[0]
    if impl == "ffa_xla":
        if t > 8192:
            raise NotImplementedError("ffa_xla only up to 8k (slow)")
        from magi_jax.ffa import flex_flash_attention

        return lambda q, k, v: flex_flash_attention(q, k, v, mask, backend="xla")[0]
    if impl in ("cudnn", "xla_dense"):
        kind = "cudnn" if impl == "cudnn" else "xla"
        if impl == "xla_dense" and t > 4096:
            raise NotImplementedError("dense XLA only up to 4k")
        if name in ("full", "causal"):
            return functools.partial(
                jax.nn.dot_product_attention, is_causal=name == "causal", implementation=kind
            )
        if t > 32768 or (impl == "cudnn" and name != "doc_causal"):
            raise NotImplementedError(
                "dense bool mask: only doc_causal up to 32k (the "
                "benchmark's comparison; ~23 TFLOP/s, the cost is Tq·Tk)"
            )
        dense = jnp.asarray(mask.to_dense(max_cells=1 << 31))[None, None]
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=dense, implementation=kind
        )
    if impl == "tokamax":
        import tokamax
        from tokamax._src.ops.attention import api, base

        if name in ("full", "causal"):
            return functools.partial(
                tokamax.dot_product_attention, is_causal=name == "causal", implementation="mosaic"
            )
        iv = row_intervals(mask)
        if iv is None:
            raise NotImplementedError("rows are not single key intervals")
        ks, ke = (jnp.asarray(x)[None, None, :] for x in iv)
        m = base.Mask(k_start=ks, k_end=ke)
        return lambda q, k, v: api.IMPLEMENTATIONS["mosaic_gpu"](q, k, v, mask=m)
    raise ValueError(f"unknown impl {impl!r}")


def bench(fn, args, n=5, reps=5):
    return bench_interleaved([(fn, args)], n, reps)[0]


def bench_interleaved(entries, n=5, reps=5, rounds_out=None):
    """Median seconds per call of each ``(fn, args)``: two warm-up calls each, then ``reps``
    rounds in which every entry runs ``n`` blocked calls in turn, so slow drifts of the GPU
    (clocks, temperature) fall on all entries alike and their ratios stay fair.
    ``rounds_out``: a list that receives each entry's seconds per call of every round."""
    for fn, args in entries:
        for _ in range(2):
            jax.block_until_ready(fn(*args))
    ts = [[] for _ in entries]
    for _ in range(reps):
        for (fn, args), t in zip(entries, ts):
            t0 = time.perf_counter()
            for _ in range(n):
                out = fn(*args)
            jax.block_until_ready(out)
            t.append((time.perf_counter() - t0) / n)
    if rounds_out is not None:
        rounds_out.extend(ts)
    return [statistics.median(t) for t in ts]


def case_inputs(total, batch, heads, kv_heads, head_dim, dtype, v_head_dim=None):
    """Random ``q, k, v, dout``; v and dout of ``v_head_dim`` (default ``head_dim``)."""
    dv = v_head_dim or head_dim
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (batch, total, heads, head_dim), dtype)
    k = jax.random.normal(ks[1], (batch, total, kv_heads, head_dim), dtype)
    v = jax.random.normal(ks[2], (batch, total, kv_heads, dv), dtype)
    do = jax.random.normal(ks[3], (batch, total, heads, dv), dtype)
    return q, k, v, do


def mode_fn(f, mode, inputs, flops):
    """``(jitted fn, args, FLOPs)`` of one mode of attention ``f``."""
    q, k, v, do = inputs
    if mode == "fwd":
        return jax.jit(f), (q, k, v), flops
    if mode == "bwd":  # the backward alone, from saved residuals: 2.5x fwd FLOPs
        _, vjp_fn = jax.vjp(jax.jit(f), q, k, v)
        return jax.jit(lambda vf, do: vf(do)), (vjp_fn, do), 2.5 * flops
    if mode == "fwd+bwd":

        def fb(q, k, v, do):
            out, vjp = jax.vjp(f, q, k, v)
            return vjp(do)

        return jax.jit(fb), (q, k, v, do), 3.5 * flops
    raise ValueError(f"mode {mode!r}: fwd, bwd or fwd+bwd")


# cuDNN timed at Dv = Dqk where it refuses v of its own head dim.
CUDNN_SAME_DV = "cudnn[Dv=Dqk]"


def run_group(
    impls,
    name,
    total,
    batch,
    heads,
    kv_heads,
    head_dim,
    dtype,
    modes,
    calls=5,
    reps=5,
    v_head_dim=None,
):
    """Rows of every impl on one case, the impls of each mode timed in alternating rounds
    (:func:`bench_interleaved`, ``reps`` rounds of ``calls`` calls; each row keeps its
    rounds' times as ``rounds_ms``); an impl that is not implemented or fails gets a row
    saying so and the others go on. With ``v_head_dim`` other than ``head_dim``, cuDNN
    failing on it is timed at ``Dv = Dqk`` instead (impl :data:`CUDNN_SAME_DV`)."""
    dv = v_head_dim or head_dim
    mask = make_mask(name, total)
    inputs = case_inputs(total, batch, heads, kv_heads, head_dim, dtype, dv)
    flops = 2.0 * mask.area * heads * (head_dim + dv) * batch
    base = dict(
        mask=name,
        length=total,
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=dv,
        dtype=jnp.dtype(dtype).name,
        area=mask.area,
    )
    rows, fns = [], {}
    for impl in impls:
        try:
            fns[impl] = attention_fn(impl, mask, name)
        except NotImplementedError as e:
            rows.append(dict(impl=impl, mask=name, length=total, mode="-", skipped=str(e)))
    for mode in modes:
        entries = []
        for impl, f in fns.items():
            try:
                fn, args, fl = mode_fn(f, mode, inputs, flops)
                for _ in range(2):  # compile and warm up here, so a failure names its impl
                    jax.block_until_ready(fn(*args))
                entries.append((impl, fn, args, fl))
            except Exception as e:  # keep the sweep going; record the failure
                traceback.print_exc()
                rows.append(
                    dict(impl=impl, mask=name, length=total, mode=mode, error=repr(e)[:300])
                )
                if impl == "cudnn" and dv != head_dim:
                    same = case_inputs(total, batch, heads, kv_heads, head_dim, dtype)
                    fn, args, fl = mode_fn(
                        f, mode, same, 4.0 * mask.area * heads * head_dim * batch
                    )
                    try:
                        for _ in range(2):
                            jax.block_until_ready(fn(*args))
                        entries.append((CUDNN_SAME_DV, fn, args, fl))
                    except Exception as e2:
                        traceback.print_exc()
                        rows.append(
                            dict(
                                impl=CUDNN_SAME_DV,
                                mask=name,
                                length=total,
                                mode=mode,
                                error=repr(e2)[:300],
                            )
                        )
        rounds = []
        times = bench_interleaved([(fn, args) for _, fn, args, _ in entries], calls, reps, rounds)
        for (impl, _, _, fl), t, r in zip(entries, times, rounds):
            rows.append(
                dict(
                    base,
                    **({"v_head_dim": head_dim} if impl == CUDNN_SAME_DV else {}),
                    impl=impl,
                    mode=mode,
                    ms=t * 1e3,
                    tflops=fl / t / 1e12,
                    rounds_ms=[round(x * 1e3, 4) for x in r],
                )
            )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--masks", default="full,causal,doc_causal")
    p.add_argument("--lengths", default="16384")
    p.add_argument("--impls", default="ffa_pallas,cudnn,tokamax")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--v-head-dim",
        type=int,
        default=None,
        help="v's (and the output's) head dim, default --head-dim (MLA: e.g. 192 / 128)",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--tokens-per-batch",
        type=int,
        default=32768,
        help="batch = max(1, this // length) (default: B=2 at 16k, 1 at 32k)",
    )
    p.add_argument("--calls", type=int, default=5, help="blocked calls per timing round")
    p.add_argument(
        "--reps",
        type=int,
        default=5,
        help="timing rounds per impl, alternating between the impls of a case",
    )
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "kernel"))
    p.add_argument("--tag", default="")
    p.add_argument(
        "--judge",
        metavar="JSON",
        default=None,
        help="print the kernel targets a results file measures and exit (no GPU needed)",
    )
    a = p.parse_args(argv)
    if a.judge:
        with open(a.judge) as f:
            checks = target_lines(json.load(f)["rows"])
        for c in checks:
            print(
                f"{c['line']:32s} {c['target']:22s} {c['value']:9.3f}  "
                f"{'holds' if c['holds'] else 'FAILS'}"
            )
        return checks
    if a.preset:
        cases = PRESETS[a.preset]
    else:
        cases = [(m, int(t), None) for t in a.lengths.split(",") for m in a.masks.split(",")]
    impls = a.impls.split(",")
    modes = a.modes.split(",")
    dtype = jnp.dtype(a.dtype)
    kvh = a.kv_heads or a.heads
    work = [
        (tuple(only or impls), m, t, tuple(c[3]) if len(c) > 3 else modes)
        for c in cases
        for m, t, only in [c[:3]]
    ]
    try:
        from tqdm import tqdm

        it = tqdm(work, file=sys.stderr)
    except ImportError:
        it = work
    rows = []
    dev = jax.devices()[0]
    meta = environment(
        argv,
        device=getattr(dev, "device_kind", str(dev)),
        tokamax=package_version("tokamax"),
        heads=a.heads,
        kv_heads=kvh,
        head_dim=a.head_dim,
        v_head_dim=a.v_head_dim or a.head_dim,
        dtype=dtype.name,
        tokens_per_batch=a.tokens_per_batch,
        calls=a.calls,
        reps=a.reps,
        flops="2*area*Hq*(Dqk+Dv)*B fwd, 3.5x for fwd+bwd",
    )
    os.makedirs(a.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    base = os.path.join(a.out, f"kernel_{stamp}_{meta['device'].replace(' ', '_')}{a.tag}")

    def save():  # after every case, so a sweep cut short still leaves its results
        with open(base + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(markdown(rows, meta))

    for case_impls, name, total, case_modes in it:
        if hasattr(it, "set_description"):
            it.set_description(f"{name} {total}")
        batch = max(1, a.tokens_per_batch // total)
        rows += run_group(
            case_impls,
            name,
            total,
            batch,
            a.heads,
            kvh,
            a.head_dim,
            dtype,
            case_modes,
            a.calls,
            a.reps,
            a.v_head_dim,
        )
        save()
    save()
    print(markdown(rows, meta))
    return rows


def _config(row) -> str:
    """The head configuration of a row, as :data:`TARGET_LINES` keys it: ``d64``, ``d256``,
    ``gqa`` (fewer key heads than query heads), ``default``, or ``mla`` (v of a head dim of its
    own: no targets); rows without head fields count as the benchmark's defaults (Hq = Hkv =
    16, D = 128)."""
    heads = row.get("heads", 16)
    d = row.get("head_dim", 128)
    if row.get("v_head_dim", d) != d:
        return "mla"
    if d in (64, 256):
        return f"d{d}"
    return "gqa" if row.get("kv_heads", heads) < heads else "default"


def target_lines(rows):
    """The kernel targets that ``rows`` measure: dicts of ``line``, ``target``, ``value``
    (a ratio, or TFLOP/s for an absolute target) and ``holds``."""
    rate = {
        (_config(r), r["mask"], r["length"], r["mode"], r["impl"]): r["tflops"]
        for r in rows
        if "tflops" in r
    }
    label = lambda cfg, mask, length, mode: (
        f"{mask} {length} {mode}" + ("" if cfg == "default" else f" [{cfg}]")
    )
    out = []
    for cfg, lines in TARGET_LINES.items():
        for mask, length, mode, against, target in lines:
            mine = rate.get((cfg, mask, length, mode, "ffa_pallas"))
            if mine is None:
                continue
            if against == "tflops":
                value, want = mine, f">= {target:g} TFLOP/s"
            elif (cfg, mask, length, mode, against) in rate:
                value = mine / rate[(cfg, mask, length, mode, against)]
                want = f">= {target:g}x {against}"
            else:
                continue
            out.append(
                dict(
                    line=label(cfg, mask, length, mode),
                    target=want,
                    value=value,
                    holds=value >= target,
                )
            )
    for (cfg, mask, length, mode, impl), mine in rate.items():
        causal = rate.get((cfg, "causal", length, mode, impl))
        if impl == "ffa_pallas" and mode == "fwd+bwd" and mask not in ("full", "causal") and causal:
            target = SHORT_DOC_LINE if (mask, length) in SHORT_DOC_MASKS else ZOO_LINE
            out.append(
                dict(
                    line=label(cfg, mask, length, mode),
                    target=f">= {target:g}x FFA causal",
                    value=mine / causal,
                    holds=mine / causal >= target,
                )
            )
    return out


def markdown(rows, meta) -> str:
    lines = [
        f"# Kernel benchmark {meta['date']} on {meta['device']}",
        "",
        f"{describe(meta)}, tokamax {meta['tokamax'] or 'not installed'}; "
        f"Hq={meta['heads']}, Hkv={meta['kv_heads']}, "
        f"D={meta['head_dim']}"
        + (
            f", Dv={meta['v_head_dim']} (rows {CUDNN_SAME_DV}: cuDNN at Dv = D)"
            if meta.get("v_head_dim", meta["head_dim"]) != meta["head_dim"]
            else ""
        )
        + f", {meta['dtype']}; B = max(1, "
        f"{meta['tokens_per_batch']} / length); TFLOP/s = {meta['flops']}",
        "",
        "| mask | length | mode | impl | ms | TFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "tflops" in r:
            lines.append(
                f"| {r['mask']} | {r['length']} | {r['mode']} | {r['impl']} | "
                f"{r['ms']:.3f} | {r['tflops']:.1f} |"
            )
        else:
            why = r.get("skipped") or r.get("error")
            lines.append(
                f"| {r['mask']} | {r['length']} | - | {r['impl']} | - | "
                f"{'skipped' if 'skipped' in r else 'ERROR'}: {why} |"
            )
    checks = target_lines(rows)
    if checks:
        lines += [
            "",
            "Kernel targets measured in this run:",
            "",
            "| line | target | value | holds |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {c['line']} | {c['target']} | {c['value']:.3f} | {'yes' if c['holds'] else 'no'} |"
            for c in checks
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
