"""Context parallelism on GPUs (marked ``gpu``; skipped elsewhere): the pallas FFA per rank,
at a size where the kernels' tiles are full, against the float64 reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.ffa.api import flex_flash_attention
from magi_jax.ffa.backends import get_backend
from magi_jax.ffa.testing import assert_matches_reference, fwd_bwd, random_inputs, reference_results
from magi_jax.mask import AttnMask
from magi_jax.sharding import dispatch, magi_attention, make_flex_key, undispatch


def _gpus():
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def test_pallas_plans_build_on_the_host():
    """Planning with the pallas backend is host work and runs anywhere."""
    mesh = jax.make_mesh(
        (2,), ("cp",), devices=jax.devices("cpu")[:2], axis_types=(jax.sharding.AxisType.Auto,)
    )
    mask = AttnMask.varlen([0, 700, 1100, 2048], causal=True)
    key = make_flex_key(mask, mesh, "cp", overlap_degree=1, ffa_backend="pallas")
    assert key.ffa_backend == "pallas" and len(key.stages) == 2
    for (ffa, _), st in zip(key.stage_arrays, key.plan.stages):
        assert type(ffa).__name__ == "FFAPlanRuns"  # expanded on the device
        assert all(a.shape[0] == 2 and a.dtype == np.int32 for a in ffa)
    assert get_backend("pallas").name == "pallas"


@pytest.mark.slow
def test_pallas_split_vjp_matches_ffa_pallas_in_interpret_mode():
    """The pallas split VJP (backward re-fetch without re-running the forward) is bit-exact
    with ffa_pallas's own VJP (single device, Mosaic GPU interpret mode; ~15 s on CPU)."""
    from magi_jax.pallas import ffa_pallas, plan_for_mask

    mask = AttnMask.varlen([0, 50, 128], causal=True)
    be = get_backend("pallas", interpret=True)
    plan = plan_for_mask(mask, "pallas")
    q, k, v, dout, dlse = random_inputs(jax.random.key(0), mask, 1, 1, 64, jnp.bfloat16)
    kw = dict(softmax_scale=0.125, softcap=0.0, block_q=0, block_k=0)
    (out, lse), saved = be.split_fwd(q, k, v, plan, **kw)
    grads = be.split_bwd(saved, q, k, v, plan, (dout, dlse), **kw)
    (out2, lse2), vjp = jax.vjp(
        lambda a, b, c: ffa_pallas(a, b, c, plan, softmax_scale=0.125, interpret=True), q, k, v
    )
    for a, b in zip((out, lse, *grads), (out2, lse2, *vjp((dout, dlse)))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("d,d_v", [(64, 64), (128, 64)])
def test_pallas_stage_backwards_from_the_merged_result_in_interpret_mode(d, d_v):
    """CP's backward runs each stage's pallas backward against the merged (out, lse)
    (``split_bwd`` over :func:`~magi_jax.pallas.ffa_pallas_backward`): the two stages'
    gradients must sum to the VJP of one pallas call over all keys (Mosaic GPU interpret
    mode, single device); also with v's own head dim (MLA), as CP with a pallas key runs it."""
    from magi_jax.pallas import ffa_pallas, plan_for_mask
    from magi_jax.sharding.attention import merge_partials

    mask = AttnMask.from_ranges(
        [[0, 128], [0, 128]], [[0, 128], [128, 256]], ["full", "causal"], 128, 256
    )
    be = get_backend("pallas", interpret=True)
    kw = dict(softmax_scale=d**-0.5, softcap=0.0, block_q=0, block_k=0)
    q, k, v, dout, dlse = random_inputs(jax.random.key(2), mask, 2, 1, d, jnp.bfloat16, dv=d_v)
    parts = [
        AttnMask.from_ranges([[0, 128]], [[0, 128]], ["full"], 128, 128),
        AttnMask.from_ranges([[0, 128]], [[0, 128]], ["causal"], 128, 128),
    ]
    halves = [(k[:128], v[:128]), (k[128:], v[128:])]
    plans = [plan_for_mask(m, "pallas") for m in parts]
    outs = [be.split_fwd(q, kk, vv, p, **kw)[0] for (kk, vv), p in zip(halves, plans)]
    out, lse = merge_partials([o for o, _ in outs], [l for _, l in outs], q.dtype)
    grads = [
        be.split_bwd((out, lse), q, kk, vv, p, (dout, dlse), **kw)
        for (kk, vv), p in zip(halves, plans)
    ]
    dq = grads[0][0].astype(jnp.float32) + grads[1][0].astype(jnp.float32)
    dk = jnp.concatenate([grads[0][1], grads[1][1]])
    dv = jnp.concatenate([grads[0][2], grads[1][2]])
    plan = plan_for_mask(mask, "pallas")
    (out1, lse1), vjp = jax.vjp(
        lambda a, b, c: ffa_pallas(a, b, c, plan, softmax_scale=d**-0.5, interpret=True), q, k, v
    )
    want = (out1, lse1, *vjp((dout, dlse)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=2e-2 * max(1.0, np.abs(b).max()), err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("degree", [0, 2])
def test_pallas_cp_matches_reference(degree):
    gpus = _gpus()
    if not gpus or not getattr(gpus[0], "compute_capability", "").startswith("9"):
        pytest.skip("needs Hopper GPUs")
    cp = len(gpus)
    mesh = jax.make_mesh((cp,), ("cp",), devices=gpus, axis_types=(jax.sharding.AxisType.Auto,))
    lens = [3000, 700, 5000, 1200, 6483]
    mask = AttnMask.varlen(np.cumsum([0] + lens), causal=True)
    key = make_flex_key(mask, mesh, "cp", overlap_degree=degree, ffa_backend="pallas")
    q, k, v, dout, dlse = random_inputs(jax.random.key(0), mask, 4, 2, 128, jnp.bfloat16)

    def fwd(q_, k_, v_):
        o, l = magi_attention(dispatch(q_, key), dispatch(k_, key), dispatch(v_, key), key)
        return undispatch(o, key), undispatch(l, key)

    @jax.jit
    def run(q_, k_, v_, do, dl):
        (out, lse), vjp = jax.vjp(fwd, q_, k_, v_)
        return dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *vjp((do, dl)))))

    assert_matches_reference(run(q, k, v, dout, dlse), q, k, v, mask, dout, dlse)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["doc_causal", "causal"])
def test_pallas_cp_at_64k_matches_single_gpu_ffa(name):
    """At 64k+ tokens the dense reference does not fit; CP must agree with single-GPU FFA on
    the same inputs to bf16 rounding (both are exact algorithms; they differ in summation
    order and in the float32 merge of partial results)."""
    import magi_jax as mj

    gpus = _gpus()
    if len(gpus) < 2 or not getattr(gpus[0], "compute_capability", "").startswith("9"):
        pytest.skip("needs two or more Hopper GPUs")
    mesh = jax.make_mesh(
        (len(gpus),), ("cp",), devices=gpus, axis_types=(jax.sharding.AxisType.Auto,)
    )
    total = 65536 + 1000
    from magi_jax.mask_zoo import DOC_LENGTHS

    docs = [d * 2 for d in DOC_LENGTHS]
    docs[-1] += total - sum(docs)
    mask = (
        AttnMask.varlen(np.cumsum([0] + docs), causal=True)
        if name == "doc_causal"
        else AttnMask.causal(total)
    )
    key = make_flex_key(mask, mesh, "cp", ffa_backend="pallas")
    q, k, v, dout, dlse = random_inputs(jax.random.key(1), mask, 8, 8, 128, jnp.bfloat16)

    def cp_fwd(q_, k_, v_):
        o, l = magi_attention(dispatch(q_, key), dispatch(k_, key), dispatch(v_, key), key)
        return undispatch(o, key), undispatch(l, key)

    def one_fwd(q_, k_, v_):
        return mj.flex_flash_attention(q_, k_, v_, mask, backend="pallas")

    def run(fwd):
        @jax.jit
        def f(q_, k_, v_, do, dl):
            (out, lse), vjp = jax.vjp(fwd, q_, k_, v_)
            return (out, lse, *vjp((do, dl)))

        return [np.asarray(jnp.asarray(x, jnp.float32)) for x in f(q, k, v, dout, dlse)]

    got, want = run(cp_fwd), run(one_fwd)
    for name_, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        scale = max(1.0, float(np.abs(b).max()))
        assert np.abs(a - b).max() <= 2e-2 * scale, name_


def _gpu_mesh():
    gpus = _gpus()
    if not gpus or not getattr(gpus[0], "compute_capability", "").startswith("9"):
        pytest.skip("needs Hopper GPUs")
    return jax.make_mesh(
        (len(gpus),), ("cp",), devices=gpus, axis_types=(jax.sharding.AxisType.Auto,)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["replicated", "dispatched"])
def test_pallas_cross_attention_matches_reference(layout):
    """Video-to-text style cross attention (Tq != Tk) on the pallas kernels, both key
    layouts: query document i attends to key document i."""
    mesh = _gpu_mesh()
    qc, kc = np.cumsum([0, 3000, 2000, 1192]), np.cumsum([0, 300, 517, 224])
    mask = AttnMask.from_ranges(
        np.stack([qc[:-1], qc[1:]], 1),
        np.stack([kc[:-1], kc[1:]], 1),
        ["full", "causal", "full"],
        total_q=int(qc[-1]),
        total_k=int(kc[-1]),
    )
    key = make_flex_key(mask, mesh, "cp", kv_layout=layout, ffa_backend="pallas")
    assert key.kv_layout == layout and key.ffa_backend == "pallas"
    q, k, v, dout, dlse = random_inputs(jax.random.key(3), mask, 4, 2, 128, jnp.bfloat16)

    def fwd(q_, k_, v_):
        o, l = magi_attention(
            dispatch(q_, key), dispatch(k_, key, role="kv"), dispatch(v_, key, role="kv"), key
        )
        return undispatch(o, key), undispatch(l, key)

    assert_matches_reference(fwd_bwd(fwd)(q, k, v, dout, dlse), q, k, v, mask, dout, dlse)


@pytest.mark.gpu
def test_pallas_sinks_and_max_logits_match_reference():
    """Attention sinks (with their gradient) and QK-clip max logits on the pallas kernels,
    on one device and under context parallelism, against the float64 reference with the
    sinks in its denominator."""
    mesh = _gpu_mesh()
    mask = AttnMask.varlen(np.cumsum([0, 2500, 131, 3000, 2561]), causal=True)
    key = make_flex_key(mask, mesh, "cp", overlap_degree=1, ffa_backend="pallas")
    q, k, v, dout, dlse = random_inputs(jax.random.key(4), mask, 4, 2, 128, jnp.bfloat16)
    sink = jax.random.normal(jax.random.key(5), (2, 4), jnp.float32)

    def one_device(q_, k_, v_, s_):
        return flex_flash_attention(
            q_, k_, v_, mask, sink=s_, backend="pallas", return_max_logits=True
        )

    def context_parallel(q_, k_, v_, s_):
        o, l, ml = magi_attention(
            dispatch(q_, key),
            dispatch(k_, key),
            dispatch(v_, key),
            key,
            sink=s_,
            return_max_logits=True,
        )
        return undispatch(o, key), undispatch(l, key), ml

    @functools.partial(jax.jit, static_argnums=0)
    def run(attn, q_, k_, v_, s_, do, dl):
        fn = lambda *a: attn(*a)[:2]
        (out, lse), vjp = jax.vjp(fn, q_, k_, v_, s_)
        dq, dk, dv, ds = vjp((do, dl))
        return dict(
            out=out, lse=lse, dq=dq, dk=dk, dv=dv, dsink=ds, max_logits=attn(q_, k_, v_, s_)[2]
        )

    ref64 = reference_results(q, k, v, mask, dout, dlse, sink=sink, float64=True)
    ref_lp = reference_results(q, k, v, mask, dout, dlse, sink=sink, float64=False)
    for attn in (one_device, context_parallel):
        assert_matches_reference(
            run(attn, q, k, v, sink, dout, dlse),
            q,
            k,
            v,
            mask,
            dout,
            dlse,
            sink=sink,
            ref64=ref64,
            ref_lp=ref_lp,
        )
