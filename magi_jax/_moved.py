"""Import paths of modules that moved into the wings (``masks/``, ``sharding/keys/``,
``sharding/transport/``) or took a name that says what they hold, kept working for one
release: ``import magi_jax.mask`` gives the
module now at ``magi_jax.masks._mask``, the same module object (so its attributes, set or
read, are the module's own), not a copy."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

__all__ = ["MOVED", "install", "old_child"]

# old path -> where the module lives now
MOVED = {
    "magi_jax.mask": "magi_jax.masks._mask",
    "magi_jax.mask_slices": "magi_jax.masks.slices",
    "magi_jax.mask_checks": "magi_jax.masks._checks",
    "magi_jax.mask_rows": "magi_jax.masks._row_runs",
    "magi_jax.mask_runs": "magi_jax.masks._builders",
    "magi_jax.mask_zoo": "magi_jax.masks._zoo",
    "magi_jax.sharding.key": "magi_jax.sharding.keys._key",
    "magi_jax.sharding.key_options": "magi_jax.sharding.keys._options",
    "magi_jax.sharding.make_key": "magi_jax.sharding.keys._make",
    "magi_jax.sharding.batch_key": "magi_jax.sharding.keys._batch",
    "magi_jax.sharding.key_wire": "magi_jax.sharding.keys._wire",
    "magi_jax.sharding.two_hop": "magi_jax.sharding.keys._relay",
    "magi_jax.sharding.collectives": "magi_jax.sharding.transport._collectives",
    "magi_jax.sharding.pair_cast": "magi_jax.sharding.transport._pair",
    "magi_jax.sharding.native": "magi_jax.sharding.transport.native",
    "magi_jax.sharding.native.transport": "magi_jax.sharding.transport.native._calls",
    "magi_jax.sharding.native.library": "magi_jax.sharding.transport.native._library",
    "magi_jax.planning.persistence": "magi_jax.planning.persistent_kernels",
    "magi_jax.planning.defaults": "magi_jax.planning.cost_model",
    "magi_jax.planning.hierarchy": "magi_jax.planning.relay_table",
    "magi_jax.ffa.segments": "magi_jax.ffa.device_planner",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new one (imported there, once)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import machinery stamped the old path's spec on the module: give it back its own.
        module.__spec__ = self.own_spec


def _target(fullname: str) -> str | None:
    """Where ``fullname`` lives now: an old path, or an old child reached through its moved
    package's new name (``from magi_jax.sharding.native import transport`` asks for
    ``magi_jax.sharding.transport.native.transport``)."""
    if fullname in MOVED:
        return MOVED[fullname]
    parent, _, child = fullname.rpartition(".")
    for old, new in MOVED.items():
        if new == parent and f"{old}.{child}" in MOVED:
            return MOVED[f"{old}.{child}"]
    return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = _target(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def old_child(package: str, name: str) -> ModuleType:
    """``package.name`` where that is an old path (a package's ``__getattr__``: the old
    children of a package are attributes of it, as they were when the package imported
    them), else ``AttributeError``."""
    if _target(f"{package}.{name}") is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(f"{package}.{name}")


def install() -> None:
    """Put the old paths on ``sys.meta_path`` (first, so that a folder left behind by a move
    cannot be found as a namespace package instead); installing twice adds nothing."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
