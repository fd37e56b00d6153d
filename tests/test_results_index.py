"""The benchmark and results indexes stay complete and the README's figures stay in one place.

Every script in ``benchmarks/`` is named in ``benchmarks/README.md``; every file under
``benchmarks/results/<area>/`` is named in that area's ``LATEST.md``, and what ``LATEST.md``
names either exists or is retired with the commit that holds it; the README's "Current
numbers" quote lines of the areas' ``LATEST.md`` verbatim, and no other README line quotes a
measured figure."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
AREAS = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())

# A run file as the scripts name it: <bench>[_<variant>]_<YYYYMMDD>_<HHMM>[...].<ext>.
_RUN_FILE = re.compile(r"[\w.]+_\d{8}_\d{4}[\w.]*\.(?:md|json|log|png|csv)")
# A commit named in backticks: how a retired run says where git keeps it.
_COMMIT = re.compile(r"`[0-9a-f]{7,40}`")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _scripts() -> list[str]:
    return sorted(
        p.relative_to(BENCH).as_posix()
        for p in BENCH.rglob("*")
        if p.is_file()
        and p.suffix in (".py", ".sh", ".cu")
        and p.name != "__init__.py"
        and RESULTS not in p.parents
        and "__pycache__" not in p.parts
    )


def test_the_tree_has_scripts_and_areas():
    # The tests below would pass vacuously on an empty tree.
    assert len(_scripts()) >= 12
    assert {"kernel", "cp", "overlap", "collectives", "solver", "dynamic", "planning"} <= set(AREAS)


@pytest.mark.parametrize("script", _scripts())
def test_every_benchmark_script_is_named_in_the_benchmarks_readme(script):
    text = (BENCH / "README.md").read_text()
    assert f"`{script}`" in text, (
        f"benchmarks/{script} is not named in benchmarks/README.md: add a line saying what it "
        "measures, how to run it and where its results go"
    )


def test_results_readme_and_design_name_every_area():
    readme = (RESULTS / "README.md").read_text()
    design = (ROOT / "docs" / "design.md").read_text()
    (row,) = [ln for ln in design.splitlines() if ln.startswith("| measurement |")]
    for area in AREAS:
        assert f"({area}/LATEST.md)" in readme, f"benchmarks/results/README.md lacks {area}/"
        assert f"`{area}`" in row, f"docs/design.md's layout row for results lacks `{area}`"
    assert sorted(p.name for p in RESULTS.iterdir() if p.is_file()) == ["README.md"]


@pytest.mark.parametrize("area", AREAS)
def test_every_results_file_is_named_in_its_latest(area):
    latest = (RESULTS / area / "LATEST.md").read_text()
    for path in sorted((RESULTS / area).rglob("*")):
        if path.is_file() and path.name != "LATEST.md":
            assert path.name in latest, (
                f"benchmarks/results/{area}/{path.name} is not named in {area}/LATEST.md: cite "
                "it there, or retire it (git rm, and one line in LATEST.md saying what it "
                "showed and the commit that holds it)"
            )


@pytest.mark.parametrize("area", AREAS)
def test_what_latest_names_exists_or_is_retired_with_its_commit(area):
    folder = RESULTS / area
    for line in (folder / "LATEST.md").read_text().splitlines():
        for target in _LINK.findall(line):
            if not target.startswith("http"):
                assert (folder / target).exists(), f"{area}/LATEST.md links a missing {target}"
        for name in _RUN_FILE.findall(line):
            assert (folder / name).exists() or _COMMIT.search(line), (
                f"{area}/LATEST.md names {name}, which is not in the folder, on a line that "
                f"names no commit: {line!r}"
            )


def test_links_inside_results_resolve():
    for md in sorted(RESULTS.rglob("*.md")):
        for target in _LINK.findall(md.read_text()):
            if not target.startswith("http"):
                assert (md.parent / target).exists(), f"{md.relative_to(ROOT)} links {target}"


# A measured figure as the README would quote one: a rate, a ratio to cuDNN, or a dated run.
_FIGURE = re.compile(r"TFLOP/s|GB/s|tokens/s|× cuDNN|\b20\d\d-\d\d-\d\d\b")


def _readme_sections() -> tuple[list[str], list[str]]:
    """The README's "Current numbers" section, and every other line outside code blocks."""
    numbers, rest, section, fenced = [], [], None, False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if line.startswith("## "):
            section = line[3:].strip()
        if not fenced:
            (numbers if section == "Current numbers" else rest).append(line)
    return numbers, rest


def test_readme_figures_are_quoted_verbatim_from_latest():
    numbers, _ = _readme_sections()
    rows = [ln for ln in numbers if ln.startswith("| ") and "LATEST.md" in ln]
    assert len(rows) >= 7
    for row in rows:
        name, figures, link = (cell.strip() for cell in row.strip().strip("|").split(" | "))
        (area,) = re.findall(r"\(benchmarks/results/(\w+)/LATEST\.md\)", link)
        lines = (RESULTS / area / "LATEST.md").read_text().splitlines()
        assert figures in lines, (
            f"the README's figures for {name!r} are not a line of {area}/LATEST.md: quote "
            "its 'In the README' line, or change that line first"
        )


def test_readme_quotes_figures_only_under_current_numbers():
    _, rest = _readme_sections()
    stray = [ln for ln in rest if _FIGURE.search(ln)]
    assert not stray, f"measured figures outside the README's 'Current numbers': {stray}"


def _lines(paths) -> int:
    return sum(p.read_bytes().count(b"\n") for p in paths if p.is_file())


def test_results_are_smaller_than_the_library():
    """Results are evidence, not a diary: fewer lines than the library they measure (the
    runs nobody cites leave the tree; git keeps them)."""
    results = _lines(RESULTS.rglob("*"))
    library = _lines((ROOT / "magi_jax").rglob("*.py"))
    assert 0 < results < library, f"benchmarks/results/ {results} lines, magi_jax/ {library}"
