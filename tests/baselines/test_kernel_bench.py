"""The kernel benchmark's acceptance check (no timing): which lines a run's rows measure."""

from benchmarks import kernel_bench as kb
from benchmarks.harness import environment


def _row(mask, length, mode, impl, tflops):
    return dict(mask=mask, length=length, mode=mode, impl=impl, tflops=tflops, ms=1.0)


def _judged(rows):
    """``{line: (target, value rounded, holds)}`` of the targets ``rows`` measure."""
    return {
        c["line"]: (c["target"], round(c["value"], 4), c["holds"]) for c in kb.target_lines(rows)
    }


def test_target_lines_ratios_absolutes_and_zoo():
    rows = [
        _row("full", 16384, "fwd", "ffa_pallas", 600.0),
        _row("full", 16384, "fwd", "cudnn", 600.0),  # 1.0: holds at the line
        _row("full", 16384, "fwd+bwd", "ffa_pallas", 400.0),
        _row("full", 16384, "fwd+bwd", "cudnn", 500.0),  # 0.80 < 1.0
        _row("causal", 16384, "fwd+bwd", "ffa_pallas", 480.0),
        _row("doc_causal", 32768, "fwd", "ffa_pallas", 599.6),
        _row("swa_causal_1024", 16384, "fwd+bwd", "ffa_pallas", 432.0),  # 0.9x causal
        _row("prefix_lm", 16384, "fwd+bwd", "ffa_pallas", 431.0),
        _row("prefix_lm", 16384, "fwd+bwd", "tokamax", 10.0),
        _row("causal", 8192, "fwd+bwd", "ffa_pallas", 400.0),
        _row("doc_causal", 8192, "fwd+bwd", "ffa_pallas", 320.0),  # short docs: 0.8x
        dict(mask="doc_full", length=16384, impl="cudnn", mode="-", skipped="no mask"),
    ]
    got = _judged(rows)
    assert got == {
        "full 16384 fwd": (">= 1x cudnn", 1.0, True),
        "full 16384 fwd+bwd": (">= 1x cudnn", 0.8, False),
        "doc_causal 32768 fwd": (">= 600 TFLOP/s", 599.6, False),
        "swa_causal_1024 16384 fwd+bwd": (">= 0.9x FFA causal", 0.9, True),
        "prefix_lm 16384 fwd+bwd": (">= 0.9x FFA causal", 0.8979, False),
        "doc_causal 8192 fwd+bwd": (">= 0.8x FFA causal", 0.8, True),
    }
    md = kb.markdown(
        rows,
        environment(
            [],
            device="dev",
            tokamax=None,
            heads=16,
            kv_heads=16,
            head_dim=128,
            dtype="bfloat16",
            tokens_per_batch=32768,
            flops="f",
        ),
    )
    assert "| full 16384 fwd+bwd | >= 1x cudnn | 0.800 | no |" in md


def test_target_lines_by_head_configuration():
    """GQA, D = 64 and D = 256 rows are judged by their own targets and never against the
    default configuration's rows."""
    cfg = lambda r, h, kvh, d: dict(r, heads=h, kv_heads=kvh, head_dim=d)
    rows = [
        cfg(_row("causal", 16384, "fwd", "ffa_pallas", 570.0), 32, 32, 64),
        cfg(_row("causal", 16384, "fwd", "cudnn", 600.0), 32, 32, 64),  # 0.95
        cfg(_row("causal", 16384, "fwd", "ffa_pallas", 590.0), 64, 8, 128),
        cfg(_row("causal", 16384, "fwd", "cudnn", 600.0), 64, 8, 128),
        cfg(_row("causal", 8192, "fwd+bwd", "ffa_pallas", 360.0), 16, 16, 256),
        cfg(_row("causal", 8192, "fwd+bwd", "cudnn", 400.0), 16, 16, 256),
        _row("causal", 16384, "fwd", "cudnn", 100.0),
    ]  # default config: not a pair
    got = _judged(rows)
    assert got == {
        "causal 16384 fwd [d64]": (">= 0.95x cudnn", 0.95, True),
        "causal 16384 fwd [gqa]": (">= 1x cudnn", 0.9833, False),
        "causal 8192 fwd+bwd [d256]": (">= 0.85x cudnn", 0.9, True),
    }


def test_many_docs_mask():
    mask = kb.make_mask("many_docs_128", 32768)
    assert mask.total_q == 32768 and mask.num_slices == 128


def test_target_lines_skip_what_was_not_measured():
    # No cuDNN row for the ratio lines, no causal row for the zoo line: nothing to judge.
    rows = [
        _row("full", 16384, "fwd", "ffa_pallas", 570.0),
        _row("block_causal", 8192, "fwd+bwd", "ffa_pallas", 400.0),
    ]
    assert kb.target_lines(rows) == []
    assert "acceptance lines" not in kb.markdown(
        rows,
        environment(
            [],
            device="dev",
            tokamax=None,
            heads=1,
            kv_heads=1,
            head_dim=64,
            dtype="bfloat16",
            tokens_per_batch=1,
            flops="f",
        ),
    )


def test_judge_reads_a_results_file(tmp_path, capsys):
    rows = [
        _row("causal", 16384, "fwd", "ffa_pallas", 560.0),
        _row("causal", 16384, "fwd", "cudnn", 560.0),
    ]
    path = tmp_path / "kernel.json"
    path.write_text(kb.json.dumps(dict(meta={}, rows=rows)))
    checks = kb.main(["--judge", str(path)])
    assert [(c["line"], c["holds"]) for c in checks] == [("causal 16384 fwd", True)]
    assert "causal 16384 fwd" in capsys.readouterr().out


def test_document_masks_are_their_packings():
    from magi_jax.masks import make_mask as zoo_mask
    from magi_jax.masks.packings import packing_mask

    for name in ("pack_web", "pack_long_full", "pack_web_w1024", "docs128", "docs512_full"):
        lens, causal, window = kb.documents(name, 32768)
        assert lens.sum() == 32768 and causal == ("full" not in name)
        assert window == (1024 if name.endswith("_w1024") else None)
        assert kb.make_mask(name, 32768) == packing_mask(lens, causal, window)
    assert len(kb.documents("docs512", 32768)[0]) == 512
    again = kb.documents("pack_long", 8192)[0]
    assert (again == kb.documents("pack_long", 8192)[0]).all()  # seeded by length
    assert kb.make_mask("doc_causal", 32768) == zoo_mask("doc-causal", 32768, multiple=128)
    assert kb.documents("causal", 1024) is None and kb.documents("swa_causal_1024", 1024) is None
    for preset in ("realistic", "realistic_masks", "stress"):
        assert all(kb.documents(m, t) is not None for m, t, _, _ in kb.PRESETS[preset])


def test_auto_judged_against_the_faster_of_ffa_and_cudnn_packed():
    rows = [
        _row("pack_web", 32768, "fwd", "ffa_pallas", 300.0),
        _row("pack_web", 32768, "fwd", "cudnn", 400.0),
        _row("pack_web", 32768, "fwd", "ffa_auto", 396.0),  # 0.99 of cuDNN's
        _row("causal", 32768, "fwd", "ffa_auto", 100.0),  # not a document mask: no line
    ]
    assert _judged(rows) == {
        "pack_web 32768 fwd": (">= 0.98x best of FFA, cuDNN packed", 0.99, True)
    }
