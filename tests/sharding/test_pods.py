"""Pods: attention over (batch, sequence, heads) meshes, a packing per row, one compilation.

Every test runs on the 8 CPU host devices: data-parallel (``dp``) or fully-sharded (``fsdp``)
batch axes beside the context-parallel one, and a tensor-parallel head axis. Each row is
checked against the float64 reference (forward and gradients), the compiled program is read
for collectives over the batch and head axes, and XLA's cost analysis gives the FLOPs per
device.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import magi_jax as mj
from magi_jax.ffa.testing import (
    assert_matches_reference,
    assert_rows_match_reference,
    random_inputs,
)

T, HQ, HKV, D = 128, 4, 2, 16

# name -> (mesh shape, axis names, batch axes, head axes, cp axis size)
MESHES = {
    "dp2_cp4": ((2, 4), ("dp", "cp"), ("dp",), ()),
    "dp2_cp2_tp2": ((2, 2, 2), ("dp", "cp", "tp"), ("dp",), ("tp",)),
    "fsdp2_cp4": ((2, 4), ("fsdp", "cp"), ("fsdp",), ()),
}


def make_mesh(name):
    shape, names, batch_axes, head_axes = MESHES[name]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    return mesh, batch_axes, head_axes


def packings(rng, n, total=T, docs=4):
    """``n`` packed document-causal masks with random document lengths."""
    out = []
    for _ in range(n):
        cuts = np.sort(rng.choice(np.arange(4, total - 3), docs - 1, replace=False))
        out.append(mj.AttnMask.varlen([0, *cuts.tolist(), total]))
    return out


def fwd_bwd_step():
    """One jitted step: dispatch natural-order ``[B, T, H, D]`` inputs with a batched key,
    attend, undispatch; returns out, lse and the VJP's dq, dk, dv (all natural order)."""

    def fwd(q, k, v, key):
        d = lambda x: mj.dispatch(x, key, seq_axis=1)
        out, lse = mj.magi_attention(d(q), d(k), d(v), key)
        return mj.undispatch(out, key, seq_axis=1), mj.undispatch(lse, key, seq_axis=1)

    @jax.jit
    def step(q, k, v, dout, dlse, key):
        (out, lse), vjp = jax.vjp(lambda q_, k_, v_: fwd(q_, k_, v_, key), q, k, v)
        dq, dk, dv = vjp((dout, dlse))
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    return step


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_batched_keys_every_row_its_packing_one_compilation(mesh_name):
    """10 steps, a new packing for every row of every step, one compilation; every row of
    every step against the float64 reference, forward and gradients."""
    mesh, batch_axes, head_axes = make_mesh(mesh_name)
    rng = np.random.default_rng(7)
    batch, steps = 4, 10
    masks = [packings(rng, batch) for _ in range(steps)]
    cp = mesh.shape["cp"]
    cap = mj.PlanCapacity.from_masks([m for row in masks for m in row], mesh_size=cp)
    step = fwd_bwd_step()
    for s in range(steps):
        key = mj.make_batch_key(
            masks[s],
            mesh,
            "cp",
            batch_axes=batch_axes,
            head_axes=head_axes,
            capacity=cap,
            ffa_backend="xla",
        )
        assert key.chunk_order.sharding.spec == P(batch_axes[0])
        mask0 = masks[s][0]
        q, k, v, dout, dlse = random_inputs(jax.random.key(s), mask0, HQ, HKV, D, "float32", batch)
        assert_rows_match_reference(step(q, k, v, dout, dlse, key), q, k, v, masks[s], dout, dlse)
    assert step._cache_size() == 1


def _collective_axes(text: str, mesh) -> set[str]:
    """The mesh axes that the compiled program's collectives span: named replica groups
    (``replica_groups=mesh[...] {'cp'}``) and, for collective-permutes, the axes along which
    a source and its target differ."""
    coords = {int(d.id): pos for pos, d in np.ndenumerate(mesh.devices)}
    axes = set()
    for line in text.splitlines():
        if not re.search(r"= \S+ (all-gather|all-reduce|all-to-all|reduce-scatter)", line) and (
            "collective-permute(" not in line
        ):
            continue
        named = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line)
        if named:
            axes |= set(re.findall(r"'(\w+)'", named.group(1)))
            continue
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
        if pairs:
            for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}"):
                ca, cb = coords[int(a)], coords[int(b)]
                axes |= {n for n, x, y in zip(mesh.axis_names, ca, cb) if x != y}
            continue
        groups = re.search(r"replica_groups=\{(.*?)\}\}", line)
        if groups:
            for group in re.findall(r"\{([\d,]+)", groups.group(1) + "}"):
                ids = [coords[int(i)] for i in group.split(",")]
                axes |= {n for j, n in enumerate(mesh.axis_names) if len({c[j] for c in ids}) > 1}
            continue
        axes.add("<unparsed>")
    return axes


def _compiled_grad(mesh, key, batch):
    """fwd+bwd of magi_attention on dispatched inputs sharded like the key wants them."""
    spec = P(*((mj.sharding.key.axes_entry(key.batch_axes),) if batch else ()), "cp")
    spec = P(*spec, mj.sharding.key.axes_entry(key.head_axes))
    lead = (batch,) if batch else ()
    sharded = lambda h: jax.ShapeDtypeStruct(
        lead + (key.padded_total, h, D), jnp.float32, sharding=NamedSharding(mesh, spec)
    )

    def loss(q, k, v, key):
        out, lse = mj.magi_attention(q, k, v, key)
        return (out.astype(jnp.float32) ** 2).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return grad.lower(sharded(HQ), sharded(HKV), sharded(HKV), key).compile()


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_no_collective_over_batch_or_heads_and_flops_of_own_rows(mesh_name):
    """The compiled fwd+bwd moves data over the cp axis only, and each device's FLOPs are
    those of one replica's rows: within 5 % of the same work on a mesh of one replica."""
    mesh, batch_axes, head_axes = make_mesh(mesh_name)
    rng = np.random.default_rng(3)
    masks = packings(rng, 2)
    cp = mesh.shape["cp"]
    cap = mj.PlanCapacity.from_masks(masks + packings(rng, 8), mesh_size=cp)
    opts = dict(capacity=cap, ffa_backend="xla", head_axes=head_axes)
    key = mj.make_batch_key(masks, mesh, "cp", batch_axes=batch_axes, **opts)
    compiled = _compiled_grad(mesh, key, 2)
    assert _collective_axes(compiled.as_text(), mesh) == {"cp"}
    # One replica alone: its row on a mesh without the batch axis (same cp, same heads).
    shape, names = MESHES[mesh_name][:2]
    keep = [i for i, n in enumerate(names) if n not in batch_axes]
    one = jax.make_mesh(
        tuple(shape[i] for i in keep),
        tuple(names[i] for i in keep),
        devices=mesh.devices[0].reshape(-1),
        axis_types=(AxisType.Auto,) * len(keep),
    )
    alone = mj.make_flex_key(masks[0], one, "cp", **opts)
    per_device, single = _flops(compiled), _flops(_compiled_grad(one, alone, 1))
    assert abs(per_device / single - 1) <= 0.05, (per_device, single)


def test_one_mask_key_with_batch_axes_attends_own_rows_only():
    """A key of one mask shared by every row, with batch_axes: the batch stays sharded over
    dp (no replication, FLOPs of the own rows) and the rows match the reference."""
    mesh, batch_axes, _ = make_mesh("dp2_cp4")
    mask = mj.AttnMask.varlen([0, 40, 90, T])
    key = mj.make_flex_key(mask, mesh, "cp", batch_axes=batch_axes, ffa_backend="xla")
    shared = mj.make_flex_key(mask, mesh, "cp", ffa_backend="xla")
    compiled = _compiled_grad(mesh, key, 2)
    assert _collective_axes(compiled.as_text(), mesh) == {"cp"}
    sharded, replicated = _flops(compiled), _flops(_compiled_grad(mesh, shared, 2))
    assert sharded < 0.6 * replicated, (sharded, replicated)
    q, k, v, dout, dlse = random_inputs(jax.random.key(1), mask, HQ, HKV, D, "float32", 2)
    res = fwd_bwd_step()(q, k, v, dout, dlse, key)
    assert res["out"].sharding.spec[0] == "dp"
    assert_rows_match_reference(res, q, k, v, mask, dout, dlse)


def test_plan_mismatch_in_a_cp_group_gives_nan_rows():
    """Ranks of one CP group holding different plans (as when the processes of a group
    planned different masks) give NaN rows, never finite wrong ones; the other row is
    untouched."""
    mesh, batch_axes, _ = make_mesh("dp2_cp4")
    rng = np.random.default_rng(11)
    masks = packings(rng, 2)
    cap = mj.PlanCapacity.from_masks(masks + packings(rng, 8), mesh_size=4)
    key = mj.make_batch_key(masks, mesh, "cp", batch_axes=batch_axes, capacity=cap)
    ids = np.asarray(key.plan_id).copy()
    ids[1, 2] += 1  # row 1, cp rank 2 planned something else
    bad = jax.tree.unflatten(
        jax.tree.structure(key),
        jax.tree.leaves(key)[:-1] + [jax.device_put(ids, key.plan_id.sharding)],
    )
    q, k, v, dout, dlse = random_inputs(jax.random.key(2), masks[0], HQ, HKV, D, "float32", 2)
    res = fwd_bwd_step()(q, k, v, dout, dlse, bad)
    assert np.isnan(np.asarray(res["out"][1])).all()
    assert np.isfinite(np.asarray(res["out"][0])).all()
    assert_matches_reference(
        {n: x[0] for n, x in res.items()}, q[0], k[0], v[0], masks[0], dout[0], dlse[0]
    )


def test_batch_rows_and_errors():
    mesh, batch_axes, _ = make_mesh("dp2_cp4")
    assert mj.batch_rows(mesh, batch_axes, 4).tolist() == [0, 1, 2, 3]  # one process
    with pytest.raises(ValueError, match="cannot be split evenly"):
        mj.batch_rows(mesh, batch_axes, 3)
    masks = packings(np.random.default_rng(0), 2)
    cap = mj.PlanCapacity.from_masks(masks, mesh_size=4)
    with pytest.raises(ValueError, match="needs a PlanCapacity"):
        mj.make_batch_key(masks, mesh, "cp", batch_axes=batch_axes, capacity=None)
    with pytest.raises(ValueError, match="shares"):
        mj.make_batch_key(masks, mesh, "cp", batch_axes=("cp",), capacity=cap)
    with pytest.raises(ValueError, match="distinct axes of the mesh"):
        mj.make_flex_key(masks[0], mesh, "cp", batch_axes=("data",))
    key = mj.make_batch_key(lambda r: masks[r], mesh, "cp", batch_axes="dp", capacity=cap, batch=2)
    q = jnp.zeros((key.padded_total, HQ, D))
    with pytest.raises(ValueError, match="the key is batched"):
        mj.magi_attention(q, q, q, key)
    with pytest.raises(ValueError, match=r"seq_axis=1"):
        mj.dispatch(jnp.zeros((T, 3)), key)
    assert mj.position_ids(key).shape == (2, key.padded_total)


def test_roll_and_positions_of_a_batched_key():
    """roll of dispatched rows equals jnp.roll in natural order, row by row (label shifts),
    under jit with the key as an argument; positions are each row's own."""
    mesh, batch_axes, _ = make_mesh("dp2_cp4")
    rng = np.random.default_rng(5)
    masks = packings(rng, 2)
    cap = mj.PlanCapacity.from_masks(masks + packings(rng, 8), mesh_size=4)
    key = mj.make_batch_key(masks, mesh, "cp", batch_axes=batch_axes, capacity=cap)
    x = jnp.asarray(rng.standard_normal((2, T, 3)), jnp.float32)

    @jax.jit
    def rolled(x, key):
        d = mj.roll(mj.dispatch(x, key, seq_axis=1), -1, key, seq_axis=1)
        return mj.undispatch(d, key, seq_axis=1), mj.position_ids(key)

    y, pos = rolled(x, key)
    np.testing.assert_array_equal(np.asarray(y), np.roll(np.asarray(x), -1, axis=1))
    for b in range(2):
        order = np.asarray(key.order)[b]
        np.testing.assert_array_equal(np.asarray(pos)[b], order)
        assert sorted(order[order < T].tolist()) == list(range(T))
    with pytest.raises(ValueError, match="batched key"):
        mj.roll(mj.dispatch(x, key, seq_axis=1), key.chunk_size, key, seq_axis=1)


def test_flax_layers_on_fsdp_cp_tp_mesh():
    """magi_jax.nn.SelfAttention and make_attention_fn (flax.nnx.MultiHeadAttention) under a
    (fsdp 2, cp 2, tp 2) mesh with parameters sharded over fsdp and tp, a batched key: every
    row equals the same layer on one device over that row's mask, outputs and gradients."""
    from flax import nnx

    from magi_jax.nn import SelfAttention, make_attention_fn

    mesh = jax.make_mesh((2, 2, 2), ("fsdp", "cp", "tp"), axis_types=(AxisType.Auto,) * 3)
    rng = np.random.default_rng(9)
    masks = packings(rng, 2)
    cap = mj.PlanCapacity.from_masks(masks + packings(rng, 8), mesh_size=2)
    key = mj.make_batch_key(
        masks, mesh, "cp", batch_axes="fsdp", head_axes="tp", capacity=cap, ffa_backend="xla"
    )
    x = jnp.asarray(rng.standard_normal((2, T, 32)), jnp.float32)
    layers = dict(
        self_attention=SelfAttention(32, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0)),
        nnx_mha=nnx.MultiHeadAttention(
            num_heads=4,
            in_features=32,
            decode=False,
            attention_fn=make_attention_fn(key),
            rngs=nnx.Rngs(1),
        ),
    )

    def fsdp_tp(path, leaf):
        """Kernels [in, out]: rows over fsdp; heads (the features of q/k/v, the input of
        the output projection) over tp."""
        names = {str(getattr(p, "key", "")) for p in path}
        if leaf.ndim < 2:
            return NamedSharding(mesh, P())
        if names & {"o_proj", "out"}:
            return NamedSharding(mesh, P(*(("tp",) + (None,) * (leaf.ndim - 2) + ("fsdp",))))
        return NamedSharding(mesh, P(*(("fsdp",) + (None,) * (leaf.ndim - 2) + ("tp",))))

    for name, layer in layers.items():
        graphdef, params = nnx.split(layer, nnx.Param)
        sharded = jax.device_put(params, jax.tree_util.tree_map_with_path(fsdp_tp, params))

        def cp_loss(p, x, key):
            model = nnx.merge(graphdef, p)
            xd = mj.dispatch(x, key, seq_axis=1)
            y = model(xd, key) if name == "self_attention" else model(xd)
            y = mj.undispatch(y, key, seq_axis=1)
            return (y**2).sum(), y

        (_, y), g = jax.jit(jax.value_and_grad(cp_loss, has_aux=True))(sharded, x, key)
        g_ref = None
        for b in range(2):
            if name == "self_attention":
                run = lambda p, xb, b=b: nnx.merge(graphdef, p)(xb, masks[b])
            else:
                model = nnx.MultiHeadAttention(
                    num_heads=4,
                    in_features=32,
                    decode=False,
                    attention_fn=make_attention_fn(masks[b], backend="xla"),
                    rngs=nnx.Rngs(1),
                )
                gd = nnx.split(model, nnx.Param)[0]
                run = lambda p, xb, gd=gd: nnx.merge(gd, p)(xb)
            yb = run(params, x[b])
            np.testing.assert_allclose(np.asarray(y[b]), np.asarray(yb), rtol=2e-5, atol=2e-5)
            gb = jax.grad(lambda p: (run(p, x[b]) ** 2).sum())(params)
            g_ref = gb if g_ref is None else jax.tree.map(jnp.add, g_ref, gb)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            scale = float(jnp.abs(b).max())
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * max(scale, 1))


def test_segment_ids_per_row_give_one_mask_per_row():
    ids = np.array([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 4, 4]])
    rows = mj.AttnMask.from_segment_ids(ids, per_row=True)
    assert [m.total_q for m in rows] == [6, 6]
    for b in range(2):
        assert rows[b].fingerprint == mj.AttnMask.from_segment_ids(ids[b]).fingerprint
    with pytest.raises(ValueError, match="per_row=True takes"):
        mj.AttnMask.from_segment_ids(ids[0], per_row=True)


@pytest.mark.parametrize("kv_layout, tk", [("replicated", 48), ("dispatched", 96)])
def test_batched_cross_attention_with_sinks_and_max_logits(kv_layout, tk):
    """Cross-attention rows (video queries over text keys, each row its own text lengths)
    on (dp 2, cp 2, tp 2): sinks and max logits follow (max over cp only, per row and
    head); every row against the float64 reference."""
    mesh, batch_axes, head_axes = make_mesh("dp2_cp2_tp2")
    rng = np.random.default_rng(4)

    def cross(n):
        out = []
        for _ in range(n):
            cut = int(rng.integers(8, tk - 8))
            q_cut = int(rng.integers(16, T - 16))
            out.append(
                mj.AttnMask.from_ranges(
                    [[0, q_cut], [q_cut, T]], [[0, cut], [cut, tk]], ["full"] * 2, T, tk
                )
            )
        return out

    masks = cross(2)
    cap = mj.PlanCapacity.from_masks(masks + cross(8), mesh_size=2)
    key = mj.make_batch_key(
        masks,
        mesh,
        "cp",
        batch_axes=batch_axes,
        head_axes=head_axes,
        capacity=cap,
        ffa_backend="xla",
    )
    assert key.kv_layout == kv_layout  # by the size rule
    q, k, v, dout, dlse = random_inputs(jax.random.key(3), masks[0], HQ, HKV, D, "float32", 2)
    sink = jnp.asarray(rng.standard_normal((2, HQ)), jnp.float32)

    @jax.jit
    def run(q, k, v, key):
        dq = mj.dispatch(q, key, seq_axis=1)
        dk, dv = (mj.dispatch(x, key, seq_axis=1, role="kv") for x in (k, v))
        out, lse, ml = mj.magi_attention(dq, dk, dv, key, sink=sink, return_max_logits=True)
        return mj.undispatch(out, key, seq_axis=1), mj.undispatch(lse, key, seq_axis=1), ml

    out, lse, ml = run(q, k, v, key)
    assert ml.shape == (2, HQ)
    for b in range(2):
        ref = mj.reference_attention(q[b], k[b], v[b], masks[b], sink=sink, return_max_logits=True)
        np.testing.assert_allclose(np.asarray(out[b]), np.asarray(ref[0]), atol=2e-5)
        np.testing.assert_allclose(np.asarray(lse[b]), np.asarray(ref[1]), atol=2e-5)
        np.testing.assert_allclose(np.asarray(ml[b]), np.asarray(ref[2]), atol=2e-5)
