"""Distributed plan: every rank's stages cover exactly its rows of the mask, and the casts
move exactly the keys its queries need from elsewhere — each once (host NumPy only)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from magi_jax.mask import AttnMask
from magi_jax.planning import solver as S
from magi_jax.planning import stages as D
from magi_jax.planning.cast_table import cast_model
from tests.zoo import ZOO, self_attention_masks


def _dense_local(shapes, tq, tk):
    """Cell counts [tq, tk] of local shapes (counts, to catch double coverage)."""
    cnt = np.zeros((tq, tk), np.int64)
    cols = np.arange(tk)
    for s in range(len(shapes.q0)):
        for q in range(shapes.q0[s], shapes.q1[s]):
            lo, hi = shapes.lo(np.int64(q), s), shapes.hi(np.int64(q), s)
            cnt[q] += (cols >= lo) & (cols <= hi)
    return cnt


def check_plan(mask, cp, degree, algorithm="magi", chunk_size=None):
    meta = S.solve_dispatch(mask, cp, chunk_size, algorithm)
    plan = D.build_dist_plan(mask, meta, degree, 8, 8)
    t, tp = mask.total_q, meta.padded_total
    dense = np.zeros((tp, tp), np.int64)
    dense[:t, :t] = mask.to_dense()
    pos = meta.positions  # [cp, local_len]
    tagged = (pos + 1)[:, :, None].astype(np.int64)  # 0 marks padding rows
    for r in range(cp):
        covered = np.zeros((meta.local_len, tp), np.int64)
        fetched = []
        for st_ in plan.stages:
            if st_.cast is None:
                kv = pos[r]
            else:
                buf = cast_model(tagged, st_.cast)[r, :, 0] - 1  # -1 = padding
                fetched.append(buf[buf >= 0])
                kv = np.concatenate([pos[r], buf]) if st_.kv_len != st_.cast.buffer_len else buf
            assert len(kv) == st_.kv_len
            cells = _dense_local(st_.shapes[r], meta.local_len, st_.kv_len)
            assert cells[:, kv < 0].sum() == 0, "a plan cell points at a padding KV row"
            np.add.at(covered, (slice(None), kv[kv >= 0]), cells[:, kv >= 0])
        # Exactly the rank's rows of the mask, each cell once.
        np.testing.assert_array_equal(covered, dense[pos[r]])
        # Exactly the remote keys the local queries need, each fetched once.
        fetched = np.concatenate(fetched) if fetched else np.zeros(0, np.int64)
        assert len(np.unique(fetched)) == len(fetched), "a KV token fetched twice"
        need = dense[pos[r]].any(axis=0)
        need[pos[r]] = False
        np.testing.assert_array_equal(np.sort(fetched), np.nonzero(need)[0])
        assert plan.remote_tokens[r] == len(fetched)
    return plan


@pytest.mark.parametrize(
    "name",
    [
        "causal",
        "doc-causal",
        "sliding-window",
        "shared-question",
        "global-sliding-window",
        "causal-blockwise",
    ],
)
@pytest.mark.parametrize("degree", [0, 1, 3])
def test_zoo_plans_are_exact(name, degree):
    check_plan(ZOO[name], 4, degree)


@given(
    self_attention_masks(max_len=40),
    st.sampled_from([1, 2, 3, 4]),
    st.sampled_from([0, 1, 2, 3]),
    st.sampled_from(S.ALGORITHMS),
)
def test_random_plans_are_exact(mask, cp, degree, algorithm):
    check_plan(mask, cp, degree, algorithm)


def test_stages_split_remote_kv_evenly_and_stack():
    plan = check_plan(AttnMask.causal(64), 4, 3, chunk_size=2)
    remote = plan.stages[1:]
    lens = [s.cast.buffer_len for s in remote]
    assert max(lens) - min(lens) <= 1
    for s in plan.stages:
        assert s.ffa.q_runs.shape[0] == 4 and s.ffa.q_runs.dtype == np.int32
        assert s.ffa.k_runs.shape[0] == 4
    # A rank's buffer holds at most ceil(remote / 3) rows per stage.
    assert max(lens) == -(-int(plan.remote_tokens.max()) // 3)


def test_no_remote_kv_gives_single_host_stage():
    plan = D.build_dist_plan(
        AttnMask.varlen([0, 16, 32], causal=False),
        S.solve_dispatch(AttnMask.varlen([0, 16, 32], causal=False), 2, 16, "contiguous"),
        2,
        8,
        8,
    )
    assert len(plan.stages) == 1 and plan.stages[0].cast is None
    assert plan.overlap_degree == 0 and plan.remote_tokens.tolist() == [0, 0]


def test_cached_and_errors():
    meta = S.solve_dispatch(ZOO["causal"], 2)
    assert D.build_dist_plan(ZOO["causal"], meta, 1, 8, 8) is D.build_dist_plan(
        ZOO["causal"], meta, 1, 8, 8
    )
    with pytest.raises(ValueError, match="overlap_degree=-1"):
        D.build_dist_plan(ZOO["causal"], meta, -1, 8, 8)


@pytest.mark.parametrize("name", ["causal", "doc-causal", "shared-question"])
def test_cast_runs_from_pieces_are_those_of_the_tables(name):
    """The runs built from the pieces are the canonical runs of the tables they expand to
    (each maximal within a slot), with and without a capacity's fixed slots."""
    from magi_jax.planning import cast_table

    mask = ZOO[name]
    meta = S.solve_dispatch(mask, 4, 4)
    views = D.rank_views(mask, meta, 2)
    for width in (None, 40):
        for s in range(2):
            a = cast_table.build_cast_table(
                meta, [v.remote[v.remote[:, 3] == s] for v in views], 40, width
            )
            b = cast_table.CastTable.from_index(a.send_index, a.recv_index, a.shifts, a.widths)
            np.testing.assert_array_equal(a.send_runs, b.send_runs)
            np.testing.assert_array_equal(a.recv_runs, b.recv_runs)
            assert a.tokens_moved() == int((a.send_index >= 0).sum()) > 0
            np.testing.assert_array_equal(a.rows_received(), (a.recv_index >= 0).sum(axis=1))


def test_split_areas_and_default_overlap_degree():
    from magi_jax.planning.defaults import default_overlap_degree

    mask = AttnMask.causal(4096)
    meta = S.solve_dispatch(mask, 4)
    host, remote, tokens = D.split_areas(mask, meta)
    assert (host + remote).sum() == mask.area
    np.testing.assert_array_equal(host + remote, meta.rank_area())
    np.testing.assert_array_equal(tokens, S.remote_kv_tokens(mask, meta))
    # No remote KV -> degree 0; a long causal sequence on many ranks -> overlap pays.
    docs = AttnMask.varlen([0, 1024, 2048, 3072, 4096], causal=True)
    assert default_overlap_degree(docs, S.solve_dispatch(docs, 4, 1024, "contiguous")) == 0
    big = AttnMask.causal(1 << 20)
    assert default_overlap_degree(big, S.solve_dispatch(big, 64)) >= 1


def test_host_stage_runs_have_their_own_bound():
    """At a capacity the host stage's run arrays take ``host_q_runs`` / ``host_k_runs`` and
    the remote stages ``q_runs`` / ``k_runs``, from the capacity alone; ``from_masks``
    measures them apart, a capacity without host bounds pads the host stage like the others,
    and a host list over its bound names the host field."""
    from magi_jax.planning.capacity import CapacityError, PlanCapacity
    from magi_jax.planning.defaults import capacity_needs

    mask = AttnMask.causal(4096)
    for degree in (1, 2):
        cap = PlanCapacity.from_masks([mask], mesh_size=8, overlap_degree=degree, headroom=1.0)
        need = capacity_needs([mask], 8, overlap_degree=degree)
        assert (cap.host_q_runs, cap.host_k_runs) == (need["host_q_runs"], need["host_k_runs"])
        # Causal: a rank's own block holds far fewer k-list runs than its remote keys.
        assert cap.host_k_runs < cap.k_runs
        assert "host_q_runs=" in repr(cap) and "host_k_runs=" in repr(cap)
        meta = S.solve_dispatch(mask, 8, cap.chunk_size)
        plan = D.build_dist_plan(mask, meta, degree, 128, 128, "xla", cap)
        host, *remote = plan.stages
        assert host.cast is None and len(remote) == degree
        assert (host.ffa.q_runs.shape[1], host.ffa.k_runs.shape[1]) == cap.runs(host=True)
        for st_ in remote:
            assert (st_.ffa.q_runs.shape[1], st_.ffa.k_runs.shape[1]) == (cap.q_runs, cap.k_runs)
        # The runs a list holds are exactly those of the free plan (the padding is empty).
        free = D.build_dist_plan(mask, meta, degree, 128, 128, "xla")
        for a, b in zip(free.stages, plan.stages):
            for x, y in ((a.ffa.q_runs, b.ffa.q_runs), (a.ffa.k_runs, b.ffa.k_runs)):
                n = x.shape[1]
                np.testing.assert_array_equal(y[:, :n], x)
                assert not y[:, n:, -1].any()
        # Without host bounds the host stage takes q_runs / k_runs, as before they existed.
        old = PlanCapacity(
            **{f: getattr(cap, f) for f in cap.__dataclass_fields__ if not f.startswith("host_")}
        )
        assert old.runs(host=True) == (cap.q_runs, cap.k_runs)
        plan = D.build_dist_plan(mask, meta, degree, 128, 128, "xla", old)
        assert plan.stages[0].ffa.k_runs.shape[1] == cap.k_runs
        for field in ("host_q_runs", "host_k_runs"):
            have = getattr(cap, field)
            small = PlanCapacity(**{**cap.__dict__, field: have - 1})
            with pytest.raises(CapacityError, match=rf"PlanCapacity\.{field}>={have}"):
                D.build_dist_plan(mask, meta, degree, 128, 128, "xla", small)
    # One combined stage (overlap degree 0): no host stage, no host bounds measured.
    cap = PlanCapacity.from_masks([mask], mesh_size=8, overlap_degree=0)
    assert cap.host_q_runs is None and cap.host_k_runs is None
    with pytest.raises(ValueError, match=r"PlanCapacity\.host_k_runs=0"):
        PlanCapacity(4096, host_k_runs=0)
