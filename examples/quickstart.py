"""magi-jax in one screen: a packed document mask, flex_flash_attention forward and backward
on the default device, checked against the dense reference.

    python examples/quickstart.py [--seqlen 4096] [--heads 8] [--kv-heads 2] [--head-dim 64]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import magi_jax as mj


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)

    # Packed documents of random lengths, causal inside each document.
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, args.seqlen), size=7, replace=False))
    cu_seqlens = np.concatenate([[0], cuts, [args.seqlen]])
    mask = mj.AttnMask.varlen(cu_seqlens, causal=True)
    dense_cells = args.seqlen**2
    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"
    )
    print(f"mask:   {len(cu_seqlens) - 1} causal documents {np.diff(cu_seqlens).tolist()}")
    print(
        f"        {mask.num_slices} slices, area {mask.area:,} cells "
        f"({100 * mask.area / dense_cells:.1f}% of the dense {args.seqlen}x{args.seqlen})"
    )
    backend, why = mj.select_backend("auto")
    print(f"backend: {backend} ({why})")

    key = jax.random.key(0)
    kq, kk, kv, kd = jax.random.split(key, 4)
    t, hq, hkv, d = args.seqlen, args.heads, args.kv_heads, args.head_dim
    q = jax.random.normal(kq, (t, hq, d), dtype)
    k = jax.random.normal(kk, (t, hkv, d), dtype)
    v = jax.random.normal(kv, (t, hkv, d), dtype)
    dout = jax.random.normal(kd, (t, hq, d), dtype)

    @jax.jit
    def fwd_bwd(q, k, v, dout):
        (out, lse), vjp = jax.vjp(lambda *x: mj.flex_flash_attention(*x, mask), q, k, v)
        dq, dk, dv = vjp((dout, jnp.zeros_like(lse)))
        return out, lse, dq, dk, dv

    out, lse, dq, dk, dv = jax.block_until_ready(fwd_bwd(q, k, v, dout))  # compile + run
    start = time.perf_counter()
    out, lse, dq, dk, dv = jax.block_until_ready(fwd_bwd(q, k, v, dout))
    sec = time.perf_counter() - start
    flops = 3.5 * 4 * mask.area * hq * d
    print(
        f"forward+backward: q {q.shape} {dtype.name}, k/v {k.shape} -> out {out.shape}, "
        f"lse {lse.shape} {lse.dtype}; {sec * 1e3:.1f} ms, {flops / sec / 1e12:.3f} TFLOP/s"
    )

    # Check the leading documents (up to ~1024 tokens) against the dense float32 reference.
    n_docs = max(1, int(np.searchsorted(cu_seqlens, 1024, side="right")) - 1)
    n = int(cu_seqlens[n_docs])
    sub = mj.AttnMask.varlen(cu_seqlens[: n_docs + 1], causal=True)
    f32 = lambda x: x[:n].astype(jnp.float32)
    ref_out, _ = mj.reference_attention(f32(q), f32(k), f32(v), sub)
    err = float(jnp.max(jnp.abs(f32(out) - ref_out)))
    finite = all(bool(jnp.isfinite(g).all()) for g in (out, dq, dk, dv))
    print(
        f"check:  max |out - dense reference| over the first {n_docs} document(s) ({n} "
        f"tokens) = {err:.2e}; all outputs and gradients finite: {finite}"
    )


if __name__ == "__main__":
    main()
