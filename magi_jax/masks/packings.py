"""Realistic packings: document lengths drawn from published statistics of public corpora,
and the masks and segment ids of the sequences they pack into.

Host-only NumPy (no JAX), so that data-loader processes can draw packings and plan them.
A *packing* is a sequence of ``total`` tokens cut into documents; every document attends
only to itself (:meth:`magi_jax.AttnMask.varlen`). :func:`sample_doc_lens` draws document
lengths until the sequence is full and cuts the last document to fit, the way a
concatenate-and-split loader fills a row.

Two length distributions are provided, both as :class:`LengthMix` objects:

**Web text** (:data:`WEB_TEXT`): one log-normal, median 340 tokens, ``sigma`` 1.2, so the
mean is 700 tokens and a quarter of the documents are longer than 770 tokens while a few in
a thousand pass 10k. The mean comes from public token and document counts of web corpora:
FineWeb's published 200k-document sample holds about 140M GPT-2 tokens (700 a document),
and C4's English training split is 364,868,892 documents of 828.6 GB of text, about 2,270
bytes or 500-570 tokens a document at 4-4.5 bytes a token. Published document-length
histograms of web and code corpora (Ding et al. 2024, "Fewer Truncations Improve Language
Modeling"; Pouransari et al. 2024, "Dataset Decomposition") show the shape a log-normal
has: most documents short, the mode a few hundred tokens, and a long tail that carries a
large share of the tokens. ``sigma`` is our choice within that shape (the median is not a
published figure); with it a 32k packing holds about 48 documents and a 128k packing about
190.

**Long-context mixture** (:data:`LONG_CONTEXT`): the 64K recipe of ProLong (Gao et al.
2024, "How to Train Long-Context Language Models (Effectively)"): 60 % of the tokens from
long documents (30 % code repositories concatenated file by file, 30 % books) and 40 % from
short data (web text, Q&A, Wikipedia, papers, math, instructions), which we draw from the
web-text distribution. Books run to a hundred thousand tokens and repositories span orders
of magnitude, so the long part is a log-normal of median 24k tokens and ``sigma`` 1.0
(mean about 40k); a long document longer than the packing is cut to it, as the recipe cuts
its sources into fixed-length chunks. Documents are chosen long or short one at a time, with
the probability that makes the long share of the tokens 60 % in expectation at the packing's
length (:meth:`LengthMix.token_shares`).

``benchmarks/README.md`` cites the sources; the benchmarks draw their realistic presets
from here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from magi_jax.masks._checks import check_doc_lens, check_total
from magi_jax.masks._mask import AttnMask

__all__ = [
    "LogNormalLengths",
    "LengthMix",
    "WEB_TEXT",
    "LONG_CONTEXT",
    "MIXES",
    "sample_doc_lens",
    "equal_doc_lens",
    "cu_seqlens",
    "segment_ids",
    "packing_mask",
]


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclasses.dataclass(frozen=True)
class LogNormalLengths:
    """Document lengths ``max(min_len, round(X))`` with ``log X ~ Normal(log median, sigma)``.

    ``median`` (tokens, > 0), ``sigma`` (> 0, the spread of ``log X``), ``min_len`` (>= 1,
    the shortest document a corpus keeps after filtering)."""

    median: float
    sigma: float
    min_len: int = 1

    def __post_init__(self):
        if not (self.median > 0 and math.isfinite(self.median)):
            raise ValueError(f"median={self.median!r} must be a positive number of tokens")
        if not (self.sigma > 0 and math.isfinite(self.sigma)):
            raise ValueError(f"sigma={self.sigma!r} must be a positive number")
        if int(self.min_len) != self.min_len or self.min_len < 1:
            raise ValueError(f"min_len={self.min_len!r} must be an int >= 1")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` lengths, int64 ``[n]``."""
        x = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.maximum(np.rint(x), self.min_len).astype(np.int64)

    def mean(self, cap: float = math.inf) -> float:
        """The mean of ``min(X, cap)`` (``min_len`` and rounding ignored): what one document
        contributes, on average, to a packing of ``cap`` tokens."""
        mu, s = math.log(self.median), self.sigma
        full = math.exp(mu + s * s / 2)
        if not math.isfinite(cap):
            return full
        z = (math.log(cap) - mu) / s
        return full * _normal_cdf(z - s) + cap * (1.0 - _normal_cdf(z))


@dataclasses.dataclass(frozen=True)
class LengthMix:
    """Documents drawn from several length distributions, each given the share of the
    *tokens* it supplies (shares > 0, summing to 1)."""

    name: str
    parts: tuple[LogNormalLengths, ...]
    shares: tuple[float, ...]

    def __post_init__(self):
        if len(self.parts) == 0 or len(self.parts) != len(self.shares):
            raise ValueError(
                f"LengthMix {self.name!r}: give one token share per part; got "
                f"{len(self.parts)} parts and {len(self.shares)} shares"
            )
        if any(not (s > 0) for s in self.shares) or abs(sum(self.shares) - 1.0) > 1e-9:
            raise ValueError(
                f"LengthMix {self.name!r}: shares={self.shares} must be > 0 and sum to 1"
            )

    def doc_probs(self, total: int) -> np.ndarray:
        """The probability that a document is drawn from each part, float64 ``[parts]``, so
        that the parts' token shares at a packing of ``total`` tokens are ``shares`` in
        expectation (a part's documents counted as cut to ``total``)."""
        w = np.array([s / p.mean(total) for p, s in zip(self.parts, self.shares)])
        return w / w.sum()

    def token_shares(self, total: int) -> np.ndarray:
        """The expected token share of each part at a packing of ``total`` tokens (equal to
        ``shares``; the check of :meth:`doc_probs`)."""
        t = self.doc_probs(total) * np.array([p.mean(total) for p in self.parts])
        return t / t.sum()

    def mean(self, total: int) -> float:
        """The expected length of one document in a packing of ``total`` tokens."""
        return float(self.doc_probs(total) @ np.array([p.mean(total) for p in self.parts]))


_WEB = LogNormalLengths(median=340.0, sigma=1.2, min_len=16)
_LONG = LogNormalLengths(median=24_000.0, sigma=1.0, min_len=16)

WEB_TEXT = LengthMix("web", (_WEB,), (1.0,))
LONG_CONTEXT = LengthMix("long", (_LONG, _WEB), (0.6, 0.4))
# The mixes by name (the benchmarks' flags).
MIXES = {m.name: m for m in (WEB_TEXT, LONG_CONTEXT)}


def _as_mix(mix: LengthMix | str) -> LengthMix:
    if isinstance(mix, LengthMix):
        return mix
    if isinstance(mix, str) and mix in MIXES:
        return MIXES[mix]
    raise ValueError(f"mix={mix!r} must be a LengthMix or one of {sorted(MIXES)}")


def sample_doc_lens(
    total: int, rng: np.random.Generator | int, mix: LengthMix | str = WEB_TEXT
) -> np.ndarray:
    """Document lengths of one packing of ``total`` tokens, int64 ``[num_docs]`` summing to
    ``total`` (every length >= 1; the last document cut to fit).

    ``rng``: a NumPy ``Generator`` (or a seed for one); the same generator state gives the
    same packing. ``mix``: :data:`WEB_TEXT`, :data:`LONG_CONTEXT`, their names ``"web"`` /
    ``"long"``, or any :class:`LengthMix`.

    >>> lens = sample_doc_lens(32768, np.random.default_rng(0))
    >>> int(lens.sum()), 20 < lens.size < 90
    (32768, True)
    """
    total = check_total("total", total)
    mix = _as_mix(mix)
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    if total == 0:
        return np.zeros((0,), np.int64)
    probs = mix.doc_probs(total)
    out, filled = [], 0
    while filled < total:
        # One batch of documents expected to fill what is left, with room to spare.
        n = int(math.ceil(1.5 * (total - filled) / mix.mean(total))) + 8
        which = rng.choice(len(mix.parts), size=n, p=probs)
        lens = np.empty((n,), np.int64)
        for i, part in enumerate(mix.parts):
            pick = which == i
            lens[pick] = part.sample(rng, int(pick.sum()))
        ends = filled + np.cumsum(lens)
        stop = int(np.searchsorted(ends, total))  # first document reaching the end
        if stop < n:
            lens = lens[: stop + 1].copy()
            lens[-1] -= int(ends[stop]) - total
            out.append(lens)
            break
        out.append(lens)
        filled = int(ends[-1])
    return np.concatenate(out)


def equal_doc_lens(total: int, num_docs: int) -> np.ndarray:
    """``num_docs`` documents of equal length (the first ``total % num_docs`` one token
    longer), int64 ``[num_docs]`` summing to ``total``: the stress case of many short
    documents.

    >>> equal_doc_lens(10, 4).tolist()
    [3, 3, 2, 2]
    """
    total = check_total("total", total)
    if int(num_docs) != num_docs or not 1 <= num_docs <= max(total, 1):
        raise ValueError(
            f"num_docs={num_docs!r} must be an int in [1, total={total}]: every document "
            "holds at least one token"
        )
    base, extra = divmod(total, int(num_docs))
    lens = np.full((int(num_docs),), base, np.int64)
    lens[:extra] += 1
    return lens


def cu_seqlens(doc_lens: np.ndarray) -> np.ndarray:
    """Cumulative lengths ``[0, n0, n0+n1, ...]``, int32 ``[num_docs + 1]`` (FlashAttention's
    and :meth:`magi_jax.AttnMask.varlen`'s ``cu_seqlens``)."""
    lens = np.asarray(check_doc_lens(doc_lens), np.int64)
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def segment_ids(doc_lens: np.ndarray) -> np.ndarray:
    """Per-token document ids ``1, 2, ...`` (0 is padding), int32 ``[sum(doc_lens)]`` (the
    ``segment_ids`` of ``jax.nn.dot_product_attention`` and
    :func:`magi_jax.dot_product_attention`)."""
    lens = np.asarray(check_doc_lens(doc_lens), np.int64)
    return np.repeat(np.arange(1, lens.size + 1, dtype=np.int32), lens)


def packing_mask(
    doc_lens: np.ndarray, causal: bool = True, window: int | tuple[int, int] | None = None
) -> AttnMask:
    """The mask of a packing: each document attends only to itself, causally (default) or
    fully, optionally within a sliding ``window`` inside each document (as in
    :meth:`magi_jax.AttnMask.varlen`, whose mask this is)."""
    return AttnMask.varlen(cu_seqlens(doc_lens), causal=causal, window=window)
