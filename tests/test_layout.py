"""The library's layout, read from its source with ``ast`` (nothing is imported): no import
circle among magi_jax modules, lazy (function-level) imports included; no private name
(``_x``) of one module used by another; the wings (packages of one concept) exist and are
entered through their ``__init__`` only; the top-level ``__all__`` is the documented API."""

from __future__ import annotations

import ast
import pathlib
import re
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "magi_jax"


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    files = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run (at load time or in a function), not those under
    ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(files: dict[str, pathlib.Path] | None = None) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``; ``from pkg import mod`` counts as an
    import of ``pkg.mod`` when that is a module, else of ``pkg``."""
    files = module_files() if files is None else files
    edges: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, is_package, node)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    for alias in node.names
                ]
            edges[name].update(t for t in targets if t in files and t != name)
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(files: dict[str, pathlib.Path] | None = None) -> list[str]:
    """``"module:line name from other"`` for every private name one module of the package
    takes from another: imported by name (``from m import _x``) or read as an attribute of
    an imported module (``m._x``)."""
    files = module_files() if files is None else files
    found = []
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> module of the package
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in files and alias.asname:
                        aliases[alias.asname] = alias.name
                continue
            base = _resolve(name, is_package, node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in files:
                    aliases[alias.asname or alias.name] = full
                elif base in files and base != name and _private(alias.name):
                    found.append(f"{name}:{node.lineno} {alias.name} from {base}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and aliases.get(node.value.id, name) != name
            ):
                found.append(f"{name}:{node.lineno} {node.attr} from {aliases[node.value.id]}")
    return sorted(found)


def _internal_package(module: str) -> str | None:
    """The package whose inside ``module`` is (the part of its path before its first
    ``_name``, dunder names aside), or ``None`` for a module of no package's inside."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            return ".".join(parts[:i])
    return None


def internal_imports(files: dict[str, pathlib.Path] | None = None) -> list[str]:
    """``"module imports internal"`` for every import of a package's internal module
    (``pkg._mod``, or anything below it) by a module outside that package."""
    edges = import_edges(files)
    found = []
    for name, targets in edges.items():
        for target in sorted(targets):
            package = _internal_package(target)
            if package is not None and name != package and not name.startswith(package + "."):
                found.append(f"{name} imports {target}")
    return sorted(found)


# The wings: packages of one concept, entered through their __init__; the modules of each
# that are not its inside (a leading underscore) are named here.
WINGS = {
    # the slice types, which plot takes without the mask type; realistic packings (data loaders)
    "magi_jax.masks": {"slices", "packings"},
    "magi_jax.sharding.keys": set(),
    "magi_jax.sharding.transport": {"native"},  # the native transport, a package itself
}


def _all_names(path: pathlib.Path) -> list[str] | None:
    """The literal ``__all__`` of a module (``None`` when it has none)."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


KNOWN_CIRCLE_MODULES: set[str] = set()
KNOWN_PRIVATE_USERS: set[str] = set()


def test_no_import_circle():
    """No two modules of the package import each other, directly or through others, at load
    time or lazily inside a function (but among the known modules above)."""
    cycles = import_cycles(import_edges())
    assert [c for c in cycles if not set(c) <= KNOWN_CIRCLE_MODULES] == []


def test_no_private_name_crosses_a_module():
    """No module takes a private name (``_x``) of another, by import or as an attribute of
    an imported module (but the known users above)."""
    found = private_uses()
    assert [f for f in found if f.split(":")[0] not in KNOWN_PRIVATE_USERS] == []


def test_the_wings_exist_and_hold_their_inside():
    """Each wing is a package with an ``__all__``; its modules are its inside but those
    named in :data:`WINGS`."""
    files = module_files()
    for wing, public in WINGS.items():
        assert wing in files and files[wing].name == "__init__.py", wing
        assert _all_names(files[wing]), f"{wing} has no __all__"
        children = {
            name[len(wing) + 1 :].split(".")[0] for name in files if name.startswith(wing + ".")
        }
        assert {c for c in children if not _private(c)} == public, wing


def test_no_module_outside_a_package_imports_its_inside():
    """A package's internal modules (``pkg._mod``) are imported by modules of that package
    only; the rest of the library goes through its ``__init__``."""
    assert internal_imports() == []


def _documented_words() -> set[str]:
    text = "\n".join(
        p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    )
    return set(re.findall(r"\bmj\.(\w+)", text)) | set(re.findall(r"`(\w+)", text))


def test_top_level_all_is_the_documented_api():
    """Every name of ``magi_jax.__all__`` is documented (README or docs/: ``mj.name`` or
    ``name`` in code), and every ``mj.name`` the documents use is in ``__all__`` (or is a
    layer of the package)."""
    public = _all_names(ROOT / PACKAGE / "__init__.py")
    documented = _documented_words()
    assert [n for n in public if n not in documented] == []
    text = "\n".join(
        p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    )
    layers = {p.name for p in (ROOT / PACKAGE).iterdir() if not _private(p.name)}
    used = set(re.findall(r"\bmj\.(\w+)", text))
    assert sorted(n for n in used if n not in public and n not in layers) == []


def test_the_checks_see_what_they_look_for(tmp_path):
    """The helpers on a small package of their own: a lazy circle, a relative import, a
    private name by import and by attribute."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from magi_jax.b import _g\n    return _g\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import magi_jax.c\n"
        "def _g():\n    import magi_jax.sub.a as A\n    return A._h\n"
    )
    (pkg / "c.py").write_text("import magi_jax.b\n")
    files = module_files(tmp_path)
    edges = import_edges(files)
    assert edges["magi_jax.sub"] == {"magi_jax.sub.a"}
    assert edges["magi_jax.b"] == {"magi_jax.sub.a"}  # not c: under TYPE_CHECKING
    assert import_cycles(edges) == [["magi_jax.b", "magi_jax.sub.a"]]
    assert private_uses(files) == [
        "magi_jax.b:6 _h from magi_jax.sub.a",
        "magi_jax.sub.a:2 _g from magi_jax.b",
    ]
    assert internal_imports(files) == []
    (pkg / "sub" / "_inside.py").write_text("X = 1\n")
    (pkg / "sub" / "c.py").write_text("from magi_jax.sub._inside import X\n")
    (pkg / "d.py").write_text("from magi_jax.sub import _inside\n")
    files = module_files(tmp_path)
    assert internal_imports(files) == ["magi_jax.d imports magi_jax.sub._inside"]


def _layout_rows(doc: str) -> list[tuple[str, str]]:
    """``(path cell, row)`` of every row of docs/design.md's layout table (§1); a row with an
    empty path cell continues the layer above."""
    table = doc[doc.index("| layer | path") : doc.index("\n\n", doc.index("| layer | path"))]
    rows = []
    for line in table.splitlines()[2:]:
        cells = line.split("|")
        rows.append((cells[2].strip(), line))
    return rows


def test_design_layout_table_names_every_module():
    """docs/design.md's layout table matches the tree: every module of the package is named,
    by its path or by its file name in the row of its top folder."""
    rows = _layout_rows((ROOT / "docs" / "design.md").read_text())
    missing = []
    for path in module_files().values():
        rel = path.relative_to(ROOT).as_posix()
        parts = rel.split("/")
        folder = "/".join(parts[:2]) + "/" if len(parts) > 2 else None
        named = any(f"`{rel}`" in row for _, row in rows) or any(
            folder is not None and f"`{folder}`" in cell and f"`{path.name}`" in row
            for cell, row in rows
        )
        if not named:
            missing.append(rel)
    assert missing == []


def unannotated(files: dict[str, pathlib.Path] | None = None) -> list[str]:
    """``"module:line name"`` for every public function of the package (module level, and the
    methods of public classes, ``__init__`` and ``__call__`` included) with an argument
    (``self``/``cls`` aside) or a return (``__init__`` aside) that carries no annotation."""
    files = module_files() if files is None else files
    found = []

    def check(name: str, fn: ast.FunctionDef, owner: str = "") -> None:
        if fn.name.startswith("_") and fn.name not in ("__init__", "__call__"):
            return
        a = fn.args
        args = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]
        bare = [x.arg for x in args if x.annotation is None and x.arg not in ("self", "cls")]
        if bare or (fn.returns is None and fn.name != "__init__"):
            found.append(f"{name}:{fn.lineno} {owner}{fn.name}")

    for name, path in files.items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                check(name, node)
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        check(name, sub, node.name + ".")
    return sorted(found)


def test_every_public_function_is_annotated(tmp_path):
    """Type hints on every public function and method of the package; the check itself sees a
    missing argument and a missing return."""
    assert unannotated() == []
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "def f(x: int, y) -> int: ...\ndef g(x: int): ...\ndef _h(x): ...\n"
        "class C:\n    def __init__(self, a: int): ...\n    def m(self, *args) -> None: ...\n"
    )
    assert unannotated(module_files(tmp_path)) == [
        "magi_jax.m:1 f",
        "magi_jax.m:2 g",
        "magi_jax.m:6 C.m",
    ]
