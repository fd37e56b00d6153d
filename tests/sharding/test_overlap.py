"""Overlap degrees on 8 CPU host devices: separate forward and backward degrees (a key whose
backward runs a stage split of its own) against the float64 reference, forward and
gradients, for keys of one mask, keys at a capacity (several packings, one compilation) and
batched keys; the calibration (valid degrees, cached, reset, errors). Nothing here is timed:
what a calibration measures is not checked, only what it returns and when it measures."""

import functools

import jax
import jax.numpy as jnp
import pytest

import magi_jax as mj
from magi_jax.ffa.testing import (
    assert_matches_reference,
    assert_rows_match_reference,
    random_inputs,
)
from magi_jax.sharding import calibrate as C
from tests.dynamic_masks import varlen_packings
from tests.zoo import ZOO


@functools.lru_cache(maxsize=None)
def _mesh(cp):
    return jax.make_mesh(
        (cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,)
    )


@jax.jit
def _step(q, k, v, dout, dlse, key):
    """Natural-order forward and VJP through dispatch -> magi_attention -> undispatch, the
    key an argument (one compilation per key structure)."""

    def fwd(q, k, v):
        out, lse = mj.magi_attention(*(mj.dispatch(x, key) for x in (q, k, v)), key)
        return mj.undispatch(out, key), mj.undispatch(lse, key)

    (out, lse), vjp = jax.vjp(fwd, q, k, v)
    dq, dk, dv = vjp((dout, dlse))
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def _check(key, mask, seed=0, hq=2, hkv=1, d=8):
    q, k, v, dout, dlse = random_inputs(jax.random.key(seed), mask, hq, hkv, d, jnp.float32)
    res = _step(q, k, v, dout, dlse, key)
    assert_matches_reference(res, q, k, v, mask, dout, dlse)


@pytest.mark.parametrize(
    "name, degrees",
    [("doc-causal", (1, 3)), ("shared-question", (0, 2)), ("doc-causal", (3, 0))],
)
def test_separate_degrees_match_reference(name, degrees):
    mask = ZOO[name]
    key = mj.make_flex_key(mask, _mesh(4), "cp", overlap_degree=degrees, chunk_size=3)
    fwd, bwd = degrees
    assert (key.overlap_degree, key.backward_overlap_degree) == degrees
    assert len(key.stages) == (1 if fwd == 0 else fwd + 1)
    assert len(key.static.backward_stages) == (1 if bwd == 0 else bwd + 1)
    assert len(key.backward_stage_arrays) == len(key.static.backward_stages)
    assert f"backward_overlap_degree={bwd}" in repr(key)
    _check(key, mask)


def test_one_degree_keeps_one_stage_plan():
    mask = ZOO["doc-causal"]
    for degree in (2, (2, 2)):
        key = mj.make_flex_key(mask, _mesh(4), "cp", overlap_degree=degree, chunk_size=3)
        assert key.backward_overlap_degree == key.overlap_degree == 2
        assert key.static.backward_stages is None and key.backward_stage_arrays is None
    # "auto" is the cost model's choice, as None is.
    auto = mj.make_flex_key(mask, _mesh(4), "cp", overlap_degree="auto", chunk_size=3)
    assert auto is mj.make_flex_key(mask, _mesh(4), "cp", chunk_size=3)
    # Keeping the forward's buffers (backward_refetch=False): one degree for both.
    kept = mj.make_flex_key(mask, _mesh(8), "cp", backward_refetch=False)
    assert kept.backward_overlap_degree == kept.overlap_degree


def test_backward_cost_model_sees_the_backward():
    from magi_jax.planning.defaults import default_overlap_degrees
    from magi_jax.planning.solver import solve_dispatch

    big = mj.AttnMask.causal(1 << 20)
    meta = solve_dispatch(big, 64)
    degrees = default_overlap_degrees(big, meta)
    assert all(0 <= d <= 4 for d in degrees) and degrees.forward >= 1
    key_mask = ZOO["doc-causal"]
    key = mj.make_flex_key(key_mask, _mesh(4), "cp", chunk_size=3)
    assert key.backward_overlap_degree == default_overlap_degrees(key_mask, key.plan.meta)[1]


def test_separate_degrees_at_a_capacity_one_compilation():
    """Four packings at one capacity measured for both stage plans; one compilation."""
    masks = list(varlen_packings(128, 4, seed=3))
    cap = mj.PlanCapacity.from_masks(masks, mesh_size=8, overlap_degree=(1, 3))
    assert (cap.overlap_degree, cap.backward_overlap_degree) == (1, 3)
    size = _step._cache_size()
    statics = set()
    for i, mask in enumerate(masks):
        key = mj.make_flex_key(mask, _mesh(8), "cp", capacity=cap, ffa_backend="xla")
        assert (key.overlap_degree, key.backward_overlap_degree) == (1, 3)
        statics.add(key.static)
        _check(key, mask, seed=i)
    assert len(statics) == 1
    assert _step._cache_size() == size + 1
    # A capacity without degrees takes the key's pair; one that fixes others refuses it.
    free = mj.PlanCapacity(128)
    key = mj.make_flex_key(masks[0], _mesh(8), "cp", capacity=free, overlap_degree=(2, 1))
    assert (key.overlap_degree, key.backward_overlap_degree) == (2, 1)
    with pytest.raises(
        ValueError,
        match=r"overlap_degree=\(2, 1\) but capacity.overlap_degree=1, "
        r"capacity.backward_overlap_degree=3",
    ):
        mj.make_flex_key(masks[0], _mesh(8), "cp", capacity=cap, overlap_degree=(2, 1))
    with pytest.raises(ValueError, match="backward_refetch=False"):
        mj.make_flex_key(masks[0], _mesh(8), "cp", capacity=cap, backward_refetch=False)


def test_batched_key_with_separate_degrees():
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    masks = list(varlen_packings(64, 2, seed=11))
    cap = mj.PlanCapacity.from_masks(masks, mesh_size=4, overlap_degree=(2, 1))
    key = mj.make_batch_key(masks, mesh, "cp", batch_axes="dp", capacity=cap, ffa_backend="xla")
    assert key.backward_overlap_degree == 1 and key.backward_stage_arrays is not None

    @jax.jit
    def step(q, k, v, dout, dlse, key):
        def fwd(q, k, v):
            d = lambda x: mj.dispatch(x, key, seq_axis=1)
            out, lse = mj.magi_attention(d(q), d(k), d(v), key)
            return mj.undispatch(out, key, seq_axis=1), mj.undispatch(lse, key, seq_axis=1)

        (out, lse), vjp = jax.vjp(fwd, q, k, v)
        return dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *vjp((dout, dlse)))))

    q, k, v, dout, dlse = random_inputs(jax.random.key(5), masks[0], 2, 1, 8, "float32", 2)
    assert_rows_match_reference(step(q, k, v, dout, dlse, key), q, k, v, masks, dout, dlse)


@pytest.mark.parametrize(
    "value, match",
    [
        ((1,), r"overlap_degree=\(1,\): a sequence must be a pair"),
        ((1, 9), r"overlap_degree\[1\] \(backward\)=9 must be an integer in \[0, 8\]"),
        ((-1, 0), r"overlap_degree\[0\] \(forward\)=-1"),
        ("calibrate", "overlap_degree='calibrate' is not a degree.*calibrate_overlap"),
        (True, "overlap_degree=True"),
        (1.5, "overlap_degree=1.5"),
    ],
)
def test_overlap_degree_errors(value, match):
    with pytest.raises(ValueError, match=match):
        mj.make_flex_key(ZOO["causal"], _mesh(2), "cp", overlap_degree=value)


def test_separate_degrees_need_refetch_and_capacity_checks():
    with pytest.raises(ValueError, match=r"overlap_degree=\(1, 2\).*backward_refetch=True"):
        mj.make_flex_key(
            ZOO["causal"], _mesh(2), "cp", overlap_degree=(1, 2), backward_refetch=False
        )
    with pytest.raises(ValueError, match="backward_overlap_degree=9"):
        mj.PlanCapacity(64, backward_overlap_degree=9)
    assert mj.PlanCapacity(64, overlap_degree=2).backward_overlap_degree == 2
    with pytest.raises(ValueError, match="a pair is"):
        mj.PlanCapacity.from_masks([ZOO["causal"]], mesh_size=2, overlap_degree=(1, 2, 3))


def test_calibration_valid_cached_and_reset(monkeypatch):
    mask = ZOO["doc-causal"]
    mj.clear_overlap_calibrations()
    args = dict(num_heads=2, num_kv_heads=1, head_dim=8, dtype=jnp.float32, chunk_size=3)
    cal = mj.calibrate_overlap(mask, _mesh(4), "cp", candidates=(0, 2), rounds=1, **args)
    assert set(cal.degrees) <= {0, 2} and isinstance(cal, mj.OverlapCalibration)
    assert sorted(cal.forward_ms) == sorted(cal.backward_ms) == [0, 2]
    assert all(t > 0 for t in [*cal.forward_ms.values(), *cal.backward_ms.values()])
    assert cal.forward == min(
        d for d in (0, 2) if cal.forward_ms[d] <= 1.02 * min(cal.forward_ms.values())
    )
    assert mj.overlap_calibrations() == [cal]
    key = mj.make_flex_key(mask, _mesh(4), "cp", chunk_size=3, overlap_degree=cal.degrees)
    assert (key.overlap_degree, key.backward_overlap_degree) == cal.degrees

    def no_measuring(*_args, **_kw):
        raise AssertionError("measured again")

    monkeypatch.setattr(C, "_measure", no_measuring)
    again = mj.calibrate_overlap(mask, _mesh(4), "cp", candidates=(0, 2), rounds=1, **args)
    assert again is cal
    # A key brings its mask, mesh and options.
    mask_, mesh_, axis, cap, options = C._resolve(key, None, "cp", None, {})
    assert (mask_, mesh_, axis, cap) == (mask, _mesh(4), "cp", None)
    assert options["chunk_size"] == 3 and options["ffa_backend"] == key.ffa_backend
    mj.clear_overlap_calibrations()
    assert mj.overlap_calibrations() == []
    with pytest.raises(AssertionError, match="measured again"):
        mj.calibrate_overlap(mask, _mesh(4), "cp", candidates=(0, 2), rounds=1, **args)
    # clear_caches reaches the calibrations too.
    monkeypatch.setattr(C, "_measure", lambda *a, **kw: "measured")
    mj.calibrate_overlap(mask, _mesh(4), "cp", candidates=(0,), rounds=1, **args)
    assert mj.overlap_calibrations() == ["measured"]
    mj.clear_caches()
    assert mj.overlap_calibrations() == []


def test_calibration_at_a_capacity():
    masks = list(varlen_packings(128, 3, seed=4))
    cap = mj.PlanCapacity.from_masks(masks, mesh_size=8, overlap_degree=1)
    cal = mj.calibrate_overlap(
        masks[0],
        _mesh(8),
        "cp",
        capacity=cap,
        num_heads=2,
        head_dim=8,
        dtype=jnp.float32,
        candidates=(0, 3),
        rounds=1,
        ffa_backend="xla",
    )
    assert set(cal.degrees) <= {0, 3} and "at a capacity" in cal.setting
    sized = mj.PlanCapacity.from_masks(masks, mesh_size=8, overlap_degree=cal.degrees)
    for mask in masks:
        key = mj.make_flex_key(mask, _mesh(8), "cp", capacity=sized, ffa_backend="xla")
        assert (key.overlap_degree, key.backward_overlap_degree) == cal.degrees


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(candidates=()), ValueError, r"candidates=\(\) must be a non-empty"),
        (dict(candidates=(0, 9)), ValueError, r"candidates=\(0, 9\)"),
        (dict(rounds=0), ValueError, "rounds=0"),
        (dict(tolerance=1.5), ValueError, "tolerance=1.5"),
        (dict(num_heads=0), ValueError, "num_heads=0"),
        (dict(num_kv_heads=3), ValueError, "num_heads=2 must be a multiple of num_kv_heads=3"),
        (dict(overlap_degree=1), ValueError, "overlap_degree= is not an option"),
        (dict(batch_axes="dp"), ValueError, "batch_axes= is not an option"),
        (dict(comm_backend="carrier pigeon"), ValueError, "comm_backend='carrier pigeon'"),
        (dict(flavour=1), TypeError, r"unknown options \['flavour'\]"),
        (dict(mesh=None), ValueError, "pass mesh="),
    ],
)
def test_calibration_errors(kw, error, match):
    args = dict(mesh=_mesh(2), num_heads=2, head_dim=8)
    args.update(kw)
    with pytest.raises(error, match=match):
        mj.calibrate_overlap(ZOO["causal"], **args)


def test_calibration_of_a_key_takes_no_other_arguments():
    key = mj.make_flex_key(ZOO["causal"], _mesh(2), "cp")
    with pytest.raises(ValueError, match="a key brings its mesh"):
        mj.calibrate_overlap(key, _mesh(2), num_heads=2, head_dim=8)
    with pytest.raises(TypeError, match="must be a MagiKey or an AttnMask"):
        mj.calibrate_overlap("causal", _mesh(2), num_heads=2, head_dim=8)
