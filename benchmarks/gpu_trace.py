"""Where a jitted GPU program spends its time: a profiler trace reduced to a few numbers.

:func:`trace_summary` runs a callable under ``jax.profiler`` and reads the trace back
(``jax.profiler.ProfileData``): every kernel on this process's GPU streams, grouped by a
category of its name (:data:`CATEGORIES`). The calls are told apart by the longest gaps
between kernels (the host's round trip between two calls). Per call it reports the GPU time
(median over the calls, first kernel's start to last kernel's end: what CUDA events around
the call would measure, without the host's launch and synchronisation around it), how long
each category kept the GPU busy (the union of its kernels' intervals, over all streams), how
long communication kernels ran at the same time as compute kernels, how long no kernel ran
inside a call, and the heaviest kernels by total time. It answers questions like "does the
collective overlap the attention?" and "is a chain of small collectives bound by its kernels
or by the gaps between them?"
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections import defaultdict

import jax
import numpy as np

# Categories by kernel name, first match wins; everything else is "compute".
CATEGORIES = (
    ("native", ("CastKernel", "ReduceKernel")),
    ("nccl", ("nccl",)),
    ("copy", ("memcpy", "memset", "Memcpy", "Memset")),
)
COMM = ("native", "nccl")


def _category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "compute"


def _union(iv: np.ndarray) -> np.ndarray:
    """Disjoint, sorted intervals covering the ``[n, 2]`` intervals ``iv``."""
    if len(iv) == 0:
        return iv.reshape(0, 2)
    iv = iv[np.argsort(iv[:, 0])]
    out = [list(iv[0])]
    for a, b in iv[1:]:
        if a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return np.asarray(out, np.float64)


def _length(iv: np.ndarray) -> float:
    return float((iv[:, 1] - iv[:, 0]).sum()) if len(iv) else 0.0


def _intersection(a: np.ndarray, b: np.ndarray) -> float:
    """Length of the intersection of two unions of disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        total += max(0.0, hi - lo)
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return total


def kernel_events(path: str, lines: bool = False):
    """``(name, start_ns, end_ns)`` of every kernel on the GPU stream lines of an xplane
    (``(name, start_ns, end_ns, line name)`` with ``lines``)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                ev = (e.name, float(e.start_ns), float(e.start_ns + e.duration_ns))
                out.append(ev + (line.name,) if lines else ev)
    return out


def summarize(events, calls: int, top: int = 8, timeline_min_us: float | None = None) -> dict:
    """The numbers of :func:`trace_summary` from kernel events of ``calls`` calls (``(name,
    start, end)``, or with a fourth item, the stream line, kept for the timeline)."""
    if not events:
        return {"error": "no GPU kernels in the trace"}
    lined = events
    events = [ev[:3] for ev in events]
    by_cat = defaultdict(list)
    per_kernel = defaultdict(list)  # name -> durations of its launches
    for name, s, e in events:
        by_cat[_category(name)].append((s, e))
        per_kernel[name].append(e - s)
    unions = {c: _union(np.asarray(v, np.float64)) for c, v in by_cat.items()}
    every = _union(np.asarray([(s, e) for _, s, e in events], np.float64))
    comm = _union(np.concatenate([unions[c] for c in COMM if c in unions] or [np.zeros((0, 2))]))
    # The calls-1 longest gaps between busy intervals separate the calls.
    gaps = every[1:, 0] - every[:-1, 1]
    cuts = np.sort(np.argsort(gaps)[len(gaps) - (calls - 1) :]) if calls > 1 else []
    bounds = np.split(np.arange(len(every)), np.asarray(cuts, int) + 1)
    spans = [every[b[-1], 1] - every[b[0], 0] for b in bounds if len(b)]
    inner_idle = sum(spans) - _length(every)
    us = lambda ns: round(float(ns) / calls / 1e3, 2)
    heavy = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    copy = unions.get("copy", np.zeros((0, 2)))
    out = {
        "calls": calls,
        "gpu_us": round(float(np.median(spans)) / 1e3, 2),
        "span_us": us(sum(spans)),
        "busy_us": {c: us(_length(u)) for c, u in sorted(unions.items())},
        "comm_under_compute_us": us(_intersection(comm, unions.get("compute", np.zeros((0, 2))))),
        "copy_under_compute_us": us(_intersection(copy, unions.get("compute", np.zeros((0, 2))))),
        "idle_us": us(inner_idle),
        # median_us: one launch's median duration. In a chain of back-to-back ops it is
        # the op's time in steady state: the first op of a call, which also waits for
        # the other process to start, is one launch of many.
        "top_kernels": [
            {
                "name": n[:80],
                "count_per_call": len(d) / calls,
                "us_per_call": us(sum(d)),
                "median_us": round(float(np.median(d)) / 1e3, 2),
            }
            for n, d in heavy
        ],
    }
    if heavy:
        # The heaviest kernel's steady rate inside a call (a chain of back-to-back ops):
        # from the end of its first launch to the end of its last, per launch after the
        # first. Unlike the span it leaves out the first launch, which in a collective also
        # waits for the other processes to start, and like the span it counts the gaps.
        name = heavy[0][0]
        ends = np.sort([e for n, _, e in events if n == name])
        steady = []
        for b in bounds:
            if len(b):
                lo, hi = every[b[0], 0], every[b[-1], 1]
                mine = ends[(ends >= lo) & (ends <= hi)]
                if len(mine) > 1:
                    steady.append((mine[-1] - mine[0]) / (len(mine) - 1))
        if steady:
            out["steady_op_us"] = round(float(np.median(steady)) / 1e3, 2)
    if timeline_min_us is not None and bounds and len(bounds[-1]):
        # The last call's kernels of at least timeline_min_us: (name, stream line, start
        # after the call's first kernel, duration), in µs.
        t0, t1 = every[bounds[-1][0], 0], every[bounds[-1][-1], 1]
        out["timeline"] = sorted(
            (
                ev[0][:48],
                ev[3] if len(ev) > 3 else "",
                round(float(ev[1] - t0) / 1e3, 1),
                round(float(ev[2] - ev[1]) / 1e3, 1),
            )
            for ev in lined
            if t0 <= ev[1] <= t1 and ev[2] - ev[1] >= timeline_min_us * 1e3
        )
        out["timeline"].sort(key=lambda r: r[2])
    return out


def trace_summary(fn, calls: int = 3, top: int = 8, timeline_min_us: float | None = None) -> dict:
    """Runs ``fn()`` (blocking on its result) ``calls`` times under the profiler, after one
    untraced call, and summarizes this process's GPU kernels per call (module docstring);
    with ``timeline_min_us``, also the last call's kernels of at least that long, in order
    (name, stream, start, duration)."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for _ in range(calls):
                jax.block_until_ready(fn())
        finally:
            jax.profiler.stop_trace()
        paths = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))
        if not paths:
            return {"error": "the profiler wrote no trace"}
        return summarize(
            kernel_events(paths[-1], lines=timeline_min_us is not None), calls, top, timeline_min_us
        )
