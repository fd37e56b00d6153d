import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from magi_jax.mask import AttnMask, AttnMaskType, shape_to_slices
from tests.strategies import slice_masks


def _slice_dense(sq, sk, t):
    """docs/masks.md's matrices, cell by cell."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    return {
        0: np.ones((sq, sk), bool),
        1: j <= i + (sk - sq),
        2: j >= i,
        3: (j >= i) & (j <= i + (sk - sq)),
    }[int(t)]


def _dense_count(mask):
    """Cells covered by each slice, counted (independent of mask.py's geometry)."""
    cnt = np.zeros((mask.total_q, mask.total_k), np.int64)
    for (qs, qe), (ks, ke), t in mask.slices():
        cnt[qs:qe, ks:ke] += np.broadcast_to(_slice_dense(qe - qs, ke - ks, t), (qe - qs, ke - ks))
    return cnt


# ---- the exact matrices of docs/masks.md ------------------------------------------------------

DESIGN_EXAMPLES = {
    (5, 2, "causal"): "00 00 00 10 11",
    (5, 2, "inv_causal"): "11 01 00 00 00",
    (5, 2, "bi_causal"): "00 00 00 00 00",
    (5, 2, "full"): "11 11 11 11 11",
    (2, 5, "causal"): "11110 11111",
    (2, 5, "inv_causal"): "11111 01111",
    (2, 5, "bi_causal"): "11110 01111",
    (3, 3, "causal"): "100 110 111",
    (3, 3, "inv_causal"): "111 011 001",
    (3, 3, "bi_causal"): "100 010 001",
}


@pytest.mark.parametrize("sq,sk,t", list(DESIGN_EXAMPLES))
def test_design_matrices(sq, sk, t):
    want = np.array([[c == "1" for c in row] for row in DESIGN_EXAMPLES[(sq, sk, t)].split()])
    # Placed at an offset inside a larger canvas, to exercise global coordinates.
    m = AttnMask.from_ranges([[3, 3 + sq]], [[2, 2 + sk]], t, total_q=sq + 5, total_k=sk + 4)
    dense = m.to_dense()
    np.testing.assert_array_equal(dense[3 : 3 + sq, 2 : 2 + sk], want)
    assert dense.sum() == want.sum() == m.area


@pytest.mark.parametrize("sq,sk", [(1, 1), (4, 9), (9, 4), (7, 7), (1, 6), (6, 1)])
@pytest.mark.parametrize("t", range(4))
def test_area_formula(sq, sk, t):
    m = AttnMask.from_ranges([[0, sq]], [[0, sk]], t)
    if t == 0:
        want = sq * sk
    elif t in (1, 2):
        want = (2 * sk - sq + 1) * sq // 2 if sq <= sk else sk * (sk + 1) // 2
    else:
        want = max(0, sk - sq + 1) * sq
    assert m.area == want == _slice_dense(sq, sk, t).sum()


# ---- constructors against independent dense constructions -----------------------------------


def _docs(lens):
    lens = np.asarray(lens)
    doc = np.repeat(np.arange(len(lens)), lens)
    start = np.repeat(np.cumsum(lens) - lens, lens)
    return doc, np.arange(lens.sum()) - start


def _grid(total):
    return np.arange(total)[:, None], np.arange(total)[None, :]


LENS = [7, 1, 12, 5, 9]


def _expected(name):
    total = sum(LENS)
    q, k = _grid(total)
    doc, pos = _docs(LENS)
    same = doc[:, None] == doc[None, :]
    if name == "varlen_full":
        return AttnMask.varlen(np.cumsum([0] + LENS), causal=False), same
    if name == "varlen_causal":
        return AttnMask.varlen(np.cumsum([0] + LENS), causal=True), same & (k <= q)
    if name == "varlen_causal_window":
        return (
            AttnMask.varlen(np.cumsum([0] + LENS), causal=True, window=3),
            same & (k <= q) & (q - k <= 3),
        )
    if name == "varlen_window_2_1":
        return (
            AttnMask.varlen(np.cumsum([0] + LENS), causal=False, window=(2, 1)),
            same & (q - k <= 2) & (k - q <= 1),
        )
    if name == "sliding_window":
        return AttnMask.sliding_window(total, 4, 2), (q - k <= 4) & (k - q <= 2)
    if name == "sliding_window_wide":
        return AttnMask.sliding_window(total, 30, 25), (q - k <= 30) & (k - q <= 25)
    if name == "block_causal":
        blk = pos // 4
        return (AttnMask.block_causal(LENS, 4), same & (blk[None, :] <= blk[:, None]))
    if name == "prefix_lm":
        p = np.array([3, 1, 5, 0, 9])[doc]
        return (
            AttnMask.prefix_lm(LENS, [3, 1, 5, 0, 9]),
            same & ((k <= q) | ((pos[:, None] < p[:, None]) & (pos[None, :] < p[:, None]))),
        )
    if name == "prefix_lm_single":
        return AttnMask.prefix_lm(total, 6), (k <= q) | ((q < 6) & (k < 6))
    if name == "shared_question":
        head = doc <= 1
        both_head = head[:, None] & head[None, :]
        return (
            AttnMask.shared_question(LENS),
            (both_head & (k <= q))
            | (same & ~both_head & (k <= q))
            | (~head[:, None] & (doc[None, :] == 0)),
        )
    if name == "causal_blockwise":
        last = doc == len(LENS) - 1
        return (AttnMask.causal_blockwise(LENS), (k <= q) & (same | last[:, None]))
    if name == "global_sliding_window":
        return (AttnMask.global_sliding_window(total, 5, 3), (k <= q) & ((q - k <= 5) | (k < 3)))
    if name == "full":
        return AttnMask.full(total), np.ones((total, total), bool)
    if name == "causal":
        return AttnMask.causal(total), k <= q
    if name == "causal_rect":
        qq, kk = np.arange(10)[:, None], np.arange(25)[None, :]
        return AttnMask.causal(10, 25), kk <= qq + 15
    raise KeyError(name)


CONSTRUCTORS = [
    "full",
    "causal",
    "causal_rect",
    "varlen_full",
    "varlen_causal",
    "varlen_causal_window",
    "varlen_window_2_1",
    "sliding_window",
    "sliding_window_wide",
    "block_causal",
    "prefix_lm",
    "prefix_lm_single",
    "shared_question",
    "causal_blockwise",
    "global_sliding_window",
]


@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_constructor_matches_dense_definition(name):
    mask, want = _expected(name)
    np.testing.assert_array_equal(mask.to_dense(), want)
    cnt = _dense_count(mask)
    assert cnt.max() <= 1, "constructor produced overlapping slices"
    assert mask.area == int(want.sum())


def test_sliding_window_at_most_three_slices():
    for total, left, right in [(50, 4, 2), (50, 0, 0), (50, 60, 3), (9, 3, 40), (50, 10, 0)]:
        m = AttnMask.sliding_window(total, left, right)
        assert m.num_slices <= 3, (total, left, right, m.slices())


@given(slice_masks())
def test_area_and_disjointness_random(mask):
    cnt = _dense_count(mask)
    assert cnt.max(initial=0) <= 1
    assert mask.area == int(cnt.sum()) == int(mask.to_dense().sum())


@given(
    st.integers(0, 12),
    st.integers(0, 12),
    st.integers(0, 12),
    st.integers(0, 12),
    st.integers(-14, 14),
    st.integers(-14, 14),
)
def test_shape_to_slices_exact(q0, q1, k0, k1, dlo, dhi):
    slices = shape_to_slices(q0, q1, k0, k1, dlo, dhi)
    assert len(slices) <= 3
    q, k = _grid(16)
    want = (q >= q0) & (q < q1) & (k >= k0) & (k < k1) & (k - q >= dlo) & (k - q <= dhi)
    got = np.zeros((16, 16), np.int64)
    for qs, qe, ks, ke, t in slices:
        assert 0 <= qs < qe and 0 <= ks < ke
        got[qs:qe, ks:ke] += _slice_dense(qe - qs, ke - ks, t)
    np.testing.assert_array_equal(got, want.astype(np.int64))


# ---- validation ------------------------------------------------------------------------------


@given(slice_masks(max_len=24), st.data())
def test_overlap_detected_exactly(mask, data):
    """Adding a random slice is accepted iff it shares no cell with the mask."""
    qs = data.draw(st.integers(0, mask.total_q))
    qe = data.draw(st.integers(qs, mask.total_q))
    ks = data.draw(st.integers(0, mask.total_k))
    ke = data.draw(st.integers(ks, mask.total_k))
    t = data.draw(st.integers(0, 3))
    extra = np.zeros((mask.total_q, mask.total_k), bool)
    extra[qs:qe, ks:ke] = _slice_dense(qe - qs, ke - ks, t)
    clash = bool((extra & mask.to_dense()).any())
    args = (
        np.concatenate([mask.q_ranges, [[qs, qe]]]),
        np.concatenate([mask.k_ranges, [[ks, ke]]]),
        np.concatenate([mask.types, [t]]),
        mask.total_q,
        mask.total_k,
    )
    if clash:
        with pytest.raises(ValueError, match=rf"slice {mask.num_slices} .*overlap"):
            AttnMask(*args)
    else:
        AttnMask(*args)


def test_overlap_error_names_both_slices():
    with pytest.raises(ValueError) as e:
        AttnMask.from_ranges(
            [[0, 4], [10, 12], [2, 6]], [[0, 4], [0, 3], [3, 5]], ["full", "full", "inv_causal"]
        )
    msg = str(e.value)
    assert "slice 0 (q_range=[0, 4), k_range=[0, 4), type=FULL)" in msg
    assert "slice 2 (q_range=[2, 6), k_range=[3, 5), type=INV_CAUSAL)" in msg


def test_touching_triangles_are_not_overlap():
    # A causal square and its strict upper triangle tile the square exactly.
    m = AttnMask.from_ranges([[0, 6], [0, 5]], [[0, 6], [1, 6]], ["causal", "inv_causal"])
    assert m.area == 36


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(q_ranges=[[3, 2]], k_ranges=[[0, 4]], types=[0]),
            r"q_ranges\[0\] = \[3, 2\).*reversed",
        ),
        (
            dict(q_ranges=[[0, 2]], k_ranges=[[5, 4]], types=[0]),
            r"k_ranges\[0\] = \[5, 4\).*reversed",
        ),
        (
            dict(q_ranges=[[0, 2], [0, 9]], k_ranges=[[0, 1], [1, 2]], types=[0, 0], total_q=8),
            r"q_ranges\[1\] = \[0, 9\) ends past total_q=8.*slice 1",
        ),
        (
            dict(q_ranges=[[0, 2]], k_ranges=[[0, 9]], types=[0], total_k=4),
            r"k_ranges\[0\].*ends past total_k=4",
        ),
        (dict(q_ranges=[[0, 2]], k_ranges=[[0, 2]], types=[7]), r"types\[0\]: unknown mask type 7"),
        (
            dict(q_ranges=[[0, 2]], k_ranges=[[0, 2]], types=["diagonal"]),
            r"types\[0\]: unknown mask type 'diagonal'",
        ),
        (dict(q_ranges=[[0, 2]], k_ranges=[[0, 2], [2, 3]], types=[0]), r"q_ranges has 1 slices"),
        (dict(q_ranges=[[0, 2, 3]], k_ranges=[[0, 2]], types=[0]), r"q_ranges must have shape"),
        (dict(q_ranges=[[-1, 2]], k_ranges=[[0, 2]], types=[0]), r"q_ranges\[0\].*non-negative"),
        (dict(q_ranges=[[0, 2]], k_ranges=[[0, 2]], types=[0, 1]), r"types has 2 entries"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttnMask.from_ranges(**kwargs)


def test_constructor_argument_errors():
    with pytest.raises(ValueError, match="cu_seqlens"):
        AttnMask.varlen([1, 4])
    with pytest.raises(ValueError, match="contradicts causal"):
        AttnMask.varlen([0, 4], causal=True, window=(2, 1))
    with pytest.raises(ValueError, match=r"prefix_lens\[1\]=5"):
        AttnMask.prefix_lm([4, 3], [1, 5])
    with pytest.raises(ValueError, match="block_size"):
        AttnMask.block_causal([4], 0)


def test_types_and_strings():
    assert AttnMaskType.coerce("Causal") is AttnMaskType.CAUSAL
    assert AttnMaskType.coerce("bi-causal") is AttnMaskType.BI_CAUSAL
    assert AttnMaskType.coerce(2) is AttnMaskType.INV_CAUSAL
    m = AttnMask.from_ranges([[0, 2], [2, 4]], [[0, 2], [0, 4]], ["full", AttnMaskType.CAUSAL])
    assert m.types.dtype == np.int32 and m.types.tolist() == [0, 1]
    assert m.q_ranges.dtype == np.int32 and m.q_ranges.shape == (2, 2)


def test_immutable_hashable_fingerprint():
    a = AttnMask.varlen([0, 3, 8], causal=True)
    b = AttnMask.varlen([0, 3, 8], causal=True)
    c = AttnMask.varlen([0, 3, 8], causal=False)
    assert a == b and hash(a) == hash(b) and a.fingerprint == b.fingerprint
    assert a != c and a.fingerprint != c.fingerprint
    assert len({a, b, c}) == 2
    with pytest.raises(ValueError):
        a.q_ranges[0, 0] = 1
    with pytest.raises(AttributeError):
        a.total_q = 3
    # The same slices over a longer sequence are a different mask.
    assert AttnMask.causal(4, 4) != AttnMask.from_ranges([[0, 4]], [[0, 4]], 1, total_q=5)


def test_to_dense_refuses_huge():
    m = AttnMask.causal(1 << 20)
    with pytest.raises(ValueError, match="max_cells"):
        m.to_dense()
    assert m.area == (1 << 20) * ((1 << 20) + 1) // 2


def test_empty_rows_and_mask():
    m = AttnMask.from_ranges([], [], [], total_q=5, total_k=3)
    assert m.area == 0 and m.to_dense().shape == (5, 3)


# ---- scale -----------------------------------------------------------------------------------


def _timed(fn):
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def test_validation_scales_to_1m_tokens_10k_docs():
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 200, 10_000)
    lens = (lens * (1_000_000 / lens.sum())).astype(np.int64) + 1
    m, sec = _timed(lambda: AttnMask.shared_question(lens))
    assert m.total_q >= 1_000_000 and m.num_slices > 19_000
    assert sec < 1.0, f"validation of a 1M-token, 10k-document mask took {sec:.2f}s"


def test_validation_scales_to_100k_slices():
    rng = np.random.default_rng(1)
    # 100k slices: 50k documents, each a causal sliding window (2 slices).
    lens = rng.integers(4, 40, 50_000)
    cu = np.concatenate([[0], np.cumsum(lens)])
    q, k, t = [], [], []
    for s, e in zip(cu[:-1], cu[1:]):
        for qs, qe, ks, ke, ty in shape_to_slices(s, e, s, e, -3, 0):
            q.append((qs, qe))
            k.append((ks, ke))
            t.append(int(ty))
    q, k, t = np.array(q), np.array(k), np.array(t)
    assert len(t) >= 100_000
    _, sec = _timed(lambda: AttnMask.from_ranges(q, k, t))
    assert sec < 1.0, f"validation of {len(t)} slices took {sec:.2f}s"
    # Many slices sharing every row (column stripes), also linear.
    stripes = np.arange(0, 200_000, 2)
    _, sec = _timed(
        lambda: AttnMask.from_ranges(
            np.tile([[0, 64]], (len(stripes), 1)), np.stack([stripes, stripes + 2], 1), 0
        )
    )
    assert sec < 1.0, f"validation of 100k column stripes took {sec:.2f}s"


def test_docstring_examples():
    import doctest

    import magi_jax.mask

    res = doctest.testmod(magi_jax.mask)
    assert res.attempted >= 12 and res.failed == 0
