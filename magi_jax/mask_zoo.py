"""The benchmark mask zoo: the reference document lengths and the masks built from them.

One definition for the planner CLI, the benchmarks (``benchmarks/*_bench.py``) and the tests.
Host-only NumPy; imports only :mod:`magi_jax.mask`.

>>> sum(DOC_LENGTHS), scaled_doc_lengths(65536)[:3]
(32768, [14080, 10752, 8704])
>>> zoo(4096)["doc-causal"].num_slices
10
"""

from __future__ import annotations

import numpy as np

from magi_jax.mask import AttnMask

__all__ = [
    "DOC_LENGTHS",
    "REFERENCE_TOTAL",
    "MASKS",
    "scaled_doc_lengths",
    "random_doc_lengths",
    "make_mask",
    "zoo",
]

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
)


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
    tokens of ``global-sliding-window`` (default ``min(64, total // 64)``)."""
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
    return AttnMask.causal_blockwise(docs)  # causal-blockwise


def zoo(total: int) -> dict[str, AttnMask]:
    """Every mask of :data:`MASKS` over ``total`` tokens, with the defaults of
    :func:`make_mask` (those of the planner CLI)."""
    return {name: make_mask(name, total) for name in MASKS}
