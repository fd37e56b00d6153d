"""The pallas kernels in Mosaic GPU interpret mode on the CPU (tiny shapes), against the
float64 reference by docs/design.md §5: band items, pipeline knobs, persistent programs, the
plan-array and backward entry points, lowering for sm90. Interpret mode fills fresh buffers
with NaN, so an output element the kernels forget to write fails the NaN check: the outputs
are poisoned. The mask zoo, the tile-edge masks at every head dim, softcap and batches are in
tests/test_conformance.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax.pallas.tuning as T
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask
from magi_jax.pallas import ffa_pallas, flex_flash_attention_pallas, plan_for_mask, supported
from magi_jax.planning.work_list import BAND
from tests.zoo import EDGES

# The tile-edge masks of the test zoo (tests/zoo.py).
IRREGULAR, EMPTY_TILES = EDGES["irregular"], EDGES["empty-tiles"]


def _run(mask, dtype, hq, hkv, d, batch=None, softcap=0.0, seed=0, jit=False, **tuning):
    q, k, v, dout, dlse = random_inputs(jax.random.key(seed), mask, hq, hkv, d, dtype, batch)
    fn = functools.partial(
        flex_flash_attention_pallas, mask=mask, softcap=softcap, interpret=True, **tuning
    )
    f = lambda a, b, c: fn(a, b, c)
    if jit:
        f = jax.jit(f)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp((dout, dlse))
    assert out.dtype == dtype and lse.dtype == jnp.float32 and dk.dtype == dtype
    res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    assert_matches_reference(res, q, k, v, mask, dout, dlse, softcap=softcap)
    return res


def test_band_items():
    """A band 65 diagonals wide (keys r..r+64 for row r): tiles inside the slice are band
    items (only the diagonal bounds cut them; both bounds on the diagonal tiles, the upper
    one alone beside them), tiles past the key range general ones; forward and backward."""
    mask = AttnMask.from_ranges([[0, 256]], [[0, 320]], ["bi_causal"], 256, 320)
    plan = plan_for_mask(mask, "pallas")
    for items in (plan.fwd.items, plan.bwd.items):
        assert (items[:, -1] == BAND).sum() >= 2 and (items[:, -1] != BAND).any()
    _run(mask, jnp.bfloat16, hq=2, hkv=1, d=64, seed=5)


def test_tuning_knobs_keep_results():
    """Pipeline depths change speed, not results."""
    _run(IRREGULAR, jnp.bfloat16, hq=2, hkv=1, d=64, seed=4, num_stages=1, dkv_num_stages=3)


def test_plan_arrays_entry_point_with_padded_items():
    """The mask-free entry point (what context parallelism calls per rank) gives the same
    result with extra padding items appended to its plan."""
    mask = IRREGULAR
    q, k, v, _, _ = random_inputs(jax.random.key(1), mask, 1, 1, 64, jnp.bfloat16)
    arr = plan_for_mask(mask, "pallas")
    padded = arr.pad_to(len(arr.q_items) + 3, len(arr.k_items) + 2)
    run = lambda plan: ffa_pallas(q, k, v, plan, softmax_scale=0.125, interpret=True)
    (o1, l1), (o2, l2) = run(arr), run(padded)
    np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


def test_supported_reasons():
    mask = AttnMask.causal(16)
    x = lambda dt, d=64, h=2: jnp.zeros((16, h, d), dt)
    ok, why = supported(x(jnp.float32), x(jnp.float32), x(jnp.float32), check_device=False)
    assert not ok and "bfloat16 or float16" in why
    ok, why = supported(
        x(jnp.bfloat16, 96), x(jnp.bfloat16, 96), x(jnp.bfloat16, 96), check_device=False
    )
    assert not ok and "head dim 96" in why
    ok, why = supported(x(jnp.bfloat16, h=3), x(jnp.bfloat16), x(jnp.bfloat16), check_device=False)
    assert not ok and "multiple" in why
    assert supported(x(jnp.bfloat16), x(jnp.bfloat16), x(jnp.bfloat16), check_device=False) == (
        True,
        "",
    )
    e = jnp.zeros((0, 2, 64), jnp.bfloat16)
    assert supported(e, x(jnp.bfloat16), x(jnp.bfloat16), check_device=False)[1].startswith(
        "empty sequence"
    )
    big = jax.ShapeDtypeStruct((128 * 65536, 2, 64), jnp.bfloat16)
    assert "tiles" in supported(big, big, big, check_device=False)[1]
    if jax.devices()[0].platform == "cpu":
        ok, why = supported(x(jnp.bfloat16), x(jnp.bfloat16), x(jnp.bfloat16))
        assert not ok and "cpu" in why
        with pytest.raises(ValueError, match="backend='pallas' cannot run"):
            flex_flash_attention_pallas(x(jnp.bfloat16), x(jnp.bfloat16), x(jnp.bfloat16), mask)


def test_front_door_backend_choice_without_gpu():
    import magi_jax as mj

    if jax.devices()[0].platform != "cpu":
        pytest.skip("checks the CPU fallback")
    mask = AttnMask.causal(16)
    q = jnp.zeros((16, 2, 64), jnp.bfloat16)
    name, why = mj.select_backend("auto", q, q, q, mask)
    assert name == "xla" and "not an NVIDIA GPU" in why
    assert mj.select_backend("auto")[0] == "xla"
    with pytest.raises(NotImplementedError, match="Mosaic GPU FFA kernels are not available"):
        mj.flex_flash_attention(q, q, q, mask, backend="pallas")
    out, lse = mj.flex_flash_attention(q, q, q, mask)  # auto: xla, still works
    assert out.shape == q.shape and lse.shape == (16, 2)


def test_stacked_per_rank_plans():
    """Context parallelism's use: each rank's plan, stacked along a leading cp axis (padded to
    one shape), drives the kernels exactly like the rank's own plan. (Under ``shard_map``
    each rank sees its slice; GPU interpret mode keeps global state, so running two devices'
    kernels concurrently on the CPU is not reliable and this checks rank by rank.)"""
    from magi_jax.planning.work_list import FFAPlanArrays, stack_plans

    masks = [AttnMask.causal(128), AttnMask.varlen([0, 50, 128], causal=True)]
    qkv = [
        jax.random.normal(kk, (2, 128, 1, 64), jnp.float32).astype(jnp.bfloat16)
        for kk in jax.random.split(jax.random.key(7), 3)
    ]
    stacked = stack_plans([plan_for_mask(m, "pallas") for m in masks])
    run = jax.jit(
        lambda q, k, v, plan: ffa_pallas(q, k, v, plan, softmax_scale=0.125, interpret=True)
    )
    for r, m in enumerate(masks):
        mine = FFAPlanArrays(*(jnp.asarray(a[r]) for a in stacked))
        o1, l1 = run(*(x[r] for x in qkv), mine)
        o2, l2 = ffa_pallas(
            *(x[r] for x in qkv), plan_for_mask(m, "pallas"), softmax_scale=0.125, interpret=True
        )
        np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
        np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


def _forward_only(mask, dtype, hq, hkv, d, seed, batch=None, **tuning):
    q, k, v, _, _ = random_inputs(jax.random.key(seed), mask, hq, hkv, d, dtype, batch)
    out, lse = flex_flash_attention_pallas(q, k, v, mask, interpret=True, **tuning)
    assert_matches_reference(dict(out=out, lse=lse), q, k, v, mask)
    return np.asarray(out, np.float32), np.asarray(lse)


# The forward's pipeline knobs: 1, 2 and 3 slots (3 fit D = 128 only without the reduction
# scratch), one persistent program, exponentials split between the units. Forward only: the
# backward kernels ignore them.
_FWD_KNOBS = [
    {},
    dict(num_stages=3),
    dict(num_stages=1),
    dict(persistent=1),
    dict(fma_exp_cols=32),
    dict(fma_exp_cols=120, persistent=1),
]


# Like IRREGULAR, but q-tiles walk 10 and 6 items (several per k-tile): more than the slots
# of the K/V ring, so every slot is refilled and its barriers change phase.
WIDE = AttnMask.from_ranges(
    [[0, 100], [100, 190], [100, 190]],
    [[0, 500], [0, 60], [60, 640]],
    ["causal", "full", "inv_causal"],
    200,
    640,
)


@pytest.mark.parametrize(
    "tuning", _FWD_KNOBS, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()) or "default"
)
def test_forward_pipeline_knobs(tuning):
    """Non-square slices, rows covered by several slices, empty rows (WIDE), a whole empty
    q-tile (EMPTY_TILES); D = 128."""
    _, lse = _forward_only(WIDE, jnp.bfloat16, 1, 1, 128, 5, **tuning)
    assert np.isneginf(lse[190:]).all()
    out, _ = _forward_only(EMPTY_TILES, jnp.float16, 1, 1, 128, 6, **tuning)
    assert (out[128:256] == 0).all()


@pytest.mark.parametrize("programs", [3, 5])
def test_forward_persistent_units(programs):
    """Persistent programs: 8 units (2 q-tiles x batch 2 x 2 heads) over 3 or 5 programs
    (some own more units than others); the K/V ring and its barriers carry on across units,
    the next unit's Q is loaded under the current one and outputs leave through their own
    buffer."""
    out, lse = _forward_only(WIDE, jnp.bfloat16, 2, 1, 64, 7, batch=2, persistent=programs)
    assert np.isneginf(lse[:, 190:]).all() and (out[:, 190:] == 0).all()
    # A whole q-tile without items: its units prefetch the next Q at their end.
    out, _ = _forward_only(EMPTY_TILES, jnp.float16, 2, 2, 64, 8, batch=2, persistent=programs)
    assert (out[:, 128:256] == 0).all()


def test_forward_shared_memory_budget_error():
    q = jax.ShapeDtypeStruct((WIDE.total_q, 1, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((WIDE.total_k, 1, 128), jnp.bfloat16)
    plan = plan_for_mask(WIDE, "pallas")
    f = jax.jit(
        lambda q, k, v: ffa_pallas(q, k, v, plan, softmax_scale=0.1, num_stages=3, persistent=132)
    )
    with pytest.raises(
        ValueError,
        match="forward kernel with num_stages=3, persistent=132, "
        "D=128 and bfloat16 needs .* lower num_stages or turn persistent off",
    ):
        f.trace(q, kv, kv).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("d", [64, 128])
def test_forward_knobs_lower_for_sm90(d):
    """Every forward knob lowers to a Mosaic GPU kernel for CUDA on this host (layout
    inference and the shared-memory budget are checked there, no GPU needed); 3 slots fit
    D = 128."""
    mask = WIDE
    plan = plan_for_mask(mask, "pallas")
    q = jax.ShapeDtypeStruct((mask.total_q, 2, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((mask.total_k, 1, d), jnp.bfloat16)
    for tuning in _FWD_KNOBS:
        f = jax.jit(lambda q, k, v: ffa_pallas(q, k, v, plan, softmax_scale=0.1, **tuning))
        f.trace(q, kv, kv).lower(lowering_platforms=("cuda",))


def test_default_persistent_programs(monkeypatch):
    """``persistent=None``: one program per SM of the GPU when the plan is on the host, its
    rows are short and the kernels run there; none in interpret mode, with traced (per-rank)
    plans or on long rows."""

    class _Gpu:
        platform = "gpu"
        core_count = 132

    plan = plan_for_mask(WIDE, "pallas")
    monkeypatch.setattr(jax, "devices", lambda *a: [_Gpu()])
    assert T.default_programs(plan, interpret=False) == 132
    assert T.default_programs(plan, interpret=True) == 0
    traced = []
    jax.jit(lambda o: traced.append(T.default_programs(plan._replace(q_order=o), False)))(
        plan.q_order
    )
    assert traced == [0]
    monkeypatch.setattr(jax, "devices", lambda *a: [object()])  # no core count: off
    assert T.default_programs(plan, interpret=False) == 0
    # Long rows (full 8k: 64 items per q-tile) run one program per unit; a window of 1024
    # (at most 9 items per q-tile) runs persistent.
    monkeypatch.setattr(jax, "devices", lambda *a: [_Gpu()])
    full = plan_for_mask(AttnMask.full(8192), "pallas")
    assert T.default_programs(full, interpret=False) == 0
    swa = plan_for_mask(AttnMask.varlen([0, 8192], causal=True, window=1024), "pallas")
    assert np.diff(swa.q_offsets).max() < T.PERSISTENT_MAX_MEAN_ITEMS
    assert T.default_programs(swa, interpret=False) == 132
    # dK/dV: a k-tile of SWA 1024 meets at most 18 q-steps of 64 rows, one of full 8k 128.
    assert T.default_programs(swa, interpret=False, kernel="dkv") == 132
    assert T.default_programs(full, interpret=False, kernel="dkv") == 0


def test_head_dim_64_default_rings():
    """At D = 64 the default rings are deeper (4 forward slots, 2 in the persistent forward;
    3 dQ slots; 4 dK/dV slots with two query blocks per wait, 3 and one in the persistent
    dK/dV: a slot holds half the bytes of D = 128's), and the forward exponentiates 16 keys
    of each block on the FMA pipes. Forward and backward on those
    defaults against the reference, on q-tiles that walk more items than the rings have
    slots (WIDE), and the whole step lowers for sm90 with them, one program per unit and
    persistent (layout inference, shared memory)."""
    assert T.default_num_stages(64, fwd_persistent=False, dkv_persistent=False) == (4, 3, 4)
    assert T.default_num_stages(64, fwd_persistent=True, dkv_persistent=True) == (2, 3, 3)
    assert T.default_num_stages(128, fwd_persistent=False, dkv_persistent=False) == (2, 2, 2)
    assert [T.default_fma_exp_cols(d) for d in (64, 128, 256)] == [16, 0, 0]
    assert [
        T.default_steps_per_wait(d, n, persistent)
        for d, n, persistent in [(64, 4, False), (64, 4, True), (64, 3, False), (128, 4, False)]
    ] == [2, 1, 1, 1]
    _run(WIDE, jnp.bfloat16, hq=2, hkv=1, d=64, seed=9)
    plan = plan_for_mask(WIDE, "pallas")
    q = jax.ShapeDtypeStruct((WIDE.total_q, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((WIDE.total_k, 1, 64), jnp.bfloat16)
    for programs in (0, 132):
        loss = lambda q, k, v: ffa_pallas(
            q, k, v, plan, softmax_scale=0.125, persistent=programs, dkv_persistent=programs
        )[0].sum()
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
            lowering_platforms=("cuda",)
        )


def test_backward_entry_point_equals_the_vjp():
    """``ffa_pallas_backward`` from the forward's own (out, lse) is the VJP of
    ``ffa_pallas``, bit for bit (batched; CP uses it unbatched, tests/sharding)."""
    from magi_jax.pallas import ffa_pallas_backward

    plan = plan_for_mask(IRREGULAR, "pallas")
    q, k, v, dout, dlse = random_inputs(jax.random.key(11), IRREGULAR, 2, 1, 64, jnp.bfloat16, 2)
    f = lambda a, b, c: ffa_pallas(a, b, c, plan, softmax_scale=0.125, interpret=True)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    want = vjp((dout, dlse))
    got = ffa_pallas_backward(
        q, k, v, plan, out, lse, dout, dlse, softmax_scale=0.125, interpret=True
    )
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_array_equal(
            np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name
        )


def test_backward_with_work_between_dkv_and_dq():
    # dK/dV first, then the hook (context parallelism starts the dK/dV reduce there), then
    # dQ: the same gradients; the hook saw the dK/dV that come back, and its token returns.
    from magi_jax.pallas import ffa_pallas_backward

    plan = plan_for_mask(IRREGULAR, "pallas")
    q, k, v, dout, dlse = random_inputs(
        jax.random.key(12), IRREGULAR, 2, 1, 64, jnp.bfloat16
    )  # unbatched, as CP
    out, lse = ffa_pallas(q, k, v, plan, softmax_scale=0.125, interpret=True)
    want = ffa_pallas_backward(
        q, k, v, plan, out, lse, dout, dlse, softmax_scale=0.125, interpret=True
    )
    seen = []

    def hook(dk, dv):
        seen.append((dk, dv))
        return (dk.astype(jnp.float32).sum() + dv.astype(jnp.float32).sum())[None]

    *grads, token = ffa_pallas_backward(
        q,
        k,
        v,
        plan,
        out,
        lse,
        dout,
        dlse,
        softmax_scale=0.125,
        interpret=True,
        between_dkv_dq=hook,
    )
    for name, a, b in zip(("dq", "dk", "dv"), grads, want):
        np.testing.assert_array_equal(
            np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name
        )
    assert seen[0][0] is grads[1] and seen[0][1] is grads[2]
    np.testing.assert_allclose(
        np.asarray(token)[0],
        float(np.asarray(want[1], np.float32).sum() + np.asarray(want[2], np.float32).sum()),
        rtol=1e-5,
    )


@pytest.mark.parametrize("split", [128, 100])
def test_backward_hook_with_dkv_in_two_parts(split):
    # split_kv_at: the hook gets dK and dV as (rows [:split], rows [split:]); an aligned split
    # is stored apart by the kernel (128), another sliced (100); the same values either way.
    from magi_jax.pallas import DKV_SPLIT_ALIGN, ffa_pallas_backward

    assert (split % DKV_SPLIT_ALIGN == 0) == (split == 128)
    plan = plan_for_mask(IRREGULAR, "pallas")
    q, k, v, dout, dlse = random_inputs(jax.random.key(13), IRREGULAR, 2, 1, 64, jnp.bfloat16)
    out, lse = ffa_pallas(q, k, v, plan, softmax_scale=0.125, interpret=True)
    _, dk, dv = ffa_pallas_backward(
        q, k, v, plan, out, lse, dout, dlse, softmax_scale=0.125, interpret=True
    )
    seen = []

    def hook(dk2, dv2):
        seen.append((dk2, dv2))
        return jnp.zeros((1,), jnp.int32)

    _, dk2, dv2, _ = ffa_pallas_backward(
        q,
        k,
        v,
        plan,
        out,
        lse,
        dout,
        dlse,
        softmax_scale=0.125,
        interpret=True,
        between_dkv_dq=hook,
        split_kv_at=split,
    )
    assert seen[0][0] is dk2 and seen[0][1] is dv2
    for name, parts, whole in (("dk", dk2, dk), ("dv", dv2, dv)):
        assert [p.shape[0] for p in parts] == [split, k.shape[0] - split], name
        np.testing.assert_array_equal(
            np.asarray(jnp.concatenate(parts), np.float32),
            np.asarray(whole, np.float32),
            err_msg=name,
        )
