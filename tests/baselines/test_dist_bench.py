"""The distributed benchmark's bookkeeping (no timing): work order, derived ratios, report."""

from benchmarks import dist_bench as db
from benchmarks.harness import environment


def test_work_list_puts_d1_first():
    a = db._parse([])
    work = db.work_list(a)
    assert len(work) == 4 * 2 * 2 * 2 * 6  # masks x lengths x heads x modes x impls
    first = work[:24]
    assert {w[0] for w in first} == {"doc_causal", "causal"}
    assert {w[4] for w in first} == {"fwd+bwd"} and {w[2] for w in first} == {16}
    assert first[0] == ("doc_causal", 131072, 16, 16, "fwd+bwd", "single")
    assert work[-1][2:4] == (64, 8)


def _row(impl, ms, area, tflops, mask="doc_causal", mode="fwd+bwd"):
    return dict(
        mask=mask,
        length=1024,
        heads=16,
        kv_heads=16,
        mode=mode,
        impl=impl,
        ms=ms,
        tflops_per_gpu=tflops,
        max_rank_area=area,
        imbalance=1.0,
        compile_s=1.0,
    )


def test_derived_ratios_and_d1_lines():
    rows = [
        _row("single", 10.0, 1000, 400.0),
        _row("magi", 11.0, 1000, 380.0),
        _row("ring", 16.0, 1200, 250.0),
        _row("ulysses", 30.0, 500, 140.0),
        _row("magi_nocomm", 10.25, 1000, 390.0),
    ]
    db._derive(rows)
    magi, ring, uly = rows[1], rows[2], rows[3]
    assert abs(magi["vs_single"] - 0.95) < 1e-12 and abs(magi["vs_ring"] - 16 / 11) < 1e-12
    assert abs(magi["compute_ms"] - 10.0) < 1e-12 and abs(magi["exposed_ms"] - 1.0) < 1e-12
    assert abs(ring["compute_ms"] - 12.0) < 1e-12 and abs(uly["compute_ms"] - 5.0) < 1e-12
    meta = environment(
        [],
        num_devices=2,
        device="dev",
        platform="gpu",
        head_dim=128,
        dtype="bfloat16",
        ffa_backend="pallas",
        ffa_backend_reason="r",
        magi_ffa_backend="pallas",
        flops="f",
    )
    md = db.markdown(meta, rows)
    assert "0.95× single (PASS ≥ 0.9), 1.45× ring (PASS ≥ 1.3)" in md
    assert abs(magi["comm_exposed_ms"] - 0.75) < 1e-12
    assert abs(magi["stage_overhead_ms"] - 0.25) < 1e-12
    assert "0.2 stages/merge (magi_nocomm − single) + 0.8 communication" in md
    rows[2]["ms"] = 12.0
    db._derive(rows)
    assert "(FAIL ≥ 1.3)" in db.markdown(meta, rows)


def test_resume_carries_complete_cases_only(tmp_path):
    a = db._parse(
        [
            "--masks",
            "doc_causal,causal",
            "--lengths",
            "1024",
            "--heads",
            "16:16",
            "--modes",
            "fwd+bwd",
            "--impls",
            "single,magi,ring",
        ]
    )
    work = db.work_list(a)
    assert len(work) == 6
    old = [_row(i, 1.0, 10, 1.0) for i in ("single", "magi", "ring")]  # doc_causal done
    old += [
        _row("single", 1.0, 10, 1.0, mask="causal"),  # causal partial
        dict(_row("magi", 1.0, 10, 1.0, mask="causal"), ms=None),
    ]
    del old[-1]["ms"]
    path = tmp_path / "prev.json"
    path.write_text(db.json.dumps(dict(meta=dict(date="yesterday"), rows=old)))
    carried, left = db._resume(str(path), work)
    assert [r["impl"] for r in carried] == ["single", "magi", "ring"]
    assert all(r["mask"] == "doc_causal" and r["run"] == "yesterday" for r in carried)
    assert [w[0] for w in left] == ["causal"] * 3
