"""Pictures of masks and context-parallel plans (matplotlib, PNG).

- :func:`plot_mask` (``mask.plot(path)``): the mask as a query × key picture, every slice
  filled in the colour of its type and outlined with its rectangle ``q_range × k_range``.
- :func:`plot_plan` (``key.plot(path)``): which rank owns which chunk of the sequence, the
  attention work (mask cells) of every rank split by stage, and for every remote stage the
  rank-to-rank matrix of KV tokens that the group-cast moves.

Host-only: works on a plan built without devices (``magi_jax.plan`` does that for cp 64 on
a laptop). Needs the ``plot`` extra (``pip install magi-jax[plot]``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from magi_jax.masks.slices import AttnMaskType

if TYPE_CHECKING:  # annotations only (matplotlib is an extra; mask, planner and keys sit above)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from magi_jax.masks import AttnMask
    from magi_jax.planning.cast_table import CastTable
    from magi_jax.planning.stages import DistPlan
    from magi_jax.sharding.keys import MagiKey

__all__ = ["plot_mask", "plot_plan", "plot_key", "remote_kv_matrix"]

# Colours of the slice types (colour-blind friendly: Okabe-Ito).
_TYPE_COLOURS = {
    AttnMaskType.FULL: "#0072B2",
    AttnMaskType.CAUSAL: "#E69F00",
    AttnMaskType.INV_CAUSAL: "#009E73",
    AttnMaskType.BI_CAUSAL: "#CC79A7",
}
# Up to this many tokens per side the mask is drawn cell by cell; above, as polygons.
_MAX_CELL_IMAGE = 2048
# Slices are numbered in the picture when there are at most this many.
_MAX_LABELS = 40


def _figure(figsize, dpi):
    """A figure that is not registered with pyplot: nothing to close, no GUI backend needed,
    and Jupyter still shows it when a cell returns it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("magi_jax.plot needs matplotlib: pip install 'magi-jax[plot]'") from e
    return Figure(figsize=figsize, dpi=dpi)


def _fmt_tokens(n: int) -> str:
    for unit, div in (("M", 1 << 20), ("k", 1 << 10)):
        if n >= div and n % (div // 16) == 0:
            return f"{n / div:g}{unit}"
    return f"{n:,}"


def _fmt_count(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def plot_mask(
    mask: AttnMask,
    path: str | os.PathLike | None = None,
    *,
    title: str | None = None,
    ax: Axes | None = None,
    figsize: tuple[float, float] = (7, 7),
    dpi: int = 100,
    label_slices: bool | None = None,
) -> Figure:
    """Draws ``mask`` (queries down, keys across, like the dense matrix) and writes a PNG to
    ``path`` (when given). Each slice is filled in its type's colour and outlined with its
    rectangle; slices are numbered when there are few. Returns the matplotlib figure."""
    from matplotlib.patches import Patch, Polygon, Rectangle

    own = ax is None
    if own:
        fig = _figure(figsize, dpi)
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    tq, tk = mask.total_q, mask.total_k
    sh = mask.shapes
    types = np.asarray(mask.types)
    live = np.nonzero(sh.nonempty)[0]
    if max(tq, tk) <= _MAX_CELL_IMAGE:
        # Cell-exact image: every cell coloured by the type of the slice holding it.
        img = np.ones((tq, tk, 4))
        cols = np.arange(tk)
        for s in live:
            rows = np.arange(sh.q0[s], sh.q1[s])
            inside = (cols[None, :] >= sh.lo(rows, s)[:, None]) & (
                cols[None, :] <= sh.hi(rows, s)[:, None]
            )
            rgba = np.array(_rgba(_TYPE_COLOURS[AttnMaskType(int(types[s]))]))
            img[sh.q0[s] : sh.q1[s]][inside] = rgba
        ax.imshow(img, extent=(0, tk, tq, 0), interpolation="nearest", aspect="auto")
    else:
        for s in live:
            q0, q1 = int(sh.q0[s]), int(sh.q1[s])
            lo0, lo1 = int(sh.lo(q0, s)), int(sh.lo(q1 - 1, s))
            hi0, hi1 = int(sh.hi(q0, s)) + 1, int(sh.hi(q1 - 1, s)) + 1
            ax.add_patch(
                Polygon(
                    [(lo0, q0), (hi0, q0), (hi1, q1), (lo1, q1)],
                    closed=True,
                    facecolor=_TYPE_COLOURS[AttnMaskType(int(types[s]))],
                    edgecolor="none",
                    linewidth=0,
                )
            )
    n = mask.num_slices
    label = n <= _MAX_LABELS if label_slices is None else label_slices
    lw = 1.0 if n <= 200 else 0.4
    for i, ((qs, qe), (ks, ke)) in enumerate(zip(mask.q_ranges, mask.k_ranges)):
        ax.add_patch(
            Rectangle(
                (ks, qs),
                ke - ks,
                qe - qs,
                fill=False,
                edgecolor="0.25",
                linewidth=lw,
                linestyle="--",
            )
        )
        if label:
            ax.text(
                (ks + ke) / 2,
                (qs + qe) / 2,
                str(i),
                ha="center",
                va="center",
                fontsize=8,
                color="black",
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.7),
            )
    ax.set_xlim(0, tk)
    ax.set_ylim(tq, 0)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    present = sorted({AttnMaskType(int(t)) for t in types[live]})
    handles = [Patch(facecolor=_TYPE_COLOURS[t], label=t.name) for t in present]
    handles.append(
        Patch(facecolor="white", edgecolor="0.25", linestyle="--", label="slice rectangle")
    )
    ax.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.9)
    dense = tq * tk
    ax.set_title(
        title
        or (
            f"{n} slices over {_fmt_tokens(tq)} × {_fmt_tokens(tk)} tokens; "
            f"area {_fmt_count(mask.area)} cells "
            f"({100 * mask.area / max(dense, 1):.1f}% of dense)"
        ),
        fontsize=10,
    )
    if own:
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=dpi)
    return fig


def _rgba(colour):
    from matplotlib.colors import to_rgba

    return to_rgba(colour)


def remote_kv_matrix(cast: CastTable) -> np.ndarray:
    """int64 ``[cp, cp]``: ``m[dst, src]`` = KV tokens rank ``src`` sends to rank ``dst`` in
    one stage's group-cast table (:class:`~magi_jax.planning.cast_table.CastTable`)."""
    cp = cast.cp
    counts = (np.asarray(cast.send_index) >= 0).sum(axis=2)  # [cp src, slots]
    m = np.zeros((cp, cp), np.int64)
    for j, shift in enumerate(cast.shifts):
        src = np.arange(cp)
        np.add.at(m, ((src + shift) % cp, src), counts[:, j])
    return m


def plot_plan(
    plan: DistPlan,
    path: str | os.PathLike | None = None,
    *,
    mask: AttnMask | None = None,
    title: str | None = None,
    figsize: tuple[float, float] = (12, 10),
    dpi: int = 100,
) -> Figure:
    """Draws a distributed plan (:class:`~magi_jax.planning.stages.DistPlan`): (1) which
    rank owns each chunk, (2) attention work per rank split into the host stage (local KV)
    and the remote stages, against the mean, (3) per remote stage, KV tokens moved from every
    rank to every rank. Writes a PNG of ``figsize × dpi`` pixels to ``path`` (when given) and
    returns the figure."""
    from matplotlib import colormaps

    meta = plan.meta
    cp, c = meta.cp, meta.chunk_size
    remote_stages = [s for s in plan.stages if s.cast is not None]
    n_mat = max(len(remote_stages), 1)
    n_cols = max(n_mat + 1, 4)  # bottom row: a summary, then one matrix per stage
    fig = _figure(figsize, dpi)
    grid = fig.add_gridspec(
        3,
        n_cols,
        height_ratios=[1.1, 1.0, 1.35],
        hspace=0.55,
        wspace=0.3,
        left=0.07,
        right=0.95,
        top=0.9,
        bottom=0.06,
        width_ratios=[1.5] + [1] * (n_cols - 1),
    )
    rank_cmap = colormaps["tab10" if cp <= 10 else "tab20"]

    # (1) Ownership: one row per rank, a bar for every chunk it holds.
    ax = fig.add_subplot(grid[0, :])
    # Chunks narrower than a few pixels are drawn wider so that every one stays visible.
    width = max(c, meta.padded_total / 300)
    for r in range(cp):
        bars = [(int(ch) * c, width) for ch in meta.rank_chunks[r]]
        ax.broken_barh(
            bars, (r - 0.4, 0.8), facecolors=rank_cmap(r % rank_cmap.N), edgecolors="none"
        )
    if meta.padded_total > meta.total:
        ax.axvspan(meta.total, meta.padded_total, color="0.85", zorder=0)
        ax.text(meta.padded_total, cp - 0.5, " padding", ha="left", va="top", fontsize=8)
    if mask is not None:
        # Where slices start and end along the queries (document boundaries of varlen masks).
        edges = np.unique(np.asarray(mask.q_ranges).reshape(-1))
        edges = edges[(edges > 0) & (edges < meta.total)]
        if 0 < len(edges) <= 128:
            ax.vlines(
                edges,
                -0.5,
                cp - 0.5,
                colors="0.55",
                linewidths=0.6,
                linestyles=":",
                zorder=0,
                label="slice boundary (e.g. document)",
            )
            ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 1.22), frameon=False)
    ax.set_xlim(0, meta.padded_total)
    ax.set_ylim(cp - 0.5, -0.5)
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _fmt_count(x)))
    ax.set_xlabel(
        "token position in the packed sequence"
        + (" (small chunks drawn wider)" if width > c else "")
    )
    ax.set_ylabel("rank")
    if cp > 16:
        ax.set_yticks(np.arange(0, cp, max(1, cp // 8)))
    else:
        ax.set_yticks(np.arange(cp))
    ax.set_title(
        f"dispatch: {meta.num_chunks} chunks of {c:,} tokens, "
        f"{meta.chunks_per_rank} per rank ({meta.local_len:,} tokens each), "
        f"algorithm '{meta.algorithm}'",
        fontsize=10,
    )

    # (2) Work per rank, stacked by stage.
    ax = fig.add_subplot(grid[1, :])
    bottom = np.zeros(cp)
    stage_cmap = colormaps["Blues"]
    for i, st in enumerate(plan.stages):
        if st.cast is None:
            name, colour = "host stage (local KV)", "#555555"
        elif len(plan.stages) == 1:
            name, colour = "one stage (local + all remote KV)", "#555555"
        else:
            name = f"remote stage {i - 1}"
            colour = stage_cmap(0.35 + 0.6 * (i - 1) / max(1, len(plan.stages) - 2))
        ax.bar(
            np.arange(cp),
            st.area,
            bottom=bottom,
            color=colour,
            label=name,
            width=0.8 if cp <= 32 else 1.0,
            edgecolor="none",
        )
        bottom += st.area
    mean = bottom.mean()
    ax.axhline(
        mean, color="crimson", linestyle="--", linewidth=1, label=f"mean {_fmt_count(mean)} cells"
    )
    ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: _fmt_count(x)))
    ax.set_xlim(-0.6, cp - 0.4)
    ax.set_ylim(0, max(bottom.max(), 1) * 1.25)
    ax.set_xlabel("rank")
    ax.set_ylabel("mask cells (work)")
    imbalance = bottom.max() / mean if mean else 1.0
    ax.set_title(
        f"attention work per rank: max/mean = {imbalance:.4f} (1.0 = perfectly balanced)",
        fontsize=10,
    )
    ax.legend(fontsize=8, ncol=min(len(plan.stages) + 1, 6), loc="upper center")

    # (3) A summary, then the remote KV of every stage.
    ax = fig.add_subplot(grid[2, 0])
    ax.set_axis_off()
    rem = plan.remote_tokens
    ring = (cp - 1) * meta.local_len  # KV tokens ring attention brings to every rank
    lines = [
        f"ranks (cp): {cp}",
        f"tokens: {meta.total:,}"
        + (f" (+{meta.padded_total - meta.total:,} pad)" if meta.padded_total > meta.total else ""),
        f"work max/mean: {imbalance:.4f}",
        f"stages: {len(plan.stages)} (overlap degree {plan.overlap_degree})",
        "remote KV tokens per rank:",
        f"  max {_fmt_count(int(rem.max()))}, mean {_fmt_count(float(rem.mean()))}",
        f"  ring attention: {_fmt_count(ring)}",
        f"  ({100 * rem.max() / max(ring, 1):.1f}% of ring's)",
    ]
    ax.text(
        -0.05,
        1.0,
        "\n".join(lines),
        ha="left",
        va="top",
        fontsize=8.5,
        family="monospace",
        transform=ax.transAxes,
    )
    mats = [remote_kv_matrix(s.cast) for s in remote_stages]
    vmax = max([int(m.max()) for m in mats] + [1])
    mat_axes = []
    for i in range(n_mat):
        ax = fig.add_subplot(grid[2, 1 + i])
        if not mats:
            ax.text(
                0.5,
                0.5,
                "no remote KV:\nevery rank's queries\nsee only local keys",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
            ax.set_axis_off()
            continue
        m = mats[i]
        im = ax.imshow(
            np.where(m > 0, m, np.nan),
            cmap="viridis",
            vmin=0,
            vmax=vmax,
            interpolation="nearest",
            extent=(-0.5, cp - 0.5, cp - 0.5, -0.5),
        )
        ax.set_xlabel("from rank (KV owner)", fontsize=8)
        if i == 0:
            ax.set_ylabel("to rank (needs the KV)", fontsize=8)
        name = "remote KV" if len(plan.stages) == 1 else f"remote stage {i}"
        ax.set_title(f"{name}: {_fmt_count(int(m.sum()))}\nKV tokens moved", fontsize=9)
        if cp <= 16:
            ax.set_xticks(np.arange(cp))
            ax.set_yticks(np.arange(cp))
        ax.tick_params(labelsize=7)
        mat_axes.append(ax)
    if mats:
        cb = fig.colorbar(im, ax=mat_axes, fraction=0.03, pad=0.02)
        cb.set_label("tokens (blank = none)", fontsize=8)
        cb.ax.tick_params(labelsize=7)
    head = title or "context-parallel plan"
    mask_txt = (
        ""
        if mask is None
        else (f"mask: {mask.num_slices} slices over {_fmt_tokens(mask.total_q)} tokens · ")
    )
    fig.suptitle(
        f"{head}\n{mask_txt}cp = {cp} · overlap degree {plan.overlap_degree} · "
        f"remote KV per rank max {_fmt_count(int(plan.remote_tokens.max()))} tokens",
        fontsize=11,
    )
    if path is not None:
        fig.savefig(path, dpi=dpi)
    return fig


def plot_key(key: MagiKey, path: str | os.PathLike | None = None, **kwargs: Any) -> Figure:
    """:func:`plot_plan` of a :class:`~magi_jax.sharding.MagiKey`'s plan and mask."""
    return plot_plan(key.plan, path, mask=key.mask, **kwargs)
