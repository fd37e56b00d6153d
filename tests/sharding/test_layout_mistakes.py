"""Every layout mistake named (8 CPU host devices, tests/conftest.py): never dispatched and
dispatched twice (tests/test_errors.py), a stale key (dispatched with one key, attended with
another of the same mesh), undispatch of a natural-order array, a key of another mesh; and
the raw errors of JAX a user meets first, each a message that names the argument and the fix.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import magi_jax as mj

T = 256  # 4 ranks x 64 tokens: no padding, so natural and dispatched shapes agree
A = mj.AttnMask.varlen([0, 100, 256])
B = mj.AttnMask.varlen([0, 30, 200, 256])


@functools.lru_cache(maxsize=None)
def _mesh(first=0):
    devices = jax.devices()[first : first + 4]
    return jax.make_mesh((4,), ("cp",), axis_types=(AxisType.Auto,), devices=devices)


@functools.lru_cache(maxsize=None)
def _cap():
    return mj.PlanCapacity.from_masks([A, B], mesh_size=4)


def _key(mask, capacity=False, check=False, first=0):
    cap = _cap() if capacity else None
    return mj.make_flex_key(mask, _mesh(first), "cp", capacity=cap, check_dispatch=check)


def _qkv():
    rng = np.random.default_rng(0)  # on the host: a jax.random draw compiles a program
    return tuple(rng.standard_normal((T, 2, 8), np.float32) for _ in range(3))


_attend = jax.jit(lambda q, k, v, key: mj.magi_attention(q, k, v, key)[0])


# ---- a stale key: the typed route -----------------------------------------------------------


@pytest.mark.parametrize("capacity", [False, True], ids=["one_mask", "capacity"])
def test_stale_key_raises_eagerly_and_gives_nan_under_jit(capacity):
    ka, kb = _key(A, capacity), _key(B, capacity)
    qkv = [mj.dispatch(x, ka, typed=True) for x in _qkv()]
    assert all(isinstance(x, mj.DispatchedArray) for x in qkv)
    with pytest.raises(ValueError, match="q was dispatched with another key: its plan id"):
        mj.magi_attention(*qkv, kb)
    if capacity:  # one compilation for both keys, so the check is on the device
        assert bool(jnp.isnan(_attend(*qkv, kb).value).all())
    out = _attend(*qkv, ka)
    assert isinstance(out, mj.DispatchedArray)
    ref = mj.flex_flash_attention(*_qkv(), A)[0]
    np.testing.assert_allclose(np.asarray(mj.undispatch(out, ka)), np.asarray(ref), atol=2e-5)
    with pytest.raises(ValueError, match="x was dispatched with another key"):
        mj.undispatch(out, kb)


def test_typed_route_keeps_its_tag_through_token_wise_layers():
    ka, kb = _key(A, True, check=True), _key(B, True, check=True)
    tokens = mj.dispatch(np.arange(T, dtype=np.int32) % 7, ka, typed=True)
    table = jnp.asarray(np.random.default_rng(1).standard_normal((7, 16), np.float32))
    h = tokens.map(lambda t: table[t])
    q, k, v = h.map(lambda x: tuple(x.reshape(-1, 2, 8) * s for s in (1.0, 0.5, 2.0)))
    assert all(x.shape == (ka.padded_total, 2, 8) for x in (q, k, v))
    assert bool(jnp.isfinite(_attend(q, k, v, ka).value).all())
    assert bool(jnp.isnan(_attend(q, k, v, kb).value).all())
    other = mj.dispatch(np.zeros((T, 16), np.float32), kb, typed=True)
    with pytest.raises(ValueError, match="argument 1 was dispatched with another key"):
        h.map(jnp.add, other)
    with pytest.raises(ValueError, match="already in a key's dispatched layout"):
        mj.dispatch(h, ka)
    with pytest.raises(ValueError, match="laid out by another kind of key"):
        mj.magi_attention(q, k, v, _key(A, True))  # unchecked key, checked layout
    with pytest.raises(ValueError, match="roll: x was dispatched with another key"):
        mj.roll(h, -1, kb)
    shifted = mj.roll(tokens, -1, ka)  # typed in, typed out, the tag kept
    assert isinstance(shifted, mj.DispatchedArray) and shifted.tag == tokens.tag


def test_keys_of_one_plan_agree():
    qkv = [mj.dispatch(x, _key(A), typed=True) for x in _qkv()]
    again = mj.make_flex_key(A, _mesh(), "cp", overlap_degree=1)  # same dispatch
    assert isinstance(mj.magi_attention(*qkv, again)[0], mj.DispatchedArray)


# ---- undispatch of a natural-order array ----------------------------------------------------


def test_undispatch_of_natural_order_raises_in_debug_mode():
    x = jnp.asarray(_qkv()[0])
    with pytest.raises(ValueError, match="x looks undispatched already"):
        mj.undispatch(x, _key(A, check=True))
    with pytest.raises(ValueError, match="x looks undispatched already"):
        jax.jit(lambda x, key: mj.undispatch(x, key))(x, _key(A, True, check=True))


# ---- a key of another mesh ------------------------------------------------------------------


def test_key_of_another_mesh_names_both_device_sets():
    here, there = _key(A), _key(A, first=4)
    q, k, v = (mj.dispatch(x, here) for x in _qkv())
    msg = r"lives on devices \[0, 1, 2, 3\], but the key was built on a mesh of devices \[4, 5"
    with pytest.raises(ValueError, match="magi_attention: q " + msg):
        mj.magi_attention(q, k, v, there)
    with pytest.raises(ValueError, match="undispatch: x " + msg):
        mj.undispatch(q, there)
    x = jax.device_put(_qkv()[0], NamedSharding(_mesh(), P()))
    with pytest.raises(ValueError, match="dispatch: x " + msg):
        mj.dispatch(x, there)
    one = jax.device_put(_qkv()[0], jax.devices()[0])
    with pytest.raises(ValueError, match=r"committed to device \[0\].*jax.device_put\(x, Named"):
        mj.dispatch(one, there)
    typed = [mj.dispatch(x, here, typed=True) for x in _qkv()]  # under jit: the typed route
    with pytest.raises(ValueError, match="q was dispatched with a key of another mesh"):
        _attend(*typed, there)


# ---- raw errors of JAX, in a user's words ---------------------------------------------------


def test_make_batch_key_of_one_mask_says_one_per_row():
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)
    cap = mj.PlanCapacity.from_masks([A], mesh_size=4)
    with pytest.raises(TypeError, match=r"masks is one AttnMask.*\[mask\] \* B.*make_flex_key"):
        mj.make_batch_key(A, mesh, "cp", batch_axes="dp", capacity=cap)
    with pytest.raises(TypeError, match="masks must be a sequence of AttnMask.*got int"):
        mj.make_batch_key(3, mesh, "cp", batch_axes="dp", capacity=cap)


def test_attn_mask_as_jit_argument_says_what_to_do():
    q, k, v = _qkv()
    with pytest.raises(TypeError) as e:
        jax.jit(lambda q, k, v, m: mj.flex_flash_attention(q, k, v, m))(q, k, v, A)
    cause = str(e.value.__cause__)
    assert "cannot be an argument of a jitted function" in cause
    for fix in ("Close over it", "static_argnames", "mj.plan_attention(mask"):
        assert fix in cause
    static = jax.jit(lambda q, k, v, m: mj.flex_flash_attention(q, k, v, m)[0], static_argnums=3)
    assert static(q, k, v, A).shape == (T, 2, 8)  # marked static, it works
