"""The native transport's CPU FFI handlers (magi_jax/sharding/native/,
ffi/cpu_group_collectives.cc) on 8 host devices: against the NumPy model of the tables and
the XLA transports, on hand-checked and random tables; errors; magi_attention with
comm_backend="native"."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from magi_jax.planning.cast_table import CastTable, build_cast_table, cast_model, reduce_model
from magi_jax.sharding import make_flex_key
from magi_jax.sharding.collectives import CastArrays, CastSpec, group_cast, group_reduce
from magi_jax.sharding.native import library as native_library
from magi_jax.sharding.native import transport as native
from tests.sharding.test_attention import _check, _mesh
from tests.sharding.test_collectives import _meta, _random_table, _run
from tests.zoo import ZOO

# CI must build the CPU library (pip install -e .): its absence is a failure, not a skip.
if not native_library.available("cpu"):
    raise RuntimeError(f"native CPU library unavailable: {native.unavailable_reason('cpu')}")


def _hand_table():
    # cp 4, 2 tokens per rank (chunk 2): rank r owns globals 2r, 2r+1.
    # rank 0 needs global 2 (rank 1 row 0) -> buffer 0 and global 6 (rank 3 row 0) -> 1;
    # rank 1 needs global 6 -> buffer 0        (global 6 has three destinations);
    # rank 2 needs globals 6, 7 -> buffer 0, 1 and global 3 (rank 1 row 1) -> 2;
    # rank 3 needs nothing. Ranks 0 and 2 send nothing; globals 0, 1, 4, 5 go nowhere.
    meta = _meta(4, 2, 1)
    remote = [
        np.array([[2, 3, 1, 0, 0], [6, 7, 3, 0, 1]]),
        np.array([[6, 7, 3, 0, 0]]),
        np.array([[6, 8, 3, 0, 0], [3, 4, 1, 0, 2]]),
        np.zeros((0, 5), np.int64),
    ]
    return build_cast_table(meta, remote, 3)


def test_hand_checked_cast_and_reduce():
    t = _hand_table()
    native.check_table(t)
    x = (np.arange(4)[:, None, None] * 10 + np.arange(2)[None, :, None] + 1).astype(
        np.float32
    ) * np.ones((1, 1, 3), np.float32)  # x[r, row] = 10 r + row + 1
    out = _run("cast", x, t, 2, "native")[..., 0]
    np.testing.assert_array_equal(out, [[11, 31, 0], [31, 0, 0], [31, 32, 12], [0, 0, 0]])
    y = (np.arange(4)[:, None] * 10 + np.arange(3)[None, :] + 1).astype(np.float32)[..., None]
    back = _run("reduce", y, t, 2, "native")[..., 0]
    # rank 3 row 0 <- y[0,1] + y[1,0] + y[2,0]; row 1 <- y[2,1]; rank 1 row 0 <- y[0,0],
    # row 1 <- y[2,2]; ranks 0 and 2 get nothing (rank 3's buffer rows are padding).
    np.testing.assert_array_equal(back, [[0, 0], [1, 23], [0, 0], [2 + 11 + 21, 22]])
    np.testing.assert_array_equal(out, cast_model(x, t)[..., 0])
    np.testing.assert_array_equal(back, reduce_model(y, t, 2)[..., 0])


@settings(max_examples=6)
@given(
    st.integers(0, 10_000),
    st.sampled_from([2, 4, 8]),
    st.sampled_from([np.float32, jnp.bfloat16, np.float16]),
)
def test_random_tables_match_model_and_xla(seed, cp, dtype):
    rng = np.random.default_rng(seed)
    table, t_loc = _random_table(rng, cp, 3, 2, int(rng.integers(0, 3)))
    native.check_table(table)
    x = rng.standard_normal((cp, t_loc, 2, 4)).astype(dtype)
    got = _run("cast", x, table, t_loc, "native")
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got, cast_model(x, table))  # a cast moves bits
    np.testing.assert_array_equal(got, _run("cast", x, table, t_loc, "ppermute"))
    y = rng.standard_normal((cp, table.buffer_len, 2, 4)).astype(dtype)
    want = reduce_model(y.astype(np.float64), table, t_loc)
    for op in ("reduce", "cast_vjp"):
        r = _run(op, y, table, t_loc, "native")
        assert r.dtype == (np.float32 if op == "reduce" else y.dtype)
        tol = 1e-6 if op == "reduce" else (1e-6 if dtype == np.float32 else 1e-2)
        np.testing.assert_allclose(r.astype(np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(
        r, _run("cast_vjp", y, table, t_loc, "all_to_all"), rtol=tol, atol=tol
    )


def test_several_arrays_in_one_collective():
    # One native call moves arrays of different dtypes and row sizes (6-byte rows included)
    # side by side, each into its own output; the reduce sums two arrays of one dtype, on top
    # of initial sums. Through the transport-generic group_cast, a pytree of mixed dtypes
    # (one native call per dtype) matches the ppermute transport.
    rng = np.random.default_rng(11)
    cp = 4
    table, t_loc = _random_table(rng, cp, 3, 2, 1)
    spec = CastSpec("cp", cp, table.shifts, table.widths, "native")
    xs = [
        rng.standard_normal((cp, t_loc) + shp).astype(dt)
        for shp, dt in (((2, 4), np.float32), ((3,), np.float16), ((2, 8), jnp.bfloat16))
    ]
    ys = [
        rng.standard_normal((cp, table.buffer_len) + shp).astype(np.float32)
        for shp in ((2, 3), (5,))
    ]
    accs = [rng.standard_normal((cp, t_loc) + y.shape[2:]).astype(np.float32) for y in ys]

    def body(x0, x1, x2, y0, y1, a0, a1, send, recv):
        t = CastArrays(send[0], recv[0])
        cast = native.group_cast([x0[0], x1[0], x2[0]], t, spec)
        red = native.group_reduce([y0[0], y1[0]], t, spec, t_loc, acc=[a0[0], a1[0]])
        tree = group_cast({"a": x0[0], "b": x1[0], "c": x2[0]}, t, spec)
        tree_x = group_cast(
            {"a": x0[0], "b": x1[0], "c": x2[0]}, t, dataclasses.replace(spec, transport="ppermute")
        )
        return tuple(o[None] for o in (*cast, *red, *tree.values(), *tree_x.values()))

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=_mesh(cp),
            in_specs=(P("cp"),) * 9,
            out_specs=(P("cp"),) * 11,
            check_vma=False,
        )
    )
    got = [np.asarray(o) for o in f(*xs, *ys, *accs, table.send_index, table.recv_index)]
    for i, x in enumerate(xs):
        assert got[i].dtype == x.dtype
        np.testing.assert_array_equal(got[i], cast_model(x, table))
        np.testing.assert_array_equal(got[5 + i], got[8 + i])
        np.testing.assert_array_equal(got[5 + i], got[i])
    for i, (y, a) in enumerate(zip(ys, accs)):
        np.testing.assert_allclose(
            got[3 + i], a + reduce_model(y, table, t_loc), rtol=1e-6, atol=1e-6
        )
    with pytest.raises(ValueError, match="same number of rows"):
        jax.jit(
            jax.shard_map(
                lambda x, y, s, r: native.group_cast(
                    [x[0], y[0, :1]], CastArrays(s[0], r[0]), spec
                )[0][None],
                mesh=_mesh(cp),
                in_specs=(P("cp"),) * 4,
                out_specs=P("cp"),
                check_vma=False,
            )
        )(xs[0], xs[0], table.send_index, table.recv_index)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_prefix_cast_and_reduce_in_input_dtype(cp, dtype):
    # A combined stage: the cast's output is [x; cast(x)] and the reduce's input [own rows;
    # buffer], its own rows added; the reduce rounds its float32 sums once to y's dtype. The
    # sums are computed in float32 in the handler's order (own rows, then slots ascending),
    # so the rounded results match NumPy exactly. The pytree path through the
    # differentiable group_cast matches the ppermute transport, gradients included.
    rng = np.random.default_rng(cp)
    table, t_loc = _random_table(rng, cp, 3, 2, 1)
    spec = CastSpec("cp", cp, table.shifts, table.widths, "native")
    x = rng.standard_normal((cp, t_loc, 2, 4)).astype(dtype)
    y = rng.standard_normal((cp, t_loc + table.buffer_len, 2, 4)).astype(dtype)

    def body(x_, y_, send, recv):
        t = CastArrays(send[0], recv[0])
        cast = native.group_cast(x_[0], t, spec, prefix=True)
        red = native.group_reduce(y_[0], t, spec, t_loc, prefix=True)
        narrow = native.group_reduce(y_[0], t, spec, t_loc, prefix=True, out_dtype=y_.dtype)
        return cast[None], red[None], narrow[None]

    mesh = _mesh(cp)
    put = lambda *a: [jax.device_put(b, jax.NamedSharding(mesh, P("cp"))) for b in a]
    args = put(x, y, table.send_index, table.recv_index)
    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("cp"),) * 4, out_specs=(P("cp"),) * 3, check_vma=False
        )
    )
    cast, red, narrow = map(np.asarray, f(*args))
    np.testing.assert_array_equal(cast, np.concatenate([x, cast_model(x, table)], axis=1))
    # Slot by slot in float32, as the handler sums (an owner row is in a slot at most once).
    want = y[:, :t_loc].astype(np.float32)
    for j, shift in enumerate(table.shifts):
        one = CastTable.from_index(
            table.send_index[:, j : j + 1],
            np.where(
                table.recv_index // table.slot_len == j, table.recv_index % table.slot_len, -1
            ).astype(np.int32),
            (shift,),
            (table.widths[j],),
        )
        want = want + reduce_model(y[:, t_loc:].astype(np.float32), one, t_loc).astype(np.float32)
    assert red.dtype == np.float32 and narrow.dtype == x.dtype
    np.testing.assert_array_equal(red, want)
    np.testing.assert_array_equal(narrow, want.astype(dtype))

    def grads(transport):
        sp = dataclasses.replace(spec, transport=transport)

        def g(x_, ct, send, recv):
            t = CastArrays(send[0], recv[0])
            out, vjp = jax.vjp(lambda a: group_cast({"k": a, "v": 2 * a}, t, sp, True), x_[0])
            return out["k"][None], out["v"][None], vjp({"k": ct[0], "v": ct[0]})[0][None]

        return [
            np.asarray(o)
            for o in jax.jit(
                jax.shard_map(
                    g, mesh=mesh, in_specs=(P("cp"),) * 4, out_specs=(P("cp"),) * 3, check_vma=False
                )
            )(*args)
        ]

    for a, b in zip(grads("native"), grads("ppermute")):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_reduce_sums_bf16_in_float32():
    meta = _meta(4, 1, 1)
    remote = [np.zeros((0, 5), np.int64)] + [np.array([[0, 1, 0, 0, 0]])] * 3
    table = build_cast_table(meta, remote, 1)
    y = np.full((4, 1, 1), 1.0 + 2**-7, jnp.bfloat16)
    out = _run("reduce", y, table, 1, "native")
    assert out.dtype == np.float32 and out[0, 0, 0] == 3.0234375


def _direct(cp, spec, fn, mesh=None):
    mesh = mesh or _mesh(cp)
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"), check_vma=False)
    )


def test_reduce_accumulates_into_existing_output():
    rng = np.random.default_rng(3)
    table, t_loc = _random_table(rng, 4, 2, 2, 0)
    spec = CastSpec("cp", 4, table.shifts, table.widths, "native")
    y = rng.standard_normal((4, table.buffer_len, 3)).astype(np.float32)
    acc = rng.standard_normal((4, t_loc, 3)).astype(np.float32)

    def body(y_, acc_, send, recv):
        return native.group_reduce(y_[0], CastArrays(send[0], recv[0]), spec, t_loc, acc=acc_[0])[
            None
        ]

    f = jax.jit(
        jax.shard_map(
            body, mesh=_mesh(4), in_specs=(P("cp"),) * 4, out_specs=P("cp"), check_vma=False
        )
    )
    got = f(y, acc, table.send_index, table.recv_index)
    np.testing.assert_allclose(got, acc + reduce_model(y, table, t_loc), rtol=1e-6, atol=1e-6)


def test_concurrent_cp_groups_do_not_mix():
    # A (dp=2, cp=4) mesh: two cp groups run the same collective at the same time.
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(5)
    table, t_loc = _random_table(rng, 4, 2, 2, 0)
    spec = CastSpec("cp", 4, table.shifts, table.widths, "native")
    x = rng.standard_normal((2, 4, t_loc, 3)).astype(np.float32)

    def body(x_, send, recv):
        return group_cast(x_[0, 0], CastArrays(send[0], recv[0]), spec)[None, None]

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("dp", "cp"), P("cp"), P("cp")),
            out_specs=P("dp", "cp"),
            check_vma=False,
        )
    )
    got = np.asarray(f(x, table.send_index, table.recv_index))
    for g in range(2):
        np.testing.assert_array_equal(got[g], cast_model(x[g], table))


def test_missing_devices_time_out_with_a_clear_error():
    # The spec claims 8 ranks but only 4 devices run the program: the rendezvous must give up.
    t = _hand_table()
    spec = CastSpec("cp", 8, t.shifts, t.widths, "native")

    def body(x, send, recv):
        return native.group_cast(x[0], CastArrays(send[0], recv[0]), spec, timeout_s=0.3)[None]

    f = jax.jit(
        jax.shard_map(
            body, mesh=_mesh(4), in_specs=(P("cp"),) * 3, out_specs=P("cp"), check_vma=False
        )
    )
    with pytest.raises(Exception, match="rendezvous timed out after 300 ms with 4 of 8"):
        np.asarray(f(np.zeros((4, 2, 3), np.float32), t.send_index, t.recv_index))


def test_check_table_rejects_what_the_kernels_cannot_move():
    t = _hand_table()
    recv = t.recv_index.copy()
    recv[3, 0] = 0  # rank 3 reads slot entry 0 of rank 0, which is padding
    with pytest.raises(ValueError, match="rank 3 receives slot entries"):
        native.check_table(CastTable.from_index(t.send_index, recv, t.shifts, t.widths))
    recv = t.recv_index.copy()
    recv[2, 2] = recv[2, 0]  # the same entry twice
    with pytest.raises(ValueError, match="twice"):
        native.check_table(CastTable.from_index(t.send_index, recv, t.shifts, t.widths))


def test_magi_attention_native_matches_reference():
    # Two remote stages: two casts per forward, their reduces in the backward.
    key, _ = _check(ZOO["doc-causal"], 8, 2, comm_backend="native")
    casts = [s.cast for s in key.stages if s.cast is not None]
    assert len(casts) == 2 and all(c.transport == "native" for c in casts)


@pytest.mark.parametrize("cp", [2, 4])
def test_started_reduce_matches_reduce(cp):
    # reduce_runs rebuilds every rank's receive table; a started reduce (start, then done)
    # gives the synchronous reduce's result bit for bit, two arrays, own rows and rounding
    # included; the CPU start rejects runs that do not match the tables.
    rng = np.random.default_rng(10 + cp)
    table, t_loc = _random_table(rng, cp, 3, 2, 1)
    flat, offsets = native.reduce_runs(table)
    assert len(offsets) == cp + 1 and offsets[-1] == len(flat)
    for r in range(cp):
        rebuilt = np.full(table.buffer_len, -1)
        for b0, e0, n in np.reshape(flat[offsets[r] : offsets[r + 1]], (-1, 3)):
            assert n >= 1 and e0 // table.slot_len == (e0 + n - 1) // table.slot_len
            rebuilt[b0 : b0 + n] = e0 + np.arange(n)
        np.testing.assert_array_equal(rebuilt, table.recv_index[r])
    spec = CastSpec("cp", cp, table.shifts, table.widths, "native", (flat, offsets))
    assert native.can_start_reduce(spec)
    with native.tuning(started_reduce=False):
        assert not native.can_start_reduce(spec)
    assert not native.can_start_reduce(dataclasses.replace(spec, runs=None))
    y = rng.standard_normal((cp, t_loc + table.buffer_len, 2, 4)).astype(jnp.bfloat16)
    mesh = _mesh(cp)

    def run(sp):
        def body(y_, send, recv):
            t = CastArrays(send[0], recv[0])
            ys = [y_[0], (2 * y_[0]).reshape(y_.shape[1], -1)]
            want = native.group_reduce(ys, t, sp, t_loc, prefix=True, out_dtype=y_.dtype)
            token, done = native.group_reduce_start(
                ys, t, sp, t_loc, prefix=True, out_dtype=y_.dtype
            )
            got = done(token)
            return want[0][None], want[1][None], got[0][None], got[1][None]

        f = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P("cp"),) * 3, out_specs=(P("cp"),) * 4, check_vma=False
            )
        )
        put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P("cp")))
        return [np.asarray(o) for o in f(put(y), put(table.send_index), put(table.recv_index))]

    want0, want1, got0, got1 = run(spec)
    assert got0.dtype == y.dtype
    np.testing.assert_array_equal(got0, want0)
    np.testing.assert_array_equal(got1, want1)
    shifted = tuple(v + (i % 3 == 1) for i, v in enumerate(flat))  # every e0 off by one
    with pytest.raises(Exception, match="does not match the receive table"):
        run(dataclasses.replace(spec, runs=(shifted, offsets)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_reduce_with_own_rows_apart(dtype):
    # own= (the owner's rows as arrays of their own) gives prefix=True's result bit for bit,
    # synchronous and started; in the own rows' dtype the call aliases them (in place), and
    # an own array used afterwards still holds its values (XLA copies it first).
    cp = 2
    rng = np.random.default_rng(21)
    table, t_loc = _random_table(rng, cp, 3, 2, 1)
    spec = CastSpec("cp", cp, table.shifts, table.widths, "native", native.reduce_runs(table))
    y = rng.standard_normal((cp, t_loc + table.buffer_len, 2, 4)).astype(dtype)
    mesh = _mesh(cp)

    def body(y_, send, recv):
        t = CastArrays(send[0], recv[0])
        ys = [y_[0], 2 * y_[0]]
        own, buf = [a[:t_loc] for a in ys], [a[t_loc:] for a in ys]
        want = native.group_reduce(ys, t, spec, t_loc, prefix=True, out_dtype=dtype)
        sync = native.group_reduce(buf, t, spec, t_loc, own=own, out_dtype=dtype)
        token, done = native.group_reduce_start(buf, t, spec, t_loc, own=own, out_dtype=dtype)
        wide = native.group_reduce(buf, t, spec, t_loc, own=own)  # float32 sums
        return tuple(a[None] for a in (*want, *sync, *done(token), *wide, own[0]))

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("cp"),) * 3, out_specs=(P("cp"),) * 9, check_vma=False
        )
    )
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P("cp")))
    args = (put(y), put(table.send_index), put(table.recv_index))
    hlo = f.lower(*args).as_text()
    assert "output_operand_aliases" in hlo
    got = [np.asarray(o) for o in f(*args)]
    for g in got[2:6]:
        assert g.dtype == y.dtype
    np.testing.assert_array_equal(got[2], got[0])
    np.testing.assert_array_equal(got[3], got[1])
    np.testing.assert_array_equal(got[4], got[0])
    np.testing.assert_array_equal(got[5], got[1])
    assert got[6].dtype == np.float32
    np.testing.assert_allclose(
        got[6],
        y[:, :t_loc].astype(np.float32)
        + reduce_model(y[:, t_loc:].astype(np.float32), table, t_loc),
        rtol=1e-6,
        atol=1e-6,
    )
    np.testing.assert_array_equal(got[8], y[:, :t_loc])
    with pytest.raises(ValueError, match="either in y"):
        jax.eval_shape(
            lambda: native.group_reduce(
                jnp.zeros((t_loc + table.buffer_len, 2)),
                CastArrays(table.send_index[0], table.recv_index[0]),
                spec,
                t_loc,
                prefix=True,
                own=jnp.zeros((t_loc, 2)),
            )
        )


def test_reduce_runs_of_scattered_tables_are_refused():
    # More than MAX_RUNS runs on a rank: no started reduce (each run is a host-queued copy).
    b = 2 * native.MAX_RUNS + 2
    recv = np.full((2, b), -1, np.int32)
    recv[0, ::2] = np.arange(0, b, 2)  # every other row: b / 2 runs
    send = np.full((2, 1, b), -1, np.int32)
    table = lambda: CastTable.from_index(send, recv, (1,), (b,))  # a snapshot of recv
    assert native.reduce_runs(table()) is None
    recv[0, ::2] = np.arange(b // 2)  # consecutive entries, rows apart
    assert native.reduce_runs(table()) is None
    recv[0] = -1
    recv[0, 3:b] = np.arange(b - 3)  # one run
    assert native.reduce_runs(table()) == ((3, 0, b - 3), (0, 3, 3))


def test_magi_attention_starts_its_last_reduce():
    # Native transport: the backward starts the last remote stage's group-reduce between the
    # dK/dV and dQ work and ends it after; the result equals the synchronous reduce's.
    from magi_jax.ffa.testing import random_inputs
    from tests.sharding.test_attention import _end_to_end

    mask = ZOO["doc-causal"]
    key = make_flex_key(mask, _mesh(2), "cp", overlap_degree=0, comm_backend="native")
    assert all(s.cast.runs is not None for s in key.stages if s.cast is not None)
    args = random_inputs(jax.random.key(3), mask, 2, 1, 8, jnp.float32)
    started = _end_to_end(key)
    hlo = started.lower(*args).as_text()
    assert "magi_group_reduce_start" in hlo and "magi_group_reduce_done" in hlo
    got = started(*args)
    jax.clear_caches()  # jit would reuse the trace above: tuning is not in its key
    with native.tuning(started_reduce=False):
        sync = _end_to_end(key)
        assert "magi_group_reduce_start" not in sync.lower(*args).as_text()
        want = sync(*args)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), name)
    _check(ZOO["doc-causal"], 4, 1, comm_backend="native")  # with a host stage after it


def test_magi_attention_native_bf16_gqa_refetch():
    _check(
        ZOO["block-causal"],
        2,
        1,
        jnp.bfloat16,
        hq=4,
        hkv=2,
        d=16,
        softcap=4.0,
        comm_backend="native",
        backward_refetch=True,
    )


def test_auto_picks_xla_on_cpu_and_says_why():
    key = make_flex_key(ZOO["causal"], _mesh(2), "cp", overlap_degree=1)
    assert all(s.cast.transport != "native" for s in key.stages if s.cast is not None)
    assert "cpu" in native.auto_reason(_mesh(2), "cp")


def test_staging_that_does_not_fit_says_how_much_to_reserve(monkeypatch):
    # The GPU path sizes NVSHMEM's symmetric staging from the plan; a cast that needs more
    # than was reserved is refused at trace time with the number to pass to initialize().
    monkeypatch.setitem(native._nv, "initialized", True)
    monkeypatch.setitem(native._nv, "bytes", 1 << 20)
    send = np.zeros((3, 1000), np.int32)  # 3 slots x 1000 rows
    need = native.staging_bytes(3, 1000, (2, 128), jnp.bfloat16)
    assert need == 3 * 1000 * 2 * 128 * 2
    row = 2 * 128 * 2
    with pytest.raises(ValueError, match=f"initialize\\(symmetric_bytes={need}\\)"):
        native._ensure_staging(send, row, "(2, 128) bfloat16")
    native._ensure_staging(np.zeros((1, 10), np.int32), row, "(2, 128) bfloat16")  # fits


def test_one_call_site_run_twice_in_one_program():
    # A jitted cast traced once and called on two different inputs: both executions carry
    # the same call site; each device's n-th execution must meet the others' n-th.
    t = _hand_table()
    spec = CastSpec("cp", 4, t.shifts, t.widths, "native")
    inner = jax.jit(lambda a, s, r: group_cast(a, CastArrays(s, r), spec))

    def body(x, y, send, recv):
        s, r = send[0], recv[0]
        return jnp.stack([inner(x[0], s, r), inner(y[0], s, r)])[None]

    f = jax.jit(
        jax.shard_map(
            body, mesh=_mesh(4), in_specs=(P("cp"),) * 4, out_specs=P("cp"), check_vma=False
        )
    )
    rng = np.random.default_rng(7)
    x, y = (rng.standard_normal((4, 2, 3)).astype(np.float32) for _ in range(2))
    for _ in range(3):
        got = np.asarray(f(x, y, t.send_index, t.recv_index))
        np.testing.assert_array_equal(got[:, 0], cast_model(x, t))
        np.testing.assert_array_equal(got[:, 1], cast_model(y, t))


def test_cuda_tuning_and_chunk_plan():
    """The CUDA launch plan (pure Python, checked here because no GPU runs in CI): chunks of
    ~chunk_kib, at least one per send block for small casts, never more than the flags."""
    with pytest.raises(ValueError, match="mode"):
        native.CudaTuning(mode="sideways")
    with pytest.raises(ValueError, match="send_blocks"):
        native.CudaTuning(send_blocks=0)
    with pytest.raises(ValueError, match="stream"):
        native.CudaTuning(stream=-1)
    with pytest.raises(ValueError, match="chunk_kib"):
        native.CudaTuning(chunk_kib=0)
    call = lambda x: x + 1
    with pytest.raises(ValueError, match="collective"):
        native.CudaTuning(stream="compute")
    for stream in (2, "collective"):
        with native.tuning(stream=stream):
            assert native._on_stream("cpu", call) is call  # the stream is a CUDA placement
            assert native._on_stream("cuda", call) is not call
    assert native._on_stream("cuda", call) is call  # default: the compute stream
    default = native.cuda_tuning()
    big = CastSpec("cp", 2, (1,), (32768,), "native")  # 256 MiB of 8 KiB rows
    a = native._cuda_attrs(big, 32768, 8192)
    assert int(a["rows_per_chunk"]) * 8192 == default.chunk_kib * 1024
    with native.tuning(mode="pull", chunk_kib=1024, double_buffer=False) as t:
        assert native.cuda_tuning() is t
        b = native._cuda_attrs(big, 32768, 8192)
    assert native.cuda_tuning() == default
    assert int(b["mode"]) == 1 and b["double_buffer"] is False
    assert int(b["rows_per_chunk"]) == 128
    small = CastSpec("cp", 2, (1, 3), (100, 28), "native")  # 1 MiB: spread over blocks
    c = native._cuda_attrs(small, 100, 8192)
    assert int(c["rows_per_chunk"]) == -(-128 // default.send_blocks)
    huge = CastSpec("cp", 2, (1,), (10**7,), "native")
    d = native._cuda_attrs(huge, 10**7, 16)
    assert -(-(10**7) // int(d["rows_per_chunk"])) <= native._FLAG_CAPACITY // 2


def test_chain_of_mixed_tuning_matches_model():
    """Back-to-back casts and reduces traced under different CudaTuning settings in one
    program (on CPU the settings do not apply; the GPU worker runs the same chain)."""
    cp = 4
    mesh = _mesh(cp)
    rng = np.random.default_rng(5)
    table, t_loc = _random_table(rng, cp, 3, 2, 1)
    spec = CastSpec("cp", cp, table.shifts, table.widths, "native")
    x = rng.standard_normal((cp, t_loc, 2, 4)).astype(np.float32)
    y = rng.standard_normal((cp, table.buffer_len, 2, 4)).astype(np.float32)

    def chain(x_, y_, send, recv):
        t = CastArrays(send[0], recv[0])
        outs = []
        for i, mode in enumerate(("push", "pull", "pull", "push")):
            with native.tuning(mode=mode, double_buffer=bool(i % 3)):
                if i % 2:
                    outs.append(group_reduce(y_[0] * (i + 1), t, spec, t_loc)[None])
                else:
                    outs.append(group_cast(x_[0] * (i + 1), t, spec)[None])
        return tuple(outs)

    f = jax.jit(
        jax.shard_map(
            chain, mesh=mesh, in_specs=(P("cp"),) * 4, out_specs=(P("cp"),) * 4, check_vma=False
        )
    )
    outs = f(x, y, table.send_index, table.recv_index)
    for i, o in enumerate(outs):
        if i % 2:
            want = reduce_model(y * (i + 1), table, t_loc)
            np.testing.assert_allclose(np.asarray(o), want, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(np.asarray(o), cast_model(x * (i + 1), table))


def test_auto_falls_back_when_nvshmem_fails_to_initialize(monkeypatch):
    # comm_backend="auto" joins NVSHMEM at key time over several GPUs; a failure there makes
    # it pick xla, with the reason in a warning and in auto_reason, and is not retried.
    from magi_jax.sharding.native import transport

    calls = []

    def failing_init(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("NVSHMEM initialization failed (7): out of symmetric memory")

    monkeypatch.setattr(transport, "initialize", failing_init)
    monkeypatch.setattr(transport, "_INIT_FAILURE", None)
    with pytest.warns(RuntimeWarning, match="comm_backend='auto' uses 'xla'.*out of symmetric"):
        reason = transport.init_problem()
    assert "NVSHMEM failed to initialize" in reason and "out of symmetric memory" in reason
    assert transport.init_problem() == reason and len(calls) == 1

    monkeypatch.setattr(transport, "initialize", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(transport, "_INIT_FAILURE", None)
    assert transport.init_problem() is None and transport.init_problem() is None
    assert len(calls) == 2
