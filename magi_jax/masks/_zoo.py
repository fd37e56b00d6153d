"""The benchmark mask zoo: the reference document lengths and the masks built from them.

One definition for the planner CLI, the benchmarks (``benchmarks/*_bench.py``) and the tests.
Besides the constructors of :class:`~magi_jax.masks.AttnMask`, two families live here:
:func:`hstu` (generative recommenders) and :func:`doc_window_global` (documents with a
sliding window and global tokens). Host-only NumPy; imports only :mod:`magi_jax.masks`.

>>> sum(DOC_LENGTHS), scaled_doc_lengths(65536)[:3]
(32768, [14080, 10752, 8704])
>>> zoo(4096)["doc-causal"].num_slices
10
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from magi_jax.masks._mask import AttnMask, AttnMaskType, shape_to_slices

# The ten documents of the benchmarks' document-causal mask: 32768 tokens in all.
DOC_LENGTHS = (7040, 5376, 4352, 2560, 2816, 768, 1024, 512, 1792, 6528)
REFERENCE_TOTAL = sum(DOC_LENGTHS)
# The masks of the zoo, by the names the planner CLI accepts (``--mask``).
MASKS = (
    "doc-causal",
    "doc-full",
    "causal",
    "full",
    "sliding-window",
    "doc-window",
    "block-causal",
    "prefix-lm",
    "shared-question",
    "causal-blockwise",
    "global-sliding-window",
    "many-docs",
    "hstu",
    "doc-window-global",
)


def _lengths(name: str, value) -> list[int]:
    arr = np.asarray(value)
    if arr.ndim > 1 or not np.issubdtype(arr.dtype, np.integer) or np.any(arr < 0):
        raise ValueError(f"{name} must be lengths, ints >= 0; got {value!r}")
    return arr.astype(np.int64).reshape(-1).tolist()


def _per_doc(name: str, value, lens: list[int]) -> list[int]:
    arr = np.asarray(value)
    if (
        arr.ndim > 1
        or arr.size not in (1, len(lens))
        or not np.issubdtype(arr.dtype, np.integer)
        or np.any(arr < 0)
    ):
        raise ValueError(
            f"{name} must be one int >= 0 or {len(lens)} of them (one per sequence); got {value!r}"
        )
    return np.broadcast_to(arr.astype(np.int64).reshape(-1), (len(lens),)).tolist()


def _mask(slices, total: int) -> AttnMask:
    if not slices:
        return AttnMask.from_ranges([], [], [], total_q=total, total_k=total)
    arr = np.array([[a, b, c, d, int(t)] for a, b, c, d, t in slices], np.int64)
    return AttnMask.from_ranges(arr[:, 0:2], arr[:, 2:4], arr[:, 4], total, total)


def _nonneg(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")
    return int(value)


def hstu(
    seq_lens: Sequence[int],
    num_targets: int | Sequence[int] = 0,
    num_context: int | Sequence[int] = 0,
    window: int | None = None,
) -> AttnMask:
    """The HSTU mask of generative recommenders over packed user sequences.

    Each sequence of ``seq_lens[i]`` tokens is ``num_context`` context tokens, then the
    history, then ``num_targets`` target (candidate) tokens (ints for all sequences or one
    per sequence). Within a sequence:

    - context tokens see the context and the whole history (not the targets);
    - history token ``q`` sees the context and the history up to itself — with ``window``,
      only history keys ``k >= q - window`` (the context stays visible: global tokens);
    - target tokens see the context, the history (with ``window``: its last ``window``
      tokens) and themselves, never another target.

    Sequences do not see each other.

    >>> hstu([6], num_targets=2, num_context=1).area   # 1*4 + (2+3+4) + 2*(4+1)
    23
    """
    lens = _lengths("seq_lens", seq_lens)
    targets = _per_doc("num_targets", num_targets, lens)
    context = _per_doc("num_context", num_context, lens)
    w = None if window is None else _nonneg("window", window)
    slices, s = [], 0
    full = AttnMaskType.FULL
    for i, (n, t, c) in enumerate(zip(lens, targets, context)):
        if c + t > n:
            raise ValueError(
                f"sequence {i} has {n} tokens but num_context={c} + num_targets={t}; "
                "each sequence must hold its context and targets"
            )
        hs, ts, e = s + c, s + n - t, s + n  # history [hs, ts), targets [ts, e)
        if c and ts > s:
            slices.append((s, hs, s, ts, full))  # context rows: context + history
        if ts > hs:
            if c:
                slices.append((hs, ts, s, hs, full))
            slices += shape_to_slices(hs, ts, hs, ts, None if w is None else -w, 0)
        if t:
            k0 = hs if w is None else max(hs, ts - w)
            if c:
                slices.append((ts, e, s, hs, full))
            if ts > k0:
                slices.append((ts, e, k0, ts, full))
            slices.append((ts, e, ts, e, AttnMaskType.BI_CAUSAL))  # the diagonal
        s = e
    return _mask(slices, s)


def doc_window_global(doc_lens: Sequence[int], window: int, num_global: int) -> AttnMask:
    """Packed causal documents with a sliding window and global tokens: query ``q`` of a
    document sees the keys ``k <= q`` of its own document with ``q - k <= window``, and
    the document's first ``num_global`` tokens (StreamingLLM's sinks, per document).

    >>> doc_window_global([4, 3], window=1, num_global=1).area   # (1+2+3+3) + (1+2+3)
    15
    """
    lens = _lengths("doc_lens", doc_lens)
    w, g = _nonneg("window", window), _nonneg("num_global", num_global)
    slices, s = [], 0
    for n in lens:
        e = s + n
        slices += shape_to_slices(s, e, s, e, -w, 0)
        slices += shape_to_slices(s, e, s, min(s + g, e), None, -w - 1)
        s = e
    return _mask(slices, s)


def scaled_doc_lengths(total: int, multiple: int = 1) -> list[int]:
    """:data:`DOC_LENGTHS` scaled to ``total`` tokens: each rounded to a multiple of
    ``multiple`` (at least one multiple), the last document takes what is left."""
    g = multiple
    lens = [max(g, int(round(d * total / REFERENCE_TOTAL / g)) * g) for d in DOC_LENGTHS]
    lens[-1] += total - sum(lens)
    if lens[-1] < 1:
        raise ValueError(f"{total} tokens are too few for {len(lens)} documents")
    return lens


def random_doc_lengths(total: int, num_docs: int, seed: int = 0) -> list[int]:
    """``num_docs`` documents of random lengths (1/4 to 4 times the mean) over ``total``
    tokens; the last one takes what is left."""
    rng = np.random.default_rng(seed)
    w = np.exp(rng.uniform(np.log(0.25), np.log(4.0), num_docs))
    lens = np.maximum(1, (w / w.sum() * total).astype(int)).tolist()
    lens[-1] += total - sum(lens)
    if lens[-1] < 1:
        raise ValueError(f"{total} tokens are too few for {len(lens)} documents")
    return lens


def make_mask(
    name: str,
    total: int,
    *,
    window: int = 4096,
    num_docs: int | None = None,
    seed: int = 0,
    block: int | None = None,
    num_global: int | None = None,
    multiple: int = 1,
) -> AttnMask:
    """One of :data:`MASKS` over ``total`` tokens.

    Documents: :func:`scaled_doc_lengths` (``multiple``), or ``num_docs`` random lengths
    (``many-docs``: 64 unless given). ``window``: the window of ``sliding-window``,
    ``doc-window`` and ``global-sliding-window`` (capped at ``total``); ``block``: the block
    of ``block-causal`` (default ``min(window, total // 16)``); ``num_global``: the sink
    tokens of ``global-sliding-window`` and ``doc-window-global`` (default
    ``min(64, total // 64)``), capped at a quarter of each sequence for the context of
    ``hstu`` (whose targets are an eighth of each sequence)."""
    if name not in MASKS:
        raise ValueError(f"--mask {name!r} is not one of {MASKS}")
    w = min(window, total)
    if name == "causal":
        return AttnMask.causal(total)
    if name == "full":
        return AttnMask.full(total)
    if name == "sliding-window":
        return AttnMask.sliding_window(total, w, 0)
    if name == "global-sliding-window":
        g = max(1, min(64, total // 64)) if num_global is None else num_global
        return AttnMask.global_sliding_window(total, w, g)
    if name == "many-docs" and num_docs is None:
        num_docs = 64
    docs = (
        scaled_doc_lengths(total, multiple)
        if num_docs is None
        else random_doc_lengths(total, num_docs, seed)
    )
    cu = np.concatenate([[0], np.cumsum(docs)])
    if name in ("doc-causal", "many-docs"):
        return AttnMask.varlen(cu, causal=True)
    if name == "doc-full":
        return AttnMask.varlen(cu, causal=False)
    if name == "doc-window":
        return AttnMask.varlen(cu, causal=True, window=(w, 0))
    if name == "block-causal":
        return AttnMask.block_causal(docs, max(1, min(w, total // 16)) if block is None else block)
    if name == "prefix-lm":
        return AttnMask.prefix_lm(docs, [d // 4 for d in docs])
    if name == "shared-question":
        return AttnMask.shared_question(docs)
    if name == "hstu":
        g = max(1, min(64, total // 64)) if num_global is None else num_global
        return hstu(docs, [d // 8 for d in docs], [min(g, d // 4) for d in docs])
    if name == "doc-window-global":
        g = max(1, min(64, total // 64)) if num_global is None else num_global
        return doc_window_global(docs, w, g)
    return AttnMask.causal_blockwise(docs)  # causal-blockwise


def zoo(total: int) -> dict[str, AttnMask]:
    """Every mask of :data:`MASKS` over ``total`` tokens, with the defaults of
    :func:`make_mask` (those of the planner CLI)."""
    return {name: make_mask(name, total) for name in MASKS}
