"""What the layout checks cost: a jitted fwd+bwd step (projection, ``magi_attention``,
``undispatch``) on CPU host devices, with plain dispatched arrays (the default), with the
typed route (``dispatch(..., typed=True)``: the stale-key check on the device), with a
``check_dispatch=True`` key (one hidden row per rank), and with both. Each step compiles
once (keys at one capacity are arguments); the timings are medians of interleaved rounds.

"Zero cost when off" is shown by the compiled program itself: the SHA-256 of the plain
step's optimised HLO computations (source tables and metadata stripped, names numbered: the
named scopes and source lines live there) is printed with ``--hlo-only``; run it on two
trees to compare them (the plain path only, so it runs on trees without the typed route).

    python benchmarks/debug_checks_bench.py [--tokens 8192 --cp 4 --rounds 7]
    python benchmarks/debug_checks_bench.py --hlo-only

Writes ``benchmarks/results/debug/debug_checks_<date>_<time>_cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import hashlib
import re

from benchmarks import harness

harness.host_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import magi_jax as mj  # noqa: E402

OUT = harness.RESULTS / "debug"


def _masks(tokens: int, count: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        cuts = np.sort(rng.choice(np.arange(64, tokens - 64), 7, replace=False))
        out.append(mj.AttnMask.varlen([0, *cuts.tolist(), tokens]))
    return out


def _step(heads: int, kv_heads: int, dim: int):
    """loss(w) of one layer on dispatched x: q, k, v = x @ w, attention, undispatch."""

    def project(x, w):
        y = x @ w
        q = y[:, : heads * dim].reshape(-1, heads, dim)
        k = y[:, heads * dim : (heads + kv_heads) * dim].reshape(-1, kv_heads, dim)
        v = y[:, (heads + kv_heads) * dim :].reshape(-1, kv_heads, dim)
        return q, k, v

    def loss(w, x, key):
        if isinstance(x, getattr(mj, "DispatchedArray", ())):
            q, k, v = x.map(project, w)
        else:
            q, k, v = project(x, w)
        out, _ = mj.magi_attention(q, k, v, key)
        return (mj.undispatch(out, key) ** 2).sum()

    return jax.jit(jax.value_and_grad(loss))


def _hlo_hash(compiled) -> tuple[str, int]:
    """A fingerprint of the optimised program: its computations only (not the tables of
    source files and frames before them), metadata stripped, and every name (which XLA
    derives from the source's scopes) replaced by its order of first appearance."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    text = text[re.search(r"^(%|ENTRY )", text, re.M).start() :]
    names: dict[str, str] = {}
    text = re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text)
    ops = sum(1 for line in text.splitlines() if " = " in line)
    return hashlib.sha256(text.encode()).hexdigest()[:16], ops


def _check_alone(key, tokens: int, heads: int, dim: int, calls: int) -> dict:
    """The typed route's device check by itself, on the step's output shapes: compare the
    plan ids and select over ``(out, lse)``, against returning ``(out, lse)`` as they are
    (min over ``calls`` calls of each, in ms)."""
    from magi_jax.sharding.layout import poison

    rng = np.random.default_rng(2)
    out = mj.dispatch(rng.standard_normal((tokens, heads, dim), np.float32), key)
    lse = mj.dispatch(rng.standard_normal((tokens, heads), np.float32), key)
    ids = key.plan_id
    checked = jax.jit(lambda o, s, a, b: poison((o, s), jnp.all(a == b)))
    plain = jax.jit(lambda o, s, a, b: (o + 0, s + 0))  # the same outputs, materialised
    timed = harness.time_interleaved(
        [(fn, (out, lse, ids, ids)) for fn in (plain, checked)], calls=1, reps=calls, warmup=1
    )
    return {name: min(r) * 1e3 for name, (_, r) in zip(("plain", "checked"), timed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3, help="calls per round and case")
    ap.add_argument("--hlo-only", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()

    mesh = jax.make_mesh(
        (a.cp,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[: a.cp]
    )
    masks = _masks(a.tokens, 2, seed=0)
    cap = mj.PlanCapacity.from_masks(masks, mesh_size=a.cp)
    width = (a.heads + 2 * a.kv_heads) * a.dim
    rng = np.random.default_rng(1)
    x = rng.standard_normal((a.tokens, 64), np.float32)
    w = jnp.asarray(rng.standard_normal((64, width), np.float32) * 0.1)
    step = _step(a.heads, a.kv_heads, a.dim)
    keys = [mj.make_flex_key(m, mesh, "cp", capacity=cap) for m in masks]

    plain = mj.dispatch(x, keys[0])
    hlo, ops = _hlo_hash(step.lower(w, plain, keys[0]).compile())
    print(f"plain step: optimised HLO sha256 {hlo} ({ops} instructions, metadata stripped)")
    if a.hlo_only:
        return

    cases = {}
    for name, check, typed in (
        ("plain", False, False),
        ("typed", False, True),
        ("check_dispatch", True, False),
        ("check_dispatch + typed", True, True),
    ):
        key = mj.make_flex_key(masks[0], mesh, "cp", capacity=cap, check_dispatch=check)
        xd = mj.dispatch(x, key, typed=True) if typed else mj.dispatch(x, key)
        h, n = _hlo_hash(step.lower(w, xd, key).compile())
        cases[name] = dict(key=key, x=xd, hlo=h, ops=n)
    timed = harness.time_interleaved(
        [(step, (w, c["x"], c["key"])) for c in cases.values()], a.calls, a.rounds, warmup=1
    )
    # The typed check at work: the same step with the other mask's key gives NaN.
    stale = mj.make_flex_key(masks[1], mesh, "cp", capacity=cap)
    loss, _ = step(w, cases["typed"]["x"], stale)
    assert np.isnan(float(loss)), "a stale key must give NaN on the typed route"
    alone = _check_alone(cases["typed"]["key"], a.tokens, a.heads, a.dim, calls=200)
    base = timed[0][0]
    rows = [
        dict(
            case=name,
            median_ms=round(med * 1e3, 2),
            min_ms=round(min(times) * 1e3, 2),
            vs_plain=round(med / base, 3),
            hlo_sha256=c["hlo"],
            hlo_instructions=c["ops"],
        )
        for (name, c), (med, times) in zip(cases.items(), timed)
    ]
    meta = harness.environment(
        device="cpu",
        devices=f"{a.cp} of {jax.device_count()} CPU host devices",
        shape=dict(tokens=a.tokens, cp=a.cp, heads=a.heads, kv_heads=a.kv_heads, dim=a.dim),
        rounds=a.rounds,
        calls=a.calls,
        stale_key_on_typed_route="NaN loss",
        check_alone_ms={k: round(v, 4) for k, v in alone.items()},
    )
    print(markdown(rows, meta))
    if not a.no_write:
        run = harness.Run("debug_checks", OUT, meta, markdown)
        run.add(*rows)
        print(f"wrote {run.base}.md/.json")


def markdown(rows, meta) -> str:
    s, alone = meta["shape"], meta["check_alone_ms"]
    lines = [
        "# Layout checks: cost of a fwd+bwd step",
        "",
        f"{harness.describe(meta)}; {meta['devices']}; {s['tokens']} tokens, cp {s['cp']}, "
        f"{s['heads']}/{s['kv_heads']} heads, D {s['dim']}, float32, `xla` backend, keys at "
        f"one capacity; median of {meta['rounds']} interleaved rounds of {meta['calls']} calls.",
        "",
        *harness.table(
            rows,
            [("case", "case"), ("median ms / step", "median_ms"), ("min ms", "min_ms")]
            + [("vs plain", "vs_plain"), ("HLO instructions", "hlo_instructions")]
            + [("HLO sha256", "hlo_sha256")],
        ),
        "",
        f"The typed route's device check alone (plan-id compare and select over out and lse, "
        f"min of 200 calls): {alone['checked']:.3f} ms, against {alone['plain']:.3f} ms for "
        "the same outputs copied.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
