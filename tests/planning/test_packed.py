"""Masks of cuDNN's packed layout (host side of the cudnn engine): which masks it takes,
the offsets and lengths it builds, and the reasons it gives."""

import numpy as np
import pytest

from magi_jax.masks import MASKS, AttnMask, make_mask, shape_to_slices
from magi_jax.masks.packings import equal_doc_lens, sample_doc_lens
from magi_jax.planning.packed import CAUSAL_DOCS, FULL_DOCS, packed_arrays, packed_docs

# The zoo at 2048 tokens, window 128 (so that windows narrow documents): what each is.
TAKEN = {
    "doc-causal": (CAUSAL_DOCS, 0, 10),
    "doc-full": (FULL_DOCS, 0, 10),
    "causal": (CAUSAL_DOCS, 0, 1),
    "full": (FULL_DOCS, 0, 1),
    "sliding-window": (CAUSAL_DOCS, 129, 1),
    "doc-window": (CAUSAL_DOCS, 129, 10),
    "many-docs": (CAUSAL_DOCS, 0, 64),
}
REFUSED = {
    "block-causal": "neither a full block nor a square causal one",
    "prefix-lm": "neither a full block nor a square causal one",
    "hstu": "more than one range",
    "shared-question": "more than one range",
    "causal-blockwise": "neither a full block nor a square causal one",
    "global-sliding-window": "more than one range",
    "doc-window-global": "more than one range",
}


def _dense_of(docs):
    """The cells the packed documents stand for, as cuDNN reads them (top-left causal)."""
    dense = np.zeros((docs.total_q, docs.total_k), bool)
    for qs, n, ks, m in zip(docs.q_starts, docs.q_lens, docs.k_starts, docs.k_lens):
        i, j = np.ogrid[:n, :m]
        cell = np.ones((n, m), bool)
        if docs.kind == CAUSAL_DOCS:
            cell = j <= i
            if docs.window:
                cell &= j > i - docs.window
        dense[qs : qs + n, ks : ks + m] = cell
    return dense


def test_the_zoo_is_sorted_exactly():
    assert set(TAKEN) | set(REFUSED) == set(MASKS)
    for name, want in TAKEN.items():
        mask = make_mask(name, 2048, window=128)
        docs, why = packed_docs(mask)
        assert why == "" and (docs.kind, docs.window, docs.num_docs) == want, name
        np.testing.assert_array_equal(_dense_of(docs), mask.to_dense(), err_msg=name)
    for name, reason in REFUSED.items():
        docs, why = packed_docs(make_mask(name, 2048, window=128))
        assert docs is None and reason in why, (name, why)


@pytest.mark.parametrize("mix,total", [("web", 8192), ("web", 32768), ("long", 32768)])
@pytest.mark.parametrize("kind", ["causal", "full", "window"])
def test_realistic_packings(mix, total, kind):
    lens = sample_doc_lens(total, 7, mix)
    cu = np.concatenate([[0], np.cumsum(lens)])
    window = (127, 0) if kind == "window" else None
    mask = AttnMask.varlen(cu, causal=kind != "full", window=window)
    docs, why = packed_docs(mask)
    assert why == ""
    assert docs.kind == (FULL_DOCS if kind == "full" else CAUSAL_DOCS)
    # A window wider than every document is no window.
    assert docs.window == (128 if kind == "window" and lens.max() > 128 else 0)
    np.testing.assert_array_equal(docs.q_starts, cu[:-1])
    np.testing.assert_array_equal(docs.k_starts, cu[:-1])
    np.testing.assert_array_equal(docs.q_lens, lens)
    np.testing.assert_array_equal(docs.k_lens, lens)
    cap = len(lens) + 5
    q_off, k_off, q_len, k_len = packed_arrays(docs, cap)
    assert [a.shape for a in (q_off, k_off, q_len, k_len)] == [(cap + 1,)] * 2 + [(cap,)] * 2
    assert all(a.dtype == np.int32 for a in (q_off, k_off, q_len, k_len))
    n = len(lens)
    np.testing.assert_array_equal(q_off[:n], cu[:-1])
    np.testing.assert_array_equal(k_off[:n], cu[:-1])
    np.testing.assert_array_equal(q_len[:n], lens)
    assert (q_off[n:] == -1).all() and (q_len[n:] == -1).all() and (k_len[n:] == -1).all()


@pytest.mark.parametrize("num_docs", [128, 512])
def test_stress_packings(num_docs):
    lens = equal_doc_lens(32768, num_docs)
    mask = AttnMask.varlen(np.concatenate([[0], np.cumsum(lens)]))
    docs, why = packed_docs(mask)
    assert why == "" and docs.num_docs == num_docs and not docs.dense
    arrays = packed_arrays(docs, 1024)
    assert [a.shape for a in arrays] == [(1025,), (1025,), (1024,), (1024,)]
    with pytest.raises(ValueError, match=f"max_docs=100.*at least {num_docs}"):
        packed_arrays(docs, 100)


def test_padding_rows_and_cross_attention():
    # Documents with gaps between them (padding rows and unused keys), queries and keys at
    # their own offsets; causal slices taller than wide: their top rows see no key
    # (bottom-right), so the documents are the square blocks below.
    mask = AttnMask.from_ranges(
        [[0, 5], [7, 10], [12, 13]], [[0, 3], [3, 6], [8, 9]], ["causal"] * 3, 14, 10
    )
    docs, why = packed_docs(mask)
    assert why == "" and docs.kind == CAUSAL_DOCS
    assert docs.q_starts.tolist() == [2, 7, 12] and docs.q_lens.tolist() == [3, 3, 1]
    assert docs.k_starts.tolist() == [0, 3, 8] and docs.k_lens.tolist() == [3, 3, 1]
    np.testing.assert_array_equal(_dense_of(docs), mask.to_dense())
    q_off, k_off, q_len, k_len = packed_arrays(docs, 4)
    assert q_off.tolist() == [2, 7, 12, -1, -1] and k_off.tolist() == [0, 3, 8, -1, -1]
    assert q_len.tolist() == [3, 3, 1, -1] and k_len.tolist() == [3, 3, 1, -1]
    # Full blocks may be rectangles.
    docs, why = packed_docs(AttnMask.from_ranges([[0, 4], [4, 6]], [[0, 7], [7, 8]], "full"))
    assert why == "" and docs.kind == FULL_DOCS and docs.k_lens.tolist() == [7, 1]


@pytest.mark.parametrize(
    "mask,reason",
    [
        (AttnMask.from_ranges([[0, 4], [4, 8]], [[4, 8], [0, 4]], "full"), "not in the order"),
        (AttnMask.from_ranges([[0, 4], [4, 8]], [[0, 4], [4, 8]], ["causal", "full"]), "mix"),
        (AttnMask.from_ranges([[0, 4]], [[0, 6]], "causal"), "square causal"),
        (AttnMask.from_ranges([[0, 4]], [[0, 4]], "inv_causal"), "neither"),
        (AttnMask.varlen([0, 8]) - AttnMask.from_ranges([[5, 6]], [[2, 3]], "full", 8, 8), "range"),
        (AttnMask.from_ranges([[0, 4]], [[0, 4]], "full", 4, 4) - AttnMask.causal(4), "neither"),
    ],
)
def test_reasons(mask, reason):
    docs, why = packed_docs(mask)
    assert docs is None and reason in why, why


def test_windows_of_two_widths_are_refused():
    slices = shape_to_slices(0, 100, 0, 100, -9, 0) + shape_to_slices(100, 300, 100, 300, -19, 0)
    mask = AttnMask.from_ranges(
        [s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices]
    )
    docs, why = packed_docs(mask)
    assert docs is None and "different widths ([10, 20])" in why


def test_random_masks_are_taken_exactly_when_cudnn_expresses_them():
    """Property: a mask is taken iff some packed layout is cell for cell the mask, and the
    documents it gives are that layout."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 5))
        lens = rng.integers(1, 12, n)
        gaps = rng.integers(0, 3, n + 1) * (rng.random() < 0.5)
        kind = rng.choice(["causal", "full", "window"])
        starts = np.cumsum(gaps[:-1]) + np.concatenate([[0], np.cumsum(lens)[:-1]])
        total = int(starts[-1] + lens[-1] + gaps[-1])
        w = int(rng.integers(1, 6))
        dense = np.zeros((total, total), bool)
        for s, m in zip(starts, lens):
            i, j = np.ogrid[:m, :m]
            cell = np.ones((m, m), bool) if kind == "full" else (j <= i)
            if kind == "window":
                cell &= j > i - w
            dense[s : s + m, s : s + m] = cell
        spoil = rng.random() < 0.3
        if spoil:  # flip one cell: no packed layout is this mask any more
            a, b = (int(x) for x in rng.integers(0, total, 2))
            dense[a, b] = not dense[a, b]
        if not dense.any():
            continue
        mask = AttnMask.from_dense(dense)
        docs, why = packed_docs(mask)
        if docs is not None:
            np.testing.assert_array_equal(_dense_of(docs), dense, err_msg=f"trial {trial}")
        else:
            assert why, trial
            assert spoil, (trial, why)  # an unspoiled layout is always taken
