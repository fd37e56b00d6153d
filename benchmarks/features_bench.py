"""What attention sinks and max logits cost: FFA with and without them, same run.

Times ``flex_flash_attention`` on one case (default: doc-causal 32k, bf16, Hq = Hkv = 16,
D = 128, the zoo's document lengths) in four variants — plain, ``sink=`` (4 sink logits per
head), ``return_max_logits=True``, and both — forward alone and forward+backward (the
backward differentiates the sink logits too). Variants of one mode are timed in alternating
rounds after two warm-up calls each (``harness.time_interleaved``), so the medians
compare within one run. Writes ``<out>/features_<date>_<device>.{json,md}``.

    PYTHONPATH=. python benchmarks/features_bench.py
    PYTHONPATH=. python benchmarks/features_bench.py --mask causal --length 16384 --softcap 30
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import magi_jax as mj  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.kernel_bench import make_mask  # noqa: E402

VARIANTS = {
    "plain": (False, False),
    "sinks": (True, False),
    "max_logits": (False, True),
    "sinks+max_logits": (True, True),
}
MODES = ("fwd", "fwd+bwd")
NUM_SINKS = 4


def variant_fn(mask, sinks: bool, max_logits: bool, mode: str, softcap: float, backend: str):
    """A jitted ``fn(q, k, v, do, sink)``: the forward's outputs, or the gradients of
    ``Σ out·do`` in q, k, v (and the sink logits) with the max logits beside them."""

    def attend(q, k, v, sink):
        return mj.flex_flash_attention(
            q,
            k,
            v,
            mask,
            softcap=softcap,
            backend=backend,
            sink=sink if sinks else None,
            return_max_logits=max_logits,
        )

    if mode == "fwd":
        return jax.jit(lambda q, k, v, do, sink: attend(q, k, v, sink))

    def fwd_bwd(q, k, v, do, sink):
        def loss(q, k, v, sink):
            res = attend(q, k, v, sink)
            return (res[0].astype(jnp.float32) * do).sum(), res[2:]

        grads, extra = jax.grad(loss, argnums=(0, 1, 2, 3) if sinks else (0, 1, 2), has_aux=True)(
            q, k, v, sink
        )
        return grads, extra

    return jax.jit(fwd_bwd)


def run(mask_name, length, heads, kv_heads, head_dim, dtype, softcap, backend, reps, n):
    mask = make_mask(mask_name, length)
    q, k, v, do = harness.random_inputs(length, 1, heads, kv_heads, head_dim, dtype)
    q, k, v, do = (x[0] for x in (q, k, v, do))
    do = do.astype(jnp.float32)
    sink = jax.random.normal(jax.random.key(1), (NUM_SINKS, heads), jnp.float32)
    name, why = mj.select_backend(backend, q, k, v, mask)
    rows = []
    for mode in MODES:
        fns = {
            v_: variant_fn(mask, *flags, mode, softcap, backend) for v_, flags in VARIANTS.items()
        }
        times = [
            t
            for t, _ in harness.time_interleaved(
                [(f, (q, k, v, do, sink)) for f in fns.values()], n, reps
            )
        ]
        plain = times[0]
        for v_, t in zip(fns, times):
            rows.append(
                dict(
                    mask=mask_name,
                    length=length,
                    heads=heads,
                    kv_heads=kv_heads,
                    head_dim=head_dim,
                    dtype=jnp.dtype(dtype).name,
                    softcap=softcap,
                    backend=name,
                    mode=mode,
                    variant=v_,
                    ms=t * 1e3,
                    vs_plain=t / plain,
                )
            )
    return rows, f"{name} ({why})"


def markdown(rows, meta) -> str:
    lines = [
        f"# Sinks and max logits: overhead ({meta['date']}, {meta['device']})",
        "",
        f"backend {meta['backend']}; {harness.describe(meta)}; median of {meta['reps']} rounds "
        f"of {meta['n']} calls after 2 warm-up calls, variants interleaved",
        "",
        "| case | mode | variant | ms | vs plain |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        case = (
            f"{r['mask']} {r['length']} {r['dtype']} H{r['heads']}/{r['kv_heads']} "
            f"D{r['head_dim']}" + (f" softcap {r['softcap']:g}" if r["softcap"] else "")
        )
        lines.append(
            f"| {case} | {r['mode']} | {r['variant']} | {r['ms']:.3f} | {r['vs_plain']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mask", default="doc_causal", help="a kernel_bench zoo mask")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--softcap", type=float, default=0.0)
    p.add_argument("--backend", default="auto", choices=("auto", "pallas", "xla"))
    p.add_argument("--reps", type=int, default=7, help="timing rounds (median over them)")
    p.add_argument("--n", type=int, default=5, help="calls per round")
    p.add_argument("--out", default="benchmarks/results/kernel")
    a = p.parse_args(argv)
    rows, backend = run(
        a.mask,
        a.length,
        a.heads,
        a.kv_heads or a.heads,
        a.head_dim,
        jnp.dtype(a.dtype),
        a.softcap,
        a.backend,
        a.reps,
        a.n,
    )
    meta = harness.environment(
        argv,
        device=harness.device_name(),
        backend=backend,
        reps=a.reps,
        n=a.n,
        num_sinks=NUM_SINKS,
    )
    record = harness.Run("features", a.out, meta, markdown)
    record.add(*rows)
    print(markdown(rows, meta))
    print(f"wrote {record.base}.json and .md")
    return rows


if __name__ == "__main__":
    main()
