"""What every benchmark shares: the environment record, timing, the anchors, result files.

A script declares its cases and calls these; run it from the repository root as
``python -m benchmarks.<script>`` (or with ``PYTHONPATH=.``).

- :func:`environment` / :func:`describe`: when, where, with what software, at what commit,
  under the same keys in every script's JSON (JAX's versions only when JAX is imported).
- :func:`time_interleaved`: medians of blocked calls, entries alternating round by round.
- :func:`attempt`: one row that fails prints its error and the run goes on.
- :class:`Run`: ``<out>/<name>_<stamp>_<device>[_tag].{json,md}``, rewritten after every
  row so a run cut short keeps what it measured.
- The anchors a user would pick instead of magi-jax: :func:`cudnn_packed` (cuDNN's packed
  THD layout through ``jax._src.cudnn``), :func:`cudnn_dense` (``jax.nn`` full / causal) and
  :func:`tokamax_intervals` (tokamax's Mosaic GPU kernel, rows as key intervals).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
_GIT_TIMEOUT_S = 10


# --- the environment -------------------------------------------------------------------


def _git(*args: str) -> str | None:
    """``git args`` in the repository, its stdout stripped; None without git or a repository."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name`` without importing it; None if absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(argv: Sequence[str] | None = None, **extra: object) -> dict[str, object]:
    """The run's environment, then ``extra`` (the script's own keys, in its order).

    Keys: ``date`` (UTC, ISO 8601), ``host``, ``machine``, ``cpu``, ``system``,
    ``cpu_count``, ``load_average``, ``python``, ``numpy``, ``jax`` and ``jaxlib`` (only when
    JAX is imported), ``magi_jax``, ``commit`` and ``dirty`` (None outside a git checkout),
    ``argv`` (default the command line's) and ``xla_flags`` (only when ``XLA_FLAGS`` is set).
    Raises ``ValueError`` when a key of ``extra`` is one of these.
    """
    import magi_jax  # imports only the mask module: no JAX

    env: dict[str, object] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(),
        machine=platform.machine(),
        cpu=_cpu_model(),
        system=f"{platform.system()} {platform.release()}",
        cpu_count=os.cpu_count(),
        load_average=[round(x, 2) for x in os.getloadavg()],
        python=platform.python_version(),
        numpy=np.__version__,
    )
    if "jax" in sys.modules:
        env["jax"] = sys.modules["jax"].__version__
        env["jaxlib"] = sys.modules["jaxlib"].__version__
    status = _git("status", "--porcelain", "--untracked-files=no")
    env.update(
        magi_jax=magi_jax.__version__,
        commit=_git("rev-parse", "--short", "HEAD"),
        dirty=None if status is None else bool(status),
        argv=list(sys.argv[1:] if argv is None else argv),
    )
    if os.environ.get("XLA_FLAGS"):
        env["xla_flags"] = os.environ["XLA_FLAGS"].strip()
    clash = sorted(set(extra) & set(env))
    if clash:
        raise ValueError(
            f"environment(**extra) got {clash}, which the environment records itself; "
            "give the script's own value another name"
        )
    env.update(extra)
    return env


def describe(env: dict[str, object]) -> str:
    """The common keys of :func:`environment` as one markdown line (no trailing period)."""
    load = ", ".join(f"{x:.2f}" for x in env["load_average"])
    software = [f"Python {env['python']}", f"NumPy {env['numpy']}"]
    if "jax" in env:
        software.append(f"jax {env['jax']} (jaxlib {env['jaxlib']})")
    software.append(f"magi_jax {env['magi_jax']}")
    commit = "no git checkout" if env["commit"] is None else f"commit `{env['commit']}`"
    if env["dirty"]:
        commit += " (dirty)"
    line = (
        f"{env['date']}, {env['host']} ({env['cpu']}, {env['cpu_count']} CPUs, load "
        f"{load}); {', '.join(software)}; {commit}"
    )
    if "xla_flags" in env:
        line += f"; XLA_FLAGS `{env['xla_flags']}`"
    return line


def host_devices(n: int) -> None:
    """Asks XLA for ``n`` CPU host devices (``XLA_FLAGS``) unless the flag is already set;
    call it before JAX starts its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def device_name() -> str:
    """The first JAX device's kind (``"NVIDIA H100 80GB HBM3"``, ``"cpu"``)."""
    import jax

    dev = jax.devices()[0]
    return getattr(dev, "device_kind", str(dev))


# --- timing ----------------------------------------------------------------------------


def time_interleaved(
    entries: Sequence[tuple[Callable, tuple]], calls: int = 5, reps: int = 5, warmup: int = 2
) -> list[tuple[float, list[float]]]:
    """``(median seconds per call, seconds per call of every round)`` of each ``(fn, args)``:
    ``warmup`` calls each, then ``reps`` rounds in which every entry runs ``calls`` calls and
    waits for the last (``jax.block_until_ready``), so slow drifts of the device (clocks,
    temperature) fall on all entries alike and their ratios stay fair."""
    import jax

    for fn, args in entries:
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    rounds: list[list[float]] = [[] for _ in entries]
    for _ in range(reps):
        for (fn, args), r in zip(entries, rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            r.append((time.perf_counter() - t0) / calls)
    return [(statistics.median(r), r) for r in rounds]


def random_inputs(total, batch, heads, kv_heads, head_dim, dtype, v_head_dim=None):
    """Random ``q, k, v, dout`` ``[B, T, H, D]`` (v and dout of ``v_head_dim``, default
    ``head_dim``; k and v of ``kv_heads``), seeded."""
    import jax

    dv = v_head_dim or head_dim
    shapes = [(heads, head_dim), (kv_heads, head_dim), (kv_heads, dv), (heads, dv)]
    keys = jax.random.split(jax.random.key(0), 4)
    return tuple(
        jax.random.normal(k, (batch, total, h, d), dtype) for k, (h, d) in zip(keys, shapes)
    )


def attempt(label: str, fn: Callable, *args):
    """``(fn(*args), None)``, or ``(None, error)`` with the traceback printed under
    ``label``: one failing row never stops a run."""
    try:
        return fn(*args), None
    except Exception as e:  # a benchmark row: report and go on
        print(f"--- {label} failed:", file=sys.stderr)
        traceback.print_exc()
        return None, f"{type(e).__name__}: {e}"[:400]


def progress(items: Iterable, **kw) -> Iterable:
    """``items`` with a tqdm bar on stderr when tqdm is installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, file=sys.stderr, **kw)


# --- result files ----------------------------------------------------------------------


def stamp() -> str:  # a run file's UTC date and minute
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")


class Run:
    """One run's files: ``<out>/<name>_<stamp>[_<device>][_<tag>].{json,md}`` holding
    ``meta`` (:func:`environment`) and ``rows``; :meth:`add` rewrites both, the markdown by
    ``render(rows, meta)``. A second run in the same minute adds ``_<seconds>``."""

    def __init__(
        self,
        name: str,
        out: str | os.PathLike,
        meta: dict,
        render: Callable[[list, dict], str],
        tag: str = "",
    ):
        os.makedirs(out, exist_ok=True)
        parts = [name, stamp()]
        if meta.get("device"):
            parts.append(str(meta["device"]).replace(" ", "_"))
        if tag:
            parts.append(tag.lstrip("_"))
        self.base = Path(out) / "_".join(parts)
        if self.base.with_suffix(".json").exists():  # a run in the same minute: keep both
            self.base = self.base.with_name(f"{self.base.name}_{time.gmtime().tm_sec:02d}")
        self.meta, self.rows, self.render = meta, [], render

    def add(self, *rows: dict) -> None:
        self.rows.extend(rows)
        self.save()

    def save(self) -> None:
        with open(f"{self.base}.json", "w") as f:
            json.dump(dict(meta=self.meta, rows=self.rows), f, indent=1, default=_plain)
        with open(f"{self.base}.md", "w") as f:
            f.write(self.render(self.rows, self.meta))


def _plain(x):
    if isinstance(x, (np.generic, np.ndarray)):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> list[str]:
    """Markdown table lines: ``columns`` are ``(header, key)``; floats to 3 significant
    decimals, a missing key as ``-``."""

    def cell(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return "-" if v is None else str(v)

    out = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(r.get(k)) for _, k in columns) + " |" for r in rows]
    return out


def backend_missing(engine: str) -> str | None:
    """None if this magi_jax runs backend ``engine`` on this device, else why not (the
    name unknown to this version, or the backend unavailable here)."""
    import jax

    from magi_jax.ffa import flex_flash_attention
    from magi_jax.masks import AttnMask

    x = jax.ShapeDtypeStruct((128, 1, 64), "bfloat16")
    try:
        fn = lambda q: flex_flash_attention(q, q, q, AttnMask.causal(128), backend=engine)
        jax.eval_shape(fn, x)
    except ValueError as e:
        if "backend" in str(e):
            return f"this magi_jax has no backend {engine!r} ({e})"
    except NotImplementedError as e:  # the backend exists, not on this device
        return str(e)
    return None


# --- anchors ---------------------------------------------------------------------------


def cudnn_packed_args(doc_lens: np.ndarray, batch: int, max_docs: int | None = None):
    """cuDNN's packed-layout operands for ``batch`` rows each packing ``doc_lens``:
    ``(q_seqlen [B, M], q_offsets [B, M + 1])`` int32, padded with -1 to ``M = max_docs``
    documents (default ``len(doc_lens)``), as ``jax._src.cudnn``'s ``dot_product_attention``
    documents them (offsets are the documents' first tokens)."""
    lens = np.asarray(doc_lens, np.int64)
    m = len(lens) if max_docs is None else max_docs
    if len(lens) > m:
        raise ValueError(f"{len(lens)} documents exceed max_docs={m}")
    seqlen = np.full((m,), -1, np.int32)
    seqlen[: len(lens)] = lens
    offsets = np.full((m + 1,), -1, np.int32)
    offsets[: len(lens)] = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return np.tile(seqlen, (batch, 1)), np.tile(offsets, (batch, 1))


def cudnn_packed(causal: bool = True, window: int | None = None, scale: float | None = None):
    """``f(q, k, v, q_seqlen, q_offsets) -> out`` on cuDNN's packed (THD) layout, as
    MaxText and Transformer Engine train on packed documents: ``q, k, v`` ``[B, T, H, D]``
    (GQA: fewer key heads), documents given by :func:`cudnn_packed_args` (traced: a new
    packing with as many documents or fewer runs the same program). Documents causal
    (``PADDING_CAUSAL``) or full (``PADDING``); ``window`` (causal only): query ``q`` sees
    keys ``[q - window, q]`` of its document. Raises ``NotImplementedError`` for what the
    layout cannot express."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    if window is not None and not causal:
        raise NotImplementedError("cuDNN's sliding window is causal only")
    mask_type = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING

    def f(q, k, v, q_seqlen, q_offsets):
        return cudnn.dot_product_attention(
            q,
            k,
            v,
            q_seqlen=q_seqlen,
            kv_seqlen=q_seqlen,
            q_offsets=q_offsets,
            kv_offsets=q_offsets,
            scale=q.shape[-1] ** -0.5 if scale is None else scale,
            mask_type=mask_type,
            # cuDNN's window counts the query itself: (pos - length, pos].
            sliding_window_length=None if window is None else window + 1,
        )

    return f


def cudnn_dense(causal: bool):
    """``f(q, k, v)``: ``jax.nn.dot_product_attention`` on cuDNN, full or causal."""
    import functools

    import jax

    return functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn")


def row_intervals(mask) -> tuple[np.ndarray, np.ndarray] | None:
    """Per query row, its visible keys as one interval ``[lo, hi)`` (int32 ``[T]`` each) if
    every row's keys form one; None otherwise."""
    sh = mask.shapes
    t = mask.total_q
    lo = np.full(t, np.iinfo(np.int64).max)
    hi = np.full(t, -1)
    count = np.zeros(t, np.int64)
    for s in np.nonzero(sh.nonempty)[0]:
        rows = np.arange(sh.q0[s], sh.q1[s])
        a, b = sh.lo(rows, s), sh.hi(rows, s)
        lo[rows] = np.minimum(lo[rows], a)
        hi[rows] = np.maximum(hi[rows], b)
        count[rows] += b - a + 1
    seen = count > 0
    if not seen.all() or not np.array_equal(count, hi - lo + 1):
        return None
    return lo.astype(np.int32), (hi + 1).astype(np.int32)


def tokamax_intervals(mask, name: str = ""):
    """``f(q, k, v)``: tokamax's Mosaic GPU attention (``is_causal`` for ``full`` /
    ``causal``, else each row's keys as one interval ``k_start``/``k_end``). Raises
    ``NotImplementedError`` when a row's keys are not one interval."""
    import functools

    import jax.numpy as jnp
    import tokamax
    from tokamax._src.ops.attention import api, base

    if name in ("full", "causal"):
        return functools.partial(
            tokamax.dot_product_attention, is_causal=name == "causal", implementation="mosaic"
        )
    iv = row_intervals(mask)
    if iv is None:
        raise NotImplementedError("rows are not single key intervals")
    ks, ke = (jnp.asarray(x)[None, None, :] for x in iv)
    m = base.Mask(k_start=ks, k_end=ke)
    return lambda q, k, v: api.IMPLEMENTATIONS["mosaic_gpu"](q, k, v, mask=m)
