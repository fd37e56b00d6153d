"""Collective benchmark: the native group collectives (NVSHMEM FFI) against XLA's collectives
and a peer copy, on 2 GPUs with one process per GPU (target: a 256 MiB cast at ≥ 335 GB/s
and ≥ 0.85× the peer copy; benchmarks/results/collectives/LATEST.md).

Every rank sends ``size`` bytes (bf16 rows of ``--row-kib`` KiB) to the other rank:
  native_cast / native_reduce   magi_jax.sharding.native through group_cast / group_reduce (reduce:
                                bf16 in, float32 sums out)
  xla_cast / xla_reduce         the same group_cast / group_reduce with the ppermute transport
  ppermute, all_to_all          jax.lax on the raw rows
  ragged_all_to_all             jax.lax.ragged_all_to_all (small sizes only: ~2.6 GB/s)
  peer_copy                     torch: one tensor copied GPU0 -> GPU1 (copy engine), one process
GB/s = bytes sent per rank / time per operation; each time is the best of ``--reps`` runs of
``K`` back-to-back operations inside one jitted program (so launch gaps count, host sync not).
Every row but all_to_all gets a different input per operation and every output of the chain
is checked against the peer's rows (column ``ok``), so a race between back-to-back calls shows.
At ``--variant-sizes`` the native cast (and reduce, ``--reduce-variants``) is also timed with
other ``magi_jax.sharding.native.CudaTuning`` settings: ``--variants`` is a comma-separated list of
``MODE[:field=value...]``, e.g. ``pull``, ``push:double_buffer=0``, ``pull:chunk_kib=1024``.
Then ``magi_attention`` forward+backward with ``comm_backend="native"`` vs the XLA transport,
on dispatched q/k/v (``attn``) and through dispatch and undispatch (``step``); ``--profile``
adds GPU traces (``benchmarks/gpu_trace.py``) of those and of the 1 and 256 MiB chains.

    python benchmarks/collective_bench.py                       # launches everything
    python benchmarks/collective_bench.py --sizes 1,16,256 --no-e2e --variants pull

Writes ``benchmarks/results/collectives/collective_<date>_<device>.{json,md}`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from collective_e2e import e2e, tuning_fields  # noqa: E402
from gpu_trace import trace_summary  # noqa: E402

from benchmarks.harness import describe, environment, package_version  # noqa: E402

# The rows --profile traces (default native tuning and XLA's plain ppermute).
_PROFILED = ("native_cast", "native_reduce", "ppermute")
OPS = (
    "native_cast",
    "xla_cast",
    "ppermute",
    "all_to_all",
    "ragged_all_to_all",
    "native_reduce",
    "xla_reduce",
)
# CudaTuning variants against the default (push, 64 send + 64 receive blocks, 256 KiB chunks,
# one staging region): the other data path, double buffering, chunk sizes, and the split of
# blocks between sending and receiving (a block of the kernels takes a whole SM: keep send +
# receive <= 132 on an H200 so that every block is resident at once).
DEFAULT_VARIANTS = (
    "pull,push:double_buffer=1,pull:double_buffer=1,push:chunk_kib=64,"
    "push:chunk_kib=1024,pull:chunk_kib=1024,push:send_blocks=32,"
    "push:send_blocks=96:recv_blocks=32,push:recv_blocks=32,"
    "pull:send_blocks=32:recv_blocks=96,pull:send_blocks=16:recv_blocks=112"
)


def parse_variant(spec: str) -> dict:
    """``"pull:chunk_kib=1024:double_buffer=0"`` -> CudaTuning changes."""
    mode, *fields = spec.split(":")
    out = {"mode": mode}
    out.update(tuning_fields(fields))
    return out


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="launch", choices=("launch", "worker", "peer"))
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--sizes", default="1,4,16,64,256,512", help="MiB per rank")
    ap.add_argument("--row-kib", type=int, default=8, help="row size (a KV token: 2·Hkv·D·2 B)")
    ap.add_argument("--ragged-max-mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--ops",
        type=int,
        default=0,
        help="ops per timed chain (0: 20 up to 4 MiB, 10 up to 64, 5 above)",
    )
    ap.add_argument(
        "--e2e-rounds",
        type=int,
        default=5,
        help="end to end: rounds over every row, in a rotating order (median)",
    )
    ap.add_argument(
        "--e2e-steps",
        type=int,
        default=8,
        help="end to end: fwd+bwd steps queued back to back per timing",
    )
    ap.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help="native CudaTuning variants timed at --variant-sizes (see above)",
    )
    ap.add_argument(
        "--reduce-variants",
        default="pull",
        help="variants (of --variants syntax) also timed for native_reduce",
    )
    ap.add_argument("--variant-sizes", default="1,256", help="MiB per rank")
    ap.add_argument(
        "--send-blocks-sweep", default="", help="extra variants push:send_blocks=N (old flag)"
    )
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument(
        "--skip-native", action="store_true", help="XLA rows only (a dry run of the script on CPUs)"
    )
    ap.add_argument("--e2e-tokens", type=int, default=32768)
    ap.add_argument(
        "--e2e-backends",
        default="native,ppermute",
        help="comm_backend[:CudaTuning field=value...] of the end-to-end rows, "
        "e.g. native:stream=collective:send_blocks=16:recv_blocks=16",
    )
    ap.add_argument(
        "--e2e-modes",
        default="attn,step",
        help="attn (dispatched q/k/v) and/or step (dispatch, attention, undispatch)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also trace the end-to-end rows and the default native cast / reduce "
        "and ppermute at --profile-sizes (benchmarks/gpu_trace.py: kernel "
        "time per category, communication under compute, idle GPU time)",
    )
    ap.add_argument("--profile-sizes", default="1,256", help="MiB per rank")
    ap.add_argument(
        "--timeline-us",
        type=float,
        default=None,
        help="with --profile: keep the end-to-end rows' kernels of at least this "
        "many µs of one step, in order, with their streams",
    )
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting new rows after")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "collectives"))
    return ap.parse_args(argv)


def _k_for(mib: float, ops: int = 0) -> int:
    """Ops per timed chain: ``--ops``, or by size."""
    return ops if ops > 0 else 20 if mib <= 4 else (10 if mib <= 64 else 5)


# ---- peer copy (one process, both GPUs) -----------------------------------------------------


def peer_copy(args) -> dict:
    try:
        import torch
    except ImportError:
        return {"error": "torch not installed"}
    if torch.cuda.device_count() < 2:
        return {"error": "fewer than 2 GPUs"}
    res = {}
    for mib in (float(s) for s in args.sizes.split(",") if s):
        n = int(mib * 2**20)
        a = torch.empty(n, dtype=torch.uint8, device="cuda:0")
        b = torch.empty(n, dtype=torch.uint8, device="cuda:1")
        b.copy_(a)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        k, best = _k_for(mib, args.ops), float("inf")
        for _ in range(args.reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.device(0):
                s.record()
                for _ in range(k):
                    b.copy_(a, non_blocking=True)
                e.record()
                e.synchronize()
            best = min(best, s.elapsed_time(e) / 1e3 / k)
        res[str(mib)] = {"s": best, "GBps": n / best / 1e9}
        del a, b
    return res


# ---- 2-process worker -----------------------------------------------------------------------


def worker(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if args.port:
        jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=2, process_id=args.rank)
    # else: one process over 2 local devices (a CPU dry run of the worker:
    # XLA_FLAGS=--xla_force_host_platform_device_count=2 ... --mode worker --no-e2e)
    from magi_jax.planning.cast_table import CastTable
    from magi_jax.sharding import native
    from magi_jax.sharding.collectives import CastArrays, CastSpec, group_cast, group_reduce

    t_start = time.time()
    sizes = [float(s) for s in args.sizes.split(",") if s]
    variant_sizes = {float(s) for s in args.variant_sizes.split(",") if s}
    profile_sizes = (
        {float(s) for s in args.profile_sizes.split(",") if s} if args.profile else set()
    )
    variants = [v for v in args.variants.split(",") if v]
    variants += [f"push:send_blocks={b}" for b in args.send_blocks_sweep.split(",") if b]
    reduce_variants = {v for v in args.reduce_variants.split(",") if v}
    for v in variants:
        native.CudaTuning(**parse_variant(v))  # bad variants fail here, not mid-run
    failures = []
    feat = args.row_kib * 1024 // 2
    if not args.skip_native and jax.default_backend() == "gpu":
        # Twice the largest cast (room for two staging regions: double buffering), and at
        # least what the end-to-end attention stages: a rank fetches at most the other half
        # of the tokens, 8 KiB of K and V each (H 16, D 128, bf16), in up to two regions.
        e2e_bytes = 0 if args.no_e2e else args.e2e_tokens // 2 * 8192 * 2
        cast_bytes = 2 * int(max(sizes) * 2**20) if sizes else 0
        native.initialize(max(cast_bytes, e2e_bytes) + (16 << 20))
    mesh = jax.make_mesh((2,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    g = lambda a: jax.make_array_from_callback(
        a.shape, NamedSharding(mesh, P("cp")), lambda i: a[i]
    )
    me = args.rank

    def timed(body, per_op, k):
        """Best time of one op: ``body(*local arrays of op i)`` for the k tuples of arrays of
        ``per_op``, in one program, each call ordered after the previous one by an
        optimization barrier over its whole output (no data pass between them, nothing for
        XLA to fuse, slice or drop). Returns (seconds, the outputs of the last run, a
        function that runs the program again)."""
        n = len(per_op[0])
        flat = [a for grp in per_op for a in grp]

        def prog(*xs):
            xs = [x[0] for x in xs]
            outs = []
            for i in range(k):
                xi = xs[i * n : (i + 1) * n]
                if outs:
                    xi, _ = jax.lax.optimization_barrier((xi, outs[-1]))
                outs.append(body(*xi))
            # Every output is returned: none of the k operations can be dropped as dead code.
            return tuple(o[None] for o in outs)

        f = jax.jit(
            jax.shard_map(
                prog,
                mesh=mesh,
                in_specs=(P("cp"),) * len(flat),
                out_specs=(P("cp"),) * k,
                check_vma=False,
            )
        )
        r = f(*flat)
        jax.block_until_ready(r)
        best = float("inf")
        for _ in range(args.reps):
            del r
            t = time.perf_counter()
            r = f(*flat)
            jax.block_until_ready(r)
            best = min(best, (time.perf_counter() - t) / k)
        return best, r, lambda: f(*flat)

    def pattern(r, i, rows, xp=np):
        """Input rows ``rows`` of rank ``r`` for operation ``i``: small integers plus 0.5 on
        odd features, exact in bf16 (and in the float32 sums of the reduce)."""
        v = (rows[:, None] * 5 + 3 * r + 17 * i) % 97 + 1 + 0.5 * (xp.arange(feat)[None, :] % 2)
        return v.astype(xp.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def _make_x(t, i):
        def gen(i_):
            r = jax.lax.axis_index("cp")
            return pattern(r, i_, jnp.arange(t), jnp).astype(jnp.bfloat16)[None]

        return jax.shard_map(gen, mesh=mesh, in_specs=P(), out_specs=P("cp"), check_vma=False)(i)

    def make_x(t, i):
        return _make_x(t, jnp.int32(i))

    def check(outs, t):
        """Every output of the chain holds the peer's rows of its own input (sampled rows
        when large: first, last and a stride)."""
        rows = (
            np.arange(t)
            if t <= 8192
            else np.unique(
                np.concatenate(
                    [np.arange(64), np.arange(t - 64, t), np.arange(0, t, max(1, t // 4096))]
                )
            )
        )
        for i, o in enumerate(outs):
            got = o.addressable_shards[0].data[0]
            got = np.asarray(got if t <= 8192 else got[jnp.asarray(rows)], np.float32)
            if not np.array_equal(got, pattern(1 - me, i, rows)):
                return False
        return True

    rows = {}
    for mib in sizes:
        if time.time() - t_start > args.budget_s:
            print(f"budget reached before {mib} MiB", flush=True)
            break
        t = max(1, int(mib * 2**20) // (feat * 2))
        nbytes = t * feat * 2
        k = _k_for(mib, args.ops)
        # Distinct bf16-exact inputs per operation of a chain, made on the device: op i of
        # rank r sends pattern(r, i); the peer must receive exactly those rows.
        table = CastTable(
            np.tile(np.arange(t, dtype=np.int32), (2, 1, 1)),
            np.tile(np.arange(t, dtype=np.int32), (2, 1)),
            (1,),
            (t,),
        )
        send, recv = g(table.send_index), g(table.recv_index)
        xgs = [make_x(t, i) for i in range(k)]
        xg2 = g(np.ones((2, 2, t, feat), jnp.bfloat16))
        spec_n = CastSpec("cp", 2, (1,), (t,), "native")
        spec_x = CastSpec("cp", 2, (1,), (t,), "ppermute")
        row = {"bytes": nbytes, "rows": t}
        # Every op of a chain gets its own input (all_to_all: one block of ones), so no op
        # can reuse what an earlier one read, and its output is checked.
        tabled = [(x_, send, recv) for x_ in xgs]
        plain = [(x_,) for x_ in xgs]
        ops = {
            "native_cast": (lambda x_, s_, r_: group_cast(x_, CastArrays(s_, r_), spec_n), tabled),
            "xla_cast": (lambda x_, s_, r_: group_cast(x_, CastArrays(s_, r_), spec_x), tabled),
            "ppermute": (lambda x_: jax.lax.ppermute(x_, "cp", [(0, 1), (1, 0)]), plain),
            "all_to_all": (lambda x2_: jax.lax.all_to_all(x2_, "cp", 0, 0), [(xg2,)] * k),
            "native_reduce": (
                lambda x_, s_, r_: group_reduce(x_, CastArrays(s_, r_), spec_n, t),
                tabled,
            ),
            "xla_reduce": (
                lambda x_, s_, r_: group_reduce(x_, CastArrays(s_, r_), spec_x, t),
                tabled,
            ),
        }
        if mib in variant_sizes and not args.skip_native:
            for spec in variants:
                for op, fn in (("cast", group_cast), ("reduce", group_reduce)):
                    if op == "reduce" and spec not in reduce_variants:
                        continue

                    def body(x_, s_, r_, tv=parse_variant(spec), fn=fn, op=op):
                        with native.tuning(**tv):
                            if op == "cast":
                                return fn(x_, CastArrays(s_, r_), spec_n)
                            return fn(x_, CastArrays(s_, r_), spec_n, t)

                    ops[f"native_{op}[{spec}]"] = (body, tabled)
        if mib <= args.ragged_max_mib:

            def ragged(x_):
                r = jax.lax.axis_index("cp")
                to_peer = jnp.where(jnp.arange(2) == 1 - r, t, 0).astype(jnp.int32)
                zeros = jnp.zeros(2, jnp.int32)
                return jax.lax.ragged_all_to_all(
                    x_, jnp.zeros_like(x_), zeros, to_peer, zeros, to_peer, axis_name="cp"
                )

            ops["ragged_all_to_all"] = (ragged, plain)
        for name in OPS + tuple(n for n in ops if "[" in n):
            if name not in ops or (args.skip_native and name.startswith("native")):
                continue
            if time.time() - t_start > args.budget_s + 60:
                row[name] = {"error": "skipped: over budget"}
                continue
            body, arrays = ops[name]
            try:
                s_, outs, run = timed(body, arrays, k)
                row[name] = {"s": s_, "GBps": nbytes / s_ / 1e9}
                if name != "all_to_all":  # every other op delivers the peer's rows
                    row[name]["ok"] = ok = check(outs, t)
                    if not ok:
                        failures.append(f"{mib} MiB {name}")
                        print(f"rank {me}: CHECK FAILED {mib} MiB {name}", flush=True)
                del outs  # free the chain's outputs before tracing it again
                if mib in profile_sizes and name in _PROFILED:
                    tr = row[name]["trace"] = trace_summary(run, calls=3)
                    tr["ops_per_call"] = k
                    if "gpu_us" in tr:
                        # GPU time per op of the chain (as CUDA events around it would see
                        # it, like the peer copy's): no program launch or sync around it.
                        row[name]["gpu_s"] = tr["gpu_us"] / k / 1e6
                        row[name]["GBps_gpu"] = nbytes / row[name]["gpu_s"] / 1e9
                    top = (tr.get("top_kernels") or [{}])[0]
                    if top.get("count_per_call") == k:
                        # The chain's first op also absorbs the two processes' start skew;
                        # these leave it out: one op's median kernel time, and the steady
                        # time per op after the first (gaps between the ops included).
                        row[name]["kernel_s"] = top["median_us"] / 1e6
                        row[name]["GBps_kernel"] = nbytes / row[name]["kernel_s"] / 1e9
                        row[name]["steady_s"] = tr["steady_op_us"] / 1e6
                        row[name]["GBps_steady"] = nbytes / row[name]["steady_s"] / 1e9
            except Exception as e:  # noqa: BLE001 - a row that fails is reported, not fatal
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if me == 0:
                print(f"{mib:6.0f} MiB {name:34s} {row[name]}", flush=True)
        rows[str(mib)] = row
        del xg2, xgs, ops, tabled, plain
    result = {"sizes": rows}
    if not args.no_e2e and time.time() - t_start < args.budget_s + 20:
        result["e2e"] = e2e(args, mesh, me)
    result["check_failures"] = failures
    result["native_default"] = repr(native.cuda_tuning())
    if me == 0:
        print(json.dumps(result), flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "_worker0.json").write_text(json.dumps(result))
    if failures:
        print(f"rank {me}: {len(failures)} rows delivered wrong data: {failures}", flush=True)
        sys.exit(3)


# ---- launcher -------------------------------------------------------------------------------


def _gpus() -> list[str] | None:
    """``nvidia-smi``'s name and driver of each GPU; None where it does not answer."""
    try:
        return (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.strip()
            .splitlines()
        )
    except (OSError, subprocess.SubprocessError):
        return None


def launch(args):
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        NVSHMEM_DISABLE_NVLS="1",
        NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo",
        NCCL_NVLS_ENABLE="0",
        XLA_PYTHON_CLIENT_MEM_FRACTION="0.5",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    base = [sys.executable, str(Path(__file__).resolve())]
    passthru = [
        "--sizes",
        args.sizes,
        "--row-kib",
        str(args.row_kib),
        "--reps",
        str(args.reps),
        "--ops",
        str(args.ops),
        "--ragged-max-mib",
        str(args.ragged_max_mib),
        "--out",
        args.out,
        "--budget-s",
        str(args.budget_s),
        "--e2e-tokens",
        str(args.e2e_tokens),
        "--e2e-backends",
        args.e2e_backends,
        "--e2e-modes",
        args.e2e_modes,
        "--e2e-rounds",
        str(args.e2e_rounds),
        "--e2e-steps",
        str(args.e2e_steps),
        "--send-blocks-sweep",
        args.send_blocks_sweep,
        "--variants",
        args.variants,
        "--reduce-variants",
        args.reduce_variants,
        "--variant-sizes",
        args.variant_sizes,
    ]
    if args.no_e2e:
        passthru.append("--no-e2e")
    if args.profile:
        passthru += ["--profile", "--profile-sizes", args.profile_sizes]
        if args.timeline_us is not None:
            passthru += ["--timeline-us", str(args.timeline_us)]
    if args.skip_native:
        passthru.append("--skip-native")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print("peer copy (torch) ...", flush=True)
    pc = subprocess.run(
        base + ["--mode", "peer"] + passthru, env=env, capture_output=True, text=True, timeout=300
    )
    try:
        peer = json.loads(pc.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001
        peer = {"error": pc.stderr[-2000:]}
    print("peer copy:", peer, flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        procs.append(
            subprocess.Popen(
                base + ["--mode", "worker", "--rank", str(r), "--port", str(port)] + passthru,
                env=dict(env, CUDA_VISIBLE_DEVICES=str(r)),
                stdout=None if r == 0 else open(Path(args.out) / "_worker1.log", "w"),
                stderr=subprocess.STDOUT if r else None,
            )
        )
    for p in procs:
        try:
            p.wait(timeout=args.budget_s + 300)
        except subprocess.TimeoutExpired:
            p.kill()
    log1 = Path(args.out) / "_worker1.log"
    if procs[1].returncode:
        print(f"rank 1 exited with {procs[1].returncode}:\n" + log1.read_text()[-4000:], flush=True)
    log1.unlink(missing_ok=True)
    res_path = Path(args.out) / "_worker0.json"
    result = json.loads(res_path.read_text()) if res_path.exists() else {"error": "no result"}
    res_path.unlink(missing_ok=True)
    for mib, row in result.get("sizes", {}).items():
        if mib in peer and "GBps" in peer[mib]:
            row["peer_copy"] = peer[mib]
    stamp = datetime.datetime.now(datetime.timezone.utc)
    gpus = _gpus()
    dev = (gpus or ["unknown"])[0].split(",")[0].replace(" ", "_")
    meta = environment(
        device=gpus,
        torch=package_version("torch"),
        nvshmem=package_version("nvidia-nvshmem-cu13"),
        row_bytes=args.row_kib * 1024,
        method=__doc__.split("\n\n")[1] if "\n\n" in __doc__ else "",
    )
    out = {"meta": meta, **result}
    name = f"collective_{stamp:%Y%m%d_%H%M}_{dev}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{name}.json").write_text(json.dumps(out, indent=1))
    (Path(args.out) / f"{name}.md").write_text(markdown(out))
    print(markdown(out))


def markdown(res) -> str:
    m = res["meta"]
    lines = [
        f"# Collective benchmark {m['date']}",
        "",
        f"Device: {m['device']}; {describe(m)}, torch {m['torch'] or 'not installed'}, "
        f"NVSHMEM {m['nvshmem'] or 'not installed'}; "
        f"rows of {m['row_bytes']} B (bf16).",
        "",
        "GB/s = bytes sent per rank / time per op (best of reps, ops back to back).",
        "",
    ]
    cols = [
        "native_cast",
        "native_reduce",
        "xla_cast",
        "xla_reduce",
        "ppermute",
        "all_to_all",
        "ragged_all_to_all",
        "peer_copy",
    ]
    lines.append("| MiB/rank | " + " | ".join(cols) + " | native cast µs | outputs ok |")
    lines.append("|---" * (len(cols) + 3) + "|")
    for mib, row in res.get("sizes", {}).items():
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append("" if v is None else (f"{v['GBps']:.1f}" if "GBps" in v else "error"))
        us = row.get("native_cast", {}).get("s")
        oks = [v.get("ok") for v in row.values() if isinstance(v, dict) and "ok" in v]
        lines.append(
            f"| {float(mib):g} | "
            + " | ".join(cells)
            + (f" | {us * 1e6:.1f} |" if us else " | |")
            + (" all |" if oks and all(oks) else (" **NO** |" if oks else " |"))
        )
    var = [
        (mib, n, v)
        for mib, row in res.get("sizes", {}).items()
        for n, v in row.items()
        if n.startswith("native") and isinstance(v, dict)
    ]
    if var:
        lines += [
            "",
            f"Native transport, CudaTuning variants (unmarked rows: {res.get('native_default')}):",
            "",
            "| MiB/rank | row | GB/s | µs per op | ok |",
            "|---|---|---|---|---|",
        ]
        for mib, n, v in var:
            lines.append(
                f"| {float(mib):g} | {n} | "
                + (
                    f"{v['GBps']:.1f} | {v['s'] * 1e6:.1f} | {v.get('ok')} |"
                    if "s" in v
                    else f"{v.get('error', '')[:100]} | | |"
                )
            )
    traced = [
        (f"{float(mib):g} MiB {n}", v["trace"])
        for mib, row in res.get("sizes", {}).items()
        for n, v in row.items()
        if isinstance(v, dict) and "trace" in v
    ]
    traced += [
        (f"e2e {n}", v["trace"])
        for n, v in res.get("e2e", {}).items()
        if isinstance(v, dict) and "trace" in v
    ]
    if traced:
        lines += [
            "",
            "GPU traces (`benchmarks/gpu_trace.py`), µs per call of the timed program "
            "(a chain of ops, or one fwd+bwd step): GPU time from its first kernel to its "
            "last, busy time per kernel category, communication running under compute, "
            "idle GPU inside the call:",
            "",
            "| row | GPU time (median) | compute | native | nccl | comm under compute "
            "| idle inside |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, t in traced:
            b = t.get("busy_us", {})
            lines.append(
                f"| {label} | "
                + (
                    " | ".join(
                        str(x)
                        for x in (
                            t["gpu_us"],
                            b.get("compute", 0),
                            b.get("native", 0),
                            b.get("nccl", 0),
                            t["comm_under_compute_us"],
                            t["idle_us"],
                        )
                    )
                    if "gpu_us" in t
                    else t.get("error", "")
                )
                + " |"
            )
        gpu = [
            (mib, n, v)
            for mib, row in res.get("sizes", {}).items()
            for n, v in row.items()
            if isinstance(v, dict) and "gpu_s" in v
        ]
        if gpu:
            lines += [
                "",
                "The same chains by GPU time per op (the peer copy is timed so too, "
                "with CUDA events): the call's span / ops; steady, from the end of the "
                "first op to the end of the last / (ops - 1); one op's median kernel "
                "time:",
                "",
                "| MiB/rank | row | span µs/op | GB/s | steady µs/op | GB/s | kernel µs | GB/s |",
                "|---|---|---|---|---|---|---|---|",
            ]
            lines += [
                f"| {float(mib):g} | {n} | {v['gpu_s'] * 1e6:.1f} | {v['GBps_gpu']:.1f} | "
                + (
                    f"{v['steady_s'] * 1e6:.1f} | {v['GBps_steady']:.1f} | "
                    f"{v['kernel_s'] * 1e6:.1f} | {v['GBps_kernel']:.1f} |"
                    if "kernel_s" in v
                    else " | | | |"
                )
                for mib, n, v in gpu
            ]
    if res.get("check_failures"):
        lines += ["", f"**Wrong data delivered:** {res['check_failures']}"]
    if "e2e" in res:
        e = res["e2e"]
        lines += [
            "",
            f"magi_attention fwd+bwd, {e.get('mask')}, {e.get('tokens')} tokens, "
            f"H {e.get('heads')}, D {e.get('head_dim')}, 2 GPUs (per step: median over "
            "rounds of back-to-back steps, best round in brackets):",
            "",
            "| FFA / transport / what | ms | TFLOP/s per GPU |",
            "|---|---|---|",
        ]
        for k, v in e.items():
            if isinstance(v, dict):
                best = f" ({v['best_s'] * 1e3:.2f})" if "best_s" in v else ""
                lines.append(
                    f"| {k} | "
                    + (
                        f"{v['s'] * 1e3:.2f}{best} | {v['TFLOPs_per_gpu']:.1f} |"
                        if "s" in v
                        else f"{v['error'][:120]} | |"
                    )
                )
    return "\n".join(lines) + "\n"


def main():
    args = _args()
    if args.mode == "peer":
        print(json.dumps(peer_copy(args)))
    elif args.mode == "worker":
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
