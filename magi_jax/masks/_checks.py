"""The checks of a mask's arguments: ranges, types, totals, document lengths, windows, and
that slices stay inside their totals and share no cell. Every error names the argument, the
value and the fix. Host-only NumPy; :mod:`magi_jax.masks` runs them when it builds a mask.
"""

from __future__ import annotations

import numpy as np

from magi_jax.masks.slices import AttnMaskType, SliceShapes

# Overlap validation processes (row band, slice) pairs in chunks of this many.
_OVERLAP_CHUNK = 1 << 22


def as_ranges(name: str, ranges: object) -> np.ndarray:
    """``ranges`` (argument ``name``) as int64 ``[N, 2]`` half-open ``(start, end)`` pairs of
    non-negative int32 token positions (integral floats accepted)."""
    arr = np.asarray(ranges)
    if arr.size == 0:
        arr = arr.reshape(0, 2)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{name} must have shape [N, 2] (start, end) pairs; got shape {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"{name} must hold integer token positions; got dtype {arr.dtype}")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError(f"{name} must hold integer token positions; got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        bad = int(np.argmax((arr < 0).any(axis=1) | (arr > np.iinfo(np.int32).max).any(axis=1)))
        raise ValueError(
            f"{name}[{bad}] = {arr[bad].tolist()} is outside [0, 2**31): token "
            "positions must be non-negative int32"
        )
    return arr


def _fmt_slice(i: int, qr, kr, t) -> str:
    return (
        f"slice {i} (q_range=[{int(qr[0])}, {int(qr[1])}), k_range=[{int(kr[0])}, "
        f"{int(kr[1])}), type={AttnMaskType(int(t)).name})"
    )


def as_types(types: object, n: int) -> np.ndarray:
    """``types`` (one type for all ``n`` slices, or one per slice: names, ints 0-3 or
    :class:`AttnMaskType`) as int64 ``[n]``."""
    if isinstance(types, (str, AttnMaskType, int, np.integer)):
        return np.full((n,), int(AttnMaskType.coerce(types)), np.int64)
    try:
        seq = list(types) if not isinstance(types, np.ndarray) else types.reshape(-1).tolist()
    except TypeError:
        raise ValueError(
            f"types={types!r} must be one mask type (a name such as 'causal', an "
            "int 0-3 or an AttnMaskType) or one per slice"
        ) from None
    if len(seq) != n:
        raise ValueError(
            f"types has {len(seq)} entries but there are {n} slices; give one "
            "type per slice or a single type for all"
        )
    out = np.empty((n,), np.int64)
    for i, t in enumerate(seq):
        try:
            out[i] = int(AttnMaskType.coerce(t))
        except ValueError as e:
            raise ValueError(f"types[{i}]: {e}") from None
    return out


def drop_empty_past_end(
    qr: np.ndarray,
    kr: np.ndarray,
    types: np.ndarray,
    total_q: int | None,
    total_k: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The slices without those that have an empty range (``start == end``) ending past its
    total: they hold no cell, and sub-mask code produces them (``[9, 9)`` with
    ``total_k = 7``). Empty ranges inside ``[0, total]`` stay, as every empty range does
    when the totals are not given."""
    # A reversed range is an error whatever the other range holds (check_bounds says so).
    drop = np.zeros(len(qr), bool)
    ordered = (qr[:, 0] <= qr[:, 1]) & (kr[:, 0] <= kr[:, 1])
    for ranges, total in ((qr, total_q), (kr, total_k)):
        if total is not None:
            drop |= ordered & (ranges[:, 0] == ranges[:, 1]) & (ranges[:, 1] > total)
    if not drop.any():
        return qr, kr, types
    keep = ~drop
    return qr[keep], kr[keep], types[keep]


def check_bounds(
    name: str,
    ranges: np.ndarray,
    total: int,
    total_name: str,
    other: np.ndarray,
    types: np.ndarray,
) -> None:
    """Raises ``ValueError`` at the first of ``ranges`` (int ``[N, 2]``, argument ``name``)
    that is reversed or ends past ``total``; ``other`` (the slices' other ranges) and
    ``types`` (int ``[N]``) name the slice in the message."""
    if not len(ranges):
        return
    rev = ranges[:, 0] > ranges[:, 1]
    if rev.any():
        i = int(np.argmax(rev))
        raise ValueError(
            f"{name}[{i}] = [{ranges[i, 0]}, {ranges[i, 1]}) is reversed (start > "
            f"end) in {_fmt_slice(i, *_order(name, ranges[i], other[i]), types[i])};"
            " ranges are half-open [start, end) with start <= end"
        )
    oob = ranges[:, 1] > total
    if oob.any():
        i = int(np.argmax(oob))
        raise ValueError(
            f"{name}[{i}] = [{ranges[i, 0]}, {ranges[i, 1]}) ends past "
            f"{total_name}={total} in "
            f"{_fmt_slice(i, *_order(name, ranges[i], other[i]), types[i])}; "
            f"raise {total_name} or fix the range"
        )


def _order(name, this, other):
    return (this, other) if name == "q_ranges" else (other, this)


def check_disjoint(
    shapes: SliceShapes, q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray
) -> None:
    """Raises ``ValueError`` if two slices share a cell: ``shapes`` the slices' canonical
    form, ``q_ranges``/``k_ranges`` int ``[N, 2]`` and ``types`` int ``[N]`` the slices as given
    (for the message).

    Rows are cut into bands at every slice's first and last row. Inside a band each active
    slice's row interval ``[lo(q), hi(q)]`` moves linearly, so sorting the active slices by
    their interval on the band's first row and checking neighbours on its first and last
    rows is exact. Cost O((N + P) log(N + P)) with P the number of (band, active slice)
    pairs — linear for document-like masks, with no pairwise scan."""
    sh = shapes
    idx = np.nonzero(sh.nonempty)[0]
    if len(idx) < 2:
        return
    q0, q1 = sh.q0[idx], sh.q1[idx]
    bounds = np.unique(np.concatenate([q0, q1]))
    first_band = np.searchsorted(bounds, q0)
    end_band = np.searchsorted(bounds, q1)  # exclusive
    # Active slices per band, to cut the bands into chunks of bounded work.
    active = np.zeros(len(bounds), np.int64)
    np.add.at(active, first_band, 1)
    np.add.at(active, end_band, -1)
    per_band = np.cumsum(active)[:-1]
    cum = np.cumsum(per_band)
    b_lo = 0
    while b_lo < len(per_band):
        base = cum[b_lo - 1] if b_lo else 0
        b_hi = max(int(np.searchsorted(cum, base + _OVERLAP_CHUNK, side="right")), b_lo + 1)
        sel = np.nonzero((first_band < b_hi) & (end_band > b_lo))[0]
        fb = np.maximum(first_band[sel], b_lo)
        n = np.minimum(end_band[sel], b_hi) - fb
        pair_slice = np.repeat(sel, n)
        pair_band = np.repeat(fb, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
        _check_band_pairs(shapes, (q_ranges, k_ranges, types), idx, pair_slice, pair_band, bounds)
        b_lo = b_hi


def _check_band_pairs(sh, given, idx, pair_slice, pair_band, bounds):
    s = idx[pair_slice]
    r0 = bounds[pair_band]
    r1 = bounds[pair_band + 1] - 1
    lo0, hi0 = sh.lo(r0, s), sh.hi(r0, s)
    lo1, hi1 = sh.lo(r1, s), sh.hi(r1, s)
    order = np.lexsort((hi0, lo0, pair_band))
    same = pair_band[order][1:] == pair_band[order][:-1]
    a, b = order[:-1], order[1:]
    clash = same & ((hi0[a] >= lo0[b]) | (hi1[a] >= lo1[b]))
    if clash.any():
        j = int(np.argmax(clash))
        i1, i2 = sorted((int(s[a[j]]), int(s[b[j]])))
        row = int(r0[a[j]]) if hi0[a[j]] >= lo0[b[j]] else int(r1[a[j]])
        qr, kr, ty = given
        raise ValueError(
            f"{_fmt_slice(i1, qr[i1], kr[i1], ty[i1])} and "
            f"{_fmt_slice(i2, qr[i2], kr[i2], ty[i2])} overlap (first shared cells near query "
            f"row {row}); slices must cover disjoint cells — split or trim one of them"
        )


def check_total(name: str, value: object) -> int:
    """A sequence length argument: a non-negative integer."""
    value = value.item() if isinstance(value, np.generic) else value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        if not (isinstance(value, (float, np.floating)) and float(value).is_integer()):
            raise ValueError(f"{name}={value!r} must be an integer number of tokens")
    if value < 0:
        raise ValueError(f"{name}={int(value)} must be >= 0 (a number of tokens)")
    return int(value)


def check_cu_seqlens(cu_seqlens: object) -> np.ndarray:
    """``cu_seqlens`` as int64 ``[num_docs + 1]``, validated (1-D, integers, starts at 0,
    non-decreasing)."""
    arr = np.asarray(cu_seqlens)
    if arr.ndim != 1:
        raise ValueError(
            f"cu_seqlens must be 1-D [num_docs + 1] cumulative lengths [0, n0, n0+n1, ...]; "
            f"got shape {arr.shape}. For a batch of rows, pack them into one sequence (one "
            "cu_seqlens over all the documents, row after row) or use "
            "AttnMask.from_segment_ids with [B, T] segment ids"
        )
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise ValueError(f"cu_seqlens must hold integers; got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.floating) and not np.all(np.mod(arr, 1) == 0):
        bad = int(np.argmax(np.mod(arr, 1) != 0))
        raise ValueError(
            f"cu_seqlens[{bad}] = {arr[bad].item()!r} is not an integer; "
            "cu_seqlens are token offsets"
        )
    cu = arr.astype(np.int64)
    if cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(
            f"cu_seqlens must start at 0 and be non-decreasing; got {cu.tolist()[:16]}"
        )
    return cu


def check_doc_lens(doc_lens: object) -> list[int]:
    """``doc_lens`` (an int or a list of document lengths) as a list of ints >= 0."""
    arr = np.asarray(doc_lens)
    if not (
        np.issubdtype(arr.dtype, np.integer)
        or (np.issubdtype(arr.dtype, np.floating) and np.all(np.mod(arr, 1) == 0))
    ):
        raise ValueError(f"doc_lens must be integer document lengths; got {doc_lens!r}")
    lens = arr.astype(np.int64).reshape(-1)
    if np.any(lens < 0):
        raise ValueError(f"doc_lens must be >= 0; got {lens.tolist()[:16]}")
    return lens.tolist()


def window_bounds(
    window: int | tuple[int, int] | None, causal: bool
) -> tuple[int | None, int | None]:
    """The one parser of a ``window=`` argument: ``(left, right)`` extents (``None``:
    unbounded); an int ``w`` is ``(w, 0)`` when causal, ``(w, w)`` otherwise."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal={causal!r} must be True or False")
    if window is None:
        return (None, 0) if causal else (None, None)
    if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
        left, right = int(window), (0 if causal else int(window))
    else:
        try:
            left, right = window
            if any(isinstance(w, bool) or int(w) != w for w in (left, right)):
                raise ValueError
            left, right = int(left), int(right)
        except (TypeError, ValueError):
            raise ValueError(
                f"window must be an int or a (left, right) pair of ints; got {window!r}"
            ) from None
    if left < 0 or right < 0:
        raise ValueError(f"window=(left={left}, right={right}) must be >= 0")
    if causal and right != 0:
        raise ValueError(
            f"window right extent {right} contradicts causal=True; use "
            "causal=False with window=(left, right), or right=0"
        )
    return left, right
