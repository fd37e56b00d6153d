"""End-to-end rows of the collective benchmark (``collective_bench.py``): ``magi_attention``
forward+backward on a doc-causal mask with the native transport against the XLA one, run by
each of the benchmark's two worker processes."""

from __future__ import annotations

import functools
import time

from gpu_trace import trace_summary


def tuning_fields(fields) -> dict:
    """``["mode=pull", "recv_blocks=128"]`` -> CudaTuning changes."""
    out = {}
    for f in fields:
        k, v = f.split("=")
        out[k] = (
            v
            if k == "mode" or not v.isdigit()
            else bool(int(v))
            if k in ("double_buffer", "started_reduce")
            else int(v)
        )
    return out


def e2e(args, mesh, me):
    """magi_attention forward+backward, doc-causal, the native transport (in the tunings of
    ``--e2e-backends``) against the XLA one, two ways: ``attn``, attention alone on
    dispatched q/k/v (what a training step runs per layer: its activations are dispatched
    once, at the embedding); ``step``, from replicated q/k/v in natural order through
    dispatch, attention and undispatch (the gradients of replicated inputs add an all-reduce
    of dq/dk/dv that both transports pay alike).

    Timing: every row is compiled and warmed up first; then ``--e2e-rounds`` rounds visit
    every row, each round in another (rotated) order, and each visit queues
    ``--e2e-steps`` steps back to back and waits once, as a training loop runs (the two
    processes then move in lockstep, and one process starting late costs a step only
    once per visit). Per row: the median over rounds of the time per step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from magi_jax.mask import AttnMask
    from magi_jax.mask_zoo import scaled_doc_lengths
    from magi_jax.sharding import dispatch, magi_attention, make_flex_key, native, undispatch

    total = args.e2e_tokens
    lens = scaled_doc_lengths(total)  # the benchmark documents (mask_zoo.DOC_LENGTHS)
    mask = AttnMask.varlen(np.cumsum([0] + lens), causal=True)
    H, D = 16, 128
    rep = NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    q, k, v = (
        jax.make_array_from_callback(
            (total, H, D),
            rep,
            lambda i, a=rng.standard_normal((total, H, D)).astype(np.float32): a[i],
        ).astype(jnp.bfloat16)
        for _ in range(3)
    )
    out = {"tokens": total, "heads": H, "head_dim": D, "mask": "doc_causal (PERF docs)"}
    flops = 4 * mask.area * H * D * 3.5
    backends = [b for b in args.e2e_backends.split(",") if b]
    rows = []  # (name, step, overlap degree), compiled and warmed up
    for ffa in ("pallas", "xla"):
        if ffa == "xla" and any(n.startswith("pallas") for n, _, _ in rows):
            break  # the portable FFA only when the Mosaic GPU one did not run
        for spec in backends:
            comm, *fields = spec.split(":")
            tv = tuning_fields(fields)
            if args.skip_native and (comm == "native" or ffa == "pallas"):
                continue
            try:
                key = make_flex_key(mask, mesh, "cp", comm_backend=comm, ffa_backend=ffa)
            except Exception as e:  # noqa: BLE001
                out[f"{ffa}/{spec}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            qd, kd, vd = (jax.jit(dispatch)(x, key) for x in (q, k, v))

            def attn(q_, k_, v_, key_):
                return magi_attention(q_, k_, v_, key_)[0].astype(jnp.float32).sum()

            def step(q_, k_, v_, key_):
                o, _ = magi_attention(
                    dispatch(q_, key_), dispatch(k_, key_), dispatch(v_, key_), key_
                )
                return undispatch(o, key_).astype(jnp.float32).sum()

            for what, loss, xs in (("attn", attn, (qd, kd, vd)), ("step", step, (q, k, v))):
                if what not in args.e2e_modes:
                    continue
                name = f"{ffa}/{spec}/{what}"
                # A backend listed twice (e.g. native,ppermute,native,ppermute: both orders
                # in one process) gets a second row.
                seen = sum(
                    o == name or o.startswith(name + " #") for o in [*out, *(n for n, _, _ in rows)]
                )
                name += f" #{seen + 1}" if seen else ""
                try:
                    # Compiled ahead of time, each row traced anew: jit's caches do not key
                    # on the native tuning, and a compiled row keeps its executable.
                    jax.clear_caches()
                    with native.tuning(**tv):
                        f = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*xs, key).compile()
                    jax.block_until_ready(f(*xs, key))
                    rows.append((name, functools.partial(f, *xs, key), key.overlap_degree))
                except Exception as e:  # noqa: BLE001
                    out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    if me == 0:
                        print(f"e2e {name}: {out[name]}", flush=True)
    times = {name: [] for name, _, _ in rows}
    for r in range(args.e2e_rounds):
        for name, fn, _ in rows[r % len(rows) :] + rows[: r % len(rows)]:
            t = time.perf_counter()
            jax.block_until_ready([fn() for _ in range(args.e2e_steps)])
            times[name].append((time.perf_counter() - t) / args.e2e_steps)
    for name, fn, degree in rows:
        med = float(np.median(times[name]))
        out[name] = {
            "s": med,
            "best_s": min(times[name]),
            "rounds_s": times[name],
            "TFLOPs_per_gpu": flops / med / 2 / 1e12,
            "overlap_degree": degree,
        }
        if args.profile:
            out[name]["trace"] = trace_summary(fn, timeline_min_us=args.timeline_us)
        if me == 0:
            print(f"e2e {name}: {out[name]}", flush=True)
    return out
