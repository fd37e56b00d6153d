"""Bad inputs a new user tries, each a clear error naming the argument, the value and the fix;
and the dispatched layout at magi_attention's door (8 CPU host devices, tests/conftest.py):
inputs that skipped ``dispatch`` raise "dispatch first" instead of a silently wrong answer."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import magi_jax as mj
from magi_jax.sharding import magi_attention_local
from magi_jax.sharding.key import CheckedKey
from magi_jax.sharding.make_key import CHECK_DISPATCH_ENV

T = 256  # 8 ranks x 32 tokens: no padding
MASK = mj.AttnMask.varlen([0, 100, 256])  # causal documents (the default)
DISPATCH_FIRST = "dispatch first: q = mj.dispatch"


@functools.lru_cache(maxsize=None)
def _mesh(kind):
    if kind == "auto":
        return jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,))
    if kind == "explicit":
        return jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Explicit,))
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("cp",))  # Mesh(): Auto axes


def _host_qkv(batch=None):
    """Unit-normal float32 q, k, v in NumPy (a jax.random draw compiles a program per shape)."""
    shape = (T, 2, 8) if batch is None else (batch, T, 2, 8)
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(shape, np.float32) for _ in range(3))


def _qkv(batch=None):
    return tuple(jax.device_put(x) for x in _host_qkv(batch))


def _put(xs, mesh, spec):
    return tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in xs)


def _attend(key, jit):
    f = lambda q, k, v: mj.magi_attention(q, k, v, key)
    return jax.jit(f) if jit else f


# ---- 1. the dispatched layout cannot be mistaken --------------------------------------------


@pytest.mark.parametrize("mesh_kind", ["auto", "plain_mesh"])
def test_never_dispatched_inputs_eager_raise_dispatch_first(mesh_kind):
    key = mj.make_flex_key(MASK, _mesh(mesh_kind), "cp")
    assert key.padded_total == key.total == T  # the shapes agree: the hard case
    with pytest.raises(ValueError, match=DISPATCH_FIRST) as e:
        _attend(key, jit=False)(*_qkv())
    assert "lives on one device" in str(e.value) and "not on the key's mesh" in str(e.value)


@pytest.mark.parametrize("mesh_kind", ["auto", "plain_mesh"])
@pytest.mark.parametrize("jit", [False, True])
def test_never_dispatched_inputs_on_auto_mesh_raise_with_check_dispatch(mesh_kind, jit):
    # Under jit on an Auto mesh the type carries no sharding: only the checked layout (one
    # hidden row per rank) tells natural-order arrays from dispatched ones.
    key = mj.make_flex_key(MASK, _mesh(mesh_kind), "cp", check_dispatch=True)
    assert isinstance(key, CheckedKey) and key.padded_total == T + 8
    with pytest.raises(ValueError, match=DISPATCH_FIRST) as e:
        _attend(key, jit)(*_qkv())
    assert "natural-order" in str(e.value) and "264" in str(e.value)


@pytest.mark.parametrize("jit", [False, True])
def test_natural_order_sharded_over_cp_on_explicit_mesh_raises_with_check_dispatch(jit):
    mesh = _mesh("explicit")
    qkv = _put(_qkv(), mesh, P("cp"))  # MaxText's layout: natural order, P("cp")
    key = mj.make_flex_key(MASK, mesh, "cp", check_dispatch=True)
    with pytest.raises(ValueError, match=DISPATCH_FIRST):
        _attend(key, jit)(*qkv)
    batched = _put(_qkv(batch=2), mesh, P(None, "cp"))
    with pytest.raises(ValueError, match="dispatch first: q = mj.dispatch\\(x, key, seq_axis=1"):
        _attend(key, jit)(*batched)


def test_check_dispatch_from_the_environment(monkeypatch):
    monkeypatch.setenv(CHECK_DISPATCH_ENV, "1")
    key = mj.make_flex_key(MASK, _mesh("explicit"), "cp")
    assert isinstance(key, CheckedKey)
    with pytest.raises(ValueError, match=DISPATCH_FIRST):
        _attend(key, jit=True)(*_put(_qkv(), _mesh("explicit"), P("cp")))
    assert not isinstance(
        mj.make_flex_key(MASK, _mesh("explicit"), "cp", check_dispatch=False), CheckedKey
    )
    monkeypatch.setenv(CHECK_DISPATCH_ENV, "maybe")
    with pytest.raises(ValueError, match="MAGI_JAX_CHECK_DISPATCH='maybe'"):
        mj.make_flex_key(MASK, _mesh("explicit"), "cp")


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("placement", ["replicated", "uncommitted"])
def test_not_sharded_inputs_on_explicit_mesh_raise_dispatch_first(jit, placement):
    mesh = _mesh("explicit")
    key = mj.make_flex_key(MASK, mesh, "cp")  # the default key: no opt-in needed
    qkv = _put(_qkv(), mesh, P()) if placement == "replicated" else _qkv()
    with pytest.raises(ValueError, match=DISPATCH_FIRST) as e:
        _attend(key, jit)(*qkv)
    assert "in_specs" not in str(e.value)
    if placement == "replicated":
        assert "replicated along the sequence" in str(e.value)


def test_replicated_inputs_on_auto_mesh_eager_name_both_fixes():
    mesh = _mesh("auto")
    key = mj.make_flex_key(MASK, mesh, "cp")
    with pytest.raises(ValueError, match=DISPATCH_FIRST) as e:
        _attend(key, jit=False)(*_put(_qkv(), mesh, P()))
    assert "replicated along the sequence" in str(e.value)
    assert "jax.device_put(q, NamedSharding(" in str(e.value)  # if it is dispatched already


def test_heads_sharded_on_explicit_mesh_is_named():
    mesh = jax.make_mesh((4, 2), ("cp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    key = mj.make_flex_key(MASK, mesh, "cp")
    qkv = _put(_qkv(), mesh, P("cp", "tp"))
    with pytest.raises(ValueError, match="shards the sequence over .cp..*reshard q"):
        _attend(key, jit=True)(*qkv)
    with pytest.raises(ValueError, match=r"split over \('tp',\), not over \('cp',\)"):
        _attend(key, jit=True)(*_put(_qkv(), mesh, P("tp")))


def test_keys_of_one_mask_with_and_without_check_do_not_mix():
    mesh = _mesh("auto")
    mask = mj.AttnMask.varlen([0, 100, 250])  # 6 rows of padding
    plain = mj.make_flex_key(mask, mesh, "cp")
    checked = mj.make_flex_key(mask, mesh, "cp", check_dispatch=True)
    q, k, v = (jax.device_put(x[:250]) for x in _host_qkv())
    with pytest.raises(ValueError, match="dispatched with a check_dispatch=True key"):
        mj.magi_attention(*(mj.dispatch(x, checked) for x in (q, k, v)), plain)
    with pytest.raises(ValueError, match="unchecked twin"):
        mj.magi_attention(*(mj.dispatch(x, plain) for x in (q, k, v)), checked)


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_check_dispatch_changes_no_result(mesh_kind):
    """Same plan, same kernels: the natural-order outputs and gradients of a checked key are
    those of the unchecked one, bit for bit; the hidden rows behave like padding."""
    mesh = _mesh(mesh_kind)
    mask = mj.AttnMask.varlen([0, 70, 200, 250])  # 6 rows of padding as well
    plain = mj.make_flex_key(mask, mesh, "cp", overlap_degree=1)
    checked = mj.make_flex_key(mask, mesh, "cp", overlap_degree=1, check_dispatch=True)
    rng = np.random.default_rng(1)  # on the host: a jax.random draw compiles a program
    q, k, v, g = (jax.device_put(rng.standard_normal((250, 2, 8), np.float32)) for _ in range(4))

    def loss(q, k, v, key):
        o, lse = mj.magi_attention(*(mj.dispatch(x, key) for x in (q, k, v)), key)
        return (mj.undispatch(o, key) * g).sum(), (o, lse)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    with jax.set_mesh(mesh) if mesh_kind == "explicit" else contextlib.nullcontext():
        (l0, (o0, lse0)), g0 = run(q, k, v, plain)
        (l1, (o1, lse1)), g1 = run(q, k, v, checked)
    assert o1.shape == (checked.padded_total, 2, 8) == (plain.padded_total + 8, 2, 8)
    assert float(l0) == float(l1)
    for a, b in zip(g0, g1):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    o1 = np.asarray(o1).reshape(8, -1, 2, 8)
    lse1 = np.asarray(lse1).reshape(8, -1, 2)
    assert (o1[:, -1] == 0).all() and np.isneginf(lse1[:, -1]).all()  # the hidden rows
    np.testing.assert_array_equal(o1[:, :-1].reshape(o0.shape), np.asarray(o0))
    np.testing.assert_array_equal(lse1[:, :-1].reshape(lse0.shape), np.asarray(lse0))
    pos = np.asarray(mj.position_ids(checked)).reshape(8, -1)
    np.testing.assert_array_equal(pos[:, :-1].reshape(-1), np.asarray(mj.position_ids(plain)))
    assert (pos[:, -1] >= mask.total_q).all()
    x = jnp.arange(250.0)
    np.testing.assert_array_equal(
        np.asarray(mj.undispatch(mj.dispatch(x, checked), checked)), np.asarray(x)
    )


def test_check_dispatch_inside_your_own_shard_map():
    mesh = _mesh("auto")
    key = mj.make_flex_key(MASK, mesh, "cp", check_dispatch=True)
    q, k, v = _qkv()
    body = lambda q, k, v: magi_attention_local(q, k, v, key)[0]
    sharded = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("cp"),) * 3, out_specs=P("cp"), check_vma=False)
    )
    out = mj.undispatch(sharded(*(mj.dispatch(x, key) for x in (q, k, v))), key)
    ref, _ = mj.flex_flash_attention(q, k, v, MASK)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)
    with pytest.raises(ValueError, match="local_len=33.*dispatch first"):
        sharded(q, k, v)  # natural order: 32 rows per rank


# ---- 2. every bad input is a clear error ----------------------------------------------------


def test_empty_sequence():
    with pytest.raises(ValueError, match=r"no tokens \(total_q = total_k = 0\)"):
        mj.make_flex_key(mj.AttnMask.causal(0), _mesh("auto"), "cp")
    e = jnp.zeros((0, 2, 8))
    with pytest.raises(ValueError, match=r"shape \(0, 2, 8\) \(T = 0\).*skip the call"):
        mj.flex_flash_attention(e, e, e, mj.AttnMask.causal(0))


@pytest.mark.parametrize("name", ["block_q", "block_k"])
@pytest.mark.parametrize("value", [0, -8, 2.5])
def test_block_sizes(name, value):
    with pytest.raises(ValueError, match=f"{name}={value!r} must be a positive tile size"):
        mj.make_flex_key(MASK, _mesh("auto"), "cp", **{name: value})
    q = jnp.zeros((T, 2, 8))
    with pytest.raises(ValueError, match=f"{name}={value!r} must be a positive tile size"):
        mj.flex_flash_attention(q, q, q, MASK, backend="xla", **{name: value})


@pytest.mark.parametrize("value", [100, 9, -1, 2.5, True])
def test_overlap_degree_is_bounded(value):
    with pytest.raises(
        ValueError,
        match=rf"overlap_degree={value!r} must be an integer in "
        r"\[0, 8\]",
    ):
        mj.make_flex_key(MASK, _mesh("auto"), "cp", overlap_degree=value)
    assert mj.make_flex_key(MASK, _mesh("auto"), "cp", overlap_degree=8).overlap_degree <= 8


@pytest.mark.parametrize("value", [0, -4, 1.5])
def test_chunk_size(value):
    with pytest.raises(ValueError, match=f"chunk_size={value!r} must be a positive number"):
        mj.make_flex_key(MASK, _mesh("auto"), "cp", chunk_size=value)


def test_head_dim_and_backward_refetch():
    key = mj.make_flex_key(MASK, _mesh("auto"), "cp")
    for d in (12, 264):
        x = mj.dispatch(jnp.zeros((T, 2, d)), key)
        with pytest.raises(ValueError, match=f"head dim D={d} is not supported"):
            mj.magi_attention(x, x, x, key)
    with pytest.raises(ValueError, match="backward_refetch='no' must be True or False"):
        mj.make_flex_key(MASK, _mesh("auto"), "cp", backward_refetch="no")


def test_softcap_and_scale():
    q = jnp.zeros((T, 2, 8))
    with pytest.raises(ValueError, match="softcap=nan must be a number >= 0"):
        mj.flex_flash_attention(q, q, q, MASK, softcap=float("nan"))
    key = mj.make_flex_key(MASK, _mesh("auto"), "cp")
    qd = mj.dispatch(q, key)
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match=f"softcap={bad} must be a number >= 0"):
            mj.magi_attention(qd, qd, qd, key, softcap=bad)
    with pytest.raises(ValueError, match="softmax_scale=inf must be a finite number"):
        mj.magi_attention(qd, qd, qd, key, softmax_scale=float("inf"))
    with pytest.raises(TypeError, match="dtype int32; attention needs floating-point"):
        qi = mj.dispatch(jnp.zeros((T, 2, 8), jnp.int32), key)
        mj.magi_attention(qi, qi, qi, key)


def test_cu_seqlens_must_be_one_dimensional_integers():
    with pytest.raises(
        ValueError,
        match=r"cu_seqlens must be 1-D.*got shape \(2, 3\).*"
        "from_segment_ids",
    ):
        mj.AttnMask.varlen([[0, 3, 5], [0, 2, 5]])
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        mj.make_varlen_key([[0, 128], [0, 128]], _mesh("auto"), "cp")
    with pytest.raises(ValueError, match=r"cu_seqlens\[1\] = 3.5 is not an integer"):
        mj.AttnMask.varlen([0, 3.5, 5])
    assert mj.AttnMask.varlen(np.array([0.0, 3.0, 5.0])) == mj.AttnMask.varlen([0, 3, 5])
    with pytest.raises(ValueError, match="start at 0 and be non-decreasing"):
        mj.AttnMask.varlen([0, 5, 3])


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: mj.AttnMask.sliding_window(-4, 1, 0), r"total=-4 must be >= 0"),
        (lambda: mj.AttnMask.global_sliding_window(-4, 1, 1), r"total=-4 must be >= 0"),
        (lambda: mj.AttnMask.causal(-4), r"total_q=-4 must be >= 0"),
        (lambda: mj.AttnMask.full(8, -1), r"total_k=-1 must be >= 0"),
        (lambda: mj.AttnMask.causal(4.5), r"total_q=4.5 must be an integer"),
    ],
)
def test_negative_or_fractional_lengths_name_the_length(build, match):
    with pytest.raises(ValueError, match=match) as e:
        build()
    assert "cu_seqlens" not in str(e.value) and "q_ranges" not in str(e.value)


def test_packed_documents_are_causal_by_default_everywhere():
    cu = [0, 100, 256]
    ids = np.repeat([1, 2], [100, 156])
    causal = mj.AttnMask.varlen(cu, causal=True)
    assert mj.AttnMask.varlen(cu) == causal == mj.AttnMask.from_segment_ids(ids)
    assert mj.make_varlen_key(cu, _mesh("auto"), "cp").mask == causal
    assert mj.AttnMask.varlen(cu, causal=False) != causal


def test_dispatch_seq_axis_mistakes_name_the_right_axis():
    key = mj.make_flex_key(mj.AttnMask.varlen([0, 100, 250]), _mesh("auto"), "cp")
    x = jnp.zeros((250, 2, 8))
    with pytest.raises(
        ValueError,
        match=r"axis 1 \(seq_axis=1\) has 2 rows but the key is for "
        r"250 tokens.*Axis 0 has 250 rows: pass seq_axis=0",
    ):
        mj.dispatch(x, key, seq_axis=1)
    xd = mj.dispatch(x, key)
    with pytest.raises(ValueError, match=r"seq_axis=1\) has 2 rows.*pass seq_axis=0"):
        mj.undispatch(xd, key, seq_axis=1)
    with pytest.raises(ValueError, match="looks dispatched already"):
        mj.dispatch(xd, key)
    with pytest.raises(ValueError, match="looks undispatched already"):
        mj.undispatch(x, key)
    with pytest.raises(TypeError, match="seq_axis=None must be an int"):
        mj.dispatch(x, key, seq_axis=None)
    with pytest.raises(ValueError, match="seq_axis=5 is out of range"):
        mj.dispatch(x, key, seq_axis=5)
    assert mj.dispatch(np.zeros((250, 3)), key).shape == (key.padded_total, 3)


def test_position_ids_on_either_mesh():
    for kind in ("auto", "explicit"):
        key = mj.make_flex_key(MASK, _mesh(kind), "cp")
        pos = mj.position_ids(key)
        assert pos.sharding.is_equivalent_to(NamedSharding(key.mesh, P("cp")), 1)
        head = np.asarray(pos)[:10]  # works on both meshes
        np.testing.assert_array_equal(head, np.asarray(key.order)[:10])
        if kind == "explicit":  # typed P("cp"): JAX asks for an out_sharding to index
            rep = jax.sharding.reshard(pos, NamedSharding(key.mesh, P()))
            np.testing.assert_array_equal(np.asarray(rep[:10]), head)


def test_pallas_key_names_unsupported_inputs():
    """A key on the Mosaic GPU kernels (the default on sm90) rejects inputs they cannot take,
    naming the fix, before any kernel is traced."""
    import jax
    import jax.numpy as jnp
    import pytest

    import magi_jax as mj

    mesh = jax.make_mesh(
        (2,), ("cp",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,)
    )
    key = mj.make_flex_key(mj.AttnMask.causal(256), mesh, "cp", ffa_backend="pallas")
    x = mj.dispatch(jnp.zeros((256, 2, 64), jnp.float32), key)
    with pytest.raises(ValueError, match="ffa_backend='xla'"):
        mj.magi_attention(x, x, x, key)


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="the message of a non-GPU device")
def test_pallas_off_a_gpu_says_so_before_the_inputs():
    """backend='pallas' on a CPU names the device first, even for inputs the kernels would
    refuse anyway (float32 here): the device is what the user must change first."""
    q = jnp.ones((128, 2, 64), jnp.float32)
    with pytest.raises(NotImplementedError, match="not an NVIDIA GPU") as err:
        mj.flex_flash_attention(q, q, q, mj.AttnMask.causal(128), backend="pallas")
    assert "dtype" not in str(err.value)
