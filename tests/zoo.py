"""The test mask zoo: one small packed sequence and every mask kind over it, plus the edge
masks (cross lengths, rows and tiles that see nothing), and a hypothesis strategy for random
self-attention slice masks.

The kinds are those of the benchmark zoo (:mod:`magi_jax.mask_zoo`, by the same names), built
over 67 tokens of odd documents (padded for every cp > 1, so every context-parallel test meets
padding) with windows, blocks and prefixes small enough to cut the documents.
"""

import numpy as np
from hypothesis import strategies as st

from magi_jax.mask import AttnMask, AttnMaskType, shape_to_slices

LENS = [13, 1, 22, 9, 22]  # 67 tokens: padded for every cp > 1
CU = np.cumsum([0] + LENS)
T = int(CU[-1])

ZOO = {
    "full": AttnMask.full(T),
    "causal": AttnMask.causal(T),
    "doc-causal": AttnMask.varlen(CU, causal=True),
    "doc-full": AttnMask.varlen(CU, causal=False),
    "sliding-window": AttnMask.sliding_window(T, 7, 3),
    "doc-window": AttnMask.varlen(CU, causal=True, window=5),
    "block-causal": AttnMask.block_causal(LENS, 6),
    "prefix-lm": AttnMask.prefix_lm(LENS, [5, 1, 10, 0, 19]),
    "shared-question": AttnMask.shared_question(LENS),
    "causal-blockwise": AttnMask.causal_blockwise(LENS),
    "global-sliding-window": AttnMask.global_sliding_window(T, 6, 3),
}

# Edge masks: what the zoo's self-attention kinds do not reach.
EDGES = {
    # Fewer queries than keys, the diagonal anchored at the bottom right.
    "causal-rect": AttnMask.causal(24, 53),
    # Rows [0, 3) and [5, 9) see no key.
    "empty-rows": AttnMask.from_ranges([[3, 5]], [[0, 7]], ["causal"], total_q=9, total_k=7),
    # No slice at all: every row sees nothing.
    "empty": AttnMask.from_ranges([], [], [], total_q=5, total_k=4),
    # Non-square slices, rows covered by several slices, rows [190, 200) covered by none, and
    # lengths that are not multiples of 128-row tiles.
    "irregular": AttnMask.from_ranges(
        [[0, 100], [100, 190], [100, 190]],
        [[0, 100], [0, 60], [100, 200]],
        ["causal", "full", "causal"],
        200,
        200,
    ),
    # A whole 128-row q-tile ([128, 256)) that sees nothing and keys [300, 384) that nobody
    # sees.
    "empty-tiles": AttnMask.from_ranges(
        [[0, 128], [256, 384], [256, 384]],
        [[0, 200], [0, 50], [50, 300]],
        ["inv_causal", "full", "bi_causal"],
        384,
        384,
    ),
    # Two documents with a causal window of 40 keys.
    "doc-window-40": AttnMask.varlen([0, 70, 150], causal=True, window=40),
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


def pack(masks: dict[str, AttnMask]) -> tuple[AttnMask, dict[str, tuple[slice, slice]]]:
    """The masks one after another along the diagonal as one mask (each sees only its own
    keys), and each mask's query and key rows in it: one program runs every kind, and each
    kind's rows are the kind's own problem exactly."""
    q_ranges, k_ranges, types, rows = [], [], [], {}
    tq = tk = 0
    for name, m in masks.items():
        q_ranges.append(np.asarray(m.q_ranges).reshape(-1, 2) + tq)
        k_ranges.append(np.asarray(m.k_ranges).reshape(-1, 2) + tk)
        types.append(np.asarray(m.types).reshape(-1))
        rows[name] = (slice(tq, tq + m.total_q), slice(tk, tk + m.total_k))
        tq, tk = tq + m.total_q, tk + m.total_k
    mask = AttnMask.from_ranges(
        np.concatenate(q_ranges), np.concatenate(k_ranges), np.concatenate(types), tq, tk
    )
    return mask, rows


PACKED_ZOO, PACKED_ROWS = pack(ZOO)
