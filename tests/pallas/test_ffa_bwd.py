"""The dK/dV kernel's persistent mode (``dkv_persistent``) beside the dQ kernel in Mosaic GPU
interpret mode on the CPU (tiny shapes): against the float64 reference by docs/design.md §5, bit
for bit against one program per unit, free of races by the interpreter's race detector, and
lowered for sm90."""

import contextlib
import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask
from magi_jax.pallas import ffa_pallas, flex_flash_attention_pallas, plan_for_mask
from magi_jax.pallas.common import smem
from magi_jax.pallas.ffa_bwd import ffa_dkv, ffa_dq
from magi_jax.pallas.tuning import DkvConfig, DqConfig, default_dkv_turns
from magi_jax.planning.work_list import WorkList, persistent_schedule

# Units without work in both kernels: q-tile [128, 256) sees no key (dQ) and k-tile
# [128, 256) is seen by no query (dK/dV); rows [100, 128) and [330, 384) see nothing; q-tile
# [256, 384) walks two key tiles and k-tile [0, 128) four query steps per head.
HOLES = AttnMask.from_ranges(
    [[0, 100], [256, 330], [256, 330]],
    [[0, 128], [256, 384], [0, 60]],
    ["causal", "inv_causal", "full"],
    384,
    384,
)
# GQA (Hq = 4, Hkv = 2), batch 2: 24 dQ units and 12 dK/dV units.
_SHAPE = dict(hq=4, hkv=2, d=64, batch=2)


def _inputs(seed=8):
    return random_inputs(
        jax.random.key(seed),
        HOLES,
        _SHAPE["hq"],
        _SHAPE["hkv"],
        _SHAPE["d"],
        jnp.bfloat16,
        _SHAPE["batch"],
    )


def _grads(**tuning):
    q, k, v, dout, dlse = _inputs()
    f = lambda a, b, c: flex_flash_attention_pallas(a, b, c, HOLES, interpret=True, **tuning)
    _, vjp = jax.vjp(f, q, k, v)
    return dict(zip(("dq", "dk", "dv"), vjp((dout, dlse))))


@functools.lru_cache(maxsize=1)
def _plain_grads():
    return {n: np.asarray(x, np.float32) for n, x in _grads().items()}


# Programs owning several units, counts that do not divide the 12 dK/dV units, and rings of
# 1-3 slots whose phases carry on across units (dQ, one program per unit: 1 and 2 slots).
_PERSISTENT = [
    dict(dkv_persistent=1),
    dict(dkv_persistent=2, dkv_num_stages=3),
    dict(dkv_persistent=5, dkv_num_stages=1, dq_num_stages=1),
]


@pytest.mark.parametrize(
    "tuning", _PERSISTENT, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items())
)
def test_persistent_backward_matches_reference_and_plain(tuning):
    got = _grads(**tuning)
    q, k, v, dout, dlse = _inputs()
    assert_matches_reference(got, q, k, v, HOLES, dout, dlse)
    got = {n: np.asarray(x, np.float32) for n, x in got.items()}
    for name, plain in _plain_grads().items():
        np.testing.assert_array_equal(got[name], plain, err_msg=name)
    assert (got["dq"][:, 100:256] == 0).all() and (got["dq"][:, 330:] == 0).all()
    assert (got["dk"][:, 128:256] == 0).all() and (got["dv"][:, 128:256] == 0).all()


def _racy_store(x):
    """A kernel that overwrites a buffer its TMA store may still be reading."""

    def kernel(x_ref, o_ref, buf, ready):
        plgpu.copy_gmem_to_smem(x_ref, buf, ready)
        plgpu.barrier_wait(ready)
        plgpu.copy_smem_to_gmem(buf, o_ref)
        buf[...] = jnp.zeros(buf.shape, buf.dtype)  # no wait_smem_to_gmem first
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_types=[smem(x.shape, x.dtype), plgpu.Barrier()],
        interpret=plgpu.InterpretGPUParams(detect_races=True),
    )(x)


def test_persistent_kernels_race_free_and_equal_to_plain(capfd):
    """The kernels themselves (no forward), the dQ kernel and the dK/dV kernel's host schedule
    walked by 2 programs, under the interpreter's happens-before race detector — which sees
    a buffer reused before a TMA store read it out, a TMA load into a buffer a wgmma or a
    generic load still reads, and a missing proxy fence: no race, and exactly the plain
    kernels' dQ, dK, dV."""
    _racy_store(jnp.ones((64, 64), jnp.bfloat16)).block_until_ready()
    assert "RACE DETECTED" in capfd.readouterr().out, "the race detector is not reporting"

    plan = plan_for_mask(HOLES, "pallas")
    q, k, v, dout, _ = _inputs()
    b, t, hq = q.shape[:3]
    ks = jax.random.split(jax.random.key(9), 2)
    # lse·log2(e) of plausible size (P stays below 1) and +inf rows (P = 0), like the real ones.
    lse2 = (
        jax.random.uniform(ks[0], (b, hq, t), jnp.float32, 6.0, 9.0).at[:, :, 100:128].set(jnp.inf)
    )
    delta = jax.random.normal(ks[1], (b, hq, t), jnp.float32)

    def run(persistent, races):
        cfg = DkvConfig(scale=0.125, persistent=persistent, interpret=True)
        sched = (
            persistent_schedule(WorkList(*plan[3:]), b * k.shape[2], persistent)
            if persistent
            else ()
        )
        ctx = (
            plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True))
            if races
            else contextlib.nullcontext()
        )
        with ctx:
            dq = ffa_dq(
                q, k, v, dout, lse2, delta, *plan[:3], DqConfig(scale=0.125, interpret=True)
            )
            dk, dv = ffa_dkv(q, k, v, dout, lse2, delta, *plan[3:], cfg, sched)
            out = [np.asarray(x, np.float32) for x in (dq, dk, dv)]
        return out, capfd.readouterr().out

    persistent, report = run(2, races=True)
    assert "RACE DETECTED" not in report, report[:2000]
    plain, _ = run(0, races=False)
    for name, x, y in zip(("dq", "dk", "dv"), persistent, plain):
        assert not np.isnan(x).any(), name
        np.testing.assert_array_equal(x, y, err_msg=name)


def test_shared_memory_budget_and_config_errors():
    """The buffers must fit the 227 KiB of an sm90 block: at D = 128 dQ takes 2 stages and
    the persistent dK/dV (with its output buffers) 3; more is refused on the host, naming the
    knob."""
    mask = AttnMask.causal(256)
    plan = plan_for_mask(mask, "pallas")
    q = jax.ShapeDtypeStruct((256, 2, 128), jnp.bfloat16)

    def trace_grad(**tuning):
        loss = lambda a, b, c: (
            ffa_pallas(a, b, c, plan, softmax_scale=0.1, **tuning)[0].astype(jnp.float32).sum()
        )
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q)

    with pytest.raises(
        ValueError,
        match="dQ kernel with dq_num_stages=3, D=128 and bfloat16 "
        r"needs .* lower dq_num_stages(?! or)",
    ):
        trace_grad(dq_num_stages=3)
    with pytest.raises(ValueError, match="dkv_num_stages=4, persistent=4.*turn dkv_persistent off"):
        trace_grad(dkv_persistent=4, dkv_num_stages=4)
    with pytest.raises(ValueError, match="persistent=-1"):
        DkvConfig(scale=0.1, persistent=-1)
    # The dQ kernel runs one program per unit: its config has no persistent mode.
    with pytest.raises(TypeError, match="unexpected keyword argument 'persistent'"):
        DqConfig(scale=0.1, persistent=4)


# The turn-taking dK/dV kernel: its default (D = 128, one program per unit, one block per
# wait) and the paths only a DkvConfig reaches (persistent across units, two blocks a wait).
_TURNS = [dict(), dict(persistent=2, num_stages=3), dict(num_stages=4, steps_per_wait=2)]


@pytest.mark.parametrize(
    "tuning", _TURNS, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()) or "plain"
)
def test_dkv_turns_equal_to_free_issue(tuning):
    """``DkvConfig.turns``: the dK/dV consumers hand an issue token back and forth; the
    products and their order are those of free issue, so dK, dV are bit for bit the same (on
    HOLES: units without steps, GQA, two units a program; also stored in two parts), and the
    kernel lowers for sm90.
    The default takes turns exactly at D = 128 with one program per unit; dQ and the
    D = 256 kernels refuse it."""
    assert [
        default_dkv_turns(d, persistent)
        for d, persistent in [(64, False), (128, False), (128, True), (256, False)]
    ] == [False, True, False, False]
    plan = plan_for_mask(HOLES, "pallas")
    q, k, v, dout, _ = _inputs()
    b, t, hq = q.shape[:3]
    lse2 = jnp.full((b, hq, t), 8.0, jnp.float32).at[:, :, 100:128].set(jnp.inf)
    delta = jax.random.normal(jax.random.key(3), (b, hq, t), jnp.float32)
    sched = (
        persistent_schedule(WorkList(*plan[3:]), b * k.shape[2], tuning["persistent"])
        if "persistent" in tuning
        else ()
    )

    def run(turns, split=0):
        cfg = DkvConfig(scale=0.125, turns=turns, interpret=True, **tuning)
        return ffa_dkv(q, k, v, dout, lse2, delta, *plan[3:], cfg, sched, split=split)

    free = run(False)
    for name, x, y in zip(("dk", "dv"), run(True), free):
        x = np.asarray(x, np.float32)
        assert np.isfinite(x).all() and np.abs(x).max() > 0, name
        np.testing.assert_array_equal(x, np.asarray(y, np.float32), err_msg=name)
    if not tuning:  # context parallelism's split store, in turns
        dk1, dv1, dk2, dv2 = run(True, split=128)
        for name, parts, y in (("dk", (dk1, dk2), free[0]), ("dv", (dv1, dv2), free[1])):
            np.testing.assert_array_equal(
                np.concatenate(parts, axis=1).astype(np.float32),
                np.asarray(y, np.float32),
                err_msg=name,
            )
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v, dout, lse2, delta)]
    cfg = DkvConfig(scale=0.125, turns=True, **tuning)
    jax.jit(lambda *a: ffa_dkv(*a, *plan[3:], cfg, sched)).trace(*shapes).lower(
        lowering_platforms=("cuda",)
    )
    if not tuning:
        # The dQ kernel's consumers issue as they go: its config has no turns.
        with pytest.raises(TypeError, match="unexpected keyword argument 'turns'"):
            DqConfig(scale=0.1, turns=True)


@pytest.mark.parametrize("d", [64, 128])
def test_backward_lowers_for_sm90(d):
    """The backward kernels, dQ and dK/dV one program per unit and dK/dV persistent (host
    schedule; at D = 128 its largest shared-memory plan: 3 stages, 226 KiB), lower to Mosaic
    GPU kernels for CUDA on this host (layout inference and Mosaic GPU's own shared-memory
    check run there, no GPU needed)."""
    mask = HOLES
    plan = plan_for_mask(mask, "pallas")
    q = jax.ShapeDtypeStruct((2, mask.total_q, 4, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, mask.total_k, 2, d), jnp.bfloat16)
    for tuning in [
        {},
        dict(dkv_persistent=132),
        dict(dkv_persistent=5, dkv_num_stages=3),
        dict(dkv_persistent=3, softcap=2.0),
    ]:

        def loss(q_, k_, v_):
            out, lse = ffa_pallas(q_, k_, v_, plan, softmax_scale=0.1, **tuning)
            return out.astype(jnp.float32).sum() + lse.sum()

        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
            lowering_platforms=("cuda",)
        )


# k-tiles 0 and 1 walk three query blocks, k-tile 2 two: with Hq = Hkv every unit's step
# count is its item count, so pairs of steps end on a single step in two of the three.
ODD = AttnMask.from_ranges(
    [[0, 192], [256, 384]], [[0, 192], [200, 384]], ["causal", "full"], 384, 384
)


@pytest.mark.parametrize(
    "tuning",
    [dict(dkv_num_stages=4), dict(dkv_num_stages=5, dkv_persistent=2)],
    ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()),
)
def test_two_steps_per_wait(tuning):
    """``dkv_steps_per_wait=2`` (the D = 64 default with 4 or more ring slots): each dK/dV
    consumer takes two query blocks between waits, odd step counts ending on one. Against the
    reference, bit for bit against one step per wait (the sums keep their order), and lowered
    for sm90."""
    assert list(np.diff(plan_for_mask(ODD, "pallas").k_offsets)) == [3, 3, 2]
    q, k, v, dout, dlse = random_inputs(jax.random.key(5), ODD, 2, 2, 64, jnp.bfloat16, 2)

    def grads(**t):
        f = lambda a, b, c: flex_flash_attention_pallas(a, b, c, ODD, interpret=True, **t)
        _, vjp = jax.vjp(f, q, k, v)
        return dict(zip(("dq", "dk", "dv"), vjp((dout, dlse))))

    paired = grads(dkv_steps_per_wait=2, **tuning)
    assert_matches_reference(paired, q, k, v, ODD, dout, dlse)
    for name, x in grads(dkv_steps_per_wait=1, **tuning).items():
        np.testing.assert_array_equal(
            np.asarray(paired[name], np.float32), np.asarray(x, np.float32), err_msg=name
        )
    plan = plan_for_mask(ODD, "pallas")
    shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    programs = dict(dkv_persistent=132) if "dkv_persistent" in tuning else {}
    loss = lambda a, b, c: (
        ffa_pallas(
            a, b, c, plan, softmax_scale=0.125, dkv_steps_per_wait=2, **{**tuning, **programs}
        )[0]
        .astype(jnp.float32)
        .sum()
    )
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(shape, shape, shape).lower(
        lowering_platforms=("cuda",)
    )


def test_two_steps_per_wait_limits():
    """Two steps per wait need D <= 64 (four score blocks beside the accumulators) and four
    ring slots; anything else is refused naming the knobs."""
    plan = plan_for_mask(ODD, "pallas")

    def trace_grad(d, **tuning):
        x = jax.ShapeDtypeStruct((384, 1, d), jnp.bfloat16)
        loss = lambda a, b, c: (
            ffa_pallas(a, b, c, plan, softmax_scale=0.1, dkv_steps_per_wait=2, **tuning)[0]
            .astype(jnp.float32)
            .sum()
        )
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x)

    with pytest.raises(ValueError, match="dkv_steps_per_wait=2 needs D <= 64 .* got D=128"):
        trace_grad(128, dkv_num_stages=4, dkv_persistent=0)
    with pytest.raises(
        ValueError,
        match="dkv_steps_per_wait=2: at D = 256 the dK/dV kernel takes one query block per wait",
    ):
        trace_grad(256, dkv_num_stages=2, dkv_persistent=0)
    with pytest.raises(ValueError, match="dkv_num_stages >= 4; got D=64, dkv_num_stages=3"):
        trace_grad(64, dkv_num_stages=3)
    with pytest.raises(ValueError, match="steps_per_wait=3: use 1 or 2"):
        DkvConfig(scale=0.1, steps_per_wait=3)
