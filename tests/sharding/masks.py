"""Masks for the context-parallel tests: the zoo over one odd-length packed sequence, and a
hypothesis strategy for random self-attention slice masks."""

import numpy as np
from hypothesis import strategies as st

from magi_jax.mask import AttnMask, AttnMaskType, shape_to_slices

LENS = [13, 1, 22, 9, 22]  # 67 tokens: padded for every cp > 1
CU = np.cumsum([0] + LENS)
T = int(CU[-1])

ZOO = {
    "full": AttnMask.full(T),
    "causal": AttnMask.causal(T),
    "doc_causal": AttnMask.varlen(CU, causal=True),
    "doc_full": AttnMask.varlen(CU, causal=False),
    "sliding_window": AttnMask.sliding_window(T, 7, 3),
    "doc_window": AttnMask.varlen(CU, causal=True, window=5),
    "block_causal": AttnMask.block_causal(LENS, 6),
    "prefix_lm": AttnMask.prefix_lm(LENS, [5, 1, 10, 0, 19]),
    "shared_question": AttnMask.shared_question(LENS),
    "causal_blockwise": AttnMask.causal_blockwise(LENS),
    "global_sliding_window": AttnMask.global_sliding_window(T, 6, 3),
}


@st.composite
def self_attention_masks(draw, min_len: int = 1, max_len: int = 48, max_cuts: int = 4):
    """Random disjoint slices over one sequence (total_q == total_k): a random grid of
    rectangles, each empty, one typed slice, or a sliding-window shape split into typed
    slices. Rows that see nothing occur."""
    t = draw(st.integers(min_len, max_len))
    cuts = sorted(set(draw(st.lists(st.integers(0, t), max_size=max_cuts))) | {0, t})
    kcuts = sorted(set(draw(st.lists(st.integers(0, t), max_size=max_cuts))) | {0, t})
    slices = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        for c, d in zip(kcuts[:-1], kcuts[1:]):
            kind = draw(
                st.sampled_from(
                    ["none", "none", "full", "causal", "inv_causal", "bi_causal", "window"]
                )
            )
            if kind == "none":
                continue
            if kind == "window":
                lo = draw(st.integers(-6, 2))
                hi = lo + draw(st.integers(0, 6))
                slices += shape_to_slices(a, b, c, d, lo + (c - a), hi + (c - a))
            else:
                slices.append((a, b, c, d, AttnMaskType.coerce(kind)))
    if not slices:
        return AttnMask.from_ranges([], [], [], total_q=t, total_k=t)
    return AttnMask.from_ranges(
        [[s[0], s[1]] for s in slices],
        [[s[2], s[3]] for s in slices],
        [s[4] for s in slices],
        total_q=t,
        total_k=t,
    )
