"""The engine registry and ``auto``'s choice (CPU): what each engine says of a call, the
committed table's rule, and ``auto`` against a fixed table."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax.ffa import backends as B
from magi_jax.ffa import engine_table as E
from magi_jax.ffa.cudnn import cudnn_problem
from magi_jax.masks.packings import equal_doc_lens, sample_doc_lens
from magi_jax.planning.backends import BACKENDS, HOST_SPECS, check_backend, host_spec

DOCS = mj.AttnMask.varlen([0, 100, 300, 512])
X = jax.ShapeDtypeStruct((512, 8, 128), jnp.bfloat16)
KV = jax.ShapeDtypeStruct((512, 2, 128), jnp.bfloat16)


def _row(cls, tokens, docs, pallas, cudnn, mode="fwd+bwd", device="cpu"):
    return dict(
        device=device, **{"class": cls}, tokens=tokens, docs=docs, mode=mode,
        pallas_ms=pallas, cudnn_ms=cudnn, date="2026-12-07T00:00:00",
    )  # fmt: skip


TABLE = (
    _row("causal", 16384, 1, 15.6, 14.6),
    _row("causal", 16384, 1, 3.7, 4.0, mode="fwd"),
    _row("doc_causal", 32768, 48, 5.0, 6.0),
    _row("doc_causal", 32768, 512, 3.0, 1.5),
    _row("doc_full", 8192, 12, 1.0, 2.0, mode="fwd"),
)


def test_one_registry():
    assert tuple(B.IMPLEMENTATIONS) == tuple(HOST_SPECS) == BACKENDS[1:]
    assert BACKENDS[0] == "auto"
    # Fallbacks run down the registry and end on the engine that runs every call.
    assert [B.IMPLEMENTATIONS[n].fallback for n in HOST_SPECS] == ["pallas", "xla", None]
    assert host_spec("pallas").blocks(1000, 1000) == ((128, 128), (64, 128))
    assert host_spec("xla").blocks(100, 1000) == ((128, 128), (128, 128))
    assert host_spec("xla").lane_len == 16 and host_spec("pallas").lane_len == 0
    with pytest.raises(ValueError, match="reads no work lists"):
        host_spec("cudnn").blocks(10, 10)
    with pytest.raises(ValueError, match="ffa_backend='cudnn'.*single-device"):
        check_backend("cudnn", "ffa_backend", context_parallel=True)
    with pytest.raises(ValueError, match="backend='tpu' is not one of"):
        check_backend("tpu")
    assert B.get_backend("xla").split_fwd is not None
    with pytest.raises(ValueError, match="ffa_backend='cudnn'"):
        B.get_backend("cudnn")


def test_mask_classes():
    assert E.mask_class(mj.AttnMask.causal(64)) == ("causal", 1)
    assert E.mask_class(mj.AttnMask.full(64, 80)) == ("full", 1)
    assert E.mask_class(mj.AttnMask.sliding_window(64, 7, 0)) == ("window", 1)
    assert E.mask_class(DOCS) == ("doc_causal", 3)
    assert E.mask_class(mj.AttnMask.varlen([0, 10, 64], causal=False)) == ("doc_full", 2)
    assert E.mask_class(mj.AttnMask.varlen([0, 10, 64], window=4)) == ("doc_window", 2)
    with pytest.raises(ValueError, match="no class"):
        E.mask_class(mj.AttnMask.block_causal([64], 16))


def test_choice_from_a_fixed_table():
    # Nearest row in tokens and documents (log scale), fwd+bwd before fwd.
    assert E.choose_from(TABLE, "cpu", "causal", 8192)[0] == "cudnn"
    assert E.choose_from(TABLE, "cpu", "doc_causal", 32768, 40)[0] == "pallas"
    name, why = E.choose_from(TABLE, "cpu", "doc_causal", 32768, 300)
    assert name == "cudnn" and "512 documents" in why and "3.000 ms" in why
    # fwd rows alone still decide.
    assert E.choose_from(TABLE, "cpu", "doc_full", 8192, 12)[0] == "pallas"
    # No row for this GPU or this class: the FFA kernels by rule.
    for args in (("NVIDIA B200", "causal", 16384), ("cpu", "doc_window", 16384)):
        name, why = E.choose_from(TABLE, *args)
        assert name == "pallas" and "no measurement" in why and "engine_table.py" in why


def test_the_committed_table_holds_measurements_only():
    rows = E.load_table()
    assert rows, "the committed table is empty"
    for r in rows:
        assert r["class"] in E.CLASSES and r["mode"] in ("fwd", "fwd+bwd")
        assert r["pallas_ms"] > 0 and r["cudnn_ms"] > 0 and r["date"]
        assert r["run"], r  # every row names the run it came from


@pytest.mark.parametrize(
    "call,reason",
    [
        (B.Call(X, KV, KV, DOCS, sink=True), "sinks"),
        (B.Call(X, KV, KV, DOCS, max_logits=True), "max logits"),
        (B.Call(X, KV, KV, DOCS, softcap=30.0), "softcap"),
        (
            B.Call(X, KV, jax.ShapeDtypeStruct((512, 2, 64), jnp.bfloat16), DOCS),
            "Dv=64 differs",
        ),
        (B.Call(*(jax.ShapeDtypeStruct((512, 8, 128), jnp.float32),) * 3, DOCS), "bfloat16"),
        (B.Call(*(jax.ShapeDtypeStruct((512, 8, 264), jnp.bfloat16),) * 3, DOCS), "up to 256"),
        (B.Call(X, KV, KV, None), "needs the mask"),
        (B.Call(X, KV, KV, mj.AttnMask.causal(512, 600)), "packed layout"),
        (B.Call(X, KV, KV, DOCS), "not an NVIDIA GPU"),
    ],
)
def test_cudnn_says_why_not(call, reason):
    assert reason in cudnn_problem(call)


SM100 = "the GPU NVIDIA B200 has compute capability 10.0; the FFA kernels are Hopper's (9.0)"


@pytest.fixture
def gpu_like(monkeypatch):
    """A registry in which cudnn and pallas pass their device checks (their other checks
    stand), or pallas fails as on an sm100 GPU; and the fixed table for this device."""

    def on_gpu(check):
        def checked(call):
            why = check(call)
            return "" if "not an NVIDIA GPU" in why else why

        return checked

    def patch(pallas=True):
        for name in ("cudnn", "pallas"):
            be = B.IMPLEMENTATIONS[name]
            check = on_gpu(be.check) if pallas or name == "cudnn" else (lambda call: SM100)
            monkeypatch.setitem(B.IMPLEMENTATIONS, name, dataclasses.replace(be, check=check))
        monkeypatch.setattr(E, "load_table", lambda path=None: TABLE)

    return patch


def test_auto_against_a_fixed_table(gpu_like):
    gpu_like()
    web = np.concatenate([[0], np.cumsum(sample_doc_lens(32768, 3))])
    stress = np.concatenate([[0], np.cumsum(equal_doc_lens(32768, 512))])
    cases = {
        "causal": (mj.AttnMask.causal(16384), "cudnn"),
        "web": (mj.AttnMask.varlen(web), "pallas"),
        "stress": (mj.AttnMask.varlen(stress), "cudnn"),
        "unmeasured": (mj.AttnMask.varlen(stress, window=30), "pallas"),
        "not cudnn's": (mj.AttnMask.block_causal([4096] * 4, 512), "pallas"),
    }
    for label, (mask, want) in cases.items():
        t = mask.total_q
        q = jax.ShapeDtypeStruct((t, 8, 128), jnp.bfloat16)
        name, why = mj.select_backend("auto", q, q, q, mask)
        assert name == want, (label, why)
    # Sinks, max logits and softcap leave cudnn out whatever the table says.
    q = jax.ShapeDtypeStruct((16384, 8, 128), jnp.bfloat16)
    name, why = B.auto_backend(q, q, q, mj.AttnMask.causal(16384), sink=True)
    assert name == "pallas" and "cudnn: attention sinks" in why


def test_auto_where_only_cudnn_has_a_fast_path(gpu_like):
    """A GPU without the FFA kernels (sm100): cudnn for what it expresses, saying that the
    kernels are sm90's; xla for the rest."""
    gpu_like(pallas=False)
    q = jax.ShapeDtypeStruct((512, 8, 128), jnp.bfloat16)
    name, why = mj.select_backend("auto", q, q, q, DOCS)
    assert name == "cudnn" and "Hopper" in why
    mask = mj.AttnMask.block_causal([256, 256], 64)
    name, why = mj.select_backend("auto", q, q, q, mask)
    assert name == "xla" and "Hopper" in why and "cudnn: the mask is not" in why


def test_explicit_cudnn_off_gpu_and_where_it_has_no_plan():
    q = jnp.zeros((512, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="backend='cudnn'.*not an NVIDIA GPU"):
        mj.flex_flash_attention(q, q, q, DOCS, backend="cudnn")
    with pytest.raises(ValueError, match="reads no work lists"):
        mj.plan_attention(DOCS, backend="cudnn")
    # auto on the CPU: xla, saying why neither GPU engine.
    name, why = mj.select_backend("auto", q, q, q, DOCS)
    assert name == "xla" and why.startswith("cudnn: the default device is cpu")
