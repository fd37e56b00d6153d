"""Wire counts: real rows and the rows each transport moves, padding included, against a
hand-checked plan and a brute-force count over every move of the cast (host NumPy only)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_jax.mask import AttnMask
from magi_jax.planning import solver as S
from magi_jax.planning import stages as D
from magi_jax.planning.capacity import PlanCapacity
from magi_jax.planning.cast_table import cast_moves
from magi_jax.planning.hierarchy import NodeLayout, build_relay_table
from magi_jax.planning.relay_runs import build_relay_runs
from magi_jax.planning.wire import cast_wire, gated_widths, plan_wire, relay_wire, ring_rows
from magi_jax.planning.work_list import default_block_sizes
from tests.zoo import self_attention_masks


def test_worked_example():
    """design.md's example: causal over 16 tokens, cp 2, chunks of 4, one remote stage.
    Rank 0 sends 4 rows (0-3) to rank 1, rank 1 sends 8 to rank 0: one slot, 8 wide."""
    mask = AttnMask.causal(16)
    plan = D.build_dist_plan(mask, S.solve_dispatch(mask, 2, 4, "magi"), 1, 4, 4)
    pp = plan_wire(plan, "ppermute")
    np.testing.assert_array_equal(pp.real, [4, 8])
    np.testing.assert_array_equal(pp.wire, [8, 8])
    assert pp.per_rank_ratio() == 1.0 and pp.total_ratio() == 16 / 12
    np.testing.assert_array_equal(plan_wire(plan, "native").wire, [4, 8])
    np.testing.assert_array_equal(plan_wire(plan, "all_to_all").wire, [8, 8])
    # Two ranks on two nodes: every row crosses.
    split = plan_wire(plan, "ppermute", local=1)
    np.testing.assert_array_equal(split.real_inter, [4, 8])
    np.testing.assert_array_equal(split.wire_intra, [0, 0])
    assert ring_rows(2, 8) == 8


def _brute(table, transport, local, pieces=1):
    """Per rank (real intra, real inter, wire intra, wire inter) from every move."""
    cp = table.cp
    node = np.arange(cp) // local
    dst, _, src, _ = cast_moves(table)
    real = np.zeros((2, cp), np.int64)
    for d, s in zip(dst, src):
        real[int(node[d] != node[s]), s] += 1
    wire = np.zeros((2, cp), np.int64)
    for j, (shift, w) in enumerate(zip(table.shifts, table.widths)):
        live = max(int((table.send_index[r, j] >= 0).sum()) for r in range(cp))
        piece = -(-w // pieces)
        moved = w if pieces == 1 else min(w, -(-live // piece) * piece)
        for r in range(cp):
            if transport == "native":
                n = int((table.send_index[r, j] >= 0).sum())
            elif transport == "ppermute":
                n = moved
            else:
                continue
            wire[int(node[r] != node[(r + shift) % cp]), r] += n
    if transport == "all_to_all":
        for r in range(cp):
            for d in range(cp):
                if d != r:
                    wire[int(node[r] != node[d]), r] += table.slot_len
    return real, wire


@settings(deadline=None, max_examples=25)
@given(
    mask=self_attention_masks(max_len=96),
    cp=st.sampled_from([2, 4, 6]),
    degree=st.integers(0, 2),
    transport=st.sampled_from(["ppermute", "all_to_all", "native"]),
    pieces=st.sampled_from([1, 3]),
    capacity=st.booleans(),
)
def test_counts_match_every_move(mask, cp, degree, transport, pieces, capacity):
    meta = S.solve_dispatch(mask, cp, None, "magi")
    cap = PlanCapacity.from_masks([mask], mesh_size=cp) if capacity else None
    if cap is not None:
        meta = S.solve_dispatch(mask, cp, cap.chunk_size, "magi")
        degree = cap.overlap_degree
    bq, bk = default_block_sizes(meta.local_len, meta.local_len)
    plan = D.build_dist_plan(mask, meta, degree, bq, bk, capacity=cap)
    local = cp // 2
    total = plan_wire(plan, transport, local, pieces=pieces)
    want_real = np.zeros((2, cp), np.int64)
    want_wire = np.zeros((2, cp), np.int64)
    for stage in plan.stages:
        if stage.cast is not None:
            real, wire = _brute(stage.cast, transport, local, pieces)
            want_real += real
            want_wire += wire
    np.testing.assert_array_equal(total.real_intra, want_real[0])
    np.testing.assert_array_equal(total.real_inter, want_real[1])
    np.testing.assert_array_equal(total.wire_intra, want_wire[0])
    np.testing.assert_array_equal(total.wire_inter, want_wire[1])
    assert (total.wire >= total.real).all()


def test_gated_widths_round_to_pieces():
    np.testing.assert_array_equal(gated_widths([100, 100, 7], [0, 30, 7], 4), [0, 50, 7])
    np.testing.assert_array_equal(gated_widths([100, 100], [0, 30], 1), [100, 100])


@pytest.mark.parametrize("fixed", [False, True])
def test_relay_counts(fixed):
    mask = AttnMask.varlen([0, 40, 100, 128], causal=True)
    meta = S.solve_dispatch(mask, 8, 4, "magi")
    plan = D.build_dist_plan(mask, meta, 1, 8, 8)
    table = plan.stages[1].cast
    widths = dict(inter_width=table.slot_len, intra_width=table.buffer_len) if fixed else {}
    rt = build_relay_table(table, NodeLayout(2, 4), **widths)
    w = relay_wire(rt)
    assert int(w.real_inter.sum()) == rt.inter_node_rows()
    assert int(w.real_intra.sum()) == rt.intra_node_rows()
    assert int(w.wire_inter.sum()) == rt.inter_node_wire_rows()
    # The same counts from the tables planned by runs, whole slots and gated pieces.
    runs = build_relay_runs(table, NodeLayout(2, 4), **widths)
    for pieces in (1, 3):
        a, b = relay_wire(rt, pieces), relay_wire(runs, pieces)
        for f in ("real_intra", "real_inter", "wire_intra", "wire_inter"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    live = (rt.inter_send >= 0).sum(axis=2).max(axis=0)
    assert relay_wire(rt, 3).wire_inter[0] == gated_widths(rt.inter_widths, live, 3).sum()
    # The relay moves each (row, node) pair across once: never more than the flat cast.
    assert w.real_inter.sum() <= cast_wire(table, "native", local=4).real_inter.sum()


def test_errors():
    mask = AttnMask.causal(16)
    plan = D.build_dist_plan(mask, S.solve_dispatch(mask, 2, 4, "magi"), 1, 4, 4)
    with pytest.raises(ValueError, match="transport"):
        plan_wire(plan, "relay")
    with pytest.raises(ValueError, match="local=3"):
        plan_wire(plan, "ppermute", local=3)
    with pytest.raises(ValueError, match="one entry each"):
        plan_wire(plan, ["ppermute", "native"])


def test_cli_prints_the_counts(capsys):
    from magi_jax.cli import _fmt, main

    assert main(["--cu-seqlens", "0,3000,8k,20000", "--cp", "4", "--local", "2", "--out", ""]) == 0
    out = capsys.readouterr().out
    mask = AttnMask.varlen([0, 3000, 8192, 20000], causal=True)
    meta = S.solve_dispatch(mask, 4, None, "magi")
    from magi_jax.planning.defaults import default_overlap_degree

    bq, bk = default_block_sizes(meta.local_len, meta.local_len)
    plan = D.build_dist_plan(mask, meta, default_overlap_degree(mask, meta), bq, bk)
    w = plan_wire(plan, "ppermute", local=2)
    line = next(x for x in out.splitlines() if x.strip().startswith("ppermute"))
    assert f"{_fmt(int(w.wire.max()))} ({_fmt(int(w.wire.sum()))})" in line, out
    assert f"{w.per_rank_ratio():5.2f}x per rank" in line, out
    assert f"between nodes {_fmt(int(w.wire_inter.sum()))}" in line, out
    assert "two-hop" in out and f"ring attention sends {_fmt(3 * meta.local_len)}" in out, out
    with pytest.raises(SystemExit):
        main(["--cp", "4", "--local", "3", "--out", ""])


def test_gated_casts_choose_ppermute():
    """A capacity's table on 10 ranks (9 slots, all as wide as the capacity): whole slots go
    through one padded all_to_all, gated ones through ppermute, which never moves more."""
    from magi_jax.planning.cast_table import build_cast_table, choose_transport

    meta = S.DispatchMeta(
        total=40,
        cp=10,
        chunk_size=2,
        rank_chunks=np.arange(20).reshape(10, 2),
        algorithm="contiguous",
        chunk_area=np.zeros(20, np.int64),
    )
    remote = [np.zeros((0, 5), np.int64)] * 10
    remote[3] = np.array([[0, 2, 0, 0, 0]])  # rank 3 needs rank 0's rows 0-1
    table = build_cast_table(meta, remote, 4, width=4)
    assert choose_transport(table) == "all_to_all"
    assert choose_transport(table, gated=True) == "ppermute"
    whole, gated = cast_wire(table, "auto"), cast_wire(table, "auto", pieces=2)
    assert gated.transports == ("ppermute",) and whole.transports == ("all_to_all",)
    np.testing.assert_array_equal(gated.wire, [2] * 10)  # one piece of the shift-3 slot
    np.testing.assert_array_equal(whole.wire, [36] * 10)


def test_cli_prints_the_capacity_run_bounds(capsys):
    """``--capacity-packings``: the capacity's run bounds per list, the host stage's apart."""
    from magi_jax.cli import _fmt, main
    from magi_jax.planning.capacity import PlanCapacity

    args = ["--mask", "causal", "--seqlen", "16384", "--cp", "4", "--capacity-packings", "1"]
    assert main(args + ["--out", ""]) == 0
    out = capsys.readouterr().out
    cap = PlanCapacity.from_masks([AttnMask.causal(16384)], mesh_size=4)
    assert cap.host_k_runs < cap.k_runs
    line = next(x for x in out.splitlines() if x.startswith("capacity"))
    assert (
        f"runs per q / k list: host stage {_fmt(cap.host_q_runs)} / {_fmt(cap.host_k_runs)}, "
        f"stages on fetched KV {_fmt(cap.q_runs)} / {_fmt(cap.k_runs)}" in line
    ), line
