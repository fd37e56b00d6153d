"""Sequences of different packings within one length: what a training loop feeds a jitted
step. Varlen causal packings, and a mix of the mask zoo's kinds, drawn from a seeded RNG."""

import numpy as np

from magi_jax.mask import AttnMask


def varlen_packings(total: int, count: int, seed: int = 0, max_docs: int = 12):
    """``count`` document-causal masks over ``total`` tokens, random document boundaries."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        cuts = rng.choice(np.arange(1, total), size=int(rng.integers(0, max_docs)), replace=False)
        yield AttnMask.varlen(np.concatenate([[0], np.sort(cuts), [total]]), causal=True)


def mixed_packings(total: int, count: int, seed: int = 0):
    """``count`` masks of mixed kinds (document-causal, full, sliding windows, block-causal,
    prefix-LM, shared question, causal blockwise) over ``total`` tokens."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        n = int(rng.integers(1, 6))
        lens = np.diff(
            np.concatenate(
                [[0], np.sort(rng.choice(np.arange(1, total), n - 1, replace=False)), [total]]
            )
        )
        lens = [int(x) for x in lens]
        kind = i % 7
        if kind == 0:
            yield AttnMask.varlen(np.cumsum([0] + lens), causal=True)
        elif kind == 1:
            yield AttnMask.varlen(np.cumsum([0] + lens), causal=False)
        elif kind == 2:
            yield AttnMask.sliding_window(total, int(rng.integers(0, 40)), int(rng.integers(0, 10)))
        elif kind == 3:
            yield AttnMask.block_causal(lens, int(rng.integers(4, 40)))
        elif kind == 4:
            yield AttnMask.prefix_lm(lens, [int(rng.integers(0, x + 1)) for x in lens])
        elif kind == 5:
            yield AttnMask.shared_question(lens) if len(lens) > 1 else AttnMask.causal(total)
        else:
            yield AttnMask.causal_blockwise(lens)
