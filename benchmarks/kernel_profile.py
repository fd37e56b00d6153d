"""Where the FFA pallas kernels' warps wait: Nsight Compute's per-instruction stall sampling of
the forward, dQ and dK/dV kernels, one launch each with the backend's default tuning, summed
by stall reason and by SASS opcode, with the instructions that collect the most samples.

On a GPU machine with ``ncu`` (Firecracker machines read the counters; gVisor ones cannot):

    PYTHONPATH=. python benchmarks/kernel_profile.py --parts dkv,dq --mask full --length 4096

runs the kernels once under ``ncu --page source --csv --print-source sass`` and writes
``kernel_profile_<stamp>_<device>.{csv,json,md}``. Anywhere, ``--report FILE.csv`` summarises
a CSV such a run wrote (no GPU). Sampling is statistical and the clocks are left alone
(``--clock-control none``): read shares, not absolute counts. The long scoreboard also
counts ``mbarrier`` try-waits, so a producer spinning on a free slot shows up there.
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime
import io
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kernel_bench, when run

PARTS = ("forward", "dq", "dkv")
# The CSV's per-instruction columns this report reads.
_ADDRESS, _SOURCE, _SAMPLES, _EXECUTED = (
    "Address",
    "Source",
    "Warp Stall Sampling (All Samples)",
    "Instructions Executed",
)
_SPILLS = ("LDL", "STL")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(source: str) -> str:
    """``@!P1 BRA 0x...`` -> ``BRA``; ``HGMMA.64x64x16.F32.BF16 ...`` -> ``HGMMA``."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def split_kernels(text: str) -> list[list[dict]]:
    """The per-instruction rows of each profiled launch in an ``ncu --page source --csv``
    output, in launch order (other lines, such as ``==PROF==`` notes, are skipped)."""
    launches, current = [], None
    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            current = []
            launches.append(current)
        elif current is not None and line.startswith('"'):
            current.append(line)
    out = []
    for lines in launches:
        rows = list(csv.reader(io.StringIO("\n".join(lines))))
        header, body = rows[0], rows[1:]
        out.append([dict(zip(header, r)) for r in body])
    return out


def summarize(rows: list[dict], top: int = 8) -> dict:
    """Stall samples of one launch: total, share per reason and per opcode, the spill
    instructions executed, and the ``top`` instructions by samples."""
    reasons = [
        k
        for k in (rows[0] if rows else {})
        if k.startswith("stall_") and not k.endswith("(Not Issued)")
    ]
    by_reason, by_opcode = collections.Counter(), collections.Counter()
    spills = 0.0
    for r in rows:
        for k in reasons:
            by_reason[k[len("stall_") :]] += _number(r[k])
        op = _opcode(r[_SOURCE])
        by_opcode[op] += _number(r[_SAMPLES])
        if op in _SPILLS:
            spills += _number(r[_EXECUTED])
    total = sum(by_reason.values()) or 1.0
    share = lambda c: {k: round(100.0 * v / total, 1) for k, v in c.most_common() if v}
    hot = sorted(rows, key=lambda r: -_number(r[_SAMPLES]))[:top]
    return dict(
        samples=int(total),
        by_reason=share(by_reason),
        by_opcode=share(by_opcode),
        spill_instructions_executed=int(spills),
        top=[
            dict(
                address=r[_ADDRESS],
                source=r[_SOURCE].strip(),
                samples=int(_number(r[_SAMPLES])),
                executed=int(_number(r[_EXECUTED])),
                reason=max(reasons, key=lambda k: _number(r[k]))[len("stall_") :]
                if reasons
                else "",
            )
            for r in hot
        ],
    )


def markdown(summaries: list[dict], meta: dict) -> str:
    lines = [
        f"# FFA pallas kernel profile {meta.get('date', '')} on {meta.get('device', '')}",
        "",
        f"{meta.get('case', '')}; Nsight Compute source sampling, one launch each; "
        "shares of all stall samples",
        "",
    ]
    for s in summaries:
        lines += [
            f"## {s['part']} ({s['samples']} samples, "
            f"{s['spill_instructions_executed']} spill instructions executed)",
            "",
            "| stall reason | % |",
            "|---|---|",
        ]
        lines += [f"| {k} | {v} |" for k, v in list(s["by_reason"].items())[:8]]
        lines += ["", "| opcode | % |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in list(s["by_opcode"].items())[:8]]
        lines += ["", "| instruction | samples | executed | main reason |", "|---|---|---|---|"]
        lines += [
            f"| `{t['source'][:60]}` | {t['samples']} | {t['executed']} | {t['reason']} |"
            for t in s["top"]
        ]
        lines.append("")
    return "\n".join(lines)


def report(csv_text: str, parts: list[str], meta: dict, base: str | None = None) -> list[dict]:
    """Summaries of the launches in ``csv_text``, named by ``parts`` in launch order; with
    ``base``, also written to ``base.json`` and ``base.md``."""
    launches = split_kernels(csv_text)
    if len(launches) != len(parts):
        raise ValueError(
            f"the CSV holds {len(launches)} launches; --parts names "
            f"{len(parts)} ({','.join(parts)}): name them in launch order"
        )
    summaries = [dict(part=p, **summarize(rows)) for p, rows in zip(parts, launches)]
    text = markdown(summaries, meta)
    if base:
        with open(base + ".json", "w") as f:
            json.dump(dict(meta=meta, kernels=summaries), f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(text + "\n")
    print(text)
    return summaries


def run_kernels(parts, mask_name, length, heads, head_dim, interpret=False):
    """Compiles, then runs once, each named kernel with the backend's default tuning for one
    program per unit (so the profiled launches are exactly these, in this order), after a
    forward that makes the backward kernels' inputs. ``interpret``: Mosaic GPU interpret
    mode (tests)."""
    import jax
    import jax.numpy as jnp
    from kernel_bench import case_inputs, make_mask

    from magi_jax.pallas import plan_for_mask
    from magi_jax.pallas.common import LOG2E
    from magi_jax.pallas.ffa_bwd import ffa_dkv, ffa_dq
    from magi_jax.pallas.ffa_fwd import ffa_forward
    from magi_jax.pallas.tuning import kernel_configs

    if head_dim > 128:
        raise ValueError(
            "--head-dim above 128 runs the wide backward kernels; this script "
            "profiles the D <= 128 ones"
        )
    mask = make_mask(mask_name, length)
    plan = plan_for_mask(mask, "pallas")
    q, k, v, do = case_inputs(length, 1, heads, heads, head_dim, jnp.bfloat16)
    fwd_lists = tuple(jnp.asarray(a) for a in plan.fwd)
    dkv_lists = tuple(jnp.asarray(a) for a in plan.bwd)
    scale = head_dim**-0.5
    cfg = kernel_configs(head_dim, scale, 0.0, interpret)
    out, lse = jax.jit(lambda *a: ffa_forward(*a, *fwd_lists, cfg.fwd))(q, k, v)
    lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf)
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
    args = (q, k, v, do, lse2, delta)
    calls = dict(
        forward=(lambda *a: ffa_forward(*a, *fwd_lists, cfg.fwd), (q, k, v)),
        dq=(lambda *a: ffa_dq(*a, *fwd_lists, cfg.dq), args),
        dkv=(lambda *a: ffa_dkv(*a, *dkv_lists, cfg.dkv), args),
    )
    compiled = [(jax.jit(calls[p][0]).lower(*calls[p][1]).compile(), calls[p][1]) for p in parts]
    jax.block_until_ready((out, delta))
    return [jax.block_until_ready(fn(*a)) for fn, a in compiled]


def ncu_command(ncu: str, parts: list[str], argv: list[str]) -> list[str]:
    """The ``ncu`` command that profiles this script's ``--child`` run: only Mosaic GPU
    kernels, skipping the first forward launch (it makes the backward parts' inputs)."""
    return [
        ncu,
        "--clock-control",
        "none",
        "-k",
        "regex:mosaic",
        "--launch-skip",
        "1",
        "--launch-count",
        str(len(parts)),
        "--section",
        "WarpStateStats",
        "--section",
        "SourceCounters",
        "--page",
        "source",
        "--csv",
        "--print-source",
        "sass",
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        *argv,
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--parts",
        default="forward,dq,dkv",
        help=f"kernels to profile, a subset of {','.join(PARTS)} (run in that order)",
    )
    p.add_argument("--mask", default="full")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "kernel"))
    p.add_argument(
        "--report",
        metavar="CSV",
        default=None,
        help="summarise a CSV an earlier run wrote (no GPU)",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    parts = [x for x in PARTS if x in a.parts.split(",")]
    if not parts or len(parts) != len(a.parts.split(",")):
        p.error(f"--parts={a.parts}: name kernels among {','.join(PARTS)}")
    case = (
        f"{a.mask} {a.length}, Hq = Hkv = {a.heads}, D = {a.head_dim}, bf16, B = 1; "
        f"parts {','.join(parts)}"
    )
    if a.report:
        with open(a.report) as f:
            return report(f.read(), parts, dict(case=case))
    if a.child:
        return run_kernels(parts, a.mask, a.length, a.heads, a.head_dim)
    ncu = shutil.which("ncu")
    if ncu is None:
        p.error("ncu (Nsight Compute) is not on the PATH; --report reads a CSV without it")
    child_argv = [
        f"--parts={','.join(parts)}",
        f"--mask={a.mask}",
        f"--length={a.length}",
        f"--heads={a.heads}",
        f"--head-dim={a.head_dim}",
    ]
    res = subprocess.run(
        ncu_command(ncu, parts, child_argv), capture_output=True, text=True, check=False
    )
    if res.returncode:
        sys.exit(f"ncu failed ({res.returncode}):\n{res.stderr[-4000:]}")
    import jax  # only now: a client opened before would hold GPU memory the child needs

    device = jax.devices()[0].device_kind
    stamp = datetime.datetime.now(datetime.timezone.utc)
    meta = dict(date=stamp.isoformat(timespec="seconds"), device=device, case=case)
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(
        a.out, f"kernel_profile_{stamp.strftime('%Y%m%d_%H%M')}_{device.replace(' ', '_')}"
    )
    with open(base + ".csv", "w") as f:
        f.write(res.stdout)
    return report(res.stdout, parts, meta, base)


if __name__ == "__main__":
    main()
