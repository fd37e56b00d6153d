"""Planning off the critical path: :func:`prefetch_keys` plans the next batches' keys (or
single-device plans) on a background thread while the current step runs.

Host planning is NumPy; with a capacity the keys of every batch share one compilation, so a
training loop's only per-step host work is planning, and this hides it behind the step::

    cap = mj.PlanCapacity.from_masks(sample, mesh_size=cp)
    plan_key = lambda batch: mj.make_varlen_key(batch["cu_seqlens"], mesh, "cp", capacity=cap)
    for batch, key in mj.prefetch_keys(loader, plan_key):
        state = train_step(state, batch, key)          # jitted once; key is an argument
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["prefetch_keys"]


def prefetch_keys(
    batches: Iterable[Any], make_key: Callable[[Any], Any], *, depth: int = 2
) -> Iterator[tuple[Any, Any]]:
    """Yields ``(batch, make_key(batch))`` in order, with the keys of up to ``depth`` batches
    ahead being planned on one background thread.

    ``make_key`` is called once per batch, in order, on the worker thread (it must not
    depend on the consumer's state); an exception it raises comes out of the iteration at
    that batch. An exception of the loader (``batches``) comes out after every batch it
    delivered before it, so nothing loaded and planned is lost. Closing the iterator early
    (``break``) stops the worker after the keys in flight."""
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth={depth!r} must be a positive number of batches")
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
                yield batch, future.result()
        finally:
            for _, future in pending:
                if future is not None:
                    future.cancel()


class _LoaderError:
    """A loader exception queued behind the batches that came before it."""

    def __init__(self, error: BaseException):
        self.error = error
