"""The code of docs/switching.md runs as written: its Python blocks, in order, as one program
(on 8 CPU host devices, tests/conftest.py); each block checks its own results."""

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def _blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


def test_switching_page_runs():
    blocks = _blocks("switching.md")
    assert len(blocks) >= 6  # the page's examples, not an empty match
    scope: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/switching.md, block {i + 1}", "exec"), scope)
