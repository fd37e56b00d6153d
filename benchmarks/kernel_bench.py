"""Kernel benchmark: magi-jax's engines against the anchors users have, over the mask zoo and
realistic packings.

Rows: ``ffa_<engine>`` is ``flex_flash_attention(..., backend=<engine>)`` for each engine of
``--engines`` (``pallas``, ``xla`` up to 8k, ``auto``, ``cudnn``; one this version of the
library lacks is skipped with the reason). Anchors (``--anchors``): ``cudnn`` as a user
calls it (``jax.nn.dot_product_attention`` for full / causal; cuDNN's packed THD layout with
per-document offsets and lengths for every document mask, causal, full or with a causal
window), ``tokamax`` (rows as key intervals), ``xla_dense`` (up to 4k). TFLOP/s count the
mask's area for every row: ``2·area·Hq·(Dqk + Dv)·B`` forward, 3.5× forward+backward, 2.5×
the backward alone.

Masks: the zoo (``ZOO``), ``many_docs_<n>``, ``swa_causal_<w>``, and documents
``pack_<mix>`` (lengths from :mod:`magi_jax.masks.packings`, mix ``web`` or ``long``, seeded by
length) and ``docs<n>`` (``n`` equal documents), each causal, or ``..._full``, or
``..._w<window>`` (a causal window inside each document).

    python -m benchmarks.kernel_bench --preset realistic --out DIR        # causal documents
    python -m benchmarks.kernel_bench --preset realistic_masks --out DIR  # full, windowed
    python -m benchmarks.kernel_bench --preset stress --out DIR           # equal documents
    python -m benchmarks.kernel_bench --preset acceptance
    python -m benchmarks.kernel_bench --judge benchmarks/results/kernel/kernel_<...>.json

The markdown ends with the kernel targets (``TARGET_LINES``) the run measured and, for
document masks, ``auto`` against the faster of FFA pallas and cuDNN's packed layout.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import numpy as np

from benchmarks import harness
from magi_jax.masks import AttnMask, packings, random_doc_lengths, scaled_doc_lengths
from magi_jax.masks import make_mask as zoo_mask

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
ENGINES = ("pallas", "xla", "auto", "cudnn")
ANCHORS = ("cudnn", "tokamax", "xla_dense")
_PACKS = [f"pack_{mix}{kind}" for mix in ("web", "long") for kind in ("", "_full", "_w1024")]
# (mask, length, engines or None for --engines, anchors or None for --anchors).
PRESETS = {
    # The kernel targets at Hq = Hkv = 16, D = 128 (TARGET_LINES["default"]).
    "acceptance": [(m, t, None, None) for t in (16384, 32768) for m in ("full", "causal")]
    + [
        ("doc_causal", 32768, ("pallas",), ()),
        ("causal", 8192, ("pallas",), ()),
        ("doc_causal", 8192, ("pallas",), ()),
        ("many_docs_128", 32768, ("pallas",), ()),
    ]
    + [(m, 16384, ("pallas",), ()) for m in ZOO if m not in ("full", "causal")],
    "smoke": [("causal", 4096, None, None), ("doc_causal", 4096, None, None)],
    # Realistic packings (magi_jax.masks.packings): causal documents at 8k, 32k and 128k; then full
    # documents and a 1024-token window inside each. A few minutes each on an H100 (estimate).
    "realistic": [
        (f"pack_{m}", t, None, None) for t in (8192, 32768, 131072) for m in ("web", "long")
    ],
    "realistic_masks": [
        (m, 32768, None, None) for m in _PACKS if m not in ("pack_web", "pack_long")
    ]
    + [("pack_long_w1024", 131072, None, None)],
    # Many equal short documents: 128 and 512 in 32k (256 and 64 tokens), causal and full.
    "stress": [(f"docs{n}{kind}", 32768, None, None) for n in (128, 512) for kind in ("", "_full")],
    # Masks of 10^4+ slices built by AttnMask.from_fn against their own slice lists.
    "any_mask": [
        (m, 32768, ("pallas",), ())
        for m in ("causal", "fn_block_sparse_64_5", "block_sparse_64_5", "fn_docs_3", "docs_3")
    ],
}
_DOCS = re.compile(r"(pack_(?P<mix>web|long)|docs(?P<n>\d+))(?P<full>_full)?(_w(?P<w>\d+))?$")


def documents(name: str, total: int) -> tuple[np.ndarray, bool, int | None] | None:
    """``(doc_lens, causal, window)`` of a document mask (what cuDNN's packed layout takes),
    or None for a mask that is not one."""
    m = _DOCS.match(name)
    if m:
        if m["mix"]:
            mix = packings.MIXES[m["mix"]]
            rng = np.random.default_rng([total, list(packings.MIXES).index(m["mix"])])
            lens = packings.sample_doc_lens(total, rng, mix)
        else:
            lens = packings.equal_doc_lens(total, int(m["n"]))
        return lens, not m["full"], None if m["w"] is None else int(m["w"])
    if name in ("doc_causal", "doc_full"):
        lens = scaled_doc_lengths(total, 128 if total >= 16384 else 1)
        return np.array(lens), name == "doc_causal", None
    if name.startswith("many_docs_"):
        return np.array(random_doc_lengths(total, int(name.rsplit("_", 1)[1]))), True, None
    return None


def make_mask(name: str, total: int) -> AttnMask:
    """The mask ``name`` over ``total`` tokens (see the module docstring)."""
    docs = documents(name, total)
    if docs is not None:
        return packings.packing_mask(*docs)
    if name.startswith(("fn_", "block_sparse_", "docs_")):
        return any_mask(name, total)
    if name.startswith("swa_causal_"):
        return zoo_mask("sliding-window", total, window=int(name.rsplit("_", 1)[1]))
    if name not in ZOO:
        raise ValueError(f"unknown mask {name!r}; one of {ZOO}, pack_*, docs<n>*")
    return zoo_mask(
        name.replace("_", "-"), total, block=2048, multiple=128 if total >= 16384 else 1
    )


def any_mask(name: str, total: int) -> AttnMask:
    """``fn_<form>`` by ``AttnMask.from_fn``, ``<form>`` from its own slice list (checked to
    be the same cells): ``block_sparse_<block>_<pct>`` (random blocks at ``pct`` %),
    ``docs_<mean>`` (causal documents of 1 .. 2·mean - 1 tokens). Seeded."""
    rng = np.random.default_rng(0)
    by_fn, form = name.startswith("fn_"), name.removeprefix("fn_")
    if form.startswith("block_sparse_"):
        block, pct = (int(x) for x in form.removeprefix("block_sparse_").split("_"))
        nb = -(-total // block)
        blocks = rng.random((nb, nb)) < pct / 100
        if not by_fn:
            return AttnMask.from_block_mask(blocks, block, block, total, total)
        built = AttnMask.from_fn(
            lambda q, k: blocks[q // block, k // block], total, total, block=block
        )
    elif form.startswith("docs_"):
        mean = int(form.removeprefix("docs_"))
        cu = np.concatenate([[0], np.cumsum(rng.integers(1, 2 * mean, size=2 * total // mean))])
        cu = np.append(cu[cu < total], total)
        if not by_fn:
            return AttnMask.varlen(cu, causal=True)
        doc = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
        built = AttnMask.from_fn(lambda q, k: (doc[q] == doc[k]) & (k <= q), total, total)
    else:
        raise ValueError(f"unknown mask {name!r}")
    own = any_mask(form, total)
    if (built - own).area or (own - built).area:
        raise AssertionError(f"from_fn's {form} differs from its slice list's")
    return built


def attention_fns(name: str, mask: AttnMask, engines, anchors, batch: int) -> tuple[dict, list]:
    """``{impl: (f(q, k, v, *extra), extra)}`` and the rows of impls skipped, with why."""
    import jax.numpy as jnp

    from magi_jax.ffa import flex_flash_attention

    fns, skipped, t = {}, [], mask.total_q
    for e in engines:
        why = harness.backend_missing(e) or (
            "xla only up to 8k (slow)" if e == "xla" and t > 8192 else None
        )
        if why:
            print(f"skipping ffa_{e}: {why}")
            skipped.append(dict(impl=f"ffa_{e}", skipped=why))
            continue
        fns[f"ffa_{e}"] = (
            lambda q, k, v, e=e: flex_flash_attention(q, k, v, mask, backend=e)[0],
            (),
        )
    docs = documents(name, t)
    for a in anchors:
        try:
            if a == "cudnn" and docs is not None:
                lens, causal, window = docs
                extra = tuple(jnp.asarray(x) for x in harness.cudnn_packed_args(lens, batch))
                fns[a] = (harness.cudnn_packed(causal, window), extra)
            elif a == "cudnn":
                if name not in ("full", "causal"):
                    raise NotImplementedError("not full, causal or documents")
                fns[a] = (harness.cudnn_dense(name == "causal"), ())
            elif a == "tokamax":
                fns[a] = (harness.tokamax_intervals(mask, name), ())
            elif a == "xla_dense":
                if t > 4096:
                    raise NotImplementedError("dense XLA only up to 4k")
                dense = jnp.asarray(mask.to_dense())[None, None]
                import jax

                fns[a] = (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense), ())
            else:
                raise ValueError(f"unknown anchor {a!r}; one of {ANCHORS}")
        except (NotImplementedError, ImportError) as e:
            skipped.append(dict(impl=a, skipped=str(e)))
    return fns, skipped


def mode_fn(f, mode: str, qkv, do, extra):
    """``(jitted fn, args, FLOPs factor)`` of one mode of ``f(q, k, v, *extra)``."""
    import jax

    if mode == "fwd":
        return jax.jit(f), (*qkv, *extra), 1.0
    if mode == "bwd":  # from saved residuals
        _, vjp = jax.vjp(lambda q, k, v: f(q, k, v, *extra), *qkv)
        return jax.jit(lambda vf, do: vf(do)), (vjp, do), 2.5

    def fb(q, k, v, do, *extra):
        return jax.vjp(lambda q, k, v: f(q, k, v, *extra), q, k, v)[1](do)

    if mode == "fwd+bwd":
        return jax.jit(fb), (*qkv, do, *extra), 3.5
    raise ValueError(f"mode {mode!r}: fwd, bwd or fwd+bwd")


def run_case(name, total, engines, anchors, a) -> list[dict]:
    """Every impl of one case, each mode's impls timed in alternating rounds."""
    import jax
    import jax.numpy as jnp

    batch = max(1, a.tokens_per_batch // total)
    kvh, dv = a.kv_heads or a.heads, a.v_head_dim or a.head_dim
    mask = make_mask(name, total)
    docs = documents(name, total)
    *qkv, do = harness.random_inputs(total, batch, a.heads, kvh, a.head_dim, a.dtype, dv)
    flops = 2.0 * mask.area * a.heads * (a.head_dim + dv) * batch
    base = dict(
        mask=name,
        length=total,
        batch=batch,
        heads=a.heads,
        kv_heads=kvh,
        head_dim=a.head_dim,
        v_head_dim=dv,
        dtype=jnp.dtype(a.dtype).name,
        area=mask.area,
        docs=None if docs is None else len(docs[0]),
    )
    fns, skipped = attention_fns(name, mask, engines, anchors, batch)
    rows = [dict(base, mode="-", **s) for s in skipped]
    for mode in a.modes.split(","):
        ready = []
        for impl, (f, extra) in fns.items():
            built, err = harness.attempt(
                f"{name} {total} {mode} {impl}", mode_fn, f, mode, qkv, do, extra
            )
            if built is not None:  # compile and run once here, so a failure names its impl
                _, err = harness.attempt(
                    f"{name} {total} {mode} {impl}",
                    lambda b: jax.block_until_ready(b[0](*b[1])),
                    built,
                )
            if err:
                rows.append(dict(base, impl=impl, mode=mode, error=err))
            else:
                ready.append((impl, *built))
        timed, err = harness.attempt(
            f"{name} {total} {mode} timing",
            harness.time_interleaved,
            [(fn, args) for _, fn, args, _ in ready],
            a.calls,
            a.reps,
        )
        # Forward outputs against the first FFA engine's: an anchor wired wrong shows here.
        ref = next((f(*x) for i, f, x, _ in ready if mode == "fwd" and "ffa_" in i), None)
        diff = lambda f, x: float(jnp.max(jnp.abs(f(*x).astype(float) - ref.astype(float))))
        for (impl, fn, args, factor), got in zip(ready, timed or [(None, [])] * len(ready)):
            if got[0] is None:
                rows.append(dict(base, impl=impl, mode=mode, error=err))
                continue
            t, rounds = got
            rows.append(
                dict(
                    base,
                    impl=impl,
                    mode=mode,
                    ms=t * 1e3,
                    tflops=factor * flops / t / 1e12,
                    max_diff=None if ref is None else diff(fn, args),
                    rounds_ms=[round(x * 1e3, 4) for x in rounds],
                )
            )
    return rows


# Kernel targets on FFA pallas by head configuration (:func:`_config`): (mask, length, mode,
# against, target), against "cudnn" (a ratio) or "tflops" (absolute); besides, every other
# zoo mask's fwd+bwd against FFA's own causal rate (ZOO_LINE; SHORT_DOC_LINE for short docs).
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
# The engine `auto` must reach against the faster of these two on document masks.
AUTO_LINE = 0.98


def _config(row) -> str:
    """``d64``, ``d256``, ``gqa``, ``default``, or ``mla`` (Dv ≠ Dqk: no targets); rows
    without head fields count as Hq = Hkv = 16, D = 128."""
    heads, d = row.get("heads", 16), row.get("head_dim", 128)
    if row.get("v_head_dim", d) != d:
        return "mla"
    if d in (64, 256):
        return f"d{d}"
    return "gqa" if row.get("kv_heads", heads) < heads else "default"


def target_lines(rows) -> list[dict]:
    """The kernel targets ``rows`` measure: dicts of ``line``, ``target``, ``value`` (a ratio
    or TFLOP/s) and ``holds``."""
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
            other = rate.get((cfg, mask, length, mode, against))
            if mine is None or (against != "tflops" and other is None):
                continue
            value = mine if against == "tflops" else mine / other
            want = f">= {target:g} TFLOP/s" if against == "tflops" else f">= {target:g}x {against}"
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
        if (
            impl == "ffa_pallas"
            and mode == "fwd+bwd"
            and mask in ZOO + ("many_docs_128",)
            and mask not in ("full", "causal")
            and causal
        ):
            target = SHORT_DOC_LINE if (mask, length) in SHORT_DOC_MASKS else ZOO_LINE
            out.append(
                dict(
                    line=label(cfg, mask, length, mode),
                    target=f">= {target:g}x FFA causal",
                    value=mine / causal,
                    holds=mine / causal >= target,
                )
            )
    for (cfg, mask, length, mode, impl), mine in rate.items():
        if impl != "ffa_auto" or documents(mask, length) is None:
            continue
        best = max(rate.get((cfg, mask, length, mode, i), 0.0) for i in ("ffa_pallas", "cudnn"))
        if best:
            value = mine / best
            out.append(
                dict(
                    line=label(cfg, mask, length, mode),
                    target=f">= {AUTO_LINE:g}x best of FFA, cuDNN packed",
                    value=value,
                    holds=value >= AUTO_LINE,
                )
            )
    return out


def markdown(rows, meta) -> str:
    lines = [
        f"# Kernel benchmark {meta['date']} on {meta['device']}",
        "",
        f"{harness.describe(meta)}, tokamax {meta['tokamax'] or 'not installed'}; "
        f"Hq={meta['heads']}, Hkv={meta['kv_heads']}, D={meta['head_dim']}, "
        f"Dv={meta.get('v_head_dim', meta['head_dim'])}, {meta['dtype']}; "
        f"B = max(1, {meta['tokens_per_batch']} / length); TFLOP/s = {meta['flops']}",
        "",
    ]
    why = lambda r: f"skipped: {r['skipped']}" if "skipped" in r else f"ERROR: {r.get('error')}"
    shown = [dict(r, note="" if "tflops" in r else why(r)) for r in rows]
    cols = [(h, h) for h in ("mask", "length", "docs", "mode", "impl", "ms")]
    lines += harness.table(
        shown, cols + [("TFLOP/s", "tflops"), ("max diff", "max_diff"), ("note", "note")]
    )
    checks = target_lines(rows)
    if checks:
        lines += ["", "Kernel targets measured in this run:", ""]
        lines += harness.table(
            [dict(c, v=round(c["value"], 3), ok="yes" if c["holds"] else "no") for c in checks],
            [("line", "line"), ("target", "target"), ("value", "v"), ("holds", "ok")],
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--masks", default="full,causal,doc_causal")
    p.add_argument("--lengths", default="16384")
    p.add_argument("--engines", default="pallas,auto,cudnn,xla", help=f"of {ENGINES}")
    p.add_argument("--anchors", default="cudnn,tokamax", help=f"of {ANCHORS}")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--v-head-dim", type=int, default=None, help="v's head dim (MLA), default --head-dim"
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--tokens-per-batch", type=int, default=32768, help="batch = max(1, this // length)"
    )
    p.add_argument("--calls", type=int, default=5, help="blocked calls per timing round")
    p.add_argument("--reps", type=int, default=5, help="timing rounds, alternating between impls")
    p.add_argument("--out", default=str(harness.RESULTS / "kernel"))
    p.add_argument("--tag", default="")
    p.add_argument(
        "--judge", metavar="JSON", help="print the targets a results file measures (no GPU)"
    )
    a = p.parse_args(argv)
    if a.judge:
        with open(a.judge) as f:
            checks = target_lines(json.load(f)["rows"])
        for c in checks:
            print(
                f"{c['line']:32s} {c['target']:36s} {c['value']:9.3f}  "
                f"{'holds' if c['holds'] else 'FAILS'}"
            )
        return checks
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    import jax.numpy as jnp

    a.dtype = jnp.dtype(a.dtype)
    cases = (
        PRESETS[a.preset]
        if a.preset
        else [(m, int(t), None, None) for t in a.lengths.split(",") for m in a.masks.split(",")]
    )
    meta = harness.environment(
        argv,
        device=harness.device_name(),
        tokamax=harness.package_version("tokamax"),
        heads=a.heads,
        kv_heads=a.kv_heads or a.heads,
        head_dim=a.head_dim,
        v_head_dim=a.v_head_dim or a.head_dim,
        dtype=a.dtype.name,
        tokens_per_batch=a.tokens_per_batch,
        calls=a.calls,
        reps=a.reps,
        flops="2*area*Hq*(Dqk+Dv)*B fwd, 3.5x fwd+bwd, 2.5x bwd",
    )
    run = harness.Run("kernel", a.out, meta, markdown, a.tag)
    for name, total, engines, anchors in harness.progress(cases):
        engines = a.engines.split(",") if engines is None else engines
        anchors = [x for x in a.anchors.split(",") if x] if anchors is None else anchors
        rows, err = harness.attempt(f"{name} {total}", run_case, name, total, engines, anchors, a)
        run.add(*(rows or [dict(mask=name, length=total, impl="-", mode="-", error=err)]))
    print(markdown(run.rows, meta))
    print(f"wrote {run.base}.json and .md")
    return run.rows


if __name__ == "__main__":
    main()
