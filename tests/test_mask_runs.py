"""Any mask as slices (magi_jax/mask_runs.py): predicates, dense and block-sparse masks and
set algebra, each equal to its dense definition cell by cell; the slices they compress to;
the zoo's HSTU and documents + window + global tokens against their predicates."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from magi_jax import mask_zoo as mz
from magi_jax.mask import AttnMask, AttnMaskType
from magi_jax.mask_runs import canonical, row_runs, runs_to_mask
from tests.strategies import slice_masks

T = AttnMaskType


def _dense_of(tq, tk, draw_bits, band):
    """A random dense mask: noise, or a band (runs that slide along rows) with holes."""
    q = np.arange(tq)[:, None]
    k = np.arange(tk)[None, :]
    if band is None:
        return draw_bits
    lo, hi = band
    return ((k - q >= lo) & (k - q <= hi)) ^ (draw_bits & (np.arange(tq)[:, None] % 5 == 0))


@st.composite
def dense_masks(draw, min_len=0, max_len=24):
    tq, tk = draw(st.integers(min_len, max_len)), draw(st.integers(min_len, max_len))
    bits = draw(hnp.arrays(bool, (tq, tk)))
    band = draw(st.one_of(st.none(), st.tuples(st.integers(-8, 0), st.integers(0, 8))))
    return _dense_of(tq, tk, bits, band)


def _disjoint_exact(mask, dense):
    """``mask`` holds exactly ``dense``'s cells (the constructor checked disjointness)."""
    assert (mask.total_q, mask.total_k) == dense.shape
    np.testing.assert_array_equal(mask.to_dense(), dense)
    assert mask.area == int(dense.sum())


@given(dense_masks())
def test_from_dense_is_exact(dense):
    m = AttnMask.from_dense(dense)
    _disjoint_exact(m, dense)
    # The canonical form is unique for a set of cells.
    assert canonical(m) == m


@given(dense_masks(), st.integers(1, 7), st.integers(1, 7))
def test_from_fn_is_exact_whatever_the_block(dense, bq, bk):
    seen = []

    def fn(q, k):
        seen.append(q.shape[0] * k.shape[1])
        return dense[q, k]

    m = AttnMask.from_fn(fn, *dense.shape, block=(bq, bk))
    _disjoint_exact(m, dense)
    assert m == AttnMask.from_dense(dense)
    assert max(seen, default=0) <= bq * bk  # memory bounded by the block


@given(dense_masks(), st.integers(1, 6), st.integers(1, 6), st.data())
def test_from_fn_with_block_codes(dense, bq, bk, data):
    """Blocks coded empty / full are never evaluated; coded 2 they are; the result is the
    same mask whatever the codes (as long as they are right)."""
    tq, tk = dense.shape
    nq, nk = -(-tq // bq), -(-tk // bk)
    codes = np.full((nq, nk), 2)
    for i in range(nq):
        for j in range(nk):
            blk = dense[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            if data.draw(st.booleans()):
                codes[i, j] = 1 if blk.all() else 0 if not blk.any() else 2
    evaluated = []

    def fn(q, k):
        evaluated.append((int(q[0, 0]), int(k[0, 0]), k.shape[1]))
        return dense[q, k]

    m = AttnMask.from_fn(fn, tq, tk, block=(bq, bk), blocks=lambda qb, kb: codes[qb, kb])
    _disjoint_exact(m, dense)
    for q0, k0, n in evaluated:
        assert (codes[q0 // bq, k0 // bk : (k0 + n - 1) // bk + 1] == 2).all()
    AttnMask.from_fn(
        lambda q, k: dense[q, k], tq, tk, block=(bq, bk), blocks=lambda qb, kb: codes[qb, kb]
    )


def test_wrong_block_code_is_caught_when_checked():
    dense = np.tril(np.ones((8, 8), bool))
    fn = lambda q, k: k <= q  # noqa: E731
    with pytest.raises(ValueError, match=r"coded block \(0, 0\) as 0 \(no cell\) but fn holds 10"):
        AttnMask.from_fn(fn, 8, 8, block=4, blocks=lambda qb, kb: qb + kb, check_blocks=True)
    ok = AttnMask.from_fn(
        fn,
        8,
        8,
        block=4,
        blocks=lambda qb, kb: np.where(kb < qb, 1, 2 * (kb == qb)),
        check_blocks=True,
    )
    _disjoint_exact(ok, dense)
    with pytest.raises(ValueError, match="codes are 0"):
        AttnMask.from_fn(fn, 8, 8, block=4, blocks=lambda qb, kb: qb * 0 + 3)


@given(
    hnp.arrays(bool, st.tuples(st.integers(0, 6), st.integers(0, 6))),
    st.integers(1, 5),
    st.integers(1, 5),
    st.integers(0, 4),
    st.integers(0, 4),
)
def test_from_block_mask_is_exact(blocks, bq, bk, cut_q, cut_k):
    nq, nk = blocks.shape
    tq = max(nq * bq - min(cut_q, bq - 1), 0) if nq else 0
    tk = max(nk * bk - min(cut_k, bk - 1), 0) if nk else 0
    m = AttnMask.from_block_mask(blocks, bq, bk, tq, tk)
    dense = np.repeat(np.repeat(blocks, bq, 0), bk, 1)[:tq, :tk]
    _disjoint_exact(m, dense)
    assert all(t == T.FULL for t in m.types.tolist())


@given(dense_masks(min_len=1), st.integers(1, 5), st.integers(1, 5))
def test_from_block_mask_with_partial_blocks(dense, bq, bk):
    """Codes 0 / 1 / 2 from the cells (Flex's full and partial blocks) and the predicate of
    the partial ones: the dense mask exactly, partial blocks alone evaluated."""
    tq, tk = dense.shape
    nq, nk = -(-tq // bq), -(-tk // bk)
    codes = np.zeros((nq, nk), np.int8)
    for i in range(nq):
        for j in range(nk):
            blk = dense[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            codes[i, j] = 1 if blk.all() else 2 if blk.any() else 0
    evaluated = []

    def fn(q, k):
        evaluated.append(codes[q[0, 0] // bq, k[0, 0] // bk])
        return dense[q, k]

    m = AttnMask.from_block_mask(codes, bq, bk, tq, tk, fn=fn)
    _disjoint_exact(m, dense)
    assert all(c == 2 for c in evaluated)


def test_from_block_mask_merges_rectangles_and_checks_shapes():
    blocks = np.array([[1, 1, 0], [1, 1, 0], [0, 0, 1]], bool)
    m = AttnMask.from_block_mask(blocks, 4, 2)
    assert m.slices() == [((0, 8), (0, 4), T.FULL), ((8, 12), (4, 6), T.FULL)]
    with pytest.raises(ValueError, match="total_q=20 needs 5 blocks of 4"):
        AttnMask.from_block_mask(blocks, 4, 2, total_q=20)
    with pytest.raises(TypeError, match="need the partial blocks' predicate fn"):
        AttnMask.from_block_mask(blocks.astype(int), 4, 2)


@given(slice_masks(max_len=30), st.data())
def test_set_algebra_is_exact(a, data):
    # b: random slices over the same totals (the slices of another mask, tiled to fit).
    other = data.draw(slice_masks(max_len=30), label="other").to_dense()
    b = AttnMask.from_dense(_tile(other, a.total_q, a.total_k))
    da, db = a.to_dense(), b.to_dense()
    _disjoint_exact(a | b, da | db)
    _disjoint_exact(a & b, da & db)
    _disjoint_exact(a - b, da & ~db)
    _disjoint_exact(b - a, db & ~da)
    assert (a | b) == (b | a) and (a & b) == (b & a)
    assert (a - b) | (a & b) == canonical(a)
    # One canonical form whatever the runs came from: bands of slices or rows of cells.
    assert canonical(a) == AttnMask.from_dense(da) and canonical(b) == b


def _tile(x, tq, tk):
    reps = (-(-tq // max(x.shape[0], 1)), -(-tk // max(x.shape[1], 1)))
    return np.tile(x, reps)[:tq, :tk]


def test_set_algebra_errors():
    with pytest.raises(ValueError, match="same tokens.*total_q=4.*total_q=5"):
        AttnMask.causal(4) | AttnMask.causal(5)
    with pytest.raises(TypeError):
        AttnMask.causal(4) & np.ones((4, 4), bool)


def test_compression_finds_the_types():
    q = np.arange(64)[:, None]
    k = np.arange(64)[None, :]
    causal = AttnMask.from_fn(lambda q, k: k <= q, 64, 64, block=(5, 7))
    assert causal.slices() == [((0, 64), (0, 64), T.CAUSAL)]
    inv = AttnMask.from_dense(k >= q)
    assert inv.slices() == [((0, 64), (0, 64), T.INV_CAUSAL)]
    window = AttnMask.from_dense((k - q >= -4) & (k - q <= 2))
    assert [s[2] for s in window.slices()] == [T.CAUSAL, T.BI_CAUSAL, T.INV_CAUSAL]
    docs = AttnMask.varlen([0, 10, 30, 64], causal=True)
    assert canonical(docs) == docs  # one CAUSAL slice per document
    block = AttnMask.block_causal([64], 16)
    assert canonical(block).num_slices == 4
    assert canonical(AttnMask.full(5, 9)).slices() == [((0, 5), (0, 9), T.FULL)]


def test_row_runs_round_trip_at_scale():
    """256k tokens of 2,500 documents with a window: row runs and back in seconds, with the
    same cells (the canonical form of a canonical mask is itself)."""
    m = mz.make_mask("doc-window-global", 1 << 18, num_docs=2_500)
    runs = row_runs(m)
    assert runs.area == m.area and len(runs) <= 2 * m.total_q
    c = runs_to_mask(runs)
    assert c.area == m.area and canonical(c) == c
    assert (m - c).area == 0 and (c - m).area == 0


def test_rectangles_cost_one_run_whatever_their_height():
    """Bands: a block-sparse mask of 1M tokens is one run per run of blocks, not per row,
    and set algebra between block masks works on bands (exact: checked on the block grid)."""
    rng = np.random.default_rng(0)
    grid = rng.random((64, 64)) < 0.1
    coarse = rng.random((32, 32)) < 0.3
    m = AttnMask.from_block_mask(grid, 1 << 14, 1 << 14)
    other = AttnMask.from_block_mask(coarse, 1 << 15, 1 << 15)
    runs = row_runs(m)
    assert runs.area == m.area and len(runs) <= grid.sum()
    assert canonical(m) == m
    fine = np.repeat(np.repeat(coarse, 2, 0), 2, 1)
    cell = (1 << 14) ** 2
    assert (m & other).area == int((grid & fine).sum()) * cell
    assert (m | other).area == int((grid | fine).sum()) * cell
    assert (other - m).area == int((fine & ~grid).sum()) * cell


def test_empty_ranges_past_the_end_are_dropped():
    m = AttnMask.from_ranges([[0, 4], [2, 3], [9, 9]], [[0, 4], [9, 9], [0, 2]], "full", 5, 7)
    assert m.num_slices == 1 and m.area == 16
    assert m == AttnMask.from_ranges([[0, 4]], [[0, 4]], "full", 5, 7)
    # Empty ranges inside the totals stay as they were; reversed or non-empty ones past the
    # end are errors still.
    assert AttnMask.from_ranges([[0, 4], [5, 5]], [[0, 4], [0, 7]], 0, 5, 7).num_slices == 2
    with pytest.raises(ValueError, match="reversed"):
        AttnMask.from_ranges([[3, 2]], [[9, 9]], 0, 5, 7)
    with pytest.raises(ValueError, match="ends past total_k=7"):
        AttnMask.from_ranges([[0, 2]], [[8, 9]], 0, 5, 7)


def test_predicate_errors():
    with pytest.raises(TypeError, match="bool array"):
        AttnMask.from_fn(lambda q, k: q - k, 4, 4)
    with pytest.raises(ValueError, match="not broadcastable"):
        AttnMask.from_fn(lambda q, k: np.ones(3, bool), 4, 4)
    with pytest.raises(ValueError, match="block="):
        AttnMask.from_fn(lambda q, k: k <= q, 4, 4, block=0)
    with pytest.raises(TypeError, match="2-D bool|bool array"):
        AttnMask.from_dense(np.ones((3, 3)))


# ---- the zoo's families against their predicates -------------------------------------------


def hstu_predicate(lens, targets, context, window):
    """HSTU as generative recommenders define it, per cell (see mask_zoo.hstu)."""
    lens = np.asarray(lens, np.int64)
    doc = np.repeat(np.arange(len(lens)), lens)
    start = np.repeat(np.cumsum(lens) - lens, lens)
    hist_end = np.repeat(lens - np.asarray(targets), lens)  # local index of the 1st target
    ctx = np.repeat(np.asarray(context), lens)

    def fn(q, k):
        lq, lk = q - start[q], k - start[k]
        ts, c = hist_end[q], ctx[q]
        q_ctx, k_ctx = lq < c, lk < c
        q_tgt, k_tgt = lq >= ts, lk >= ts
        k_hist = ~k_ctx & ~k_tgt
        qid = np.minimum(lq, ts)  # targets sit at the history's end
        near = True if window is None else (qid - lk <= window)
        see = (
            (q_ctx & ~k_tgt)
            | (~q_ctx & k_ctx)
            | (~q_ctx & k_hist & (lk <= lq) & (lk < qid + ~q_tgt) & near)
            | (q_tgt & (k == q))
        )
        return (doc[q] == doc[k]) & see

    return fn


@st.composite
def hstu_cases(draw):
    lens = draw(st.lists(st.integers(0, 14), min_size=1, max_size=3))
    targets = [draw(st.integers(0, n // 2)) for n in lens]
    context = [draw(st.integers(0, n - t)) for n, t in zip(lens, targets)]
    window = draw(st.one_of(st.none(), st.integers(0, 6)))
    return lens, targets, context, window


@given(hstu_cases())
def test_hstu_matches_its_predicate(case):
    m = mz.hstu(*case)
    total = sum(case[0])
    want = AttnMask.from_fn(hstu_predicate(*case), total, total, block=(3, 5))
    _disjoint_exact(m, want.to_dense())


def test_hstu_picture():
    m = mz.hstu([6], num_targets=2, num_context=1)
    np.testing.assert_array_equal(
        m.to_dense().astype(int),
        [
            [1, 1, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 0, 1],
        ],
    )
    with pytest.raises(ValueError, match="num_context=4 \\+ num_targets=3"):
        mz.hstu([6], 3, 4)


def doc_window_global_predicate(lens, window, num_global):
    lens = np.asarray(lens, np.int64)
    doc = np.repeat(np.arange(len(lens)), lens)
    start = np.repeat(np.cumsum(lens) - lens, lens)
    return lambda q, k: (
        (doc[q] == doc[k]) & (k <= q) & ((q - k <= window) | (k - start[k] < num_global))
    )


@given(st.lists(st.integers(0, 16), min_size=1, max_size=4), st.integers(0, 6), st.integers(0, 4))
def test_doc_window_global_matches_its_predicate(lens, window, num_global):
    m = mz.doc_window_global(lens, window, num_global)
    total = sum(lens)
    want = AttnMask.from_fn(doc_window_global_predicate(lens, window, num_global), total, total)
    _disjoint_exact(m, want.to_dense())


def test_docstring_examples():
    import doctest

    import magi_jax.mask_runs
    import magi_jax.mask_zoo

    for mod in (magi_jax.mask_runs, magi_jax.mask_zoo):
        res = doctest.testmod(mod)
        assert res.attempted >= 1 and res.failed == 0, mod.__name__


def test_the_examples_of_docs_masks_section_7():
    """The matrices and slices docs/masks.md §7 prints, as the library gives them."""
    band = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], bool)
    assert AttnMask.from_dense(band).slices() == [
        ((0, 2), (0, 2), T.CAUSAL),
        ((2, 4), (1, 4), T.BI_CAUSAL),
    ]
    blocks = np.array([[1, 0, 1], [1, 1, 0]], bool)
    assert AttnMask.from_block_mask(blocks, 2, 2).slices() == [
        ((0, 2), (0, 2), T.FULL),
        ((0, 2), (4, 6), T.FULL),
        ((2, 4), (0, 4), T.FULL),
    ]
    np.testing.assert_array_equal(
        mz.hstu([8], num_targets=2, num_context=2).to_dense().astype(int),
        [
            [1, 1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 1, 0, 1],
        ],
    )
    doc = np.repeat([0, 1, 2], [24, 20, 20])
    start = np.repeat([0, 24, 44], [24, 20, 20])
    fn = lambda q, k: (doc[q] == doc[k]) & (k <= q) & ((q - k <= 6) | (k - start[k] < 2))  # noqa: E731
    assert AttnMask.from_fn(fn, 64, 64).num_slices == 9
    grid = np.random.default_rng(3).random((8, 8)) < 0.3
    assert AttnMask.from_block_mask(grid, 8, 8).num_slices == 13
