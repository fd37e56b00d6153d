"""magi_jax.masks.packings: document lengths of realistic packings, their masks and segment ids."""

import math
import subprocess
import sys

import numpy as np
import pytest

from magi_jax import AttnMask
from magi_jax.masks.packings import (
    LONG_CONTEXT,
    MIXES,
    WEB_TEXT,
    LengthMix,
    LogNormalLengths,
    cu_seqlens,
    equal_doc_lens,
    packing_mask,
    sample_doc_lens,
    segment_ids,
)


@pytest.mark.parametrize("mix", ["web", "long"])
@pytest.mark.parametrize("total", [1, 17, 8192, 32768, 131072])
def test_lengths_fill_the_packing(mix, total):
    lens = sample_doc_lens(total, np.random.default_rng(total), mix)
    assert lens.dtype == np.int64
    assert int(lens.sum()) == total
    assert lens.min() >= 1


def test_same_seed_same_packing_and_generator_advances():
    a = sample_doc_lens(32768, np.random.default_rng(7))
    b = sample_doc_lens(32768, 7)
    np.testing.assert_array_equal(a, b)
    rng = np.random.default_rng(7)
    first, second = sample_doc_lens(32768, rng), sample_doc_lens(32768, rng)
    assert not np.array_equal(first, second)


def test_web_text_statistics():
    # Many documents from long packings: the median and mean the docstring states.
    rng = np.random.default_rng(0)
    lens = np.concatenate([sample_doc_lens(1 << 20, rng)[:-1] for _ in range(4)])
    assert 300 < np.median(lens) < 380
    assert 620 < lens.mean() < 780
    assert lens.min() >= 16
    counts = [sample_doc_lens(32768, rng).size for _ in range(50)]
    assert 35 < np.mean(counts) < 60
    counts = [sample_doc_lens(131072, rng).size for _ in range(20)]
    assert 150 < np.mean(counts) < 230


@pytest.mark.parametrize("total", [8192, 32768, 131072])
def test_long_context_token_shares(total):
    # The long part supplies 60 % of the tokens, at every packing length.
    np.testing.assert_allclose(LONG_CONTEXT.token_shares(total), [0.6, 0.4], atol=1e-12)
    rng = np.random.default_rng(1)
    long_tokens = all_tokens = 0
    for _ in range(400 if total < 131072 else 150):
        lens = sample_doc_lens(total, rng, LONG_CONTEXT)
        # A document longer than any short one is from the long part (the short part's
        # chance of passing 8k is ~0.3 %; the long part's of staying under 2k is ~0.7 %).
        long_tokens += int(lens[lens >= 4096].sum())
        all_tokens += total
    assert 0.5 < long_tokens / all_tokens < 0.7


def test_capped_mean_matches_sampling():
    part = LogNormalLengths(median=1000.0, sigma=1.0)
    x = np.minimum(part.sample(np.random.default_rng(2), 400_000), 3000)
    assert part.mean(3000) == pytest.approx(x.mean(), rel=0.01)
    assert part.mean() == pytest.approx(1000 * math.exp(0.5))
    assert part.mean(3000) < part.mean()


def test_equal_doc_lens():
    assert equal_doc_lens(32768, 128).tolist() == [256] * 128
    assert equal_doc_lens(10, 4).tolist() == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="num_docs"):
        equal_doc_lens(4, 5)
    with pytest.raises(ValueError, match="num_docs"):
        equal_doc_lens(4, 0)


def test_cu_seqlens_and_segment_ids():
    lens = np.array([3, 1, 2])
    assert cu_seqlens(lens).tolist() == [0, 3, 4, 6]
    assert cu_seqlens(lens).dtype == np.int32
    assert segment_ids(lens).tolist() == [1, 1, 1, 2, 3, 3]
    assert segment_ids(lens).dtype == np.int32


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 2])
def test_packing_mask_matches_segment_ids(causal, window):
    lens = sample_doc_lens(300, np.random.default_rng(3), "web")
    lens = np.concatenate([lens[:1] % 7 + 1, [5, 1, 9], lens[1:4] % 11 + 1])
    mask = packing_mask(lens, causal=causal, window=window)
    ids = segment_ids(lens)
    q, k = np.arange(ids.size)[:, None], np.arange(ids.size)[None, :]
    dense = ids[:, None] == ids[None, :]
    if causal:
        dense &= k <= q
    if window is not None:
        dense &= (k >= q - window) & ((k <= q) if causal else (k <= q + window))
    np.testing.assert_array_equal(mask.to_dense(), dense)
    assert mask == AttnMask.from_segment_ids(ids, causal=causal, window=window)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="mix="):
        sample_doc_lens(100, 0, "books")
    with pytest.raises(ValueError, match="total"):
        sample_doc_lens(-1, 0)
    with pytest.raises(ValueError, match="median"):
        LogNormalLengths(median=0.0, sigma=1.0)
    with pytest.raises(ValueError, match="shares"):
        LengthMix("bad", (WEB_TEXT.parts[0],), (0.5,))
    assert set(MIXES) == {"web", "long"}


def test_no_jax_import():
    code = "import sys, magi_jax.masks.packings; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
