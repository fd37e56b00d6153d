"""The library's log: the standard :mod:`logging` logger ``"magi_jax"`` and its children
(``magi_jax.keys``, ``magi_jax.caches``, ``magi_jax.compile``, ...), quiet by default (a
``NullHandler``: nothing is printed unless the application configures logging, e.g.
``logging.basicConfig(level=logging.INFO)``). What it reports, by level:

- ``DEBUG``: every key planned (mask, mesh, capacity, host time), cache misses (what was
  built, in what time) and the hit/miss counts of the cache at that moment.
- ``INFO``: every trace of an entry point for a static structure it has not traced before
  (a key whose static part changed, an ``AttnMask`` that is new), with what changed:
  each such trace is a compilation of the enclosing jitted function.
- ``WARNING``: once per mesh (or per entry point), when a run compiles anew for the third
  distinct mask, which a key built at a capacity (or an ``AttnPlan``) would have avoided.

Host only: nothing here runs inside a compiled program.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable

__all__ = ["LOGGER", "get_logger", "Retraces"]

LOGGER = logging.getLogger("magi_jax")
LOGGER.addHandler(logging.NullHandler())

# Distinct structures remembered per family (a bound: a run of one-mask keys is unbounded).
_MEMORY = 64


def get_logger(name: str) -> logging.Logger:
    """The child ``magi_jax.<name>`` of the library's logger."""
    return LOGGER.getChild(name)


def changed_fields(old: object, new: object) -> list[str]:
    """The names of the dataclass fields whose values differ between ``old`` and ``new``
    (``["type"]`` when they are not dataclasses of one type)."""
    if type(old) is not type(new) or not dataclasses.is_dataclass(new):
        return ["type"]
    return [f.name for f in dataclasses.fields(new) if getattr(old, f.name) != getattr(new, f.name)]


class Retraces:
    """Counts the traces of one entry point by family (e.g. a mesh) and logs each structure
    (a hashable static part) seen for the first time: ``INFO`` with what differs from the
    family's previous structure (``describe(old, new) -> str``), ``WARNING`` once per family
    when ``is_avoidable(old, new)`` held for the second time (a third distinct structure
    that masks as data would have shared one compilation with; ``hint`` says how)."""

    def __init__(
        self,
        what: str,
        describe: Callable[[Hashable, Hashable], str],
        is_avoidable: Callable[[Hashable, Hashable], bool],
        hint: str,
    ) -> None:
        self.what, self.describe, self.is_avoidable, self.hint = what, describe, is_avoidable, hint
        self._seen: dict[Hashable, collections.OrderedDict] = {}
        self._avoidable: collections.Counter = collections.Counter()
        self._warned: set = set()
        self._lock = threading.Lock()
        self.log = get_logger("compile")

    def note(
        self, family: Hashable, structure: Hashable, family_desc: str, repeat: bool = True
    ) -> None:
        """One trace of ``structure`` in ``family`` (``family_desc`` names it in messages);
        ``repeat``: log a structure seen before too (a trace, not a cached eager call)."""
        with self._lock:
            seen = self._seen.setdefault(family, collections.OrderedDict())
            if structure in seen:
                seen.move_to_end(structure)
                if not repeat:
                    return
                self.log.debug(
                    "%s traced again for a structure it has traced before (%s): the enclosing "
                    "function was traced again (another shape, dtype or sharding of its other "
                    "arguments, or a new jitted function)",
                    self.what,
                    family_desc,
                )
                return
            previous = next(reversed(seen)) if seen else None
            seen[structure] = None
            if len(seen) > _MEMORY:
                seen.popitem(last=False)
            count = len(seen)
            avoidable = previous is not None and self.is_avoidable(previous, structure)
            if avoidable:
                self._avoidable[family] += 1
            warn = self._avoidable[family] >= 2 and family not in self._warned
            if warn:
                self._warned.add(family)
        if previous is None:
            self.log.info("%s traced for %s (a compilation)", self.what, family_desc)
            return
        self.log.info(
            "%s traced for a new structure (%d seen on %s; a compilation): %s",
            self.what,
            count,
            family_desc,
            self.describe(previous, structure),
        )
        if warn:
            self.log.warning(
                "%s compiles anew for every mask on %s: %s", self.what, family_desc, self.hint
            )
