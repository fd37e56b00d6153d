"""One q/k/v check (``magi_jax.ffa.api.check_qkv``) behind every entry point: the same
mistake gives the same sentence from flex_flash_attention, dot_product_attention,
magi_attention, magi_attention_local and the Flax layers, each prefixed with its caller; and
magi_attention_local takes ``sink=`` like magi_attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import magi_jax as mj
from magi_jax.nn import attend
from magi_jax.sharding.attention import magi_attention_local

T, H, D = 16, 2, 8


@functools.lru_cache(maxsize=None)
def _key():
    mesh = jax.make_mesh(
        (2,), ("cp",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,)
    )
    return mj.make_flex_key(mj.AttnMask.causal(T), mesh, "cp")


def _entry(name):
    """(call, caller, tokens): the entry point as ``call(q, k, v)``, the prefix of its
    messages and the tokens its inputs have."""
    if name == "flex_flash_attention":
        call = lambda q, k, v: mj.flex_flash_attention(q, k, v, mj.AttnMask.causal(T))
        return call, name, T
    if name == "dot_product_attention":
        return lambda q, k, v: mj.dot_product_attention(q, k, v), name, T
    if name == "magi_attention":
        key = _key()
        return lambda q, k, v: mj.magi_attention(q, k, v, key), name, key.padded_total
    if name == "magi_attention_local":
        key = _key()
        return lambda q, k, v: magi_attention_local(q, k, v, key), name, key.local_len
    return lambda q, k, v: attend(q, k, v, mj.AttnMask.causal(T)), "magi-jax attention", T


ENTRIES = [
    "flex_flash_attention",
    "dot_product_attention",
    "magi_attention",
    "magi_attention_local",
    "layers",
]

# fault -> (q, k, v shapes as (heads, head dim, v's head dim) changes, error, message)
FAULTS = {
    "head_dim": (dict(d=12), ValueError, r"head dim D=12 is not supported: use a multiple of 8"),
    "v_head_dim": (dict(dv=12), ValueError, r"head dim Dv \(.*\)=12 is not supported"),
    "gqa": (
        dict(hkv=3, hq=4),
        ValueError,
        r"has 4 heads and .* have 3: the number of query heads must be a multiple",
    ),
    "kv_shape": (dict(v_tokens=-1), ValueError, r"must have the same shape up to the head dim"),
    "d_differs": (dict(dk=16), ValueError, r"head dims differ: .* has D=8, .* has D=16"),
    "int_dtype": (dict(dtype=np.int32), TypeError, r"have dtype int32; attention needs floating"),
    "rank": (dict(rank=2), ValueError, r"must be of one rank \(they must all .*\); got shapes"),
    "batch": (dict(k_batch=3), ValueError, r"batch sizes differ"),
}


def _inputs(
    tokens, d=D, dv=None, dk=None, hq=H, hkv=H, v_tokens=0, dtype=np.float32, rank=3, k_batch=None
):
    rng = np.random.default_rng(0)
    make = lambda *shape: rng.standard_normal(shape).astype(dtype)
    q = make(tokens, hq, d)
    k = make(tokens, hkv, d if dk is None else dk)
    v = make(tokens + v_tokens, hkv, d if dv is None else dv)
    if rank == 2:
        k = k[:, 0]
    if k_batch is not None:
        q, v = q[None].repeat(2, 0), v[None].repeat(2, 0)
        k = k[None].repeat(k_batch, 0)
    return q, k, v


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_one_check_one_sentence(entry, fault):
    call, caller, tokens = _entry(entry)
    change, error, message = FAULTS[fault]
    with pytest.raises(error, match=message) as e:
        call(*_inputs(tokens, **change))
    assert str(e.value).startswith(f"{caller}: "), str(e.value)


def test_mixed_dtypes_and_non_arrays():
    for entry in ENTRIES[:4]:
        call, caller, tokens = _entry(entry)
        q, k, v = _inputs(tokens)
        with pytest.raises(TypeError, match=rf"^{caller}: .* dtypes differ \(float32, bfloat16"):
            call(q, jnp.asarray(k, jnp.bfloat16), v)
        with pytest.raises(TypeError, match=rf"^{caller}: .* must be an array .*got list"):
            call(q, k.tolist(), v)
    # The Flax layers promote q, k, v to one dtype first, as Flax's own layers do.
    q, k, v = _inputs(T)
    out = attend(q, jnp.asarray(k, jnp.bfloat16), v, mj.AttnMask.causal(T))
    assert out.dtype == jnp.float32


def test_magi_attention_local_takes_sinks():
    key = _key()
    rng = np.random.default_rng(1)
    q, k, v = (
        mj.dispatch(rng.standard_normal((T, H, D)).astype(np.float32), key) for _ in range(3)
    )
    sink = jnp.asarray(rng.standard_normal((2, H)), jnp.float32)
    local = jax.shard_map(
        lambda q, k, v, s: magi_attention_local(q, k, v, key, sink=s),
        mesh=key.mesh,
        in_specs=(P("cp"), P("cp"), P("cp"), P()),
        out_specs=(P("cp"), P("cp")),
        check_vma=False,
    )
    loss = lambda f: jax.jit(jax.value_and_grad(lambda q, s: (f(q, k, v, s)[0] ** 2).sum(), (0, 1)))
    got = loss(local)(q, sink)
    want = loss(lambda q, k, v, s: mj.magi_attention(q, k, v, key, sink=s))(q, sink)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match=r"sink must be a \[S, Hq\] array"):
        magi_attention_local(
            q[: key.local_len],
            k[: key.local_len],
            v[: key.local_len],
            key,
            sink=jnp.zeros((2, H + 1)),
        )
