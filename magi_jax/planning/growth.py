"""Capacity that holds or grows over a training run: :class:`CapacityPolicy`.

A :class:`~magi_jax.planning.capacity.PlanCapacity` fixes the shapes of every step's key, so
a jitted step compiles once for every packing within it. A loader's packings come from a
distribution whose tail a sample of a few packings does not see; the policy measures each
packing before its key is planned and, when one needs more than the capacity holds, does
what the user chose: grow the capacity (the step compiles once more, and the run goes on),
skip the packing, or raise. It also keeps how full each field ran (max and p99 over the
packings seen), and saves the capacity beside a checkpoint so a resumed run starts with the
capacity it had grown to.

Host NumPy only; measuring a packing costs about as much as planning its key once more (on
the background thread of :func:`magi_jax.prefetch_keys`, off the step's critical path).
Logs go to the ``magi_jax.planning.growth`` logger (quiet unless the application configures
``logging``): growth at ``WARNING`` — it costs a compilation — skips at ``WARNING``,
utilisation every ``log_every`` packings at ``INFO``.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Iterable, Mapping

import numpy as np

from magi_jax.masks import AttnMask
from magi_jax.planning.capacity import GROWN_FIELDS, HEADROOM, PlanCapacity
from magi_jax.planning.errors import capacity_error

__all__ = ["CapacityPolicy", "ON_OVERFLOW"]

_log = logging.getLogger(__name__)
# Quiet unless the application configures logging (no "last resort" lines on stderr).
_root = logging.getLogger("magi_jax")
if not any(isinstance(h, logging.NullHandler) for h in _root.handlers):
    _root.addHandler(logging.NullHandler())

ON_OVERFLOW = ("grow", "skip", "raise")


class CapacityPolicy:
    """What to do, step after step, with packings that overflow a capacity.

    Args:
      capacity: the capacity the run starts with (e.g. ``PlanCapacity.from_masks`` over a
        couple of sample packings, or :meth:`PlanCapacity.load` of a resumed run's file).
      mesh_size: ranks of the context-parallel axis the keys are built on (default: the
        capacity's recorded size, when it records one; ``None`` and none recorded:
        single-device plans, :func:`magi_jax.plan_attention`).
      on_overflow: ``"grow"`` (default): the fields that overflowed — and any other field
        with less than ``headroom`` over the most any packing needed so far — grow to that
        most times ``headroom`` (:meth:`PlanCapacity.grow`), and :meth:`fit` returns the new
        capacity (keys built at it have a new static part: the step compiles once more);
        ``"skip"``: :meth:`fit` returns ``None`` and the caller drops the packing;
        ``"raise"``: :class:`~magi_jax.planning.errors.CapacityError` naming the limit and
        the call that fixes it.
      headroom: growth factor over the needs (default 1.25).
      log_every: log the utilisation every this many packings (0: never; read
        :meth:`utilisation` instead).
      window: packings whose needs are kept for the p99 (the max covers every packing).

    Use it per step (:meth:`fit`, from any loop) or through
    :func:`magi_jax.prefetch_keys`'s ``capacity=`` argument::

        policy = mj.CapacityPolicy(mj.PlanCapacity.from_masks(sample, mesh_size=cp))
        for batch in loader:
            cap = policy.fit(mask_of(batch))            # grown if this packing needs it
            if cap is None:                             # on_overflow="skip"
                continue
            key = mj.make_flex_key(mask_of(batch), mesh, "cp", capacity=cap)
            state = train_step(state, batch, key)
        policy.save("ckpt/capacity.json")               # beside the checkpoint
    """

    def __init__(
        self,
        capacity: PlanCapacity,
        *,
        mesh_size: int | None = None,
        on_overflow: str = "grow",
        headroom: float = HEADROOM,
        log_every: int = 0,
        window: int = 10_000,
    ):
        if not isinstance(capacity, PlanCapacity):
            raise TypeError(f"capacity must be a PlanCapacity; got {type(capacity).__name__}")
        if on_overflow not in ON_OVERFLOW:
            raise ValueError(f"on_overflow={on_overflow!r} must be one of {ON_OVERFLOW}")
        if not headroom >= 1:
            raise ValueError(f"headroom={headroom!r} must be >= 1")
        for name, value in (("log_every", log_every), ("window", window)):
            if not isinstance(value, int) or value < (1 if name == "window" else 0):
                raise ValueError(f"{name}={value!r} must be a non-negative number of packings")
        if mesh_size is None and capacity.mesh_size is not None:
            if len(capacity.mesh_size) != 1:
                raise ValueError(
                    f"capacity.mesh_size={capacity.mesh_size} records several sizes; pass "
                    "mesh_size= the size this run's keys are built on"
                )
            mesh_size = capacity.mesh_size[0]
        if mesh_size is not None:
            capacity.check_mesh_size(int(mesh_size))
            mesh_size = int(mesh_size)
        self.mesh_size = mesh_size
        self.on_overflow = on_overflow
        self.headroom = float(headroom)
        self.log_every = log_every
        self._capacity = capacity
        self._lock = threading.Lock()
        self._needs = {f: collections.deque(maxlen=window) for f in GROWN_FIELDS}
        self._most = dict.fromkeys(GROWN_FIELDS, 0)
        self.seen = 0
        self.skipped = 0
        self.growths: list[tuple[int, dict[str, tuple[int | None, int]]]] = []

    @property
    def capacity(self) -> PlanCapacity:
        """The capacity as it stands (grown by every overflow so far)."""
        return self._capacity

    # ---- per packing ---------------------------------------------------------------------

    def needs(self, masks: AttnMask | Iterable[AttnMask]) -> dict[str, int | None]:
        """What ``masks`` (one packing, or the rows of one batch) need of every field of
        :data:`~magi_jax.planning.capacity.GROWN_FIELDS` at this policy's mesh size and the
        capacity's chunk size and overlap degrees (``None``: a field that plan has none of)."""
        from magi_jax.planning.defaults import sample_needs

        masks = [masks] if isinstance(masks, AttnMask) else list(masks)
        cap = self._capacity
        need = sample_needs(
            masks, self.mesh_size, cap.chunk_size, cap.overlap_degree, cap.backward_overlap_degree
        )
        return {f: (None if need.get(f) is None else int(need[f])) for f in GROWN_FIELDS}

    def fit(self, masks: AttnMask | Iterable[AttnMask]) -> PlanCapacity | None:
        """The capacity to build the keys of ``masks`` (one packing, or a batch's rows) at:
        the current one when they fit; on overflow, per ``on_overflow``, a grown one,
        ``None`` (skip these masks), or :class:`~magi_jax.planning.errors.CapacityError`."""
        need = self.needs(masks)
        with self._lock:
            self.seen += 1
            for f, n in need.items():
                if n is not None:
                    self._needs[f].append(n)
                    self._most[f] = max(self._most[f], n)
            over = self._overflow(need)
            if over and self.on_overflow == "grow":
                self._grow(over)
            elif over and self.on_overflow == "skip":
                self.skipped += 1
                f = next(iter(over))
                _log.warning(
                    "packing %d skipped: it needs PlanCapacity.%s>=%d, the capacity holds %s "
                    "(%d skipped of %d)",
                    self.seen - 1,
                    f,
                    over[f][0],
                    over[f][1],
                    self.skipped,
                    self.seen,
                )
                return None
            elif over:
                f = next(iter(over))
                raise capacity_error(f, over[f][0], over[f][1], what=f"packing {self.seen - 1}")
            if self.log_every and self.seen % self.log_every == 0:
                _log.info("capacity utilisation after %d packings: %s", self.seen, self.report())
            return self._capacity

    def _overflow(self, need: Mapping[str, int | None]) -> dict[str, tuple[int, int]]:
        out = {}
        for f, n in need.items():
            have = self._capacity.held(f, self.mesh_size)
            if n is not None and have is not None and n > have:
                out[f] = (n, have)
        return out

    def _grow(self, over: Mapping[str, tuple[int, int]]) -> None:
        """Every field to at least the most needed so far times the headroom (the fields
        that overflowed, and the others running with less margin: one compilation for all)."""
        old = self._capacity
        target = {f: int(np.ceil(m * self.headroom)) for f, m in self._most.items() if m > 0}
        new = old.grow(target, headroom=1.0, mesh_size=self.mesh_size)
        changed = {
            f: (old.held(f, self.mesh_size), getattr(new, f))
            for f in GROWN_FIELDS
            if getattr(new, f) != getattr(old, f)
        }
        self._capacity = new
        self.growths.append((self.seen - 1, changed))
        _log.warning(
            "capacity grown at packing %d (growth %d; the step compiles once more): %s; "
            "it overflowed %s",
            self.seen - 1,
            len(self.growths),
            ", ".join(f"{f} {a} -> {b}" for f, (a, b) in changed.items()),
            ", ".join(f"{f} (needed {n}, held {h})" for f, (n, h) in over.items()),
        )

    # ---- what it saw ---------------------------------------------------------------------

    def utilisation(self) -> dict[str, dict[str, float | int | None]]:
        """Per field: ``held`` (the current capacity's bound, ``None``: unbounded),
        ``max`` and ``p99`` of the needs over the packings seen, and ``max_share`` /
        ``p99_share``, the share of ``held`` they fill."""
        out = {}
        with self._lock:
            for f in GROWN_FIELDS:
                seen = np.asarray(self._needs[f], np.float64)
                if not seen.size:
                    continue
                held = self._capacity.held(f, self.mesh_size)
                most, p99 = self._most[f], float(np.percentile(seen, 99))
                out[f] = dict(
                    held=held,
                    max=int(most),
                    p99=p99,
                    max_share=None if held is None else most / held,
                    p99_share=None if held is None else p99 / held,
                )
        return out

    def report(self) -> str:
        """One line: per field ``max/held (p99)``."""
        parts = []
        for f, u in self.utilisation().items():
            held = "-" if u["held"] is None else u["held"]
            share = "" if u["max_share"] is None else f" {100 * u['max_share']:.0f}%"
            parts.append(f"{f} {u['max']}/{held}{share} (p99 {u['p99']:.0f})")
        return "; ".join(parts)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the current capacity to ``path`` (:meth:`PlanCapacity.save`)."""
        self._capacity.save(path)
