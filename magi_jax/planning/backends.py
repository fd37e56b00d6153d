"""The attention engines' host specs: one registry every entry point reads (host; no JAX).

An engine is what runs one attention call: ``pallas`` (the Mosaic GPU FFA kernels, sm90),
``xla`` (the portable blockwise FFA) and ``cudnn`` (cuDNN's fused attention over packed
documents, for the masks its packed layout expresses). Its host half, a :class:`HostSpec`,
is what planning needs: the name, whether it reads work lists
(:mod:`magi_jax.planning.work_list`) and on which tiles, and the ``xla`` engine's lane
length. :data:`HOST_SPECS` lists them in the order ``"auto"`` prefers them; the device half
(what can run where, the forward and backward, the fallback) is
:mod:`magi_jax.ffa.backends`, the one registry on the device side.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "AUTO",
    "HostSpec",
    "HOST_SPECS",
    "BACKENDS",
    "check_backend",
    "host_spec",
    "backend_blocks",
    "default_block_sizes",
    "FWD_BLOCK_Q",
    "FWD_BLOCK_K",
    "DKV_BLOCK_Q",
    "DKV_BLOCK_K",
]

AUTO = "auto"

# Tile sizes the Mosaic GPU kernels are built for. Forward and dQ: a program owns 128 query
# rows (two consumer warpgroups of 64) and steps over 128 keys. dK/dV: a program owns 128
# keys (two warpgroups of 64) and steps over 64 query rows.
FWD_BLOCK_Q, FWD_BLOCK_K = 128, 128
DKV_BLOCK_Q, DKV_BLOCK_K = 64, 128
# Tiles of the xla engine (its vectorised tile loop is the same at any size), and the items
# per lane of its device-side cut of each tile's run.
_XLA_BLOCK, _XLA_MIN_BLOCK = 128, 8
_XLA_LANE_LEN = 16


@dataclasses.dataclass(frozen=True, slots=True)
class HostSpec:
    """What host planning knows of an engine.

    ``name``; ``work_lists``: whether it reads FFA work lists (``cudnn`` reads per-document
    offsets instead, :mod:`magi_jax.planning.packed`); ``fwd_block`` / ``bwd_block``: fixed
    ``(block_q, block_k)`` tiles of its q-tile and k-tile lists (``None``: sized per call,
    :func:`default_block_sizes`); ``lane_len``: items per lane of the ``xla`` engine (0
    elsewhere); ``context_parallel``: whether a rank of context parallelism can run it."""

    name: str
    work_lists: bool
    fwd_block: tuple[int, int] | None = None
    bwd_block: tuple[int, int] | None = None
    lane_len: int = 0
    context_parallel: bool = False

    def blocks(
        self,
        total_q: int,
        total_k: int,
        block_q: int | None = None,
        block_k: int | None = None,
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(q-list tiles, k-list tiles)`` as ``(block_q, block_k)`` pairs: the fixed
        tiles, or tiles sized for the lengths (``block_q``/``block_k`` override them)."""
        if not self.work_lists:
            raise ValueError(f"the {self.name!r} engine reads no work lists, so it has no tiles")
        if self.fwd_block is not None:
            return self.fwd_block, self.bwd_block
        auto_q, auto_k = default_block_sizes(total_q, total_k)
        block = (int(block_q or auto_q), int(block_k or auto_k))
        return block, block


# In the order "auto" prefers them where each can run (magi_jax.ffa.backends decides).
HOST_SPECS: dict[str, HostSpec] = {
    "cudnn": HostSpec("cudnn", work_lists=False),
    "pallas": HostSpec(
        "pallas",
        work_lists=True,
        fwd_block=(FWD_BLOCK_Q, FWD_BLOCK_K),
        bwd_block=(DKV_BLOCK_Q, DKV_BLOCK_K),
        context_parallel=True,
    ),
    "xla": HostSpec("xla", work_lists=True, lane_len=_XLA_LANE_LEN, context_parallel=True),
}
# What an entry point's ``backend`` argument takes.
BACKENDS = (AUTO, *HOST_SPECS)


def check_backend(
    backend: str, arg: str = "backend", *, auto: bool = True, context_parallel: bool = False
) -> str:
    """``backend`` if it names an engine (or ``"auto"`` where ``auto``; only engines a rank
    of context parallelism runs where ``context_parallel``), else a ``ValueError`` naming
    the argument ``arg``, the value and the choices."""
    names = [n for n, s in HOST_SPECS.items() if s.context_parallel or not context_parallel]
    choices = (AUTO, *names) if auto else tuple(names)
    if backend not in choices:
        extra = ""
        if backend in HOST_SPECS:
            extra = f" ({backend!r} runs single-device calls only)"
        raise ValueError(f"{arg}={backend!r} is not one of {choices}{extra}")
    return backend


def host_spec(name: str, arg: str = "backend", *, context_parallel: bool = False) -> HostSpec:
    """The host spec of engine ``name`` (``ValueError`` naming ``arg`` otherwise; with
    ``context_parallel``, also for an engine a rank of context parallelism cannot run)."""
    return HOST_SPECS[check_backend(name, arg, auto=False, context_parallel=context_parallel)]


def default_block_sizes(total_q: int, total_k: int) -> tuple[int, int]:
    """Tiles of the ``xla`` engine: 128 x 128, shrunk (to a power of two >= 8) for short
    sequences."""

    def pick(t):
        return int(min(_XLA_BLOCK, max(_XLA_MIN_BLOCK, 1 << max(int(t) - 1, 0).bit_length())))

    return pick(total_q), pick(total_k)


def backend_blocks(
    backend: str, total_q: int, total_k: int, block_q: int | None = None, block_k: int | None = None
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(q-list tiles, k-list tiles)`` of engine ``backend`` (:meth:`HostSpec.blocks`;
    ``"pallas_interpret"`` is the pallas kernels in interpret mode, on their tiles)."""
    name = "pallas" if backend == "pallas_interpret" else backend
    return host_spec(name).blocks(total_q, total_k, block_q, block_k)
