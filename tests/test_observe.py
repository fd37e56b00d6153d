"""What a run shows of itself: named scopes in the lowered program (so in profiler traces)
and the library's logger, quiet by default, reporting traces for new key structures."""

import functools
import logging

import jax
import numpy as np
from jax.sharding import AxisType

import magi_jax as mj

T = 256


@functools.lru_cache(maxsize=None)
def _mesh(axis):
    return jax.make_mesh((4,), (axis,), axis_types=(AxisType.Auto,), devices=jax.devices()[4:])


def _loss(q, key):
    d = mj.dispatch(q, key)
    out, _ = mj.magi_attention(d, d, d, key)
    return mj.undispatch(out, key).sum()


def test_named_scopes_reach_the_lowered_program():
    key = mj.make_flex_key(mj.AttnMask.varlen([0, 100, T]), _mesh("cp"), "cp", overlap_degree=1)
    assert any(s.cast is not None for s in key.stages)  # a remote stage, so casts
    q = np.ones((T, 2, 8), np.float32)
    text = jax.jit(jax.grad(_loss)).lower(q, key).as_text(debug_info=True)
    for scope in (
        "magi_dispatch",
        "magi_attention",
        "magi_undispatch",
        "stage0_host/",
        "stage1_remote/group_cast/",
        "stage1_remote_bwd/group_reduce/",
        "stage0_host/ffa_xla_fwd/",
        "stage0_host_bwd/ffa_xla_bwd/",
        "merge_partials/",
    ):
        assert scope in text, scope
    one = jax.jit(lambda q: mj.flex_flash_attention(q, q, q, mj.AttnMask.causal(64))[0])
    assert "flex_flash_attention/ffa_xla" in one.lower(q[:64]).as_text(debug_info=True)


def test_logger_is_quiet_by_default_and_reports_recompiles(caplog):
    log = logging.getLogger("magi_jax")
    assert any(isinstance(h, logging.NullHandler) for h in log.handlers)
    mesh = _mesh("seq")  # a family of its own: no other test traces on it
    q = jax.ShapeDtypeStruct((T, 2, 8), np.float32)
    with caplog.at_level(logging.DEBUG, logger="magi_jax"):
        keys = [
            mj.make_flex_key(mj.AttnMask.varlen([0, c, T]), mesh, "seq") for c in (90, 120, 150)
        ]
        for key in keys:
            jax.eval_shape(_loss, q, key)  # a trace, as a jitted step's first call makes
        # The same key in another function (as a step retraced when the placement of its
        # parameters changes): a DEBUG line only.
        jax.eval_shape(lambda q, key: _loss(q, key), q, keys[0])
    compile_records = [r for r in caplog.records if r.name == "magi_jax.compile"]
    infos = [r.getMessage() for r in compile_records if r.levelno == logging.INFO]
    assert len(infos) == 3 and "(a compilation)" in infos[0]
    assert "key fields changed:" in infos[1] and "fingerprint" in infos[1]
    warnings = [r.getMessage() for r in compile_records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "PlanCapacity" in warnings[0]
    assert any("traced again" in r.getMessage() for r in compile_records)
    assert any(
        r.name == "magi_jax.keys" and "planned a key" in r.getMessage() for r in caplog.records
    )
