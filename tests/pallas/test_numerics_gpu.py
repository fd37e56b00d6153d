"""The numerical edges of ``tests/test_numerics.py`` on the Mosaic GPU kernels
(``backend="pallas"``: bfloat16/float16, D = 64 and 128), against the float64 reference
(docs/design.md §5): q x 100 with softcap off and on, rows that see one key or none, an
all-masked batch, and one query over 2**20 keys. Skipped without an sm90 GPU.

    python -m pytest -p no:xdist -q tests/pallas/test_numerics_gpu.py
"""

import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.mask import AttnMask
from tests.test_numerics import LONG_ROW, check_edges, edge_mask, run_ffa, scaled_inputs

pallas = pytest.importorskip("magi_jax.pallas")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not pallas.device_supported()[0], reason="needs an sm90 GPU"),
]

CASES = [
    dict(dtype=jnp.float16, softcap=0.0, hq=4, hkv=2, d=128, batch=2),
    dict(dtype=jnp.float16, softcap=30.0, hq=2, hkv=1, d=64, batch=None),
    dict(dtype=jnp.bfloat16, softcap=0.0, hq=2, hkv=2, d=64, batch=None),
    dict(dtype=jnp.bfloat16, softcap=30.0, hq=4, hkv=1, d=128, batch=2),
]


@pytest.mark.parametrize("unit", [128, 77])  # tile-aligned edges, and unaligned ones
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c['dtype'].__name__}-d{c['d']}-softcap{c['softcap']:g}"
)
def test_large_logits_single_key_and_empty_rows(case, unit):
    mask = edge_mask(unit)
    inputs = scaled_inputs(
        mask,
        case["dtype"],
        hq=case["hq"],
        hkv=case["hkv"],
        d=case["d"],
        q_scale=100.0,
        batch=case["batch"],
    )
    res = run_ffa(mask, *inputs, backend="pallas", softcap=case["softcap"])
    check_edges(res, mask, *inputs, softcap=case["softcap"])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_all_masked_batch(dtype):
    mask = AttnMask.from_ranges([], [], [], total_q=300, total_k=520)
    q, k, v, dout, dlse = scaled_inputs(mask, dtype, hq=2, hkv=1, d=64, q_scale=100.0, batch=2)
    res = run_ffa(mask, q, k, v, dout, dlse, backend="pallas")
    assert np.isneginf(np.asarray(res["lse"])).all()
    for name in ("out", "dq", "dk", "dv"):
        assert (np.asarray(jnp.asarray(res[name], jnp.float32)) == 0).all(), name
    check_edges(res, mask, q, k, v, dout, dlse)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_long_row_matches_reference(dtype):
    mask = AttnMask.full(1, LONG_ROW)
    inputs = scaled_inputs(mask, dtype, hq=2, hkv=1, d=64, seed=2)
    check_edges(run_ffa(mask, *inputs, backend="pallas"), mask, *inputs)


def test_long_row_lse_is_exact_for_equal_logits():
    mask = AttnMask.full(1, LONG_ROW)
    rng = np.random.default_rng(3)
    q = jnp.asarray((rng.standard_normal((1, 1, 64), np.float32) * 4).astype(jnp.bfloat16))
    k = jnp.asarray(
        np.broadcast_to(np.linspace(-1.0, 1.0, 64, dtype=np.float32), (LONG_ROW, 1, 64)).astype(
            jnp.bfloat16
        )
    )
    v = jnp.asarray(rng.standard_normal((LONG_ROW, 1, 64), np.float32).astype(jnp.bfloat16))
    zeros = jnp.zeros((1, 1, 64), jnp.bfloat16), jnp.zeros((1, 1), jnp.float32)
    res = run_ffa(mask, q, k, v, *zeros, backend="pallas")
    s = float(np.asarray(q, np.float64)[0, 0] @ np.asarray(k[0, 0], np.float64)) * 64**-0.5
    want_lse = s + np.log(LONG_ROW)
    assert abs(float(res["lse"][0, 0]) - want_lse) <= 2e-5 * max(1.0, abs(want_lse))
    want_out = np.asarray(v, np.float64).mean(0)
    # out is rounded to bfloat16 once: half an ulp of its magnitude, and the f32 sum's error.
    np.testing.assert_allclose(
        np.asarray(res["out"][0], np.float64), want_out, rtol=2**-8, atol=1e-4
    )
