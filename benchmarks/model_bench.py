"""Model benchmark: a Llama-3-1B-shaped decoder trained on one GPU over realistic packings.

Dim 2048, 16 layers, 32 query / 8 key heads of 64, SwiGLU 8192, RoPE (positions restart at
every document), tied embeddings (vocab 128256), each layer rematerialised, bf16 compute
over float32 AdamW weights; one row of ``--tokens`` tokens a step, a new packing from
:mod:`magi_jax.masks.packings` every step (``--mix``, causal documents). Attention variants, all
in one run and one table:

- ``auto`` and each engine forced (``--engines``): ``magi_jax.dot_product_attention`` with
  the step's segment ids as data (a plan built on the device: one compilation for every
  packing); an engine this version lacks is skipped with the reason;
- ``cudnn_packed``: the same model calling cuDNN's packed THD layout directly (per-document
  offsets and lengths as data, padded to a fixed number of documents), as MaxText and
  Transformer Engine train.

tokens/s over the timed steps (every step blocked on, its packing staged on the device
beforehand); MFU = (6·N·T + 12·L·Hq·Dh·area) / time / peak, N the matmul parameters (the
tied head counted once, the embedding lookup not), ``area`` the packing's causal cells, the
peak bf16 dense rate by device (``--peak-tflops``); rematerialisation is not counted.

    python -m benchmarks.model_bench --out DIR    # 32k and 64k (estimate: ~6 min, H100)
    python -m benchmarks.model_bench --smoke      # tiny model on CPU, xla backend
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import magi_jax as mj
from benchmarks import harness
from magi_jax.masks import packings


@dataclasses.dataclass(frozen=True)
class Shape:
    dim: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    ffn: int = 8192
    vocab: int = 128256
    rope_theta: float = 500000.0

    @property
    def matmul_params(self) -> int:
        d, h, kv, dh = self.dim, self.heads, self.kv_heads, self.head_dim
        layer = d * h * dh * 2 + d * kv * dh * 2 + 3 * d * self.ffn
        return self.layers * layer + d * self.vocab


SMOKE = Shape(dim=32, layers=1, heads=2, kv_heads=1, head_dim=16, ffn=64, vocab=128)
# bf16 dense peaks (TFLOP/s) by device kind, for MFU.
_PEAKS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "GH200": 989.0}
_LOSS_CHUNK = 4096


def init_params(key, s: Shape):

    ks = jax.random.split(key, 8)
    n = lambda k, shape, fan_in: jax.random.normal(k, shape, jnp.float32) * fan_in**-0.5
    L, d, h, kv, dh, f = s.layers, s.dim, s.heads, s.kv_heads, s.head_dim, s.ffn
    return dict(
        embed=n(ks[0], (s.vocab, d), d),
        norm=jnp.ones((d,)),
        layers=dict(
            attn_norm=jnp.ones((L, d)),
            wq=n(ks[1], (L, d, h * dh), d),
            wk=n(ks[2], (L, d, kv * dh), d),
            wv=n(ks[3], (L, d, kv * dh), d),
            wo=n(ks[4], (L, h * dh, d), h * dh),
            mlp_norm=jnp.ones((L, d)),
            w1=n(ks[5], (L, d, f), d),
            w3=n(ks[6], (L, d, f), d),
            w2=n(ks[7], (L, f, d), f),
        ),
    )


def rms_norm(x, w):

    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5) * w).astype(x.dtype)


def rope(x, pos, theta):
    """Rotary embedding of ``x`` ``[B, T, H, Dh]`` at positions ``pos`` ``[B, T]``."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = pos[..., None, None].astype(jnp.float32) * freq
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def loss_fn(params, batch, s: Shape, attend):
    """Mean next-token cross-entropy of ``batch`` (tokens, positions, segment data)."""
    tokens, pos = batch["tokens"], batch["pos"]
    b, t = tokens.shape
    cast = lambda p: jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
    x = cast(params["embed"])[tokens]

    @jax.checkpoint
    def layer(x, w):
        h = rms_norm(x, w["attn_norm"])
        q = (h @ w["wq"]).reshape(b, t, s.heads, s.head_dim)
        k = (h @ w["wk"]).reshape(b, t, s.kv_heads, s.head_dim)
        v = (h @ w["wv"]).reshape(b, t, s.kv_heads, s.head_dim)
        q, k = rope(q, pos, s.rope_theta), rope(k, pos, s.rope_theta)
        x = x + attend(q, k, v, batch).reshape(b, t, -1) @ w["wo"]
        h = rms_norm(x, w["mlp_norm"])
        return x + (jax.nn.silu(h @ w["w1"]) * (h @ w["w3"])) @ w["w2"], None

    x, _ = jax.lax.scan(layer, x, cast(params["layers"]))
    x = rms_norm(x, params["norm"].astype(jnp.bfloat16)).reshape(b * t, s.dim)
    targets = jnp.roll(tokens, -1, axis=1).reshape(b * t)
    head = cast(params["embed"])
    chunk = min(_LOSS_CHUNK, b * t)

    @jax.checkpoint
    def chunk_loss(args):  # the logits of one chunk only: [chunk, vocab] in float32
        xc, tc = args
        logits = (xc @ head.T).astype(jnp.float32)
        return jnp.sum(
            jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tc[:, None], -1)[:, 0]
        )

    parts = jax.lax.map(chunk_loss, (x.reshape(-1, chunk, s.dim), targets.reshape(-1, chunk)))
    return parts.sum() / (b * t)


def attention_variant(name: str):
    """``attend(q, k, v, batch)`` of a variant: ``cudnn_packed`` or a magi_jax backend."""
    if name == "cudnn_packed":
        f = harness.cudnn_packed(causal=True)
        return lambda q, k, v, batch: f(q, k, v, batch["q_seqlen"], batch["q_offsets"])
    return lambda q, k, v, batch: mj.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=batch["segment_ids"], backend=name
    )


def make_batches(steps: int, total: int, mix, vocab: int, max_docs: int, seed: int = 0):
    """``steps`` host batches, each a fresh packing: tokens, per-document positions, segment
    ids, cuDNN's padded lengths and offsets, and the packing's causal area."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < steps:
        lens = packings.sample_doc_lens(total, rng, mix)
        if len(lens) > max_docs:  # a packing past the fixed document bound: draw again
            continue
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        seqlen, offsets = harness.cudnn_packed_args(lens, 1, max_docs)
        out.append(
            dict(
                tokens=rng.integers(0, vocab, (1, total), dtype=np.int32),
                pos=(np.arange(total) - starts).astype(np.int32)[None],
                segment_ids=packings.segment_ids(lens)[None],
                q_seqlen=seqlen,
                q_offsets=offsets,
                area=int((lens * (lens + 1) // 2).sum()),
                docs=len(lens),
            )
        )
    return out


def train_variant(variant, s: Shape, total: int, batches, a) -> dict:
    """Compile one training step for ``variant`` and time ``a.steps`` of them."""
    import optax

    attend = attention_variant(variant)
    opt = optax.adamw(1e-4, weight_decay=0.1)
    params = init_params(jax.random.key(0), s)
    state = opt.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, s, attend)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    dev = [{k: jnp.asarray(v) for k, v in b.items() if k not in ("area", "docs")} for b in batches]
    t0 = time.perf_counter()
    params, state, loss = step(params, state, dev[0])
    jax.block_until_ready(loss)
    compile_s = time.perf_counter() - t0
    for b in dev[1 : 1 + a.warmup]:
        params, state, loss = step(params, state, b)
    jax.block_until_ready(loss)
    timed = dev[1 + a.warmup :]
    times = []
    for b in timed:
        t0 = time.perf_counter()
        params, state, loss = step(params, state, b)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    area = np.mean([b["area"] for b in batches[1 + a.warmup :]])
    flops = 6 * s.matmul_params * total + 12 * s.layers * s.heads * s.head_dim * area
    sec = float(np.median(times))
    peak = a.peak_tflops
    return dict(
        step_ms=sec * 1e3,
        tokens_per_s=total / sec,
        model_tflops=flops / sec / 1e12,
        mfu=None if not peak else flops / sec / 1e12 / peak,
        loss=float(loss),
        compile_s=compile_s,
        steps_ms=[round(t * 1e3, 2) for t in times],
        docs=float(np.mean([b["docs"] for b in batches[1 + a.warmup :]])),
    )


def markdown(rows, meta) -> str:
    shape = ", ".join(f"{k} {v:g}" for k, v in meta["shape"].items())
    lines = [
        f"# Model benchmark {meta['date']} on {meta['device']}",
        "",
        f"{harness.describe(meta)}; {shape}; mix {meta['mix']}, {meta['steps']} timed "
        f"steps after {meta['warmup']} warm-up, a new packing each; MFU at "
        f"{meta['peak_tflops']} TFLOP/s peak",
        "",
    ]
    for r in rows:
        r.setdefault("note", r.get("error") or r.get("skipped") or "")
    lines += harness.table(
        rows,
        [
            ("tokens", "tokens"),
            ("attention", "variant"),
            ("docs", "docs"),
            ("step ms", "step_ms"),
            ("tokens/s", "tokens_per_s"),
            ("TFLOP/s", "model_tflops"),
            ("MFU", "mfu"),
            ("compile s", "compile_s"),
            ("note", "note"),
        ],
    )
    for r in rows:
        r.pop("note")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="32768,65536")
    p.add_argument("--mix", default="web", choices=sorted(packings.MIXES))
    p.add_argument("--engines", default="auto,pallas,cudnn", help="magi_jax backends (xla: slow)")
    p.add_argument("--anchors", default="cudnn_packed", help="cudnn_packed, or empty")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=None, help="default by device kind")
    p.add_argument("--smoke", action="store_true", help="tiny model, 128 tokens, xla, on CPU")
    p.add_argument("--out", default=str(harness.RESULTS / "dynamic"))
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    shape = Shape()
    if a.smoke:
        shape, a.tokens, a.engines, a.anchors, a.steps, a.warmup = SMOKE, "128", "xla", "", 1, 0
    device = harness.device_name()
    if a.peak_tflops is None:
        a.peak_tflops = next((v for k, v in _PEAKS.items() if k in device), None)
    mix = packings.MIXES[a.mix]
    variants = [v for v in a.engines.split(",") + a.anchors.split(",") if v]
    meta = harness.environment(
        argv,
        device=device,
        shape=dataclasses.asdict(shape),
        mix=a.mix,
        steps=a.steps,
        warmup=a.warmup,
        peak_tflops=a.peak_tflops,
        variants=variants,
        mfu="(6*N*T + 12*L*Hq*Dh*area) / time / peak",
    )
    run = harness.Run("model", a.out, meta, markdown, a.tag)
    for total in (int(t) for t in a.tokens.split(",")):
        a.max_docs = int(2 * total / mix.mean(total)) + 16
        batches = make_batches(1 + a.warmup + a.steps, total, mix, shape.vocab, a.max_docs)
        for v in harness.progress(variants, desc=f"{total} tokens"):
            why = None if v == "cudnn_packed" else harness.backend_missing(v)
            if why:
                print(f"skipping {v}: {why}")
                run.add(dict(tokens=total, variant=v, skipped=why))
                continue
            got, err = harness.attempt(f"{v} {total}", train_variant, v, shape, total, batches, a)
            run.add(dict(tokens=total, variant=v, **(got or {"error": err})))
    print(markdown(run.rows, meta))
    print(f"wrote {run.base}.json and .md")
    return run.rows


if __name__ == "__main__":
    main()
