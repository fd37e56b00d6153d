"""The dispatch permutation of a key at chunk granularity (8 CPU host devices): its leaves are
``[num_chunks]`` int32, their token-level views equal the permutation of the host dispatch,
and ``dispatch`` / ``undispatch`` / ``position_ids`` and their VJPs equal, bit for bit, the
token-level gathers (``take`` with ``order`` / ``inverse``) on padded, checked, cross and
capacity keys, on Explicit and Auto meshes, with the sequence on axis 0 or 1."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.sharding.key import CheckedKey
from tests.zoo import ZOO


@functools.lru_cache(maxsize=None)
def _mesh(cp, explicit=False):
    types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto,)
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp], axis_types=types)


def _host_permutation(meta, total):
    """``(order, inverse)`` of a host dispatch, token by token: dispatched row ``i`` holds
    natural position ``order[i]``, natural position ``p`` sits at dispatched row
    ``inverse[p]``."""
    order = meta.positions.reshape(-1)
    inverse = np.empty(meta.padded_total, np.int64)
    inverse[order] = np.arange(meta.padded_total)
    return order, inverse[:total]


def _token_indices(key, role="q"):
    """The token-level gathers of ``dispatch`` / ``undispatch``: ``(dispatch index into the
    natural array zero-padded to ``rows`` rows, rows, undispatch index)``."""
    if role == "kv" and key.cross:
        order, inverse = _host_permutation(key.plan.kv_meta, key.total_k)
        return order, key.kv_padded_total, inverse
    st = key.static
    order, inverse = _host_permutation(key.plan.meta, st.total)
    if not isinstance(key, CheckedKey):
        return order, st.padded_total, inverse
    hidden = np.full((st.cp, 1), st.padded_total)  # the zero row
    order = np.concatenate([order.reshape(st.cp, st.local_len), hidden], 1).reshape(-1)
    return order, st.padded_total + 1, inverse + inverse // st.local_len


def _token_dispatch(x, index, rows, axis):
    """The token-level gather of ``dispatch`` in NumPy: ``x`` zero-padded to ``rows`` rows
    along ``axis``, then rows ``index``."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, rows - x.shape[axis])
    return np.take(np.pad(x, widths), index, axis=axis)


def _gather_vjp(dy, index, rows, n, axis):
    """The VJP of ``take(pad(x, rows), index, axis)`` (``x`` with ``n`` rows along ``axis``):
    ``dy``'s rows scatter-added to rows ``index`` of zeros of ``rows`` rows, cut to ``n``."""
    dx = np.zeros(dy.shape[:axis] + (rows,) + dy.shape[axis + 1 :], dy.dtype)
    np.add.at(np.moveaxis(dx, axis, 0), index, np.moveaxis(dy, axis, 0))
    return np.take(dx, np.arange(n), axis=axis)


def _keys():
    """(name, key, role) over the layouts: padded, checked, capacity, cross dispatched."""
    doc = ZOO["doc-causal"]
    for explicit in (False, True):
        mesh = _mesh(4, explicit)
        key = mj.make_flex_key(doc, mesh, "cp", chunk_size=4, ffa_backend="xla")
        yield f"padded-{explicit}", key, "q"
        yield f"checked-{explicit}", CheckedKey.of(key), "q"
        cross = mj.make_flex_key(
            mj.AttnMask.full(41, 19), mesh, "cp", ffa_backend="xla", kv_layout="dispatched"
        )
        yield f"cross-q-{explicit}", cross, "q"
        yield f"cross-kv-{explicit}", cross, "kv"
    yield (
        "capacity",
        mj.make_flex_key(doc, _mesh(8), "cp", capacity=_capacity(), ffa_backend="xla"),
        "q",
    )


@functools.lru_cache(maxsize=None)
def _capacity():
    return mj.PlanCapacity.from_masks([ZOO["doc-causal"], ZOO["causal"]], mesh_size=8)


KEYS = {name: (key, role) for name, key, role in _keys()}


def test_leaves_are_per_chunk():
    for name, (key, _) in KEYS.items():
        st = key.static
        num_chunks = st.padded_total // st.chunk_size
        leaves = [key.chunk_order, key.chunk_inverse]
        assert [a.shape for a in leaves] == [(num_chunks,)] * 2, name
        if key.kv_layout == "dispatched":
            kv_chunks = key.kv_padded_total // st.kv_chunk_size
            assert key.kv_chunk_order.shape == key.kv_chunk_inverse.shape == (kv_chunks,)
            leaves += [key.kv_chunk_order, key.kv_chunk_inverse]
        else:
            assert key.kv_chunk_order is key.kv_order is None
        assert all(a.dtype == jnp.int32 and a.sharding.is_fully_replicated for a in leaves)
        # The key's leaves are the stage arrays, these and the plan id of each rank
        # (int32 [cp]), nothing of token length.
        assert key.plan_id.shape == (st.cp,) and key.plan_id.dtype == jnp.int32
        stage_bytes = sum(a.nbytes for a in jax.tree.leaves(key.stage_arrays))
        assert (
            key.nbytes() - stage_bytes - key.plan_id.nbytes
            == sum(a.nbytes for a in leaves)
            == 4 * sum(a.size for a in leaves)
        ), name


def test_token_views_equal_the_host_permutation():
    for name, (key, _) in KEYS.items():
        order, inverse = _host_permutation(key.plan.meta, key.total)
        np.testing.assert_array_equal(np.asarray(key.order), order, err_msg=name)
        np.testing.assert_array_equal(np.asarray(key.inverse), inverse, err_msg=name)
        assert key.order.dtype == key.inverse.dtype == jnp.int32
        if key.kv_layout == "dispatched":
            kv_order, kv_inverse = _host_permutation(key.plan.kv_meta, key.total_k)
            np.testing.assert_array_equal(np.asarray(key.kv_order), kv_order)
            np.testing.assert_array_equal(np.asarray(key.kv_inverse), kv_inverse)


def test_capacity_keys_have_one_shape():
    a = mj.make_flex_key(ZOO["doc-causal"], _mesh(8), "cp", capacity=_capacity(), ffa_backend="xla")
    b = mj.make_flex_key(ZOO["causal"], _mesh(8), "cp", capacity=_capacity(), ffa_backend="xla")
    assert a.chunk_order.shape == b.chunk_order.shape == (a.padded_total // a.chunk_size,)
    assert not np.array_equal(np.asarray(a.chunk_order), np.asarray(b.chunk_order))
    # Traced, the token views still expand (position_ids of a key passed to jit).
    pos = jax.jit(mj.position_ids)(b)
    np.testing.assert_array_equal(np.asarray(pos), b.plan.meta.positions.reshape(-1))


@pytest.mark.parametrize("name", list(KEYS))
@pytest.mark.parametrize("seq_axis", [0, 1])
def test_dispatch_equals_token_gathers(name, seq_axis):
    key, role = KEYS[name]
    index, rows, inverse = _token_indices(key, role)
    n = key.total_k if role == "kv" else key.total
    axis = seq_axis
    shape = (n, 3, 2) if seq_axis == 0 else (2, n, 3)
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal(shape).astype(np.float32)
    x = jnp.asarray(x_np)
    want_y = _token_dispatch(x_np, index, rows, axis)
    with jax.set_mesh(key.mesh):
        for jit in (True, False) if seq_axis == 0 else (True,):
            fwd = functools.partial(mj.dispatch, key=key, seq_axis=seq_axis, role=role)
            bwd = functools.partial(mj.undispatch, key=key, seq_axis=seq_axis, role=role)
            fwd, bwd = (jax.jit(fwd), jax.jit(bwd)) if jit else (fwd, bwd)
            y, vjp = jax.vjp(fwd, x)
            np.testing.assert_array_equal(np.asarray(y), want_y)
            assert y.sharding.spec[axis] == key.cp_axis
            # Cotangents typed like the outputs (sharded ones on an Explicit mesh).
            dy = rng.standard_normal(y.shape).astype(np.float32)
            np.testing.assert_array_equal(
                np.asarray(vjp(jax.device_put(dy, y.sharding))[0]),
                _gather_vjp(dy, index, rows, n, axis),
            )
            z, vjp = jax.vjp(bwd, y)
            np.testing.assert_array_equal(np.asarray(z), x_np)
            np.testing.assert_array_equal(np.asarray(z), np.take(np.asarray(y), inverse, axis))
            dz = rng.standard_normal(z.shape).astype(np.float32)
            np.testing.assert_array_equal(
                np.asarray(vjp(jax.device_put(dz, z.sharding))[0]),
                _gather_vjp(dz, inverse, y.shape[axis], y.shape[axis], axis),
            )
    want = index.copy()
    if isinstance(key, CheckedKey) and role == "q":  # hidden rows: positions >= total
        st = key.static
        want = want.reshape(st.cp, -1)
        want[:, -1] = st.padded_total + np.arange(st.cp)
    np.testing.assert_array_equal(np.asarray(mj.position_ids(key, role=role)), want.reshape(-1))


def test_dispatch_moves_whole_chunks():
    # 67 tokens in chunks of 4 over cp 4: 17 chunks, rounded up to 5 per rank (80 rows);
    # every dispatched chunk slot holds one natural chunk, in order inside it.
    key, _ = KEYS["padded-False"]
    assert (key.total, key.padded_total, key.local_len, key.chunk_size) == (67, 80, 20, 4)
    order = np.asarray(key.order).reshape(-1, 4)
    np.testing.assert_array_equal(order - order[:, :1], np.tile(np.arange(4), (20, 1)))
    np.testing.assert_array_equal(order[:, 0] // 4, np.asarray(key.chunk_order))
    np.testing.assert_array_equal(np.sort(np.asarray(key.chunk_order)), np.arange(20))
    np.testing.assert_array_equal(
        np.asarray(key.chunk_inverse)[np.asarray(key.chunk_order)], np.arange(20)
    )
