"""The cudnn engine's wrapper on CPU: cuDNN itself replaced by a stand-in that returns what
cuDNN's packed call returns (output with unwritten padding rows, softmax statistics one row
of T per document), so that the gather of lse, the padding rows, the GQA heads, the batch
and the two backward paths (cuDNN's alone; with the lse cotangent through the xla
backward) are checked against the reference here. tests/ffa/test_cudnn_gpu.py runs the
real cuDNN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.ffa import cudnn as C
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.masks import AttnMask
from magi_jax.planning.packed import CAUSAL_DOCS

GARBAGE = 7.0  # what the stand-in leaves where cuDNN writes nothing


def _stand_in(layout, q, k, v):
    """cuDNN's packed call, densely: ``(out [B, T, Hq, D], stats [B·n, Hq, T])`` (dense
    masks: ``stats [B, Hq, T]``)."""
    d = layout.docs
    b, t, hq, _ = q.shape
    rep = hq // k.shape[2]
    k, v = (jnp.repeat(x, rep, axis=2) for x in (k, v))
    allowed = np.zeros((t, k.shape[1]), bool)
    for qs, n, ks, m in zip(d.q_starts, d.q_lens, d.k_starts, d.k_lens):
        i, j = np.ogrid[:n, :m]
        cell = np.ones((n, m), bool)
        if d.kind == CAUSAL_DOCS:
            cell = (j <= i) & ((j > i - d.window) if d.window else True)
        allowed[qs : qs + n, ks : ks + m] = cell
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * layout.scale
    s = jnp.where(allowed[None, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, H, T]
    seen = np.any(allowed, axis=1)
    p = jnp.where(seen[None, None, :, None], jnp.exp(s - lse[..., None]), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v).astype(q.dtype)
    out = jnp.where(seen[None, :, None, None], out, GARBAGE)
    if d.dense:
        return out, lse
    n = d.num_docs
    stats = jnp.full((b * n, hq, t), GARBAGE, jnp.float32)
    for row in range(b):
        for j, (qs, m) in enumerate(zip(d.q_starts, d.q_lens)):
            stats = stats.at[row * n + j, :, :m].set(lse[row, :, qs : qs + m])
    return out, stats


MASKS = {
    # Documents with padding rows between them and unused keys; GQA below.
    "doc_causal_gaps": AttnMask.from_ranges(
        [[0, 30], [34, 50], [50, 51], [60, 90]],
        [[0, 30], [34, 50], [50, 51], [60, 90]],
        "causal",
        96,
        96,
    ),
    "doc_full": AttnMask.varlen([0, 17, 40, 64], causal=False),
    "doc_window": AttnMask.varlen([0, 9, 40, 64], window=(5, 0)),
    "causal": AttnMask.causal(48),
    "cross_full": AttnMask.from_ranges([[0, 10], [12, 30]], [[0, 25], [25, 40]], "full"),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_wrapper_matches_the_reference(monkeypatch, name):
    """Forward, and a loss on out alone: cuDNN's backward by itself (the lse cotangent is a
    symbolic zero)."""
    monkeypatch.setattr(C, "_raw", _stand_in)
    mask = MASKS[name]
    q, k, v, dout, dlse = random_inputs(jax.random.key(1), mask, 4, 2, 16, jnp.float32)
    fn = lambda a, b, c: C.cudnn_attention(a, b, c, mask, softmax_scale=0.3)
    out, lse = jax.jit(fn)(q, k, v)
    loss = lambda a, b, c: jnp.sum(fn(a, b, c)[0] * dout)
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    assert_matches_reference(res, q, k, v, mask, dout, jnp.zeros_like(dlse), softmax_scale=0.3)


@pytest.mark.parametrize("name,batch", [("doc_causal_gaps", 2), ("causal", None)])
def test_the_lse_cotangent(monkeypatch, name, batch):
    """A cotangent on lse too: its part through the xla backward, the batch mapped."""
    monkeypatch.setattr(C, "_raw", _stand_in)
    mask = MASKS[name]
    q, k, v, dout, dlse = random_inputs(jax.random.key(3), mask, 4, 2, 16, jnp.float32, batch)
    fn = jax.jit(lambda a, b, c: C.cudnn_attention(a, b, c, mask, softmax_scale=0.3))
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    dq, dk, dv = vjp((dout, dlse))
    res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    assert_matches_reference(res, q, k, v, mask, dout, dlse, softmax_scale=0.3)


def test_rows_that_see_no_key(monkeypatch):
    monkeypatch.setattr(C, "_raw", _stand_in)
    mask = MASKS["doc_causal_gaps"]
    q, k, v, dout, _ = random_inputs(jax.random.key(2), mask, 2, 2, 16, jnp.float32)
    out, lse = jax.jit(lambda a, b, c: C.cudnn_attention(a, b, c, mask, softmax_scale=0.25))(
        q, k, v
    )
    empty = np.r_[30:34, 51:60, 90:96]
    assert np.all(np.asarray(out)[empty] == 0) and np.all(np.isneginf(np.asarray(lse)[empty]))
    loss = lambda a, b, c: jnp.sum(C.cudnn_attention(a, b, c, mask, softmax_scale=0.25)[0] * dout)
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert np.all(np.asarray(dq)[empty] == 0)
    assert np.all(np.asarray(dk)[empty] == 0) and np.all(np.asarray(dv)[empty] == 0)


def test_refuses_other_masks():
    q = jnp.zeros((64, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="mask: not a mask of cuDNN's packed layout"):
        C.cudnn_attention(q, q, q, AttnMask.block_causal([64], 16), softmax_scale=0.25)
