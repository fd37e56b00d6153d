"""The context-parallel baselines (ring attention, all-gather CP, Ulysses) on 8 CPU host devices
against the float64 dense reference, by the correctness rule of docs/design.md §5 (forward and
gradients).

Compilation dominates on CPU, so each baseline is compiled once for all four masks: the masks'
plans are padded to one shape and passed as arguments, the data is (un)dispatched on the host.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.baselines.allgather import allgather_attention, make_allgather_plan
from benchmarks.baselines.common import LocalFFA, make_layout, pick_backend
from benchmarks.baselines.ring import make_ring_plan, ring_attention
from benchmarks.baselines.ulysses import kv_repeat, make_ulysses_plan, ulysses_attention
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.ffa.xla import xla_ffa
from magi_jax.mask import AttnMask
from magi_jax.planning.work_list import EMPTY_ITEM, FFAPlanArrays, plan_for_mask

CP = 8
LENS = [13, 1, 22, 9, 19]  # 64 tokens, documents cut across ranks
CU = np.cumsum([0] + LENS)
T = int(CU[-1])
MASKS = {
    "causal": AttnMask.causal(T),
    "doc_causal": AttnMask.varlen(CU, causal=True),
    "shared_question": AttnMask.shared_question(LENS),
    "block_causal": AttnMask.block_causal(LENS, 6),
}
BASELINES = {
    "ring": (make_ring_plan, ring_attention),
    "allgather": (make_allgather_plan, allgather_attention),
    "ulysses": (make_ulysses_plan, ulysses_attention),
}
FFA = LocalFFA("xla", 8, 8)
# CPU compile time: the programs are small, optimising them is not worth it.
_FAST_COMPILE = dict(xla_llvm_disable_expensive_passes=True)


@functools.lru_cache(maxsize=None)
def _mesh(cp=CP):
    return jax.make_mesh(
        (cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,)
    )


def _pad_plan(plan: FFAPlanArrays, sizes) -> FFAPlanArrays:
    """Pads stacked plan arrays (any leading axes) to ``sizes = (Wq, Wk)`` items."""

    def pad(items, w):
        items = np.asarray(items)
        extra = np.zeros(items.shape[:-2] + (w - items.shape[-2], items.shape[-1]), np.int32)
        extra[..., :] = EMPTY_ITEM
        return np.concatenate([items, extra], axis=-2)

    return plan._replace(q_items=pad(plan.q_items, sizes[0]), k_items=pad(plan.k_items, sizes[1]))


def _plan_sizes(p: FFAPlanArrays):
    return (p.q_items.shape[-2], p.k_items.shape[-2])


def _arrays_of(plan):
    return plan.arrays


def _with_arrays(plan, arrays):
    leaves, tree = jax.tree.flatten(plan)
    return jax.tree.unflatten(tree, jax.tree.leaves(arrays))


@functools.lru_cache(maxsize=None)
def _plans(baseline: str):
    """Every mask's (layout, plan) for ``baseline``, the plans padded to one shape."""
    make, _ = BASELINES[baseline]
    built = {
        n: (lay := make_layout(m, _mesh())) and (lay, make(lay, FFA)) for n, m in MASKS.items()
    }
    sizes = np.max([_plan_sizes(_arrays_of(p)) for _, p in built.values()], axis=0)
    out = {}
    for name, (lay, plan) in built.items():
        arrays = _arrays_of(plan)
        padded = _pad_plan(jax.tree.map(np.asarray, arrays), tuple(int(s) for s in sizes))
        shard = jax.tree.leaves(arrays)[0].sharding
        padded = FFAPlanArrays(*(jax.device_put(a, shard) for a in padded))
        out[name] = (lay, _with_arrays(plan, padded))
    return out


@functools.lru_cache(maxsize=None)
def _runner(baseline: str):
    """Jitted forward + VJP of ``baseline`` on dispatched arrays (plan as an argument)."""
    _, attn = BASELINES[baseline]

    @jax.jit
    def run(q, k, v, dout, dlse, plan):
        (out, lse), vjp = jax.vjp(lambda q_, k_, v_: attn(q_, k_, v_, plan), q, k, v)
        dq, dk, dv = vjp((dout, dlse))
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    cache = {}

    def call(*args):
        key = jax.tree.map(lambda a: (a.shape, a.dtype), args[:5])
        key = str(key)
        if key not in cache:
            cache[key] = run.lower(*args).compile(compiler_options=_FAST_COMPILE)
        return cache[key](*args)

    return call


def _dispatch(x, lay):
    x = np.asarray(x)
    pad = lay.padded_total - lay.meta.total
    x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
    return jax.device_put(x[lay.order], lay.spec())


def _undispatch(x, lay):
    return np.asarray(jnp.asarray(x, jnp.float32))[lay.inverse]


def _check(baseline, name, dtype=jnp.float32, hq=8, hkv=2, d=16, seed=0):
    lay, plan = _plans(baseline)[name]
    mask = MASKS[name]
    q, k, v, dout, dlse = random_inputs(jax.random.key(seed), mask, hq, hkv, d, dtype)
    args = [_dispatch(x, lay) for x in (q, k, v, dout, dlse)]
    res = _runner(baseline)(*args, plan)
    assert res["out"].dtype == dtype and res["lse"].dtype == jnp.float32
    assert res["dk"].dtype == dtype
    res = {n: _undispatch(x, lay) for n, x in res.items()}
    return assert_matches_reference(res, q, k, v, mask, dout, dlse)


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("baseline", list(BASELINES))
def test_baseline_matches_reference_cp8(baseline, name):
    _check(baseline, name)


def test_ring_bf16_gqa():
    """bf16: the travelling dK/dV is summed in float32 over the 8 steps."""
    _check("ring", "doc_causal", dtype=jnp.bfloat16, seed=1)


def test_allgather_bf16_gqa():
    _check("allgather", "shared_question", dtype=jnp.bfloat16, seed=2)


def test_plans_cover_the_mask_once():
    """Host plans: the ring's per-step areas, all-gather's and Ulysses' areas add up to the
    mask area, and the zigzag layout puts blocks r and 2cp-1-r on rank r."""
    for name, mask in MASKS.items():
        lay = make_layout(mask, _mesh())
        ring = make_ring_plan(lay, FFA)
        assert ring.step_area.sum() == mask.area, name
        np.testing.assert_array_equal(ring.step_area.sum(axis=0), lay.rank_area())
        assert make_allgather_plan(lay, FFA).static.rank_area.sum() == mask.area
        assert make_ulysses_plan(lay, FFA).static.area == mask.area
        blocks = lay.meta.rank_chunks // (lay.meta.num_chunks // (2 * CP))
        for r in range(CP):
            assert set(blocks[r].tolist()) == {r, 2 * CP - 1 - r}


def test_local_ffa_backward_matches_autodiff():
    """The FFA backward from given (out, lse) that ring attention uses agrees with the VJP of
    the public per-rank entry point (guards the private backend functions it calls)."""
    mask = MASKS["shared_question"]
    q, k, v, dout, dlse = random_inputs(jax.random.key(3), mask, 4, 2, 16, jnp.float32)
    plan = jax.tree.map(jnp.asarray, plan_for_mask(mask, "xla", 8, 8))
    fwd = lambda q_, k_, v_: xla_ffa(
        q_, k_, v_, plan, softmax_scale=0.3, softcap=0.0, block_q=8, block_k=8
    )

    @jax.jit
    def both(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(fwd, q, k, v)
        return vjp((dout, dlse)), FFA.backward(
            q, k, v, out, lse, dout, dlse, plan, scale=0.3, softcap=0.0
        )

    want, got = both(q, k, v, dout, dlse)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_ulysses_head_checks():
    assert kv_repeat(16, 16, 2) == 1
    assert kv_repeat(64, 8, 2) == 1
    assert kv_repeat(8, 2, 8) == 4
    with pytest.raises(ValueError, match="query heads"):
        kv_repeat(12, 4, 8)


def test_pick_backend_on_cpu():
    assert pick_backend("auto", jnp.bfloat16, 128)[0] == "xla"  # no sm90 here
    assert pick_backend("pallas", jnp.bfloat16, 128)[0] == "pallas"
    with pytest.raises(ValueError, match="backend"):
        pick_backend("cuda", jnp.bfloat16, 128)


@pytest.mark.slow
def test_local_ffa_pallas_backward_matches_autodiff():
    """The same for the pallas kernels (Mosaic GPU interpret mode): the backward that ring
    attention runs on the GPU, from stacked (padded) plan arrays."""
    mask = AttnMask.varlen([0, 70, 150, 200], causal=True)
    ffa = LocalFFA("pallas", interpret=True)
    plans = ffa.stack(
        [ffa.plan(mask.shapes, 200, 200), ffa.plan(AttnMask.causal(200).shapes, 200, 200)]
    )
    plan = jax.tree.map(lambda a: jnp.asarray(a[0]), plans)
    q, k, v, dout, dlse = random_inputs(jax.random.key(4), mask, 2, 1, 64, jnp.bfloat16)

    @jax.jit
    def both(q, k, v, dout, dlse):
        fwd = lambda q_, k_, v_: ffa.forward(q_, k_, v_, plan, scale=0.2, softcap=0.0)
        (out, lse), vjp = jax.vjp(fwd, q, k, v)
        return (
            (out, lse),
            vjp((dout, dlse)),
            ffa.backward(q, k, v, out, lse, dout, dlse, plan, scale=0.2, softcap=0.0),
        )

    (out, lse), want, got = both(q, k, v, dout, dlse)
    assert_matches_reference(dict(out=out, lse=lse), q, k, v, mask, softmax_scale=0.2)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def _dense_of(shapes, tq, tk):
    """Cells of canonical shapes as a dense count matrix (counts > 1 would be overlaps)."""
    out = np.zeros((tq, tk), np.int64)
    for s in np.nonzero(shapes.nonempty)[0]:
        for q in range(int(shapes.q0[s]), int(shapes.q1[s])):
            out[q, int(shapes.lo(np.int64(q), s)) : int(shapes.hi(np.int64(q), s)) + 1] += 1
    return out


@pytest.mark.parametrize("name", ["doc_causal", "block_causal"])
def test_sub_shapes_are_the_dense_sub_masks(name):
    """Each ring step's local shapes are exactly the global mask restricted to the rank's
    query positions and the travelling block's key positions (padding sees nothing)."""
    from benchmarks.baselines.common import sub_shapes

    mask = MASKS[name]
    cp = 4
    lay = make_layout(mask, _mesh(cp))
    dense = np.zeros((lay.padded_total,) * 2, np.int64)
    dense[:T, :T] = mask.to_dense()
    pos = lay.meta.positions
    c = lay.meta.chunk_size
    offsets = np.arange(lay.meta.chunks_per_rank) * c
    for r in range(cp):
        for s in range(cp):
            src = (r - s) % cp
            got = _dense_of(
                sub_shapes(lay, [r], lay.meta.rank_chunks[src], offsets),
                lay.local_len,
                lay.local_len,
            )
            np.testing.assert_array_equal(
                got, dense[np.ix_(pos[r], pos[src])], err_msg=f"rank {r} step {s}"
            )
