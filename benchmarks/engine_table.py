"""Measures the FFA kernels against the cudnn engine per mask class and rewrites the engine
table that ``backend="auto"`` reads (``magi_jax/ffa/engine_table.json``).

On one GPU (sm90: both engines run there):

    python benchmarks/engine_table.py                       # measure, rewrite this GPU's rows

times ``flex_flash_attention`` with ``backend="pallas"`` and ``backend="cudnn"`` on the
same inputs (bf16, Hq = Hkv = 16, D = 128, 32768 tokens a call: B = 32768 / length), forward
and forward + backward, for every class of cuDNN's packed layout: full and causal, realistic
packings (``magi_jax.masks.packings``: web text at 8k, 32k and 128k, the long-context mixture at
32k; causal, full and with a 1024-token window) and the stress cases (128 and 512 equal
documents in 32k). It replaces this GPU kind's rows of the table and writes the run to
``benchmarks/results/kernel/engine_table_<date>_<device>.{json,md}``.

    python benchmarks/engine_table.py --from-runs RUN.json ...

rebuilds rows from earlier ``kernel_bench.py`` runs instead (no GPU): every packed-layout mask
where a run timed ``ffa_pallas`` and the cudnn engine (``ffa_cudnn``), and the full and
causal rows of older runs that timed ``cudnn`` through ``jax.nn`` (their other cuDNN rows gave
cuDNN a dense boolean mask, not the packed layout, and are not used).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from benchmarks import harness
from magi_jax.ffa.engine_table import TABLE_PATH, mask_class

_TOKENS_PER_CALL = 32768
_HEADS, _HEAD_DIM = 16, 128
_WINDOW = 1024
_KEYS = ("device", "class", "tokens", "docs", "mode")


def _cases(smoke: bool):
    from magi_jax import AttnMask
    from magi_jax.masks.packings import equal_doc_lens, sample_doc_lens

    def docs(lens, causal=True, window=None):
        cu = np.concatenate([[0], np.cumsum(lens)])
        return AttnMask.varlen(cu, causal=causal, window=window)

    if smoke:
        yield "causal 2k", AttnMask.causal(2048)
        yield "web 2k", docs(sample_doc_lens(2048, 0))
        return
    yield "full 16k", AttnMask.full(16384)
    yield "causal 16k", AttnMask.causal(16384)
    yield "causal 32k", AttnMask.causal(32768)
    for total in (8192, 32768, 131072):
        yield f"web {total // 1024}k", docs(sample_doc_lens(total, 0))
    yield "long-context 32k", docs(sample_doc_lens(32768, 0, "long"))
    yield "web 32k full", docs(sample_doc_lens(32768, 0), causal=False)
    yield f"web 32k window {_WINDOW}", docs(sample_doc_lens(32768, 0), window=(_WINDOW - 1, 0))
    for n in (128, 512):
        yield f"{n} equal docs 32k", docs(equal_doc_lens(32768, n))


def _measure(mask, engine: str, reps: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    import magi_jax as mj

    t = mask.total_q
    b = max(1, _TOKENS_PER_CALL // t)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, t, _HEADS, _HEAD_DIM), jnp.bfloat16) for kk in keys)
    attn = lambda q, k, v: mj.flex_flash_attention(q, k, v, mask, backend=engine)[0]
    fwd = jax.jit(attn)
    both = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
    timed = harness.time_interleaved([(fwd, (q, k, v)), (both, (q, k, v, do))], 1, reps, 1)
    return {mode: med * 1e3 for mode, (med, _) in zip(("fwd", "fwd+bwd"), timed)}


def _merge(rows: list[dict]) -> None:
    with open(TABLE_PATH) as f:
        table = json.load(f)
    new = {tuple(r[k] for k in _KEYS) for r in rows}
    kept = [r for r in table["rows"] if tuple(r[k] for k in _KEYS) not in new]
    table["rows"] = sorted(kept + rows, key=lambda r: tuple(str(r[k]) for k in _KEYS))
    with open(TABLE_PATH, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


def _from_runs(paths: list[str]) -> list[dict]:
    """Rows of the table from ``kernel_bench.py`` runs: every mask of cuDNN's packed layout
    where a run timed the FFA kernels (``ffa_pallas``) and the cudnn engine as ``auto`` runs
    it (``ffa_cudnn``); for full and causal masks, older runs' ``cudnn`` rows (cuDNN through
    ``jax.nn``, the same call the engine makes for one document) stand in where the engine
    was not timed."""
    from benchmarks.kernel_bench import make_mask

    rows = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        meta = run["meta"]
        found = {}
        for r in run["rows"]:
            if not isinstance(r.get("ms"), (int, float)):
                continue  # a row that failed
            if r["impl"] == "ffa_cudnn" or (
                r["impl"] == "cudnn" and r["mask"] in ("full", "causal")
            ):
                engine = "cudnn"
            elif r["impl"] == "ffa_pallas":
                engine = "pallas"
            else:
                continue
            try:
                cls, docs = mask_class(make_mask(r["mask"], r["length"]))
            except ValueError:
                continue  # not a mask of cuDNN's packed layout
            shape = (r["heads"], r.get("kv_heads", r["heads"]), r.get("head_dim"))
            key = (cls, docs, r["length"], r["mode"], shape)
            pair = found.setdefault(key, {})
            if engine not in pair or r["impl"] == "ffa_cudnn":
                pair[engine] = r
        for (cls, docs, length, mode, shape), pair in sorted(found.items()):
            if len(pair) != 2:
                continue
            rows.append(
                {
                    "device": meta["device"],
                    "class": cls,
                    "tokens": int(length),
                    "docs": int(docs),
                    "mode": mode,
                    "heads": f"{shape[0]}:{shape[1]}",
                    "head_dim": shape[2],
                    "pallas_ms": round(pair["pallas"]["ms"], 4),
                    "cudnn_ms": round(pair["cudnn"]["ms"], 4),
                    "date": meta["date"],
                    "run": os.path.relpath(os.path.abspath(path), harness.ROOT),
                }
            )
    return rows


def markdown(rows, meta) -> str:
    lines = [
        f"# Engine table run, {meta['date']}, {meta['device']}",
        "",
        f"{harness.describe(meta)}; {meta['shape']}; median of {meta['reps']}",
        "",
    ]
    shown = [dict(r, ratio=r["cudnn_ms"] / r["pallas_ms"]) for r in rows]
    columns = [("case", "run"), ("class", "class"), ("docs", "docs"), ("mode", "mode")]
    columns += [("pallas ms", "pallas_ms"), ("cudnn ms", "cudnn_ms")]
    return "\n".join(lines + harness.table(shown, columns + [("cudnn / pallas", "ratio")])) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from-runs", nargs="*", default=None, help="kernel_bench JSON runs")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="two small cases, table untouched")
    p.add_argument("--out", default="benchmarks/results/kernel")
    a = p.parse_args(argv)
    if a.from_runs is not None:
        rows = _from_runs(a.from_runs)
        _merge(rows)
        print(f"{len(rows)} rows from {len(a.from_runs)} runs into {TABLE_PATH}")
        return
    meta = harness.environment(
        argv,
        device=harness.device_name(),
        shape=f"bf16, Hq = Hkv = {_HEADS}, D = {_HEAD_DIM}, {_TOKENS_PER_CALL} tokens a call",
        reps=a.reps,
    )
    run = harness.Run("engine_table", a.out, meta, markdown)
    cases = list(_cases(a.smoke))
    for i, (name, mask) in enumerate(cases, 1):
        cls, docs = mask_class(mask)
        ms = {e: _measure(mask, e, a.reps) for e in ("pallas", "cudnn")}
        for mode in ("fwd", "fwd+bwd"):
            run.add(
                {
                    "device": meta["device"],
                    "class": cls,
                    "tokens": mask.total_q,
                    "docs": docs,
                    "mode": mode,
                    "heads": f"{_HEADS}:{_HEADS}",
                    "head_dim": _HEAD_DIM,
                    "pallas_ms": round(ms["pallas"][mode], 4),
                    "cudnn_ms": round(ms["cudnn"][mode], 4),
                    "date": meta["date"],
                    "run": name,
                }
            )
        print(f"[{i}/{len(cases)}]", *markdown(run.rows[-2:], meta).splitlines()[-2:], sep="\n")
    if not a.smoke:
        _merge(run.rows)
    print(f"wrote {run.base}.json/.md" + ("" if a.smoke else f" and {TABLE_PATH}"))


if __name__ == "__main__":
    main()
