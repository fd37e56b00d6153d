"""Which of ``cudnn`` and ``pallas`` ``"auto"`` takes where both run a call: the committed
table of measurements (``engine_table.json`` beside this module).

A row of the table is one measurement on one GPU kind: a mask class (:func:`mask_class`),
its tokens and documents, and the times of the FFA kernels and of cuDNN on it, forward and
backward (``mode`` ``"fwd+bwd"``; rows of ``"fwd"`` alone are used where no ``"fwd+bwd"``
row exists). ``benchmarks/engine_table.py`` measures and rewrites the rows of the GPU it
runs on; the table holds measured figures only. The choice takes the row of this GPU kind
and mask class nearest the call in tokens and documents (on a log scale) and the engine
that was faster there. Where the table has no row for the GPU kind and class the rule is
the FFA kernels (they run every mask), until a run fills it.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path

from magi_jax.masks import AttnMask
from magi_jax.planning.packed import CAUSAL_DOCS, packed_docs

__all__ = ["TABLE_PATH", "CLASSES", "mask_class", "load_table", "choose", "choose_from"]

TABLE_PATH = Path(__file__).with_name("engine_table.json")
# Mask classes of cuDNN's packed layout: one document over all tokens, or several.
CLASSES = ("full", "causal", "window", "doc_full", "doc_causal", "doc_window")


def mask_class(mask: AttnMask) -> tuple[str, int]:
    """``(class, documents)`` of a mask of cuDNN's packed layout (``ValueError`` for any
    other): ``full``, ``causal``, ``window`` (one causal document with a sliding window)
    over every token, else ``doc_full``, ``doc_causal`` or ``doc_window``."""
    docs, why = packed_docs(mask)
    if docs is None:
        raise ValueError(f"mask: no class of cuDNN's packed layout: {why}")
    kind = "full" if docs.kind != CAUSAL_DOCS else ("window" if docs.window else "causal")
    return (kind if docs.dense else f"doc_{kind}"), docs.num_docs


@functools.cache
def load_table(path: str | None = None) -> tuple[dict, ...]:
    """The rows of the committed table (or of the JSON file at ``path``)."""
    with open(TABLE_PATH if path is None else path) as f:
        return tuple(json.load(f)["rows"])


def choose_from(
    rows: Sequence[dict], device: str, cls: str, tokens: int, docs: int = 1
) -> tuple[str, str]:
    """``(engine, reason)`` by the measurements ``rows`` for a call of mask class ``cls``
    over ``tokens`` query tokens and ``docs`` documents on a GPU of kind ``device``."""
    mine = [r for r in rows if r["device"] == device and r["class"] == cls]
    both = [r for r in mine if r["mode"] == "fwd+bwd"] or mine
    if not both:
        return "pallas", (
            f"no measurement of {cls} masks on {device} in the engine table: the FFA kernels "
            "by rule until benchmarks/engine_table.py measures it"
        )

    def distance(r):
        return abs(math.log(r["tokens"] / tokens)) + abs(math.log(r["docs"] / max(docs, 1)))

    row = min(both, key=distance)
    faster = "cudnn" if row["cudnn_ms"] < row["pallas_ms"] else "pallas"
    return faster, (
        f"engine table: {cls} {row['tokens']} tokens, {row['docs']} documents on {device} "
        f"({row['mode']}): pallas {row['pallas_ms']:.3f} ms, cudnn {row['cudnn_ms']:.3f} ms "
        f"({row['date'][:10]})"
    )


def choose(mask: AttnMask) -> tuple[str, str]:
    """``(engine, reason)`` for ``mask`` on the default device by the committed table."""
    import jax

    cls, docs = mask_class(mask)
    return choose_from(load_table(), jax.devices()[0].device_kind, cls, mask.total_q, docs)
