"""Tuning of the Mosaic GPU kernels: a frozen config per kernel, the defaults measurement
chose, and the rules that pick them.

One config per kernel, holding only the knobs that kernel has: :class:`FwdConfig` (the
forward), :class:`DqConfig` and :class:`DkvConfig` (the backward at ``D <=``
:data:`~magi_jax.pallas.common.MAX_NARROW_D`), :class:`WideDqConfig` and
:class:`WideDkvConfig` (the backward above it: ``D =``
:data:`~magi_jax.pallas.common.WIDE_BWD_D`, and a query/key head dim of 192).
:func:`kernel_configs` builds one call's three from the knobs of
:func:`~magi_jax.pallas.ffa_pallas`, each left ``None`` taking its default here. Results
never depend on tuning beyond rounding. Why each default is what it is (dated same-run A/Bs
on an H200): benchmarks/results/kernel/LATEST.md and ``kernel_notes.md`` there.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from magi_jax.pallas.common import MAX_NARROW_D, check_fma_cols, check_pipeline
from magi_jax.planning.persistent_kernels import (
    DKV_PERSISTENT_MAX_MEAN_ITEMS,
    PERSISTENT_MAX_MEAN_ITEMS,
    persistent_pays,
)
from magi_jax.planning.work_list import FFAPlanArrays

__all__ = [
    "FwdConfig",
    "DqConfig",
    "DkvConfig",
    "WideDqConfig",
    "WideDkvConfig",
    "KernelConfigs",
    "kernel_configs",
    "default_num_stages",
    "default_fma_exp_cols",
    "default_steps_per_wait",
    "default_dkv_turns",
    "default_programs",
    "default_persistence",
    "on_host",
    "sm_count",
    "PERSISTENT_MAX_MEAN_ITEMS",
    "DKV_PERSISTENT_MAX_MEAN_ITEMS",
]

# Ring slots where nothing below says otherwise (D = 128 fits 2 in every kernel's default
# mode; D = 256 fits 2 and no more).
_NUM_STAGES = 2
# Registers per thread of a consumer and of the producer warpgroup after the split
# (setmaxnreg) in the backward kernels.
_BWD_REGISTERS = (232, 40)


def _check_registers(registers: tuple[int, int]) -> None:
    consumer, producer = registers
    if (
        consumer % 8
        or producer % 8
        or not 24 <= producer <= consumer <= 256
        or 2 * consumer + producer > 504
    ):
        raise ValueError(
            f"registers={registers}: need multiples of 8 with "
            "24 <= producer <= consumer <= 256 and 2·consumer + producer "
            "<= 504"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FwdConfig:
    """Static configuration of the forward kernel (:func:`~magi_jax.pallas.ffa_fwd.ffa_forward`).

    The kernel has one loop (FlashAttention-3's intra-warpgroup overlap, the softmax scale
    inside ``exp2``, wgmma accumulating P·V into the rescaled output registers, the
    head-major launch of :func:`~magi_jax.pallas.common.launch_grid`); the variants it
    replaced are in benchmarks/results/kernel/kernel_notes.md."""

    scale: float
    softcap: float = 0.0
    # Shared-memory slots of the K/V ring.
    num_stages: int = _NUM_STAGES
    # 0: one program per (q-tile, batch, head), in the order of launch_grid. N > 0: N
    # programs (the SM count, 132 on an H200) walk the (q-tile, batch, head) units of a host
    # schedule (magi_jax.planning.work_list.persistent_schedule). Across units the K/V ring
    # runs on, each consumer loads its next Q as soon as the last Q·Kᵀ of the current unit is
    # done, and outputs leave through their own buffer, so a unit's prologue and epilogue
    # hide under its neighbours' work (what short rows need).
    persistent: int = 0
    # Also write every row's largest scaled logit (before the softcap, allowed cells only),
    # the per-head max logits of QK-clip once reduced over the rows. Without a softcap it is
    # the running row max the softmax keeps anyway; with one the running max is kept of the
    # raw scores instead (the softmax's is its tanh, a monotone map, so this is exact).
    row_max: bool = False
    # The last ``fma_exp_cols`` keys of each score block are exponentiated on the FMA pipes
    # (magi_jax.pallas.common.exp2_cols); a multiple of 8 below the block's 128 keys (64 at
    # D > MAX_NARROW_D).
    fma_exp_cols: int = 0
    interpret: bool = False

    def __post_init__(self) -> None:
        check_pipeline(self.num_stages, self.persistent)
        if self.softcap < 0:
            raise ValueError(f"softcap={self.softcap} must be >= 0")
        check_fma_cols(self.fma_exp_cols)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _BackwardConfig:
    """The knobs every backward kernel's config has. ``num_stages``: shared-memory slots of
    the producer's ring (K/V for dQ, Q/dO/lse/delta for dK/dV). ``registers``: registers per
    thread of a consumer and of the producer warpgroup after the split (setmaxnreg; multiples
    of 8, 2·consumer + producer <= 504 for 3 warpgroups)."""

    scale: float
    softcap: float = 0.0
    num_stages: int = _NUM_STAGES
    registers: tuple[int, int] = _BWD_REGISTERS
    interpret: bool = False

    def __post_init__(self) -> None:
        check_pipeline(self.num_stages, 0)
        _check_registers(self.registers)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DqConfig(_BackwardConfig):
    """Static configuration of the dQ kernel (:func:`~magi_jax.pallas.ffa_bwd.ffa_dq`). It runs
    one program per unit (a persistent dQ measured slower on every mask) and its consumers
    issue as they go (in turns it measured 2 % slower)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DkvConfig(_BackwardConfig):
    """Static configuration of the dK/dV kernel (:func:`~magi_jax.pallas.ffa_bwd.ffa_dkv`)."""

    # 0: one program per (k-tile, batch, key head) unit, in the order of launch_grid. N > 0:
    # min(N, units) programs (the SM count, 132 on an H200) walk the units of the host
    # schedule ffa_dkv takes as its ``schedule`` argument. Across units the producer's ring
    # runs on (one drain at the end), each consumer loads its next unit's K, V as soon as the
    # last wgmma pair that reads them is done, and outputs leave through buffers of their
    # own, so the store of one unit overlaps the next.
    persistent: int = 0
    # Ring steps (query blocks of 64 rows) one consumer takes between two waits: 1, or 2
    # (both steps' Sᵀ and dPᵀ issued together, then their four dV/dK products; with D <= 64
    # only, where the four score blocks fit beside the accumulators, and at least 4 ring
    # slots so the next pair loads under this one).
    steps_per_wait: int = 1
    # The two consumers issue their wgmmas in turns (a token handed between them through a
    # barrier pair), so one's matmuls run under the other's softmax.
    turns: bool = False

    def __post_init__(self) -> None:
        check_pipeline(self.num_stages, self.persistent)
        if self.steps_per_wait not in (1, 2):
            raise ValueError(f"steps_per_wait={self.steps_per_wait}: use 1 or 2")
        _check_registers(self.registers)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WideDqConfig(_BackwardConfig):
    """Static configuration of the dQ kernel at D = 256 (and Dqk = 192)
    (:func:`~magi_jax.pallas.ffa_dq_wide.ffa_dq_wide`): one program per unit, consumers
    that meet every step; 2 ring slots fit, 3 do not."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WideDkvConfig(_BackwardConfig):
    """Static configuration of the dK/dV kernel at D = 256 (and Dqk = 192)
    (:func:`~magi_jax.pallas.ffa_dkv_wide.ffa_dkv_wide`): one program per unit (its shared
    memory leaves no room for a persistent mode's output buffers), one query block per wait,
    consumers that meet every step; 2 ring slots fit, 3 do not."""


@dataclasses.dataclass(frozen=True)
class KernelConfigs:
    """The static configuration of one call: its three kernels' configs (the wide backward
    ones at ``D > MAX_NARROW_D``)."""

    fwd: FwdConfig
    dq: DqConfig | WideDqConfig
    dkv: DkvConfig | WideDkvConfig

    @property
    def fwd_programs(self) -> int:
        """Programs of the persistent forward (0: one program per unit)."""
        return self.fwd.persistent

    @property
    def dkv_programs(self) -> int:
        """Programs of the persistent dK/dV kernel (0: one program per unit)."""
        return self.dkv.persistent if isinstance(self.dkv, DkvConfig) else 0


def default_num_stages(
    head_dim: int, fwd_persistent: bool, dkv_persistent: bool
) -> tuple[int, int, int]:
    """Default ring slots ``(forward, dQ, dK/dV)`` at ``head_dim``.

    At D <= 64 a slot holds half the bytes of D = 128's, so the rings run deeper: 4 forward
    slots, 3 dQ slots, 4 dK/dV slots; the persistent kernels of short rows keep 2 forward and
    3 dK/dV slots (what measured best there). At larger head dims every kernel takes 2."""
    if head_dim <= 64:
        return (2 if fwd_persistent else 4), 3, (3 if dkv_persistent else 4)
    return _NUM_STAGES, _NUM_STAGES, _NUM_STAGES


def default_fma_exp_cols(head_dim: int) -> int:
    """Default forward score columns exponentiated on the FMA pipes
    (:attr:`FwdConfig.fma_exp_cols`): 16 of 128 at D <= 64, where the exponentials bound the
    forward; else 0 (more, or any at D = 128, measured slower or even). The backward kernels'
    matmuls outweigh their exponentials; splitting there measured no faster."""
    return 16 if head_dim <= 64 else 0


def default_steps_per_wait(head_dim: int, dkv_num_stages: int, dkv_persistent: bool) -> int:
    """Default dK/dV query blocks per wait (:attr:`DkvConfig.steps_per_wait`): 2 where they
    fit (D <= 64, 4 ring slots) and paid (one program per unit), else 1."""
    return 2 if head_dim <= 64 and dkv_num_stages >= 4 and not dkv_persistent else 1


def default_dkv_turns(head_dim: int, dkv_persistent: bool) -> bool:
    """Whether the dK/dV consumers issue their wgmmas in turns (:attr:`DkvConfig.turns`): at
    D = 128 with one program per unit. On the persistent kernel's short rows, and at D = 64,
    turns measured slower; D = 256 has kernels of its own."""
    return 64 < head_dim <= MAX_NARROW_D and not dkv_persistent


def on_host(plan: FFAPlanArrays) -> bool:
    """Whether the plan is NumPy arrays (persistent schedules are built from it there)."""
    return all(isinstance(a, np.ndarray) for a in plan)


def default_programs(plan: FFAPlanArrays, interpret: bool, kernel: str = "fwd") -> int:
    """Programs of the persistent forward (``kernel="fwd"``) or dK/dV kernel (``"dkv"``) by
    default: one per SM of the default GPU when the plan is on the host (the schedule is
    built there) and its tiles that own any item are short rows
    (:func:`~magi_jax.planning.persistent_kernels.persistent_pays`); 0 otherwise."""
    if interpret or not on_host(plan):
        return 0
    offsets = plan.q_offsets if kernel == "fwd" else plan.k_offsets
    counts = np.diff(offsets)
    counts = counts[counts > 0]
    if counts.size and not persistent_pays(counts.sum(), counts.size, kernel):
        return 0
    return sm_count()


def sm_count() -> int:
    """Streaming multiprocessors of the default device (0 off a GPU): the programs of the
    persistent kernels."""
    dev = jax.devices()[0]
    if getattr(dev, "platform", None) != "gpu":
        return 0
    return int(getattr(dev, "core_count", 0) or 0)


def default_persistence(
    plan: FFAPlanArrays,
    head_dim: int,
    interpret: bool,
    *,
    num_stages: int | None = None,
    dkv_num_stages: int | None = None,
) -> tuple[int, int]:
    """Default ``(persistent, dkv_persistent)`` programs of :func:`~magi_jax.pallas.ffa_pallas`:
    :func:`default_programs` where the persistent kernel's output buffers fit beside the
    asked ring (forward: ``num_stages`` ``None`` or <= 2; dK/dV: ``dkv_num_stages`` ``None``
    or <= 3, any at D <= 64), and never at ``D > MAX_NARROW_D`` (their output buffers do not
    fit beside the pipelines there)."""
    if head_dim > MAX_NARROW_D:
        return 0, 0
    fwd = default_programs(plan, interpret) if num_stages is None or num_stages <= 2 else 0
    dkv_fits = dkv_num_stages is None or dkv_num_stages <= 3 or head_dim <= 64
    return fwd, (default_programs(plan, interpret, "dkv") if dkv_fits else 0)


def kernel_configs(
    head_dim: int,
    scale: float,
    softcap: float,
    interpret: bool,
    *,
    persistent: int = 0,
    dkv_persistent: int = 0,
    num_stages: int | None = None,
    dq_num_stages: int | None = None,
    dkv_num_stages: int | None = None,
    dkv_steps_per_wait: int | None = None,
    fma_exp_cols: int | None = None,
    row_max: bool = False,
) -> KernelConfigs:
    """The three kernels' configs of one call at ``head_dim`` (q's and k's: with a value head
    dim of its own, the query/key head dim picks the kernels and defaults), sharing ``scale``,
    ``softcap`` and ``interpret``; the forward and dK/dV kernels persistent over
    ``persistent`` / ``dkv_persistent`` programs (0: one program per unit). Each knob left
    ``None`` takes its default (:func:`default_num_stages`, :func:`default_steps_per_wait`,
    :func:`default_fma_exp_cols`; the dK/dV turns by :func:`default_dkv_turns`). At
    ``D > MAX_NARROW_D`` the backward kernels are the wide ones, which refuse
    ``dkv_persistent`` and ``dkv_steps_per_wait`` other than 0 and 1 (``ValueError``)."""
    shared = dict(scale=float(scale), softcap=float(softcap), interpret=bool(interpret))
    stages = default_num_stages(head_dim, bool(persistent), bool(dkv_persistent))
    num_stages = stages[0] if num_stages is None else num_stages
    dq_num_stages = stages[1] if dq_num_stages is None else dq_num_stages
    dkv_num_stages = stages[2] if dkv_num_stages is None else dkv_num_stages
    if dkv_steps_per_wait is None:
        dkv_steps_per_wait = default_steps_per_wait(head_dim, dkv_num_stages, bool(dkv_persistent))
    if fma_exp_cols is None:
        fma_exp_cols = default_fma_exp_cols(head_dim)
    fwd = FwdConfig(
        **shared,
        num_stages=int(num_stages),
        persistent=int(persistent),
        row_max=bool(row_max),
        fma_exp_cols=int(fma_exp_cols),
    )
    if head_dim > MAX_NARROW_D:
        if dkv_persistent:
            raise ValueError(
                f"dkv_persistent={dkv_persistent}: at D = {head_dim} the dK/dV kernel "
                "runs one program per unit (its shared memory leaves no room for "
                "the persistent mode's output buffers); pass dkv_persistent=0"
            )
        if dkv_steps_per_wait != 1:
            raise ValueError(
                f"dkv_steps_per_wait={dkv_steps_per_wait}: at D = {head_dim} the dK/dV "
                "kernel takes one query block per wait (its warpgroups meet every "
                "step); pass dkv_steps_per_wait=1"
            )
        return KernelConfigs(
            fwd,
            WideDqConfig(**shared, num_stages=int(dq_num_stages)),
            WideDkvConfig(**shared, num_stages=int(dkv_num_stages)),
        )
    return KernelConfigs(
        fwd,
        DqConfig(**shared, num_stages=int(dq_num_stages)),
        DkvConfig(
            **shared,
            num_stages=int(dkv_num_stages),
            persistent=int(dkv_persistent),
            steps_per_wait=int(dkv_steps_per_wait),
            turns=default_dkv_turns(head_dim, bool(dkv_persistent)),
        ),
    )
