"""benchmarks/kernel_profile.py reads Nsight Compute's per-instruction CSV: launches apart,
samples summed by stall reason and by opcode, spills counted, the hottest instructions."""

import json

import pytest

from benchmarks import kernel_profile as kp

_HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
    '"stall_long_sb","stall_wait","stall_long_sb (Not Issued)"'
)


def _launch(rows):
    lines = ['"Kernel Name","kernel_mosaic_gpu_kernel",', _HEADER]
    lines += [
        f'"{a}","{src}","{n}","{ex}","{lsb}","{wait}","0"' for a, src, n, ex, lsb, wait in rows
    ]
    return "\n".join(lines)


# Two launches with ncu's notes between them, as `ncu --page source --csv` prints them.
CSV = "\n".join(
    [
        "==PROF== Connected to process 1",
        _launch(
            [
                ("0x10", "@!P1  BRA 0x40", "60", "100", "50", "10"),
                ("0x20", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ", "30", "200", "0", "30"),
                ("0x30", "LDL R0, [R1]", "10", "1,000", "10", "0"),
            ]
        ),
        "==PROF== Disconnected from process 1",
        _launch([("0x50", "MUFU.EX2 R3, R4", "4", "64", "0", "4")]),
    ]
)


def test_launches_and_shares():
    first, second = kp.split_kernels(CSV)
    assert [r["Address"] for r in first] == ["0x10", "0x20", "0x30"] and len(second) == 1
    s = kp.summarize(first, top=2)
    assert s["samples"] == 100  # the reasons' samples, "Not Issued" columns left out
    assert s["by_reason"] == {"long_sb": 60.0, "wait": 40.0}
    assert s["by_opcode"] == {"BRA": 60.0, "HGMMA": 30.0, "LDL": 10.0}
    assert s["spill_instructions_executed"] == 1000
    assert [(t["address"], t["reason"]) for t in s["top"]] == [
        ("0x10", "long_sb"),
        ("0x20", "wait"),
    ]


def test_report_names_launches_and_writes(tmp_path):
    base = str(tmp_path / "profile")
    out = kp.report(CSV, ["dq", "dkv"], dict(case="test"), base)
    assert [s["part"] for s in out] == ["dq", "dkv"]
    assert json.load(open(base + ".json"))["kernels"][1]["by_opcode"] == {"MUFU": 100.0}
    assert "| long_sb | 60.0 |" in open(base + ".md").read()
    with pytest.raises(ValueError, match="holds 2 launches; --parts names 1"):
        kp.report(CSV, ["dq"], {})


def test_ncu_command_profiles_the_child_run():
    cmd = kp.ncu_command("ncu", ["dq", "dkv"], ["--parts=dq,dkv"])
    assert cmd[:3] == ["ncu", "--clock-control", "none"]
    assert cmd[cmd.index("--launch-skip") + 1] == "1"  # the forward making the inputs
    assert cmd[cmd.index("--launch-count") + 1] == "2"
    assert cmd[-2:] == ["--child", "--parts=dq,dkv"]


def test_main_rejects_unknown_parts():
    with pytest.raises(SystemExit):
        kp.main(["--parts", "dq,bogus", "--report", "x.csv"])


def test_child_runs_each_part_once():
    """The kernels the profiled child launches, in interpret mode at a tiny size: the
    forward, dQ and dK/dV with the backend's default tuning, each giving its outputs."""
    fwd, dq, dkv = kp.run_kernels(["forward", "dq", "dkv"], "causal", 256, 1, 64, interpret=True)
    assert fwd[0].shape == (1, 256, 1, 64) and dq.shape == (1, 256, 1, 64)
    assert [x.shape for x in dkv] == [(1, 256, 1, 64)] * 2
