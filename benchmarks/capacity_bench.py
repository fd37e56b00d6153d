"""Capacity that holds or grows: a training run on packings from a heavy-tailed document-length
distribution, starting from a capacity sized on two sample packings.

    python benchmarks/capacity_bench.py                      # 1,000 steps, 8 CPU host devices
    python benchmarks/capacity_bench.py --steps 100 --no-write

A small decoder (``examples/train.py``'s model, loss and data) trains under context
parallelism (mesh dp 2 x cp 4: each replica its own packing every step, a batched key) on
packings drawn from ``magi_jax.masks.packings.WEB_TEXT``. A ``CapacityPolicy`` fits every
step's packings before its key is planned (``prefetch_keys(capacity=...)``): an overflow
grows the capacity, and the train step compiles once more. Checked: no crash; every growth
logged; compilations <= ``--max-compiles``; each field of the settled capacity within
``--max-ratio`` of the tightest capacity for the packings seen (the most any packing
needed); the loss equal to the one-device model's (same parameters and batch) at the steps
of ``--check-steps``. Writes a JSON record and a Markdown table under
``benchmarks/results/planning/``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time

from benchmarks import harness

OUT = harness.RESULTS / "planning"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seqlen", type=int, default=1024, help="packed tokens per replica")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--max-period", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sample", type=int, default=2, help="packings the capacity starts from")
    ap.add_argument("--check-steps", default="0,500,999", help="steps checked against one device")
    ap.add_argument("--max-compiles", type=int, default=4)
    ap.add_argument("--max-ratio", type=float, default=1.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true", help="print only")
    return ap.parse_args(argv)


def run(args, say=print, compiler_options=None) -> dict:
    """Trains ``args.steps`` steps; returns the record (raises ``AssertionError`` on a
    failed check). JAX must see ``dp·cp`` devices; ``compiler_options`` go to the train
    step's ``jax.jit`` (a test suite that compiles at -O0 asks for -O3 back)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import magi_jax as mj
    from magi_jax.masks import packings

    sys.path.insert(0, str(harness.ROOT / "examples"))
    import train  # the example's model, loss and data

    n = args.dp * args.cp
    devices = jax.devices()[:n]
    assert len(devices) == n, f"needs {n} devices, {len(jax.devices())} visible"
    mesh = jax.make_mesh(  # examples/train.py's mesh, without tensor parallelism
        (args.dp, args.cp, 1),
        ("dp", "cp", "tp"),
        devices=devices,
        axis_types=(jax.sharding.AxisType.Auto,) * 3,
    )
    replicated, by_row = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    checks = sorted({int(s) for s in args.check_steps.split(",") if s} & set(range(args.steps)))

    def layouts(rng):
        return [
            packings.cu_seqlens(packings.sample_doc_lens(args.seqlen, rng)) for _ in range(args.dp)
        ]

    def masks_of(item):
        return [mj.AttnMask.varlen(cu, causal=True) for cu in item[0]]

    def batches(rng):
        for _ in range(args.steps):
            cus = layouts(rng)
            rows = [train.make_batch(cu, args.vocab, args.max_period, rng) for cu in cus]
            yield cus, tuple(np.stack(parts) for parts in zip(*rows))

    def plan(item, cap):
        cus = item[0]
        return mj.make_batch_key(
            lambda row: mj.AttnMask.varlen(cus[row], causal=True),
            mesh,
            "cp",
            batch_axes="dp",
            batch=args.dp,
            capacity=cap,
            ffa_backend="xla",
        )

    sample_rng = np.random.default_rng([args.seed, 1])
    sample = [
        mj.AttnMask.varlen(
            packings.cu_seqlens(packings.sample_doc_lens(args.seqlen, sample_rng)), causal=True
        )
        for _ in range(args.sample)
    ]
    start = mj.PlanCapacity.from_masks(sample, mesh_size=args.cp)
    policy = mj.CapacityPolicy(start)

    model = train.Transformer(
        args.vocab,
        args.dim,
        args.layers,
        args.heads,
        args.kv_heads,
        backend="xla",
        rngs=nnx.Rngs(args.seed),
    )
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.device_put(params, train.param_shardings(params, mesh))
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, 5, max(args.steps, 6)))
    on_mesh = lambda a: a.sharding if isinstance(a.sharding, NamedSharding) else replicated
    opt_state = jax.jit(tx.init)(params)
    shardings = jax.tree.map(on_mesh, (params, opt_state))
    opt_state = jax.jit(tx.init, out_shardings=shardings[1])(params)

    def cp_loss(params, tokens, labels, weights, key):
        d = lambda x: mj.dispatch(x, key, seq_axis=1)
        return train.loss_fn(params, graphdef, d(tokens), d(labels), d(weights), key)

    jit = functools.partial(jax.jit, compiler_options=compiler_options)

    @jit
    def grad_step(params, tokens, labels, weights, key):
        return jax.value_and_grad(cp_loss, has_aux=True)(params, tokens, labels, weights, key)

    @jit
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def one_device_loss(params, batch, cus):
        dev = jax.devices()[0]
        whole = jax.jit(lambda p: p, out_shardings=replicated)(params)
        whole = jax.tree.map(lambda a: jax.device_put(a.addressable_data(0), dev), whole)
        flat = [jax.device_put(np.asarray(x).reshape(-1), dev) for x in batch]
        mask = train.packed_mask(cus, args.seqlen)
        loss = jax.jit(lambda p, t, lab, w: train.loss_fn(p, graphdef, t, lab, w, mask, args.dp)[0])
        return float(loss(whole, *flat))

    grown = []
    handler = _Collect(grown)
    log = logging.getLogger("magi_jax")
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    put = lambda x: jax.make_array_from_callback(x.shape, by_row, lambda idx: x[idx])
    losses, compared, t0 = [], [], time.perf_counter()
    try:
        stream = mj.prefetch_keys(
            batches(np.random.default_rng(args.seed)),
            plan,
            depth=1,
            capacity=policy,
            masks_of=masks_of,
        )
        for step, ((cus, batch), key) in enumerate(stream):
            (loss, _), grads = grad_step(params, *map(put, batch), key)
            if step in checks:
                one = one_device_loss(params, batch, cus)
                compared.append(
                    dict(
                        step=step,
                        cp=float(loss),
                        one_device=one,
                        rel=abs(float(loss) - one) / abs(one),
                    )
                )
            params, opt_state = update(params, opt_state, grads)
            losses.append(float(loss))
            if step % 100 == 0:
                say(
                    f"step {step}: loss {losses[-1]:.4f}, compilations "
                    f"{grad_step._cache_size()}, {time.perf_counter() - t0:.0f} s"
                )
    finally:
        log.removeHandler(handler)
    wall = time.perf_counter() - t0
    compiles = grad_step._cache_size()
    use = policy.utilisation()
    settled = {
        f: dict(held=u["held"], tightest=u["max"], ratio=u["held"] / u["max"])
        for f, u in use.items()
        if u["held"] is not None and u["max"] > 0
    }
    tol = train.check_tolerance(jnp.float32)
    record = harness.environment(
        device=jax.default_backend(),
        devices=f"{n} x {devices[0].device_kind}",
        args=vars(args),
        steps=len(losses),
        wall_s=round(wall, 1),
        start=start.to_dict(),
        settled=policy.capacity.to_dict(),
        growths=[
            dict(packing=p, fields={f: list(v) for f, v in ch.items()}) for p, ch in policy.growths
        ],
        logged_growths=len(grown),
        compilations=compiles,
        fields=settled,
        utilisation=use,
        losses=dict(first=losses[0], last=losses[-1]),
        compared=compared,
        tolerance=tol,
    )
    assert len(losses) == args.steps, f"{len(losses)} steps of {args.steps}"
    assert len(grown) == len(policy.growths), (len(grown), policy.growths)
    assert compiles <= args.max_compiles, f"{compiles} compilations > {args.max_compiles}"
    assert compiles == 1 + len(policy.growths), (compiles, len(policy.growths))
    for f, v in settled.items():
        assert v["ratio"] <= args.max_ratio, f"{f}: {v}"
    for c in compared:
        assert c["rel"] <= tol, c
    return record


class _Collect(logging.Handler):
    """Keeps the growth records the library logs."""

    def __init__(self, out):
        super().__init__(logging.WARNING)
        self.out = out

    def emit(self, record):
        if "capacity grown" in record.getMessage():
            self.out.append(record.getMessage())


def markdown(_rows, record) -> str:
    args = " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in record["args"].items() if k != "no_write"
    )
    dp, cp = record["args"]["dp"], record["args"]["cp"]
    start = {f: "default" if v is None else v for f, v in record["start"].items()}
    fields = [
        dict(v, f=f, start=start.get(f, "default"), ratio=f"{v['ratio']:.2f}")
        | dict(p99=f"{record['utilisation'][f]['p99']:.0f}")
        for f, v in record["fields"].items()
    ]
    compared = [
        dict(
            step=c["step"], cp=f"{c['cp']:.6f}", one=f"{c['one_device']:.6f}", rel=f"{c['rel']:.1e}"
        )
        for c in record["compared"]
    ]
    growths = [
        f"- {g['packing']}: " + ", ".join(f"{f} {a} -> {b}" for f, (a, b) in g["fields"].items())
        for g in record["growths"]
    ]
    lines = [
        f"# Capacity that holds or grows: {record['steps']} steps, {record['devices']}",
        "",
        f"{harness.describe(record)}; `benchmarks/capacity_bench.py` {args}",
        "",
        f"Wall {record['wall_s']} s; compilations of the train step: {record['compilations']} "
        f"(1 + {len(record['growths'])} growths, every one logged: {record['logged_growths']}).",
        "",
        *harness.table(
            fields,
            [("field", "f"), ("start", "start"), ("settled", "held")]
            + [("tightest (max need)", "tightest"), ("settled / tightest", "ratio")]
            + [("p99 need", "p99")],
        ),
        *["", "Growths (packing: field old -> new):", "", *growths, ""],
        *harness.table(
            compared,
            [("step", "step"), (f"loss (dp {dp} x cp {cp})", "cp"), ("loss (one device)", "one")]
            + [("rel. diff", "rel")],
        ),
        "",
        f"Tolerance {record['tolerance']:g} (float32 on CPU, `examples/train.py`'s).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    harness.host_devices(args.dp * args.cp)
    record = run(args)
    print(markdown([], record))
    if not args.no_write:
        out = harness.Run("capacity", OUT, record, markdown)
        out.save()
        print(f"wrote {out.base}.{{json,md}}")


if __name__ == "__main__":
    main()
