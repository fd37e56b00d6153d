"""benchmarks/model_bench.py: the model's size, its packed batches, and a smoke run on CPU."""

import json

import numpy as np

from benchmarks import model_bench as mb
from magi_jax.masks.packings import WEB_TEXT


def test_llama_1b_matmul_parameters():
    # 16 layers of 60.8M matmul weights and the tied 2048 x 128256 head: 1.236B.
    assert mb.Shape().matmul_params == 16 * 60_817_408 + 2048 * 128256


def test_batches_restart_positions_at_every_document():
    (b,) = mb.make_batches(1, 4096, WEB_TEXT, vocab=100, max_docs=64)
    ids, pos = b["segment_ids"][0], b["pos"][0]
    starts = np.flatnonzero(np.diff(ids, prepend=0))
    assert (pos[starts] == 0).all() and b["docs"] == len(starts) == ids.max()
    lens = np.diff(np.append(starts, ids.size))
    assert b["q_seqlen"][0, : b["docs"]].tolist() == lens.tolist()
    assert b["area"] == int((lens * (lens + 1) // 2).sum())


def test_smoke_trains_and_writes_its_table(tmp_path):
    rows = mb.main(["--smoke", "--out", str(tmp_path)])
    (row,) = rows
    assert row["variant"] == "xla" and row["tokens_per_s"] > 0 and np.isfinite(row["loss"])
    (path,) = tmp_path.glob("model_*.json")
    assert json.loads(path.read_text())["rows"][0]["variant"] == "xla"
