"""Planning off the critical path: :func:`prefetch_keys` plans the next batches' keys (or
single-device plans) on a background thread while the current step runs.

Host planning is NumPy; with a capacity the keys of every batch share one compilation, so a
training loop's only per-step host work is planning, and this hides it behind the step::

    cap = mj.PlanCapacity.from_masks(sample, mesh_size=cp)
    plan_key = lambda batch: mj.make_varlen_key(batch["cu_seqlens"], mesh, "cp", capacity=cap)
    for batch, key in mj.prefetch_keys(loader, plan_key):
        state = train_step(state, batch, key)          # jitted once; key is an argument

With ``capacity=`` a :class:`~magi_jax.planning.growth.CapacityPolicy` decides, batch by
batch, the capacity each key is built at: a packing that overflows grows it (one more
compilation, logged), is skipped, or raises, as the policy says::

    policy = mj.CapacityPolicy(mj.PlanCapacity.from_masks(sample, mesh_size=cp))
    plan_key = lambda batch, cap: mj.make_varlen_key(batch["cu_seqlens"], mesh, "cp", capacity=cap)
    masks_of = lambda batch: mj.AttnMask.varlen(batch["cu_seqlens"], causal=True)
    for batch, key in mj.prefetch_keys(loader, plan_key, capacity=policy, masks_of=masks_of):
        state = train_step(state, batch, key)          # compiles again only when it grew
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from magi_jax.planning.growth import CapacityPolicy

__all__ = ["prefetch_keys"]


def prefetch_keys(
    batches: Iterable[Any],
    make_key: Callable[..., Any],
    *,
    depth: int = 2,
    capacity: CapacityPolicy | None = None,
    masks_of: Callable[[Any], Any] | None = None,
) -> Iterator[tuple[Any, Any]]:
    """Yields ``(batch, make_key(batch))`` in order, with the keys of up to ``depth`` batches
    ahead being planned on one background thread.

    ``capacity``: a :class:`~magi_jax.planning.growth.CapacityPolicy`; each batch's masks
    (``masks_of(batch)``: one :class:`~magi_jax.masks.AttnMask`, or a batch's rows) are
    fitted first (:meth:`~magi_jax.planning.growth.CapacityPolicy.fit`), and the key is
    ``make_key(batch, capacity)`` at the capacity it returns; batches the policy skips are
    not yielded.

    ``make_key`` is called once per batch, in order, on the worker thread (it must not
    depend on the consumer's state); an exception it raises comes out of the iteration at
    that batch. An exception of the loader (``batches``) comes out after every batch it
    delivered before it, so nothing loaded and planned is lost. Closing the iterator early
    (``break``) stops the worker after the keys in flight."""
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth={depth!r} must be a positive number of batches")
    if capacity is not None:
        from magi_jax.planning.growth import CapacityPolicy

        if not isinstance(capacity, CapacityPolicy):
            raise TypeError(
                f"capacity must be a CapacityPolicy; got {type(capacity).__name__} (wrap a "
                "PlanCapacity: mj.CapacityPolicy(capacity), or close make_key over it)"
            )
        if masks_of is None:
            raise ValueError(
                "capacity= needs masks_of=, the function from a batch to its masks (one "
                "AttnMask or the batch's rows), which the policy measures"
            )
        policy, plan_one = capacity, make_key

        def make_key(batch):
            cap = policy.fit(masks_of(batch))
            return _SKIP if cap is None else plan_one(batch, cap)

    elif masks_of is not None:
        raise ValueError("masks_of= is read only with capacity= (a CapacityPolicy)")
    it = iter(batches)
    pending: collections.deque = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="magi-plan") as pool:

        def submit():
            """Queues the next batch; a loader error is queued in its place, so it comes
            out after the batches loaded before it (never ahead of them)."""
            try:
                batch = next(it)
            except StopIteration:
                return False
            except Exception as e:  # noqa: BLE001 - re-raised in order below
                pending.append((_LoaderError(e), None))
                return False
            pending.append((batch, pool.submit(make_key, batch)))
            return True

        more = True
        for _ in range(depth):
            if not (more := submit()):
                break
        try:
            while pending:
                batch, future = pending.popleft()
                if isinstance(batch, _LoaderError):
                    raise batch.error
                if more:
                    more = submit()
                key = future.result()
                if key is not _SKIP:
                    yield batch, key
        finally:
            for _, future in pending:
                if future is not None:
                    future.cancel()


_SKIP = object()  # a batch the capacity policy skipped


class _LoaderError:
    """A loader exception queued behind the batches that came before it."""

    def __init__(self, error: BaseException):
        self.error = error
