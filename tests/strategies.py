"""Hypothesis strategies for random valid slice masks."""

from hypothesis import strategies as st

from magi_jax.mask import AttnMask, AttnMaskType, shape_to_slices

_CELL = ("none", "none", "full", "causal", "inv_causal", "bi_causal", "pair")


def _cuts(draw, total, max_cuts):
    inner = draw(st.lists(st.integers(0, total), max_size=max_cuts))
    return sorted(set(inner) | {0, total})


@st.composite
def slice_masks(draw, max_len: int = 48, max_cuts: int = 5) -> AttnMask:
    """Random non-overlapping slice sets: a random grid of (possibly length-1, non-square)
    rectangles, each empty, one typed slice, or a CAUSAL slice plus the slices of its exact
    complement (slices whose bounding boxes overlap but whose cells do not). Rows covered by
    several slices and rows covered by none both occur."""
    tq = draw(st.integers(1, max_len))
    tk = draw(st.integers(1, max_len))
    qc, kc = _cuts(draw, tq, max_cuts), _cuts(draw, tk, max_cuts)
    slices = []
    for a, b in zip(qc[:-1], qc[1:]):
        for c, d in zip(kc[:-1], kc[1:]):
            kind = draw(st.sampled_from(_CELL))
            if kind == "none":
                continue
            if kind == "pair":
                slices.append((a, b, c, d, AttnMaskType.CAUSAL))
                # Cells strictly above the bottom-right-aligned diagonal.
                dlo = (c - a) + (d - c) - (b - a) + 1
                slices += shape_to_slices(a, b, c, d, dlo=dlo, dhi=None)
            else:
                slices.append((a, b, c, d, AttnMaskType.coerce(kind)))
    if not slices:
        return AttnMask.from_ranges([], [], [], total_q=tq, total_k=tk)
    q = [[s[0], s[1]] for s in slices]
    k = [[s[2], s[3]] for s in slices]
    return AttnMask.from_ranges(q, k, [s[4] for s in slices], total_q=tq, total_k=tk)
