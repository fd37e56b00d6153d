"""One conformance suite: every entry point that promises exact attention over a slice mask
runs the same cases against the float64 reference, by the correctness rule of
docs/design.md §5 (out, lse, dq, dk, dv), on the one test mask zoo (tests/zoo.py).

Each entry point is a subclass of :class:`Conformance` that says how to call it and what it
supports (capability flags, as tokamax's ``AttentionTestBase``); a case an entry point does
not support is not generated for it. Beyond the reference rule every case checks the output
dtypes and that what sees nothing gets exactly nothing: rows that see no key give ``out = 0``,
``lse = -inf`` and ``dq = 0``, keys that no row sees give ``dk = dv = 0``.

Entry-point-specific behaviour (tile sizes, pipeline knobs, overlap degrees, dispatch, the
``jax.nn`` compatibility of ``dot_product_attention``, the Flax layers' projections) is tested
beside each entry point: tests/ffa, tests/pallas, tests/sharding, tests/test_flax.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import magi_jax as mj
from magi_jax import mask_zoo
from magi_jax.ffa.testing import assert_matches_reference, random_inputs
from magi_jax.mask import AttnMask
from magi_jax.nn import make_attention_fn
from tests.zoo import EDGES, PACKED_ROWS, PACKED_ZOO, ZOO

MASKS = {**ZOO, **EDGES, "zoo": PACKED_ZOO}


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance case: a mask of the zoo (or its edges) and the inputs' shape."""

    mask: str
    dtype: str = "float32"
    hq: int = 2
    hkv: int = 1
    d: int | None = None  # None: the entry point's own head dim
    batch: int | None = None
    softcap: float = 0.0
    softmax_scale: float | None = None
    seed: int = 0
    blocks: tuple[int, int] | None = None  # the xla backend's tiles (default 16 x 8)
    # What the case can catch: "plumbing" (arguments, shapes and batches reaching the kernels:
    # every entry point runs these) or "kernel" (numerics, tiles: the kernels' own entry
    # points run these).
    catches: str = "kernel"

    def __str__(self):
        parts = [self.mask, self.dtype, f"h{self.hq}-{self.hkv}"]
        parts += [] if self.d is None else [f"d{self.d}"]
        parts += [] if self.batch is None else [f"b{self.batch}"]
        parts += [f"softcap{self.softcap:g}"] if self.softcap else []
        parts += [] if self.softmax_scale is None else [f"scale{self.softmax_scale:g}"]
        return "-".join(parts + ([f"seed{self.seed}"] if self.seed else []))


# The cases beyond the zoo: softcap and scale with GQA, every input dtype, head dims from 16
# to 256, batches, the edge masks (cross lengths, rows, tiles and keys that see nothing).
CASES = [
    # What every entry point must pass through: batches, GQA, softcap, scale; cross lengths
    # and rows that see nothing.
    Case(
        "shared-question",
        "float32",
        6,
        2,
        16,
        batch=2,
        softcap=3.0,
        softmax_scale=0.5,
        blocks=(8, 16),
        catches="plumbing",
    ),
    Case("empty-rows", "float32", 4, 2, 16, blocks=(4, 4), catches="plumbing"),
    # What the kernels compute: dtypes, head dims, tiles.
    Case("doc-causal", "float32", 4, 2, 16, batch=3, blocks=(8, 8)),
    Case("causal-rect", "float32", 4, 2, 16),
    Case("empty", "float32", 4, 2, 16),
    Case("doc-causal", "bfloat16", 4, 1, 16, softcap=5.0),
    Case("prefix-lm", "float16", 4, 2, 32),
    Case("block-causal", "float32", 2, 2, 24),
    Case("causal", "bfloat16", 2, 1, 256),
    Case("shared-question", "bfloat16", 4, 2, 16, batch=2),
    Case("irregular", "bfloat16", 2, 1, 64),
    Case("empty-tiles", "float16", 1, 1, 128),
    Case("doc-window-40", "bfloat16", 1, 1, 64, batch=2, softcap=4.0, seed=3),
    Case("irregular", "float16", 2, 1, 256, batch=2, seed=9),
]


class Conformance:
    """The contract every entry point keeps; subclasses say how to call it and what it
    supports. ``attention(mask, q, k, v, softcap, softmax_scale)`` returns ``(out, lse)``
    (``lse`` None where the entry point gives none) for ``[(B,) T, H, D]`` inputs."""

    dtypes = ("float32", "bfloat16", "float16")
    zoo_dtypes = ("float32",)
    head_dim = 8  # the zoo's head dim
    zoo_heads = (2, 1)  # the zoo's query and key/value heads
    head_dims = None  # None: every multiple of 8 up to 256
    # Every entry point takes batches, GQA, softcap, a scale and masks without slices.
    supports_lse = True  # lse is returned and differentiable
    supports_cross = True  # total_q != total_k
    # A wrapper over another entry point runs the plumbing cases only: the kernel cases test
    # what it passes through untouched.
    wrapper = False
    # The zoo as one packed sequence (every kind in one program, checked kind by kind), or
    # each kind on its own.
    zoo_packed = True

    def attention(self, mask, q, k, v, softcap, softmax_scale):
        raise NotImplementedError

    @classmethod
    def supports(cls, case: Case) -> bool:
        mask = MASKS[case.mask]
        d = cls.head_dim if case.d is None else case.d
        return (
            case.dtype in cls.dtypes
            and (d % 8 == 0 and d <= 256 if cls.head_dims is None else d in cls.head_dims)
            and (mask.total_q == mask.total_k or cls.supports_cross)
            and (case.catches == "plumbing" or not cls.wrapper)
        )

    @classmethod
    def zoo_cases(cls):
        if cls.zoo_packed:
            return [Case("zoo", dtype, *cls.zoo_heads) for dtype in cls.zoo_dtypes]
        return [Case(name, dtype, *cls.zoo_heads) for name in ZOO for dtype in cls.zoo_dtypes]

    @classmethod
    def option_cases(cls):
        return [c for c in CASES if cls.supports(c)]

    def run(self, case: Case):
        self.case = case  # what an entry point may read beyond the contract (xla tiles)
        mask = MASKS[case.mask]
        d = self.head_dim if case.d is None else case.d
        q, k, v, dout, dlse = random_inputs(
            jax.random.key(case.seed), mask, case.hq, case.hkv, d, case.dtype, case.batch
        )
        kw = dict(softcap=case.softcap, softmax_scale=case.softmax_scale)
        res, (dq, dk, dv) = self.step(mask, **kw)(q, k, v, dout, dlse)
        res.update(dq=dq, dk=dk, dv=dv)
        dtype = jnp.dtype(case.dtype)
        assert res["out"].dtype == dtype and dq.dtype == dtype and dk.dtype == dtype
        assert "lse" not in res or res["lse"].dtype == jnp.float32
        res, q, k, v, dout, dlse = jax.device_get((res, q, k, v, dout, dlse))
        dlse = dlse if self.supports_lse else None
        # The packed zoo is checked kind by kind: each kind's rows and keys are its own
        # problem, held to its own bound.
        parts = PACKED_ROWS if case.mask == "zoo" else {case.mask: (slice(None), slice(None))}
        for name, (rq, rk) in parts.items():
            qs, ks = (slice(None),) * (q.ndim - 3) + (rq,), (slice(None),) * (q.ndim - 3) + (rk,)
            cut = {n: x[ks if n in ("dk", "dv") else qs] for n, x in res.items()}
            try:
                assert_matches_reference(
                    cut,
                    q[qs],
                    k[ks],
                    v[ks],
                    MASKS[name],
                    dout[qs],
                    None if dlse is None else dlse[qs],
                    **kw,
                )
                _assert_unseen_get_nothing(cut, MASKS[name])
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None

    def step(self, mask, **kw):
        """``step(q, k, v, dout, dlse) -> (results, (dq, dk, dv))``: the forward and the VJP
        as one jitted program, the mask a constant of it."""

        @jax.jit
        def step(q, k, v, dout, dlse):
            fwd = lambda a, b, c: self.attention(mask, a, b, c, **kw)
            if self.supports_lse:
                (out, lse), vjp = jax.vjp(fwd, q, k, v)
                return dict(out=out, lse=lse), vjp((dout, dlse))
            out, vjp = jax.vjp(lambda a, b, c: fwd(a, b, c)[0], q, k, v)
            return dict(out=out), vjp(dout)

        return step

    def test_zoo(self, case):
        self.run(case)

    def test_options(self, case):
        self.run(case)


def pytest_generate_tests(metafunc):
    """Each entry point's cases: the zoo at its dtypes, then the cases it supports."""
    if metafunc.cls is None or not issubclass(metafunc.cls, Conformance):
        return
    name = metafunc.function.__name__
    cases = metafunc.cls.zoo_cases() if name == "test_zoo" else metafunc.cls.option_cases()
    metafunc.parametrize("case", cases, ids=str)


def _assert_unseen_get_nothing(res: dict, mask: AttnMask):
    """Rows that see no key: out and dq exactly 0 (and lse -inf, which the reference rule
    checks); keys that no row sees: dk and dv exactly 0."""
    dense = mask.to_dense()
    rows, keys = ~dense.any(1), ~dense.any(0)
    for name, unseen in (("out", rows), ("dq", rows), ("dk", keys), ("dv", keys)):
        x = np.asarray(res[name], np.float32)
        assert not x[..., unseen, :, :].any(), f"{name}: nonzero where nothing is seen"
    if "lse" in res:
        assert np.isneginf(np.asarray(res["lse"])[..., rows, :]).all()


# ---- the entry points -------------------------------------------------------------------------


class TestFlexFlashAttentionXla(Conformance):
    """``flex_flash_attention(backend="xla")``."""

    zoo_dtypes = ("float32", "bfloat16")
    head_dim = 16
    zoo_heads = (4, 2)

    def attention(self, mask, q, k, v, softcap, softmax_scale):
        # Small tiles on the zoo (every mask spans tiles); the default (up to 128) on the
        # tile-edge masks, whose edges are drawn for 128-row tiles.
        small = max(mask.total_q, mask.total_k) <= 128 or self.case.mask == "zoo"
        block_q, block_k = self.case.blocks or ((16, 8) if small else (None, None))
        return mj.flex_flash_attention(
            q,
            k,
            v,
            mask,
            backend="xla",
            block_q=block_q,
            block_k=block_k,
            softcap=softcap,
            softmax_scale=softmax_scale,
        )


class TestFlexFlashAttentionPallasInterpret(Conformance):
    """The Mosaic GPU kernels in interpret mode on the CPU. Interpret mode fills fresh
    buffers with NaN, so an output element the kernels forget to write fails the NaN check.
    Its kernels take 16-bit inputs and head dims 64, 128 and 256."""

    dtypes = ("bfloat16", "float16")
    zoo_dtypes = ("bfloat16",)
    head_dim = 64
    head_dims = (64, 128, 256)

    def attention(self, mask, q, k, v, softcap, softmax_scale):
        from magi_jax.pallas import flex_flash_attention_pallas

        return flex_flash_attention_pallas(
            q, k, v, mask, softcap=softcap, softmax_scale=softmax_scale, interpret=True
        )


@functools.lru_cache(maxsize=None)
def _cp_key(mask: AttnMask):
    """The key of ``mask`` on 8 devices; the zoo's masks share one capacity (mask as data),
    so their keys share a static part and the jitted step compiles once for all of them."""
    mesh = jax.make_mesh(
        (8,), ("cp",), devices=jax.devices()[:8], axis_types=(jax.sharding.AxisType.Auto,)
    )
    if any(mask is m for m in ZOO.values()):
        return mj.make_flex_key(mask, mesh, "cp", capacity=_zoo_capacity())
    return mj.make_flex_key(mask, mesh, "cp")


@functools.lru_cache(maxsize=None)
def _zoo_capacity():
    return mj.PlanCapacity.from_masks(list(ZOO.values()), mesh_size=8)


def _cp_attention(key, q, k, v, softcap, softmax_scale):
    """Natural order in and out: dispatch, ``magi_attention``, undispatch (batches along
    axis 1)."""
    axis = q.ndim - 3
    out, lse = mj.magi_attention(
        mj.dispatch(q, key, seq_axis=axis),
        mj.dispatch(k, key, seq_axis=axis, role="kv"),
        mj.dispatch(v, key, seq_axis=axis, role="kv"),
        key,
        softcap=softcap,
        softmax_scale=softmax_scale,
    )
    return mj.undispatch(out, key, seq_axis=axis), mj.undispatch(lse, key, seq_axis=axis)


@functools.partial(jax.jit, static_argnames=("softcap", "softmax_scale"))
def _cp_step(key, q, k, v, dout, dlse, softcap, softmax_scale):
    fwd = lambda a, b, c: _cp_attention(key, a, b, c, softcap, softmax_scale)
    (out, lse), vjp = jax.vjp(fwd, q, k, v)
    return dict(out=out, lse=lse), vjp((dout, dlse))


class TestMagiAttentionCp8(Conformance):
    """``magi_attention`` on 8 CPU host devices: natural-order inputs through dispatch and
    undispatch. Each kind of the zoo on its own (how a mask is cut over the ranks is what
    this entry point adds), as data: the key is an argument of the jitted step."""

    wrapper = True
    zoo_packed = False

    def attention(self, mask, q, k, v, softcap, softmax_scale):
        return _cp_attention(_cp_key(mask), q, k, v, softcap, softmax_scale)

    def step(self, mask, **kw):
        return functools.partial(_cp_step, _cp_key(mask), **kw)


class TestDotProductAttention(Conformance):
    """``dot_product_attention`` with the mask as a concrete boolean ``mask=``: the output
    only (its residual carries no gradient, as in ``jax.nn``)."""

    supports_lse = False
    wrapper = True

    def attention(self, mask, q, k, v, softcap, softmax_scale):
        out = mj.dot_product_attention(
            q, k, v, mask=mask.to_dense(), scale=softmax_scale, softcap=softcap
        )
        return out, None


class TestFlaxAttentionFn(Conformance):
    """The Flax layers' ``attention_fn`` (``magi_jax.nn.make_attention_fn``): what
    ``nn.MultiHeadDotProductAttention`` and ``nnx.MultiHeadAttention`` call."""

    supports_lse = False
    supports_cross = False  # the layers attend over one sequence
    wrapper = True

    def attention(self, mask, q, k, v, softcap, softmax_scale):
        fn = make_attention_fn(mask, softcap=softcap, softmax_scale=softmax_scale, backend="xla")
        return fn(q, k, v), None


def test_every_entry_point_runs_the_whole_zoo():
    """Five entry points; each runs every kind of the zoo, on its own or packed; the zoo's
    kinds are the benchmark zoo's, by the same names."""
    entries = Conformance.__subclasses__()
    assert len(entries) == 5
    for entry in entries:
        kinds = [c.mask for c in entry.zoo_cases()][:: len(entry.zoo_dtypes)]
        assert kinds == (["zoo"] if entry.zoo_packed else list(ZOO))
    assert list(PACKED_ROWS) == list(ZOO)
    assert set(ZOO) <= set(mask_zoo.MASKS)
