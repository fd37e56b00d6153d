"""``roll`` on dispatched arrays (8 CPU host devices) against its definition
``dispatch(jnp.roll(undispatch(x)), ...)``: the host tables against a NumPy model, forward
and gradients on cp 2/4/8 meshes (Explicit and Auto), padded lengths, batch layout, checked
and capacity keys, capacity keys traced under jit (the device-planned path: one compilation
over several packings), the compiled program's collectives, and the errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import magi_jax as mj
from magi_jax.sharding.roll import roll, roll_tables
from tests.dynamic_masks import varlen_packings
from tests.zoo import CU, ZOO, T


@functools.lru_cache(maxsize=None)
def _mesh(cp, explicit=False):
    types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto,)
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp], axis_types=types)


def _definition(x, shift, key, seq_axis=0):
    return mj.dispatch(
        jnp.roll(mj.undispatch(x, key, seq_axis), shift, axis=seq_axis), key, seq_axis
    )


# ---- host tables ------------------------------------------------------------------------


def _apply_tables(tables, x_local):
    """NumPy model of the device half: x_local [cp, rows] -> rolled [cp, rows]."""
    cp = x_local.shape[0]
    out = []
    for r in range(cp):
        parts = [x_local[r]]
        for d, send in zip(tables.deltas, tables.send):
            src = (r - d) % cp
            parts.append(x_local[src][send[src]])
        parts.append(np.zeros(1, x_local.dtype))
        out.append(np.concatenate(parts)[tables.gather[r]])
    return np.stack(out)


@given(st.data())
def test_tables_match_the_roll_of_natural_order(data):
    cp = data.draw(st.integers(1, 8))
    per_rank = data.draw(st.integers(1, 3))
    chunk = data.draw(st.integers(1, 5))
    padded = cp * per_rank * chunk
    total = data.draw(st.integers(max(1, padded - chunk + 1), padded))
    shift = data.draw(st.integers(-3 * total, 3 * total))
    perm = np.asarray(data.draw(st.permutations(range(cp * per_rank))))
    rank_chunks = np.sort(perm.reshape(cp, per_rank), axis=1)
    positions = (rank_chunks[:, :, None] * chunk + np.arange(chunk)).reshape(cp, -1)
    natural = np.arange(1, total + 1)  # token p holds p + 1; 0 = padding
    x_local = np.where(positions < total, positions + 1, -5)  # padding holds junk
    tables = roll_tables(rank_chunks, chunk, total, shift)
    rolled = np.roll(natural, shift)
    want = np.where(positions < total, rolled[np.minimum(positions, total - 1)], 0)
    np.testing.assert_array_equal(_apply_tables(tables, x_local), want)
    assert 0 not in tables.deltas and tables.gather.dtype == np.int32
    # Each rank sends every real row at most once in all, and nothing it does not own.
    assert sum(tables.widths) <= cp * per_rank * chunk


def test_tables_hand_checked():
    # 8 tokens, chunks of 2, cp 2: rank 0 holds chunks 0, 3 (positions 0 1 6 7), rank 1
    # chunks 1, 2 (2 3 4 5). Roll by 1: position p takes p - 1.
    t = roll_tables(np.array([[0, 3], [1, 2]]), 2, 8, 1)
    assert t.deltas == (1,)
    # rank 0 needs 7, 0 (its rows 3, 0), 5 (rank 1 row 3), 6 (its row 2): rank 1 sends row 3
    # rank 1 needs 1 (rank 0 row 1), 2, 3, 4 (its rows 0, 1, 2): rank 0 sends its row 1
    np.testing.assert_array_equal(t.send[0], [[1], [3]])
    # rows 0-3 local, row 4 the one received, row 5 zero
    np.testing.assert_array_equal(t.gather, [[3, 0, 4, 2], [4, 0, 1, 2]])


def test_tables_shift_zero_is_local_and_zeroes_padding():
    t = roll_tables(np.array([[0, 3], [1, 2]]), 2, 7, 0)
    assert t.deltas == () and t.send == ()
    np.testing.assert_array_equal(t.gather, [[0, 1, 2, 4], [0, 1, 2, 3]])  # 4: zero row


# ---- on the devices -----------------------------------------------------------------------

CASES = [  # (cp, explicit mesh, mask, chunk size): every one has padding (T = 67)
    (2, True, "doc-causal", 4),
    (4, False, "sliding-window", 3),
    (8, False, "shared-question", 3),
    (8, True, "causal", 2),
]


@functools.lru_cache(maxsize=None)
def _key(cp, explicit, name, chunk):
    return mj.make_flex_key(ZOO[name], _mesh(cp, explicit), "cp", chunk_size=chunk)


def _shifts(key):
    c = key.chunk_size
    return (0, 1, -1, c, -c, key.local_len + 1, T + 5, -3 * T - 2)


def _order(key):
    """``key.order`` expanded in NumPy from the key's chunk permutation: dispatched row i
    holds natural position ``chunk_order[i // C] * C + i % C``."""
    c = key.chunk_size
    return (np.asarray(key.chunk_order)[:, None] * c + np.arange(c)).reshape(-1)


def _dispatch_np(natural, key, seq_axis=0):
    """``dispatch`` in NumPy: dispatched row i holds natural position ``order[i]``, zero when
    that is padding."""
    natural = np.moveaxis(natural, seq_axis, 0)
    order = _order(key)
    real = (order < key.total).reshape((-1,) + (1,) * (natural.ndim - 1))
    rows = np.where(real, natural[np.minimum(order, key.total - 1)], 0)
    return np.moveaxis(rows, 0, seq_axis)


def _definition_np(xd, shift, key, seq_axis=0):
    """The definition with the roll and the last dispatch in NumPy."""
    natural = np.roll(np.asarray(mj.undispatch(xd, key, seq_axis)), shift, axis=seq_axis)
    return _dispatch_np(natural, key, seq_axis)


def _definition_grad_np(w, shift, key):
    """The gradient in ``a`` of ``sum(_definition(a, shift, key) * w)``, in NumPy. The
    definition only moves rows (dispatch and undispatch are each other's transposes, a roll's
    is the opposite roll), so its gradient is ``w`` moved back: undispatched (natural
    position p from dispatched row ``inverse[p]``), rolled by -shift, dispatched."""
    order = _order(key)
    inverse = np.argsort(order)[: key.total]
    return _dispatch_np(np.roll(np.asarray(w)[inverse], -shift, axis=0), key)


def _plus_one(xd):
    """``xd + 1`` computed on the host, placed as ``xd``: padding rows then hold junk."""
    return jax.device_put(np.asarray(xd) + np.asarray(1, xd.dtype), xd.sharding)


@pytest.mark.parametrize("case", CASES, ids=[f"cp{c[0]}-{c[2]}" for c in CASES])
def test_forward_and_gradient_match_the_definition(case):
    key = _key(*case)
    assert key.padded_total > key.total
    shifts = _shifts(key)
    grad_shifts = (1, -key.chunk_size)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, 3)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((key.padded_total, 3)), jnp.float32)

    @jax.jit
    def run(xd, w, key):  # the key as an argument: its plan comes from its static part
        loss = lambda f, s: lambda a: jnp.sum(f(a, s) * w)
        got = [roll(xd, s, key) for s in shifts]
        g_got = [jax.grad(loss(lambda a, s: roll(a, s, key), s))(xd) for s in grad_shifts]
        return got, g_got

    with jax.set_mesh(key.mesh):
        xd = _plus_one(mj.dispatch(x, key))  # padding rows hold junk; roll must not read it
        got, g_got = run(xd, w, key)
        g_want = [_definition_grad_np(w, s, key) for s in grad_shifts]
    for s, a in zip(shifts, got):
        np.testing.assert_array_equal(
            np.asarray(a), _definition_np(xd, s, key), err_msg=f"shift {s}"
        )
        assert a.sharding.is_equivalent_to(NamedSharding(key.mesh, P("cp")), 2)
    for s, a, b in zip(grad_shifts, g_got, g_want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"grad {s}")
    np.testing.assert_array_equal(
        np.asarray(mj.undispatch(got[1], key)), np.roll(np.asarray(x) + 1.0, 1, axis=0)
    )


def test_eager_batch_layout_int_ids_and_natural_roll():
    key = _key(4, False, "sliding-window", 3)
    ids = jnp.asarray(np.arange(2 * T).reshape(2, T), jnp.int32)
    xd = mj.dispatch(ids, key, seq_axis=1)
    y = roll(xd, -2, key, seq_axis=1)  # eager, no jit
    assert y.dtype == jnp.int32 and y.shape == xd.shape
    np.testing.assert_array_equal(
        np.asarray(mj.undispatch(y, key, seq_axis=1)), np.roll(np.asarray(ids), -2, axis=1)
    )
    np.testing.assert_array_equal(np.asarray(y), _definition_np(xd, -2, key, 1))


def test_multi_token_prediction_labels():
    """The docstring's recipe: labels of head k are the tokens k + 1 ahead, same document."""
    key = _key(4, False, "sliding-window", 3)  # labels depend on the dispatch only
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 50, T), jnp.int32)
    ids, pos = mj.dispatch(tokens, key), mj.position_ids(key)
    cu = jnp.asarray(CU)
    doc_end = cu[jnp.searchsorted(cu, pos, side="right").clip(max=cu.size - 1)]
    for k in (1, 2):
        labels = np.asarray(roll(ids, -(k + 1), key))
        valid = np.asarray(pos + k + 1 < doc_end)
        p = np.asarray(pos)
        want_valid = np.zeros_like(valid)
        for a, b in zip(CU[:-1], CU[1:]):
            want_valid |= (p >= a) & (p + k + 1 < b)
        np.testing.assert_array_equal(valid, want_valid)
        np.testing.assert_array_equal(labels[valid], np.asarray(tokens)[p[valid] + k + 1])


def test_checked_and_capacity_keys():
    mask = ZOO["doc-window"]
    x = jnp.arange(1, T + 1, dtype=jnp.float32)
    checked = mj.make_flex_key(mask, _mesh(2, True), "cp", chunk_size=4, check_dispatch=True)
    with jax.set_mesh(checked.mesh):
        y = roll(mj.dispatch(x, checked), 5, checked)
        np.testing.assert_array_equal(
            np.asarray(mj.undispatch(y, checked)), np.roll(np.asarray(x), 5)
        )
    hidden = np.asarray(y).reshape(2, checked.local_len)[:, -1]
    np.testing.assert_array_equal(hidden, 0)

    cap = mj.PlanCapacity(T)
    key = mj.make_flex_key(mask, _mesh(4), "cp", capacity=cap)
    xd = mj.dispatch(x, key)
    want = _definition_np(xd, -7, key)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: roll(a, -7, key))(xd)), want)
    # a key rebuilt from its leaves has no host plan: read from its concrete arrays
    rebuilt = jax.tree.map(lambda a: a, key)
    assert rebuilt.plan is None
    np.testing.assert_array_equal(np.asarray(roll(xd, -7, rebuilt)), want)
    with pytest.raises(ValueError, match="PlanCapacity.*Close over the key"):
        jax.jit(lambda a, k: roll(a, -7, k))(xd, key)


_FULL_SEQUENCE_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all")


def test_compiled_program_moves_point_to_point_only():
    key = _key(8, False, "shared-question", 3)
    xd = mj.dispatch(jnp.ones((T, 4)), key)
    lowered = jax.jit(lambda a: roll(a, 1, key)).lower(xd)
    assert "all-gather" not in lowered.as_text() and "all_gather" not in lowered.as_text()
    grad = jax.jit(jax.grad(lambda a: jnp.sum(roll(a, 1, key) ** 2))).lower(xd)
    for program in (lowered.compile().as_text(), grad.compile().as_text()):
        assert "collective-permute" in program
        assert not [c for c in _FULL_SEQUENCE_COLLECTIVES if c in program]
    # the definition, by contrast, collects the whole sequence on every rank
    ref = jax.jit(lambda a: _definition(a, 1, key)).lower(xd).compile().as_text()
    assert [c for c in _FULL_SEQUENCE_COLLECTIVES if c in ref]


def test_errors():
    key = _key(4, False, "sliding-window", 3)
    xd = mj.dispatch(jnp.ones((T, 2)), key)
    for bad in (1.0, True, "1", None):
        with pytest.raises(TypeError, match="shift"):
            roll(xd, bad, key)
    with pytest.raises(TypeError, match="static Python int"):
        roll(xd, jnp.int32(1), key)
    with pytest.raises(ValueError, match=r"67 rows.*dispatch\(x, key\) first"):
        roll(jnp.ones((T, 2)), 1, key)
    with pytest.raises(ValueError, match="pass seq_axis=1"):
        roll(jnp.ones((2, key.padded_total)), 1, key)
    with pytest.raises(ValueError, match="pass an array dispatched with this key"):
        roll(jnp.ones((key.padded_total + 4, 2)), 1, key)
    with pytest.raises(ValueError, match="seq_axis=2 is out of range"):
        roll(xd, 1, key, seq_axis=2)
    with pytest.raises(TypeError, match="key must be a MagiKey"):
        roll(xd, 1, "cp")
    assert roll(xd, np.int64(3), key).shape == xd.shape  # NumPy integers are ints


# ---- capacity keys traced under jit: the device-planned path --------------------------------

CAPACITY_CASES = [  # (cp, explicit mesh, chunk size): T = 67 is a multiple of none of them
    (2, True, 6),
    (4, False, 5),
    (8, False, 3),
]


def _small_shifts(chunk):
    """The signed shifts |t| < chunk of the brief, each once."""
    return tuple(
        s for s in dict.fromkeys((0, 1, -1, 3, -4, chunk - 1, -(chunk - 1))) if abs(s) < chunk
    )


def _capacity_keys(cp, explicit, chunk, count, seed, **options):
    cap = mj.PlanCapacity(T, chunk_size=chunk)
    return [
        mj.make_flex_key(m, _mesh(cp, explicit), "cp", capacity=cap, ffa_backend="xla", **options)
        for m in varlen_packings(T, count, seed=seed)
    ]


@pytest.mark.parametrize("case", CAPACITY_CASES, ids=[f"cp{c[0]}-C{c[2]}" for c in CAPACITY_CASES])
def test_capacity_key_traced_matches_the_definition_and_compiles_once(case):
    cp, explicit, chunk = case
    keys = _capacity_keys(cp, explicit, chunk, 3, seed=cp)
    shifts, grad_shifts = _small_shifts(chunk), (1, -(chunk - 1))
    rng = np.random.default_rng(cp)
    x = jnp.asarray(rng.standard_normal((T, 3)), jnp.float32)

    @jax.jit
    def step(xd, w, key):  # the key is an argument: its dispatch is traced data
        loss = lambda f, s: lambda a: jnp.sum(f(a, s) * w)
        got = [roll(xd, s, key) for s in shifts]
        g_got = [jax.grad(loss(lambda a, s: roll(a, s, key), s))(xd) for s in grad_shifts]
        return got, g_got

    with jax.set_mesh(keys[0].mesh):
        for key in keys:
            assert key.static == keys[0].static and key.total % chunk
            xd = _plus_one(mj.dispatch(x, key))  # padding rows hold junk; roll must not read it
            w = jnp.asarray(rng.standard_normal((key.padded_total, 3)), jnp.float32)
            got, g_got = step(xd, w, key)
            g_want = [_definition_grad_np(w, s, key) for s in grad_shifts]
            pad = np.asarray(key.order) >= key.total
            for s, a in zip(shifts, got):
                np.testing.assert_array_equal(
                    np.asarray(a), _definition_np(xd, s, key), err_msg=f"shift {s}"
                )
                assert not np.asarray(a)[pad].any()
                assert a.sharding.is_equivalent_to(NamedSharding(key.mesh, P("cp")), 2)
            for s, a, b in zip(grad_shifts, g_got, g_want):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"grad {s}")
    assert step._cache_size() == 1


def test_capacity_key_traced_checked_batch_of_int_ids():
    """Multi-token-prediction labels: int32 ids [B, padded_total] (seq_axis=1) of a
    check_dispatch capacity key, shifted by -1..-4 inside one jitted step."""
    keys = _capacity_keys(4, False, 5, 2, seed=11, check_dispatch=True)
    shifts = (-1, -2, -3, -4)
    ids = jnp.asarray(np.random.default_rng(2).integers(1, 50, (2, T)), jnp.int32)

    @jax.jit
    def step(xd, key):
        return (
            [roll(xd, s, key, seq_axis=1) for s in shifts],
            [_definition(xd, s, key, 1) for s in shifts],
        )

    for key in keys:
        xd = mj.dispatch(ids, key, seq_axis=1)
        got, want = step(xd, key)
        for s, a, b in zip(shifts, got, want):
            assert a.dtype == jnp.int32 and a.shape == xd.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"shift {s}")
            np.testing.assert_array_equal(
                np.asarray(mj.undispatch(a, key, seq_axis=1)), np.roll(np.asarray(ids), s, axis=1)
            )
            hidden = np.asarray(a).reshape(2, key.cp, key.local_len)[:, :, -1]
            np.testing.assert_array_equal(hidden, 0)
    assert step._cache_size() == 1


def test_capacity_key_traced_gathers_edge_rows_only():
    cp, chunk, shift = 4, 5, -3
    key = _capacity_keys(cp, False, chunk, 1, seed=3)[0]
    xd = mj.dispatch(jnp.ones((T, 4)), key)
    num_chunks = key.padded_total // chunk
    edge_rows = (num_chunks + cp) * abs(shift)  # edges of every chunk + the wrap rows
    assert edge_rows < key.padded_total
    programs = (
        jax.jit(lambda a, k: roll(a, shift, k)).lower(xd, key).compile().as_text(),
        jax.jit(jax.grad(lambda a, k: jnp.sum(roll(a, shift, k) ** 2)))
        .lower(xd, key)
        .compile()
        .as_text(),
    )
    for program in programs:
        gathers = [line for line in program.splitlines() if " all-gather(" in line]
        assert gathers and all(
            f"f32[{edge_rows},4]" in line.split(" all-gather(")[0] for line in gathers
        ), gathers
        assert "all-to-all" not in program and "all-reduce" not in program


def test_capacity_key_traced_rejects_shifts_of_a_chunk_or_more():
    key = _capacity_keys(4, False, 5, 1, seed=4)[0]
    xd = mj.dispatch(jnp.ones((T,)), key)
    for shift in (5, -5, T - 5, 30):
        with pytest.raises(
            ValueError,
            match=rf"shift={shift} .*chunk size 5.*Close over the "
            r"key.*without capacity=.*before mj.dispatch",
        ):
            jax.jit(lambda a, k: roll(a, shift, k))(xd, key)
    # shifts are taken modulo total first: T + 4 is a roll by 4
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda a, k: roll(a, T + 4, k))(xd, key)),
        _definition_np(xd, 4, key),
    )


def test_eager_calls_compile_once():
    """Eager ``roll`` (both routes: whole chunks and edge rows) and ``undispatch`` of a key
    with a plan id (its agreement check) compile their programs at the first call only: the
    second call of each, with the same key and shapes, compiles nothing."""
    compiles = []

    def listen(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    key = mj.make_flex_key(mj.AttnMask.varlen(CU), _mesh(4), "cp")
    x = mj.dispatch(jnp.arange(T, dtype=jnp.float32), key)
    edge = 1
    whole = key.static.chunk_size * 4

    def calls():
        return (roll(x, edge, key), roll(x, whole, key), mj.undispatch(x, key))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first = jax.block_until_ready(calls())
        before = len(compiles)
        again = jax.block_until_ready(calls())
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert before > 0, "the listener saw no compilation at the first calls"
    assert len(compiles) == before, f"{len(compiles) - before} compilations at the second calls"
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
