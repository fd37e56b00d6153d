"""The vectorised host planner against brute-force models built from dense masks: every
rank's needed and remote keys, its stages, the cast tables that fill them, the work lists of
every stage, and the dispatch, for the zoo masks and random masks, several cp, overlap
degrees, backends and capacities (host NumPy only).

Each model is the definition written out cell by cell or token by token (a dense ``[T, T]``
mask, one row per token), so it is obviously right and knows nothing of how the planner
gets there."""

import chex
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from magi_jax.mask import AttnMask, SliceShapes
from magi_jax.mask_zoo import make_mask
from magi_jax.planning import solver as S
from magi_jax.planning import stages as D
from magi_jax.planning import work_list as W
from magi_jax.planning.capacity import CapacityError, PlanCapacity
from magi_jax.planning.cast_table import build_cast_table, cast_model, cast_table_from_pieces
from tests.strategies import slice_masks
from tests.zoo import ZOO, self_attention_masks

_I32 = np.iinfo(np.int32)
_FIELDS = ("q0", "q1", "k0", "k1", "dlo", "dhi")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


# ---- models ----------------------------------------------------------------------------------


def dense_padded(mask: AttnMask, padded: int) -> np.ndarray:
    """bool ``[padded, padded]``: the mask, padding rows and columns empty."""
    d = np.zeros((padded, padded), bool)
    d[: mask.total_q, : mask.total_k] = mask.to_dense()
    return d


def runs_of(flags: np.ndarray) -> np.ndarray:
    """int64 ``[n, 2]``: the maximal runs ``[start, end)`` of True in ``flags``."""
    edges = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return np.stack([np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]], axis=1)


class RankModel:
    """What rank ``r`` of a dispatch needs, token by token: the keys its queries see
    (``needed``, bool over global positions), the host area (cells on keys it owns) and the
    remote keys — sorted by position, each with its owner, remote stage and offset in that
    stage's buffer when ``k`` stages split them evenly."""

    def __init__(self, dense: np.ndarray, meta: S.DispatchMeta, r: int, k: int):
        rows = dense[meta.positions[r]]
        owner = meta.chunk_owner[np.arange(dense.shape[1]) // meta.chunk_size]
        self.needed = rows.any(axis=0)
        self.host_area = int(rows[:, owner == r].sum())
        self.remote_area = int(rows[:, owner != r].sum())
        self.keys = np.nonzero(self.needed & (owner != r))[0]
        self.owner = owner[self.keys]
        n = len(self.keys)
        self.stage_bounds = (np.arange(k + 1) * n) // k if k else np.zeros(1, np.int64)
        index = np.arange(n)
        self.stage = np.searchsorted(self.stage_bounds, index, side="right") - 1
        self.offset = index - self.stage_bounds[np.minimum(self.stage, max(k - 1, 0))]


def rank_models(mask, meta, k):
    """The :class:`RankModel` of every rank of ``meta``."""
    dense = dense_padded(mask, meta.padded_total)
    return [RankModel(dense, meta, r, k) for r in range(meta.cp)]


def pieces_as_tokens(remote: np.ndarray) -> np.ndarray:
    """``[p, 5]`` pieces (g0, g1, owner, stage, offset) -> ``[n, 4]`` tokens (g, owner,
    stage, offset), sorted by global position."""
    length = remote[:, 1] - remote[:, 0]
    step = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    rows = np.repeat(remote, length, axis=0)
    out = np.stack([rows[:, 0] + step, rows[:, 2], rows[:, 3], rows[:, 4] + step], axis=1)
    return out[np.argsort(out[:, 0], kind="stable")]


def model_needs(models, cp, k):
    """Brute-force needs of a plan at a capacity: ``remote_kv`` (``k`` stages of equal
    buffers) and, per remote stage, ``cast_width`` (most keys one rank sends another)."""
    most = max((len(m.keys) for m in models), default=0)
    widths = [
        max(int(np.bincount(m.owner[m.stage == s], minlength=cp).max()) for m in models)
        for s in range(k)
    ]
    return -(-most // k) * k, widths


def slice_cells(shapes: SliceShapes, tq: int, tk: int, step: int = 1 << 22):
    """Yields ``(first slice, bool [n, tq, tk])``: the cells of the slices, a batch at a
    time (cell ``(i, j)`` of a slice: ``q0 <= i < q1``, ``k0 <= j < k1``,
    ``dlo <= j - i <= dhi``)."""
    i = np.arange(tq)[None, :, None]
    j = np.arange(tk)[None, None, :]
    geo = np.stack([np.asarray(getattr(shapes, f), np.int64) for f in _FIELDS], axis=1)
    batch = max(1, step // max(tq * tk, 1))
    for first in range(0, len(geo), batch):
        g = geo[first : first + batch, :, None, None]
        q0, q1, k0, k1, dlo, dhi = (g[:, f] for f in range(6))
        yield first, (i >= q0) & (i < q1) & (j >= k0) & (j < k1) & (j - i >= dlo) & (j - i <= dhi)


def cell_counts(shapes: SliceShapes, tq: int, tk: int) -> np.ndarray:
    """int64 ``[tq, tk]``: how many slices hold each cell."""
    total = np.zeros((tq, tk), np.int64)
    for _, cells in slice_cells(shapes, tq, tk):
        total += cells.sum(axis=0)
    return total


def item_model(shapes: SliceShapes, tq: int, tk: int, bq: int, bk: int, by: str):
    """int64 ``[m, 9]``, sorted: the items a work list must hold with their owned tile,
    ``(owned tile, other tile, q0, q1, k0, k1, dlo, dhi, kind)``, one per (slice, q-tile,
    k-tile) with a cell; the kind is FULL
    when every cell of the tile is a cell of the slice, BAND when the tile lies inside the
    slice's query and key ranges, GENERAL otherwise."""
    nq, nk = -(-tq // bq), -(-tk // bk)
    geo = np.stack([np.asarray(getattr(shapes, f), np.int64) for f in _FIELDS], axis=1)
    rows = [np.zeros((0, 9), np.int64)]
    for first, cell in slice_cells(shapes, tq, tk):
        pad = ((0, 0), (0, nq * bq - tq), (0, nk * bk - tk))  # cells past the ends: none
        grid = np.pad(cell, pad).reshape(len(cell), nq, bq, nk, bk)
        s, qt, kt = np.nonzero(grid.any(axis=(2, 4)))
        full = grid.all(axis=(2, 4))[s, qt, kt]
        q0, q1, k0, k1, dlo, dhi = geo[first + s].T
        band = (q0 <= qt * bq) & ((qt + 1) * bq <= q1) & (k0 <= kt * bk) & ((kt + 1) * bk <= k1)
        kind = np.where(full, W.FULL, np.where(band, W.BAND, W.GENERAL))
        own, other = (qt, kt) if by == "q" else (kt, qt)
        clip = lambda x: np.clip(x, -_I32.max, _I32.max)
        rows.append(np.column_stack([own, other, q0, q1, k0, k1, clip(dlo), clip(dhi), kind]))
    rows = np.concatenate(rows)
    return rows[np.lexsort(rows.T[::-1])]


def _has_cell(rows, tq, tk, bq, bk, by) -> np.ndarray:
    """bool ``[m]``: whether the slice each item row ``(owned tile, item...)`` carries has a
    cell in the item's tile."""
    g = rows[:, 2:8, None, None]
    q0, q1, k0, k1, dlo, dhi = (g[:, f] for f in range(6))
    own, other = rows[:, 0, None, None], rows[:, 1, None, None]
    qt, kt = (own, other) if by == "q" else (other, own)
    i = qt * bq + np.arange(bq)[None, :, None]
    j = kt * bk + np.arange(bk)[None, None, :]
    cell = (i >= q0) & (i < q1) & (j >= k0) & (j < k1) & (j - i >= dlo) & (j - i <= dhi)
    return (cell & (i < tq) & (j < tk)).any(axis=(1, 2))


def check_work_list(work, shapes, tq, tk, bq, bk, by, num_items=None, canonical=True):
    """``work`` holds exactly the model's items, FULL first then by other tile within each
    owned tile, tiles launched heaviest first, padding past the last item. Shapes that are
    not canonical (rows that see no key) may add items on tiles where their slice has no
    cell (never FULL ones): visited, masked out, harmless."""
    want = item_model(shapes, tq, tk, bq, bk, by)
    num_tiles = -(-tq // bq) if by == "q" else -(-tk // bk)
    order, offsets, items = (np.asarray(x) for x in work)
    chex.assert_shape([order, offsets], [(num_tiles,), (num_tiles + 1,)])
    assert order.dtype == offsets.dtype == items.dtype == np.int32
    counts = np.diff(offsets)
    np.testing.assert_array_equal(order, np.lexsort((np.arange(num_tiles), -counts)))
    own = np.repeat(np.arange(num_tiles), counts)
    got = np.column_stack([own, items[: offsets[-1]]]).astype(np.int64)
    # Canonical shapes: every item has a cell (else the sets below differ).
    live = np.ones(len(got), bool) if canonical else _has_cell(got, tq, tk, bq, bk, by)
    assert not np.any(got[~live, 8] == W.FULL), "a FULL item without cells"
    np.testing.assert_array_equal(got[live][np.lexsort(got[live].T[::-1])], want.reshape(-1, 9))
    same_tile = own[1:] == own[:-1]
    masked = got[:, 8] != W.FULL
    assert not np.any(same_tile & masked[:-1] & ~masked[1:]), "a FULL item after a masked one"
    same_group = same_tile & (masked[1:] == masked[:-1])
    assert np.all(got[1:, 1][same_group] >= got[:-1, 1][same_group]), "not by other tile"
    if num_items is not None:
        assert len(items) == num_items
    pad = np.broadcast_to(W.EMPTY_ITEM, (len(items) - offsets[-1], W.NUM_FIELDS))
    np.testing.assert_array_equal(items[offsets[-1] :], pad)


def item_counts(shapes, tq, tk, blocks):
    """Items of the q-tile and k-tile lists of ``shapes`` (the model's)."""
    return tuple(len(item_model(shapes, tq, tk, *b, by)) for b, by in zip(blocks, ("q", "k")))


# ---- rank views, split areas ---------------------------------------------------------------


def check_views(mask, cp, algorithm="magi", chunk_size=None):
    """Every rank's view (needed intervals, remote pieces, stage lengths) at 0-3 stages and
    the split areas are the dense model's."""
    meta = S.solve_dispatch(mask, cp, chunk_size, algorithm)
    for k in (0, 1, 2, 3):
        models = rank_models(mask, meta, k)
        for m, v in zip(models, D.rank_views(mask, meta, k)):
            np.testing.assert_array_equal(v.needed, runs_of(m.needed))
            if k:
                want = np.stack([m.keys, m.owner, m.stage, m.offset], axis=1)
                np.testing.assert_array_equal(pieces_as_tokens(v.remote), want)
                np.testing.assert_array_equal(v.stage_len, np.diff(m.stage_bounds))
            else:
                assert len(v.remote) == 0 and len(v.stage_len) == 0
    host, remote, tokens = D.split_areas(mask, meta)
    models = rank_models(mask, meta, 1)
    chex.assert_trees_all_equal(
        (host, remote, tokens),
        tuple(np.array([getattr(m, f) for m in models]) for f in ("host_area", "remote_area"))
        + (np.array([len(m.keys) for m in models]),),
    )


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zoo_views_match_the_dense_model(name, cp):
    check_views(ZOO[name], cp)


@SETTINGS
@given(
    self_attention_masks(max_len=48), st.sampled_from([1, 2, 3, 4]), st.sampled_from(S.ALGORITHMS)
)
def test_random_views_match_the_dense_model(mask, cp, algorithm):
    check_views(mask, cp, algorithm)


# ---- distributed plans -----------------------------------------------------------------------


def check_plan_exact(mask, meta, plan, models, backend, block):
    """Every rank's stages cover exactly its rows of the mask, each cell once (each stage
    the cells of the keys in its KV; the stages' keys partition the ones the rank needs);
    every cast puts the model's keys at the model's offsets; every stage's work lists are
    the item model of its shapes."""
    dense = dense_padded(mask, meta.padded_total)
    pos = meta.positions
    tagged = (pos + 1)[:, :, None]
    lone = len(plan.stages) == 1
    for index, stage in enumerate(plan.stages):
        fwd, bwd = W.backend_blocks(backend, meta.local_len, stage.kv_len, block, block)
        arrays = W.expand_runs(stage.ffa, *stage.items)
        # Remote stage s is plan stage s + 1; a lone stage with a cast is the combined one.
        got_buf = None if stage.cast is None else cast_model(tagged, stage.cast)[:, :, 0] - 1
        for r in range(meta.cp):
            m = models[r]
            if stage.cast is None:
                kv = pos[r]
            else:
                buf = np.full(stage.cast.buffer_len, -1, np.int64)
                sel = m.stage == (0 if lone else index - 1)
                buf[m.offset[sel]] = m.keys[sel]
                np.testing.assert_array_equal(got_buf[r], buf, err_msg=f"stage {index} rank {r}")
                kv = np.concatenate([pos[r], buf]) if lone else buf
            assert len(kv) == stage.kv_len
            shapes = stage.shapes[r]
            cells = cell_counts(shapes, meta.local_len, stage.kv_len)
            assert cells[:, kv < 0].sum() == 0, "a cell on a padding KV row"
            np.testing.assert_array_equal(cells[:, kv >= 0], dense[pos[r]][:, kv[kv >= 0]])
            for lst, blk, by in ((arrays.fwd, fwd, "q"), (arrays.bwd, bwd, "k")):
                work = W.WorkList(*(x[r] for x in lst))
                check_work_list(work, shapes, meta.local_len, stage.kv_len, *blk, by)
    np.testing.assert_array_equal(plan.remote_tokens, [len(m.keys) for m in models])


def check_padded_like(free, plan, meta):
    """A plan at a capacity is the free plan (checked against the models) padded: the same
    shapes, the same real work-list items, the same keys in every buffer; stages the free
    plan lacks (no remote KV) plan nothing."""
    tagged = (meta.positions + 1)[:, :, None]
    pairs = list(zip(free.stages, plan.stages))
    if len(free.stages) != len(plan.stages) or (free.stages[0].cast is None) != (
        plan.stages[0].cast is None
    ):
        # The free plan is one host stage (no remote KV); at the capacity the stages exist
        # anyway (host and remote, or one combined stage) and receive nothing.
        assert len(free.stages) == 1 and free.stages[0].cast is None
        pairs = [(free.stages[0], plan.stages[0])]
        for extra in plan.stages[1:]:
            assert not extra.area.any()
        for stage in plan.stages:
            assert stage.cast is None or not stage.cast.rows_received().any()
    for a, b in pairs:
        chex.assert_trees_all_equal(
            *([tuple(getattr(x, f) for f in _FIELDS) for x in z.shapes] for z in (a, b))
        )
        a_lists = W.expand_runs(a.ffa, *a.items)
        b_lists = W.expand_runs(b.ffa, *b.items)
        for lst_a, lst_b in ((a_lists.fwd, b_lists.fwd), (a_lists.bwd, b_lists.bwd)):
            for r in range(meta.cp):
                # A longer KV buffer adds owned k-tiles without items, launched last.
                counts = np.diff(lst_b.offsets[r])
                want = np.diff(lst_a.offsets[r])
                np.testing.assert_array_equal(counts, np.pad(want, (0, len(counts) - len(want))))
                order = np.lexsort((np.arange(len(counts)), -counts))
                np.testing.assert_array_equal(lst_b.order[r], order)
                n = lst_a.offsets[r, -1]
                np.testing.assert_array_equal(lst_a.items[r, :n], lst_b.items[r, :n])
        if a.cast is not None:
            got = cast_model(tagged, b.cast)[:, :, 0]
            want = cast_model(tagged, a.cast)[:, :, 0]
            np.testing.assert_array_equal(got[:, : want.shape[1]], want)
            assert not got[:, want.shape[1] :].any()


def expected_capacity_error(capacity, models, cp, k, free, backend, block, t_loc):
    """The error the planner must raise for ``capacity``, as a pattern of its message, from
    the models (``None``: it fits). The planner checks the remote KV, then the casts, then
    the work lists."""
    remote_kv, widths = model_needs(models, cp, k)
    if cp > 1 and capacity.remote_kv is not None and remote_kv > capacity.remote_kv:
        return rf"PlanCapacity\.remote_kv\W+{remote_kv}\b"
    for width in widths:  # the first stage over the capacity
        if cp > 1 and capacity.cast_width is not None and width > capacity.cast_width:
            return rf"PlanCapacity\.cast_width\W+{width}\b"
    for stage in free.stages:  # the free plan's lists are the item model's (checked)
        fwd, bwd = W.backend_blocks(backend, t_loc, stage.kv_len, block, block)
        ratio = max(1, fwd[0] // bwd[0])
        q, kk = stage.ffa.q_offsets[:, -1], stage.ffa.k_offsets[:, -1]
        if q.max() > capacity.items or kk.max() > capacity.items * ratio:
            return r"PlanCapacity\.items\W"
    return None


def check_plan(mask, cp, degree, backend="xla", capacities=(), algorithm="magi", block=8):
    meta = S.solve_dispatch(mask, cp, None, algorithm)
    k = max(degree, 1)
    models = rank_models(mask, meta, k)
    free = D.build_dist_plan(mask, meta, degree, block, block, backend)
    check_plan_exact(mask, meta, free, models, backend, block)
    for capacity in capacities:
        capacity = PlanCapacity(
            mask.total_q,
            items=capacity.items,
            remote_kv=capacity.remote_kv,
            cast_width=capacity.cast_width,
        )
        error = expected_capacity_error(
            capacity, models, cp, k, free, backend, block, meta.local_len
        )
        if error is not None:
            with pytest.raises(CapacityError, match=error):
                D.build_dist_plan(mask, meta, degree, block, block, backend, capacity)
            continue
        plan = D.build_dist_plan(mask, meta, degree, block, block, backend, capacity)
        check_padded_like(free, plan, meta)
        if cp > 1:
            # Shapes set by the capacity alone: one combined stage or a host stage and k
            # remote ones, each remote buffer ceil(remote_kv / k), casts to every other rank.
            assert len(plan.stages) == (1 if degree == 0 else 1 + k)
            buf = D.stage_buffer_len(capacity, meta, k)
            for stage in plan.stages[1:] if degree else plan.stages:
                assert stage.cast.buffer_len == buf
                assert stage.cast.shifts == tuple(range(1, cp))
        for stage in plan.stages:
            fwd, bwd = W.backend_blocks(backend, meta.local_len, stage.kv_len, block, block)
            ratio = max(1, fwd[0] // bwd[0])
            assert stage.items == (capacity.items, capacity.items * ratio)


def capacities():
    """Capacities that fit some masks and not others (every field)."""
    for items in (1, 9, 1000):
        for remote_kv in (None, 2, 40):
            for width in (None, 1, 6):
                yield PlanCapacity(1, items=items, remote_kv=remote_kv, cast_width=width)


CAPS = list(capacities())
# Some over the capacity in each field, and one that every zoo mask fits (items 1000).
ZOO_CAPS = CAPS[::5] + CAPS[-9:-8]


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zoo_plans_match_the_models(name, cp):
    for degree in (0, 1, 2, 3):
        for backend in ("xla", "pallas"):
            check_plan(
                ZOO[name], cp, degree, backend, ZOO_CAPS if cp > 1 else CAPS[:1] + CAPS[-9:-8]
            )


@SETTINGS
@given(
    self_attention_masks(max_len=48),
    st.sampled_from([1, 2, 3, 4]),
    st.sampled_from([0, 1, 2, 3]),
    st.sampled_from(S.ALGORITHMS),
    st.sampled_from(["xla", "pallas"]),
    st.sampled_from(range(len(CAPS))),
    st.sampled_from([4, 8, 16]),
)
def test_random_plans_match_the_models(mask, cp, degree, algorithm, backend, cap, block):
    check_plan(mask, cp, degree, backend, [CAPS[cap]], algorithm, block)


@pytest.mark.parametrize("name", ["doc-causal", "many-docs", "shared-question", "sliding-window"])
def test_benchmark_masks_at_tight_capacities(name):
    """Longer masks (more chunks, ranks and tiles): the views match the model, and the
    tight capacity of ``from_masks`` plans them with the free plan's stages and casts."""
    mask = make_mask(name, 4096, window=256)
    for cp, degree in ((8, 0), (8, 2), (16, 3)):
        tight = PlanCapacity.from_masks([mask], mesh_size=cp, overlap_degree=degree)
        meta = S.solve_dispatch(mask, cp, tight.chunk_size)
        k = max(degree, 1)
        models = rank_models(mask, meta, k)
        for m, v in zip(models, D.rank_views(mask, meta, k)):
            want = np.stack([m.keys, m.owner, m.stage, m.offset], axis=1)
            np.testing.assert_array_equal(pieces_as_tokens(v.remote), want)
        free = D.build_dist_plan(mask, meta, degree, 128, 128, "pallas")
        plan = D.build_dist_plan(mask, meta, degree, 128, 128, "pallas", tight)
        check_padded_like(free, plan, meta)
        remote_kv, widths = model_needs(models, cp, k)
        assert tight.remote_kv >= remote_kv and tight.cast_width >= max(widths)


# ---- cast tables -------------------------------------------------------------------------------


def index_run_counts(table):
    """Brute-force run counts of a table's index arrays: send runs are stretches of
    consecutive local rows inside one slot; receive runs are stretches of consecutive slot
    entries (or of padding) inside one slot's values, trailing padding not counted."""
    send, recv, s = table.send_index, table.recv_index, table.slot_len
    most_send = most_recv = 0
    for r in range(table.cp):
        n = 0
        for row in send[r]:
            prev = None
            for v in row.tolist():
                if v >= 0 and not (prev is not None and prev >= 0 and v == prev + 1):
                    n += 1
                prev = v
        most_send = max(most_send, n)
        vals = recv[r].tolist()
        while vals and vals[-1] < 0:
            vals.pop()
        n, prev = 0, None
        for v in vals:
            cont = prev is not None and (
                (v < 0 and prev < 0) or (v >= 0 and prev >= 0 and v == prev + 1 and v % s)
            )
            n += not cont
            prev = v
        most_recv = max(most_recv, n)
    return most_send, most_recv


@pytest.mark.parametrize("name", ["causal", "doc-causal", "shared-question", "full"])
def test_cast_tables_match_the_model(name):
    """A stage's table puts every remote key the model assigns it at the model's offset, at
    every width and at run capacities from the exact need (same moves) to one below it
    (CapacityError)."""
    mask = ZOO[name]
    for cp in (2, 3, 4, 8):
        meta = S.solve_dispatch(mask, cp, 2 if cp < 8 else None)
        models = rank_models(mask, meta, 2)
        views = D.rank_views(mask, meta, 2)
        tagged = (meta.positions + 1)[:, :, None]
        for s in range(2):
            remote = [v.remote[v.remote[:, 3] == s] for v in views]
            want = np.full((cp, 50), -1, np.int64)
            for r, m in enumerate(models):
                sel = m.stage == s
                want[r, m.offset[sel]] = m.keys[sel]
            free = build_cast_table(meta, remote, 50)
            np.testing.assert_array_equal(cast_model(tagged, free)[:, :, 0] - 1, want)
            need = model_needs(models, cp, 2)[1][s]
            for width in (1, 3, need, 64):
                if width < need:
                    with pytest.raises(CapacityError, match=f"cast_width>={need}"):
                        build_cast_table(meta, remote, 50, width)
                    continue
                table = build_cast_table(meta, remote, 50, width)
                np.testing.assert_array_equal(cast_model(tagged, table)[:, :, 0] - 1, want)
                assert table.shifts == tuple(range(1, cp)) and table.widths == (width,) * (cp - 1)
                send_need, recv_need = index_run_counts(table)
                assert table.run_counts() == (send_need, recv_need)
                pieces = np.concatenate(
                    [
                        np.column_stack([rem[:, :3], np.full(len(rem), r), rem[:, 4]])
                        for r, rem in enumerate(remote)
                        if len(rem)
                    ]
                    or [np.zeros((0, 5), np.int64)]
                )
                build = lambda a, b: cast_table_from_pieces(
                    meta, *pieces.T, buffer_len=50, width=width, send_runs=a, recv_runs=b
                )
                for a, b in ((send_need, recv_need), (send_need + 5, recv_need + 3)):
                    at_cap = build(a, b)
                    np.testing.assert_array_equal(cast_model(tagged, at_cap)[:, :, 0] - 1, want)
                    chex.assert_shape(
                        [at_cap.send_runs, at_cap.recv_runs],
                        [(cp, min(a + cp - 1, (cp - 1) * width), 2), (cp, min(b, 50), 2)],
                    )
                if send_need > 1:
                    with pytest.raises(CapacityError, match="send_runs"):
                        build(send_need - 1, recv_need)
                if recv_need > 1:
                    with pytest.raises(CapacityError, match="recv_runs"):
                        build(send_need, recv_need - 1)


# ---- work lists --------------------------------------------------------------------------------


@SETTINGS
@given(
    slice_masks(max_len=60),
    st.sampled_from([(8, 8), (16, 8), (4, 16), (1, 1), (3, 5), (64, 64)]),
    st.sampled_from(["q", "k"]),
)
def test_work_lists_match_the_item_model(mask, blocks, by):
    work = W.build_work_list(mask.shapes, mask.total_q, mask.total_k, *blocks, by)
    check_work_list(work, mask.shapes, mask.total_q, mask.total_k, *blocks, by)


def test_work_lists_of_shapes_not_canonical():
    """Shapes with rows that see no key and empty slices (not what masks give)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 6))
        q0, k0, dlo = rng.integers(0, 30, n), rng.integers(0, 30, n), rng.integers(-20, 10, n)
        sh = SliceShapes(
            q0,
            q0 + rng.integers(0, 15, n),
            k0,
            k0 + rng.integers(1, 15, n),
            dlo,
            dlo + rng.integers(-2, 20, n),
        )
        for by in "qk":
            for blocks in ((4, 4), (8, 2), (1, 3)):
                work = W.build_work_list(sh, 50, 50, *blocks, by)
                check_work_list(work, sh, 50, 50, *blocks, by, canonical=False)


@pytest.mark.parametrize("by", ["q", "k"])
def test_stacked_work_lists_are_each_calls_model(by):
    """build_work_lists over several calls holds each call's model list, padded to the
    longest or to ``num_items``; the capacity error names the first call over it."""
    lens = [300, 77, 512, 129, 250]
    masks = [
        AttnMask.varlen(np.cumsum([0] + lens), causal=True),
        AttnMask.shared_question(lens),
        AttnMask.sliding_window(1268, 100, 31),
        AttnMask.from_ranges([], [], [], total_q=1268, total_k=1268),
    ]
    flat = SliceShapes(*(np.concatenate([getattr(m.shapes, f) for m in masks]) for f in _FIELDS))
    rank = np.repeat(np.arange(len(masks)), [m.num_slices for m in masks])
    blocks = (64, 128)
    need = [item_counts(m.shapes, 1268, 1268, (blocks, blocks))[by == "k"] for m in masks]
    for num in (None, max(need), max(need) + 7):
        got = W.build_work_lists(flat, rank, len(masks), 1268, 1268, *blocks, by, num)
        for r, m in enumerate(masks):
            work = W.WorkList(*(x[r] for x in got))
            check_work_list(work, m.shapes, 1268, 1268, *blocks, by, num or max(need))
    with pytest.raises(CapacityError, match=f">={need[0]} work items"):
        W.build_work_lists(flat, rank, len(masks), 1268, 1268, *blocks, by, 1)


# ---- the dispatch solver -------------------------------------------------------------------------


def check_dispatch(mask, cp, chunk_size, algorithm):
    """A dispatch is equal shares of whole chunks with the dense mask's chunk areas; the
    baselines are their layouts; the magi solver balances at least as well as greedy
    (within the 0.5 % it may trade for fewer remote keys)."""
    meta = S.solve_dispatch(mask, cp, chunk_size, algorithm)
    c, n = meta.chunk_size, meta.num_chunks
    assert n % cp == 0 and n * c >= mask.total_q
    assert sorted(meta.rank_chunks.reshape(-1).tolist()) == list(range(n))
    if n * c <= 8192:  # the dense model
        dense = dense_padded(mask, n * c)
        rows = dense.sum(axis=1)
        np.testing.assert_array_equal(meta.chunk_area, rows.reshape(n, c).sum(axis=1))
    layouts = {
        "contiguous": np.arange(n).reshape(cp, -1),
        "striped": np.arange(n).reshape(-1, cp).T,
    }
    if algorithm in layouts:
        np.testing.assert_array_equal(meta.rank_chunks, layouts[algorithm])
    if algorithm == "zigzag":
        blocks = np.arange(n).reshape(2 * cp, -1)
        want = np.sort(np.concatenate([blocks[:cp], blocks[::-1][:cp]], axis=1), axis=1)
        np.testing.assert_array_equal(meta.rank_chunks, want)
    if algorithm == "magi" and chunk_size is not None:
        greedy = S.solve_dispatch(mask, cp, chunk_size, "greedy")
        assert meta.rank_area().max() <= greedy.rank_area().max() * 1.005
    return meta


@SETTINGS
@given(
    self_attention_masks(max_len=64),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.sampled_from([None, 1, 2, 3, 5]),
    st.sampled_from(S.ALGORITHMS),
)
def test_random_dispatch_matches_the_model(mask, cp, chunk_size, algorithm):
    check_dispatch(mask, cp, chunk_size, algorithm)


@pytest.mark.parametrize("name", ["doc-causal", "many-docs", "shared-question", "causal"])
def test_benchmark_dispatch_balances(name):
    """Enough chunks for the communication-aware passes (and, at 4096 chunks, the
    cumulative-sum way of counting the key chunks ranks hold)."""
    cases = [(8192, 8, None), (8192, 8, 64)]
    if name in ("doc-causal", "many-docs"):
        cases.append((16384, 16, 4))
    for total, cp, chunk in cases:
        mask = make_mask(name, total)
        meta = check_dispatch(mask, cp, chunk, "magi")
        if chunk is None:
            assert meta.imbalance() <= 1.02
