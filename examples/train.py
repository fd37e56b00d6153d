"""Train a small decoder-only transformer on synthetic packed documents with context
parallelism: the packed sequence is spread over every device by magi-jax's dispatch, and
attention runs as ``magi_attention`` under a document-causal mask.

    python examples/train.py                                  # CPU host devices, or all GPUs
    python examples/train.py --steps 300 --seqlen 16384 --layers 4 --dim 256
    python examples/train.py --devices 4 --steps 20           # CP over 4 devices

Data: every document repeats a random pattern (period 2..--max-period) of tokens, so the next
token is predictable from the same document only — a model that attends across documents
cannot learn it. Every step packs a new layout (``--docs`` documents of random lengths) with
fresh patterns, as a real loader does. One ``PlanCapacity`` for the run, measured on a sample
of layouts from the same generator, fixes the shapes of every step's key: the jitted train
step takes the key as an argument and compiles once (the run fails if it compiled more). The
next step's key is planned on a background thread (``mj.prefetch_keys``) while a step runs.

Precision: parameters are float32; attention inputs (q, k, v) are bfloat16 on GPUs (the
Mosaic GPU kernels, ``pallas``, need bf16/fp16 and head dim 64, 128 or 256) and float32
elsewhere (``--dtype``). The first step's loss and gradients of the context-parallel model
are checked against the same model on one device (``flex_flash_attention`` over
natural-order tokens, same attention dtype and FFA backend) with a tolerance that fits the
dtype, before its update is applied.

Pods: ``--dp N`` gives the mesh a data-parallel axis of N replicas, each training on its own
packed sequence with its own layout every step (a batch of N rows, one plan per row: a
batched key), and ``--tp M`` a tensor-parallel axis over the heads (the q/k/v projections
column-sharded, the output projection row-sharded); context parallelism takes the rest of
the devices (``devices = dp · cp · tp``). Attention runs on each device for its own rows and
heads only.

Multi-process (one process per GPU, or per host): pass ``--distributed`` to call
``jax.distributed.initialize()`` first (it finds the cluster by itself under SLURM, Open MPI
or Kubernetes; elsewhere give ``--coordinator host:port --num-processes N --process-id i``);
every process runs this same script and draws the same layouts, and plans the keys of the
rows its own devices hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seqlen", type=int, default=4096, help="packed tokens per step")
    ap.add_argument(
        "--docs",
        type=int,
        default=12,
        help="documents per packed sequence (new random lengths every step)",
    )
    ap.add_argument("--max-period", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="dtype of the attention inputs q, k, v (parameters stay float32); "
        "auto: bfloat16 on GPUs, float32 elsewhere",
    )
    ap.add_argument(
        "--devices",
        type=int,
        default=None,
        help="devices to use, dp x cp x tp of them (default: every device; on a CPU-only "
        "machine, one host device per core, 2 to 8)",
    )
    ap.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data-parallel replicas (a batch row each, each its own packing every step)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel shards of the heads (--heads and --kv-heads must divide by it)",
    )
    ap.add_argument(
        "--overlap-degree",
        type=int,
        default=None,
        help="remote stages of magi_attention (default: the cost model's choice "
        "for the packed length)",
    )
    ap.add_argument(
        "--capacity-sample",
        type=int,
        default=32,
        help="layouts drawn up front to measure the run's PlanCapacity",
    )
    ap.add_argument(
        "--capacity-headroom",
        type=float,
        default=1.5,
        help="the capacity's margin over the largest needs of that sample (raise "
        "it if a step's layout does not fit)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the step-0 comparison with the single-device model",
    )
    ap.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() (multi-process / multi-host)",
    )
    ap.add_argument(
        "--coordinator",
        default=None,
        help="with --distributed: host:port of process 0 (auto-detected on SLURM, "
        "Open MPI, Kubernetes; or JAX_COORDINATOR_ADDRESS)",
    )
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--json", default="", help="write the loss curve and throughput here")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
# CPU host devices must be requested before JAX starts; the flag does not touch GPUs. More
# host devices than cores only adds contention (each runs its share of every step).
if ARGS is not None and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    _HOST = ARGS.devices or min(8, max(2, os.cpu_count() or 2))
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_HOST}"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import magi_jax as mj  # noqa: E402
from magi_jax.nn import SelfAttention, apply_rope, attend, rope_positions  # noqa: E402
from magi_jax.sharding.make_key import ffa_backend_reason  # noqa: E402

# ---- model ----------------------------------------------------------------------------------


class Attention(SelfAttention):
    """magi-jax's SelfAttention (GQA + RoPE) with its attention in ``attn_dtype``: the
    projections and RoPE run in float32 on float32 parameters, q, k and v are cast to
    ``attn_dtype`` for the attention kernels, and its output is cast back."""

    def __init__(self, dim, heads, kv_heads, *, attn_dtype, backend, rngs):
        super().__init__(dim, heads, num_kv_heads=kv_heads, backend=backend, rngs=rngs)
        self.attn_dtype = attn_dtype

    def __call__(self, x, mask_or_key):
        split = lambda y, h: y.reshape(y.shape[:-1] + (h, self.head_dim))
        q = split(self.q_proj(x), self.num_heads)
        k = split(self.k_proj(x), self.num_kv_heads)
        v = split(self.v_proj(x), self.num_kv_heads)
        positions = rope_positions(mask_or_key, q.shape[-3])
        q, k = (apply_rope(y, positions, self.rope_theta) for y in (q, k))
        q, k, v = (y.astype(self.attn_dtype) for y in (q, k, v))
        out = attend(q, k, v, mask_or_key, backend=self.backend).astype(x.dtype)
        return self.o_proj(out.reshape(out.shape[:-2] + (-1,)))


class Block(nnx.Module):
    def __init__(self, dim, heads, kv_heads, *, attn_dtype, backend, rngs):
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = Attention(
            dim, heads, kv_heads, attn_dtype=attn_dtype, backend=backend, rngs=rngs
        )
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, mask_or_key):
        x = x + self.attn(self.norm1(x), mask_or_key)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    """Decoder-only: embedding, pre-norm blocks (GQA + RoPE attention, MLP), LM head. Called
    with natural-order tokens and an AttnMask (one device; ``backend`` picks its FFA) or
    dispatched tokens and a key (context parallel; the key fixes the FFA backend)."""

    def __init__(
        self, vocab, dim, layers, heads, kv_heads, *, attn_dtype=jnp.float32, backend="auto", rngs
    ):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List(
            [
                Block(dim, heads, kv_heads, attn_dtype=attn_dtype, backend=backend, rngs=rngs)
                for _ in range(layers)
            ]
        )
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens, mask_or_key):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask_or_key)
        return self.head(self.norm(x))


def loss_fn(params, graphdef, tokens, labels, weights, mask_or_key, rows=None):
    """Mean next-token cross-entropy over the tokens that have a successor in their document
    (``weights``; padding and last tokens weigh 0), and each row's own mean (``[rows]``; a
    sequence of ``rows`` packed rows is cut back into them)."""
    logits = nnx.merge(graphdef, params)(tokens, mask_or_key)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    loss = (ce * weights).sum() / jnp.maximum(weights.sum(), 1.0)
    if rows is not None:
        ce, weights = ce.reshape(rows, -1), weights.reshape(rows, -1)
    per_row = (ce * weights).sum(-1) / jnp.maximum(weights.sum(-1), 1.0)
    return loss, per_row


def attention_setup(requested, head_dim, heads, kv_heads, local_len):
    """(attention dtype, FFA backend, why): bfloat16 and the Mosaic GPU kernels (``pallas``)
    where they run, float32 and the portable ``xla`` backend elsewhere."""
    device_why = ffa_backend_reason()  # None: the default device is an sm90 GPU
    on_gpu = jax.default_backend() == "gpu"
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(
        requested, jnp.bfloat16 if on_gpu else jnp.float32
    )
    if device_why is not None:
        return dtype, "xla", device_why
    from magi_jax.pallas import supported

    q = jax.ShapeDtypeStruct((local_len, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((local_len, kv_heads, head_dim), dtype)
    ok, why = supported(q, kv, kv)
    if not ok:
        return dtype, "xla", f"pallas (Mosaic GPU) not used: {why}"
    return dtype, "pallas", None


# ---- data -----------------------------------------------------------------------------------


def document_layout(seqlen, docs, rng):
    """cu_seqlens of ``docs`` documents of random lengths (1/4x to 4x the mean)."""
    w = np.exp(rng.uniform(np.log(0.25), np.log(4.0), docs))
    lens = np.maximum(2, (w / w.sum() * seqlen).astype(np.int64))
    lens[-1] += seqlen - lens.sum()
    if lens[-1] < 2:
        raise ValueError(f"--seqlen {seqlen} is too short for --docs {docs}")
    return np.concatenate([[0], np.cumsum(lens)])


def make_batch(cu, vocab, max_period, rng):
    """Tokens (each document repeats its own random pattern), next-token labels and weights,
    all in natural order ``[seqlen]``."""
    lens = np.diff(cu)
    doc = np.repeat(np.arange(len(lens)), lens)
    offset = np.arange(cu[-1]) - cu[doc]
    period = rng.integers(2, max_period + 1, len(lens))
    pattern = rng.integers(0, vocab, (len(lens), max_period))
    tokens = pattern[doc, offset % period[doc]]
    labels = np.roll(tokens, -1)
    weights = (offset < lens[doc] - 1).astype(np.float32)
    return tokens.astype(np.int32), labels.astype(np.int32), weights


def batches(args, rng):
    """A new packing every step for every replica: ``(cu_seqlens per row, (tokens, labels,
    weights) [dp, seqlen])``, drawn in order from ``rng`` on the caller's thread
    (deterministic: every process draws the same)."""
    for _ in range(args.steps):
        cus = [document_layout(args.seqlen, args.docs, rng) for _ in range(args.dp)]
        rows = [make_batch(cu, args.vocab, args.max_period, rng) for cu in cus]
        yield cus, tuple(np.stack(parts) for parts in zip(*rows))


def run_capacity(args, n):
    """One PlanCapacity for the whole run, from layouts of the same generator.

    ``remote_kv`` and ``cast_width`` size the transports (the xla transports move
    ``cast_width`` rows per pair and stage whatever the mask needs), so they are measured:
    the largest needs over ``--capacity-sample`` layouts (an rng of their own, so the
    training data does not depend on the sample), times ``--capacity-headroom``. With the
    defaults (32 layouts, x1.5) no layout of 800 drawn for the default shapes, nor for 32k
    tokens over 8 ranks, exceeded it; PlanCapacity's default x1.25 over 8 layouts was
    exceeded by 1-5% of layouts (a 60-step run would likely hit one). Work items cost memory
    only (the kernels walk a plan's real work) and vary more from layout to layout (short
    sequences: few tiles), so they get twice the headroom, up to the dense default that
    holds every layout."""
    rng = np.random.default_rng([args.seed, 1])
    sample = [
        mj.AttnMask.varlen(document_layout(args.seqlen, args.docs, rng), causal=True)
        for _ in range(args.capacity_sample)
    ]
    fixed = {} if args.overlap_degree is None else dict(overlap_degree=args.overlap_degree)
    cap = mj.PlanCapacity.from_masks(sample, mesh_size=n, headroom=args.capacity_headroom, **fixed)
    dense = mj.PlanCapacity(args.seqlen).items_at(n)
    return dataclasses.replace(cap, items=min(2 * cap.items, dense))


# ---- training -------------------------------------------------------------------------------


def main(args):
    if args.distributed:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    devices = jax.devices()
    n = args.devices or len(devices)
    if n > len(devices):
        raise SystemExit(f"--devices {n} but only {len(devices)} devices are visible")
    if args.steps < 1 or args.capacity_sample < 1:
        raise SystemExit("--steps and --capacity-sample must be at least 1")
    if args.dp < 1 or args.tp < 1 or n % (args.dp * args.tp):
        raise SystemExit(f"--devices {n} is not a multiple of --dp {args.dp} x --tp {args.tp}")
    if args.heads % args.tp or args.kv_heads % args.tp:
        raise SystemExit(f"--heads and --kv-heads must divide by --tp {args.tp}")
    cp = n // (args.dp * args.tp)
    mesh = jax.make_mesh(
        (args.dp, cp, args.tp),
        ("dp", "cp", "tp"),
        devices=devices[:n],
        axis_types=(jax.sharding.AxisType.Auto,) * 3,
    )
    replicated = NamedSharding(mesh, P())
    by_row = NamedSharding(mesh, P("dp"))

    def global_array(x):
        """The same host batch ``[dp, ...]`` on every process -> one array with its rows
        over the data-parallel axis (each process fills the rows of its own devices)."""
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, by_row, lambda idx: x[idx])

    say(
        f"devices: {n} x {devices[0].device_kind} ({jax.default_backend()}), "
        f"{jax.process_count()} process(es), jax {jax.__version__}; mesh dp {args.dp} x "
        f"cp {cp} x tp {args.tp}"
    )
    t0 = time.perf_counter()
    cap = run_capacity(args, cp)
    say(
        f"capacity: {cap} [{args.capacity_sample} layouts, x{args.capacity_headroom:g}, "
        f"{time.perf_counter() - t0:.2f} s]"
    )

    head_dim = args.dim // args.heads
    local_len = -(-args.seqlen // cp)
    attn_dtype, ffa, why = attention_setup(
        args.dtype, head_dim, args.heads // args.tp, args.kv_heads // args.tp, local_len
    )

    def plan(item):
        """The key of one step's layouts, one plan per replica, each process planning the
        rows its devices hold (runs on the prefetch thread)."""
        cus, _ = item
        try:
            return mj.make_batch_key(
                lambda row: mj.AttnMask.varlen(cus[row], causal=True),
                mesh,
                "cp",
                batch_axes="dp",
                head_axes="tp",
                batch=args.dp,
                capacity=cap,
                ffa_backend=ffa,
            )
        except mj.CapacityError as e:
            raise SystemExit(
                f"a step's layout does not fit the run's capacity ({e}); raise "
                "--capacity-headroom or --capacity-sample"
            ) from None

    rng = np.random.default_rng(args.seed)
    stream = mj.prefetch_keys(batches(args, rng), plan, depth=1)
    t0 = time.perf_counter()
    (cus, batch), key = next(stream)
    say(
        f"data:    {args.dp} x {args.seqlen:,} tokens per step, {args.docs} documents per "
        f"replica, a new layout every step for every replica; step 0, replica 0: "
        f"{np.diff(cus[0]).tolist()}"
    )
    say(f"plan:    {key} [{time.perf_counter() - t0:.2f} s]")
    say(
        f"ffa:     {key.ffa_backend}, attention in {jnp.dtype(attn_dtype).name}"
        + (f" ({why})" if why else " (Mosaic GPU kernels)")
    )

    model = Transformer(
        args.vocab,
        args.dim,
        args.layers,
        args.heads,
        args.kv_heads,
        attn_dtype=attn_dtype,
        backend=key.ffa_backend,
        rngs=nnx.Rngs(args.seed),
    )
    graphdef, params = nnx.split(model, nnx.Param)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    say(
        f"model:   {args.layers} layers, dim {args.dim}, {args.heads} query / {args.kv_heads} "
        f"key-value heads, vocab {args.vocab}: {n_params:,} parameters (float32)"
    )
    params = jax.device_put(params, param_shardings(params, mesh))
    tx = optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, args.lr, 5, max(args.steps, 6)), weight_decay=0.01
    )
    opt_state = jax.jit(tx.init)(params)

    def cp_loss(params, tokens, labels, weights, key):
        d = lambda x: mj.dispatch(x, key, seq_axis=1)  # natural order -> dispatched, sharded
        return loss_fn(params, graphdef, d(tokens), d(labels), d(weights), key)

    # The key is an argument, not a constant: its arrays are the step's layout, its static
    # part depends on (mesh, capacity, options) only, so one compilation serves every step.
    # Outputs keep the inputs' shardings, so step 1 sees the arguments step 0 compiled for.
    on_mesh = lambda a: a.sharding if isinstance(a.sharding, NamedSharding) else replicated
    state_shardings = jax.tree.map(on_mesh, (params, opt_state))
    opt_state = jax.jit(tx.init, out_shardings=state_shardings[1])(params)

    # A step is two programs: the gradients (the model, attention included) and the optimizer
    # update. The step-0 check reads the first step's own loss and gradients, so the
    # context-parallel model compiles once for the check and the training together.
    @functools.partial(jax.jit, out_shardings=((replicated, replicated), state_shardings[0]))
    def grad_step(params, tokens, labels, weights, key):
        return jax.value_and_grad(cp_loss, has_aux=True)(params, tokens, labels, weights, key)

    @functools.partial(jax.jit, out_shardings=state_shardings, donate_argnums=(0, 1))
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    history, tps, layouts = [], [], []
    for step in range(args.steps):
        start = time.perf_counter()
        if step:  # planned on the background thread meanwhile
            (cus, batch), key = next(stream)
        (loss, rows_loss), grads = grad_step(params, *map(global_array, batch), key)
        if step == 0:
            if args.check:
                check_step0(
                    (loss, rows_loss, grads),
                    params,
                    graphdef,
                    batch,
                    key,
                    packed_mask(cus, args.seqlen),
                    attn_dtype,
                    say,
                )
            bar = _progress(args.steps, lead)  # below the check's line
        params, opt_state = update(params, opt_state, grads)
        loss = float(loss)  # waits for the gradients; the update runs on meanwhile
        sec = time.perf_counter() - start
        history.append(loss)
        layouts.extend(np.diff(cu).tolist() for cu in cus)
        if step:  # step 0 includes compilation
            tps.append(args.dp * args.seqlen / sec)
        bar.update(loss, tps[-1] if tps else None)
    stream.close()
    bar.close()
    compiles = max(grad_step._cache_size(), update._cache_size())
    if not np.isfinite(history).all():
        raise SystemExit("the loss is not finite")
    k = max(1, min(5, len(history) // 4))
    first, last = float(np.mean(history[:k])), float(np.mean(history[-k:]))
    rate = float(np.median(tps)) if tps else float("nan")
    say(
        f"loss:    {history[0]:.4f} -> {history[-1]:.4f} (mean of first {k} steps {first:.4f}, "
        f"last {k} {last:.4f}; uniform guess ln {args.vocab} = {np.log(args.vocab):.4f})"
    )
    say(
        f"speed:   {rate:,.0f} tokens/s (median over steps 1..{args.steps - 1}, "
        f"{n} device{'s' if n > 1 else ''}, planning included)"
    )
    distinct = len({tuple(x) for x in layouts})
    say(
        f"compile: train step compiled {compiles} time{'s' if compiles != 1 else ''} for "
        f"{args.steps} steps with {distinct} different layouts ({args.dp} per step)"
    )
    if args.json and lead:
        import json

        with open(args.json, "w") as f:
            json.dump(
                dict(
                    loss=history,
                    tokens_per_second=rate,
                    devices=n,
                    mesh=dict(dp=args.dp, cp=cp, tp=args.tp),
                    backend=jax.default_backend(),
                    ffa_backend=key.ffa_backend,
                    attn_dtype=jnp.dtype(attn_dtype).name,
                    compilations=compiles,
                    layouts=layouts,
                    seqlen=args.seqlen,
                    steps=args.steps,
                ),
                f,
            )
    if compiles != 1:
        raise SystemExit(
            f"the train step compiled {compiles} times; keys at one capacity "
            "should share one compilation"
        )
    return history


def check_tolerance(attn_dtype) -> float:
    """Bound on the step-0 differences between the context-parallel and the one-device model
    (both compute the same math in ``attn_dtype``; they differ only in accumulation order:
    attention split over ranks and stages, matmuls over other shapes).

    Measure: per gradient leaf, max|g_cp - g_1| / max|g_1| (relative to the leaf's scale, not
    elementwise: elementwise ratios blow up on entries near zero); for the loss, |Δ|/|loss|.
    float32 on CPU: 2e-4 (observed ~1e-6). float32 on GPUs: XLA runs float32 matmuls as TF32
    by default (unit roundoff 2^-11 ≈ 4.9e-4; one H200, 32k tokens, 4 layers, dim 1024:
    2.3e-4, and 1.3e-6 with JAX_DEFAULT_MATMUL_PRECISION=highest): 2e-3. bfloat16 (unit
    roundoff 2^-8 ≈ 3.9e-3; q, k, v and the attention output are rounded to it, so another
    accumulation order can move an element by one bf16 ulp, and the backward carries it
    through every layer): 2e-2."""
    if jnp.dtype(attn_dtype) == jnp.bfloat16:
        return 2e-2
    return 2e-4 if jax.default_backend() == "cpu" else 2e-3


def packed_mask(cus, seqlen):
    """The rows' documents packed into one sequence (row ``b`` at ``[b·seqlen, (b+1)·seqlen)``):
    the one-device model over it computes every row's attention, and RoPE, which sees only
    position differences inside a document, gives each row its own rotations."""
    starts = [np.asarray(cu[:-1]) + b * seqlen for b, cu in enumerate(cus)]
    return mj.AttnMask.varlen(np.concatenate(starts + [[len(cus) * seqlen]]), causal=True)


def param_shardings(params, mesh):
    """Tensor parallelism over ``tp``: the q/k/v projections column-sharded (their output
    features are heads), the output projection row-sharded; everything else replicated."""

    def rule(path, leaf):
        names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
        if leaf.ndim == 2 and any(n in ("q_proj", "k_proj", "v_proj") for n in names):
            return NamedSharding(mesh, P(None, "tp"))
        if leaf.ndim == 2 and "o_proj" in names:
            return NamedSharding(mesh, P("tp", None))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(rule, params)


def check_step0(step0, params, graphdef, batch, key, mask, attn_dtype, say):
    """Loss and gradients of the context-parallel model equal the single-device model's (the
    same attention dtype; the model's one-device attention uses the key's FFA backend): the
    loss of every row (replica) and the gradients of their mean, against the one-device
    model over the rows packed into one sequence. ``step0``: the training's first
    ``(loss, per-row losses, gradients)``, computed from ``params``."""
    rtol = check_tolerance(attn_dtype)
    dev0 = jax.local_devices()[0]
    rows = batch[0].shape[0]
    tokens, labels, weights = (jax.device_put(np.asarray(x).reshape(-1), dev0) for x in batch)
    # This process's copy of the parameters, whole, on one of its own devices.
    params_1 = jax.jit(lambda p: p, out_shardings=NamedSharding(key.mesh, P()))(params)
    params_1 = jax.tree.map(lambda a: jax.device_put(a.addressable_data(0), dev0), params_1)

    @jax.jit
    def single(params, tokens, labels, weights):
        return jax.value_and_grad(loss_fn, has_aux=True)(
            params, graphdef, tokens, labels, weights, mask, rows
        )

    loss_cp, rows_cp, g_cp = step0
    (loss_1, rows_1), g_1 = single(params_1, tokens, labels, weights)
    replicate = jax.jit(lambda t: t, out_shardings=NamedSharding(key.mesh, P()))
    rows_cp = np.asarray(replicate(rows_cp).addressable_data(0), np.float64)
    g_cp = replicate(g_cp)
    loss_cp, loss_1 = float(loss_cp), float(loss_1)
    worst, worst_name = 0.0, ""
    flat_cp = jax.tree_util.tree_flatten_with_path(g_cp)[0]
    flat_1 = jax.tree.leaves(g_1)
    for (path, a), b in zip(flat_cp, flat_1):
        a = np.asarray(a.addressable_data(0), np.float64)
        b = np.asarray(b, np.float64)
        err = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
        if err > worst:
            worst, worst_name = err, jax.tree_util.keystr(path)
    rows_1 = np.asarray(rows_1, np.float64)
    loss_err = float(np.max(np.abs(rows_cp - rows_1) / np.maximum(np.abs(rows_1), 1e-12)))
    ok = loss_err <= rtol and worst <= rtol
    say(
        f"check:   step-0 CP vs one device ({jnp.dtype(attn_dtype).name}, {key.ffa_backend}): "
        f"loss {loss_cp:.6f} vs {loss_1:.6f} (per row, max |Δ|/|loss| {loss_err:.1e} over "
        f"{rows} row{'s' if rows > 1 else ''}); gradients: max over leaves of max|Δg|/max|g| "
        f"{worst:.1e} ({worst_name}); bound {rtol:g} -> {'OK' if ok else 'MISMATCH'}"
    )
    if not ok:
        raise SystemExit(
            f"step-0 check failed: context-parallel and single-device results "
            f"differ by more than {rtol:g} (max|Δ|/max|reference| per leaf)"
        )


class _progress:
    """A progress bar with loss and tokens/s (tqdm when installed, plain lines otherwise)."""

    def __init__(self, total, enabled):
        self.enabled, self.bar, self.step, self.total = enabled, None, 0, total
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(
                    total=total, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout
                )
            except ImportError:
                pass

    def update(self, loss, tps):
        self.step += 1
        if not self.enabled:
            return
        rate = "compiling" if tps is None else f"{tps:,.0f}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, tokens/s {rate}", refresh=False)
            self.bar.update(1)
        elif self.step == 1 or self.step % 10 == 0 or self.step == self.total:
            print(f"step {self.step}/{self.total}  loss {loss:.4f}  tokens/s {rate}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


if __name__ == "__main__":
    main(ARGS)
