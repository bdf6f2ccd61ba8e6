"""Every Python block of README.md runs as written, and the README's set-up commands keep their shape.

Each ```python block runs as a script of its own (``python block.py`` in a fresh process, so
``multiprocessing`` and ``if __name__ == "__main__":`` work as they do for a reader). A block
needs nothing unless the line before it says otherwise:

* no marker: the block is self-contained (it starts its own server, as the quick start does);
* ``<!-- needs: server -->``: the block uses ``url``, the URL of a server; here a private
  ``EmbeddedServer`` that this module starts, whose URL is set before the block runs;
* ``<!-- needs: cluster -->``: the same with a private ``EmbeddedCluster`` of three primaries.

A block must leave the server as it found it (``clear_redis()`` what it made), so a reader who
runs it against a real server leaves nothing behind; the servers here start empty and are
checked empty after each block.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tdstore.cluster_server import EmbeddedCluster
from tdstore.server import EmbeddedServer

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
HOW_IT_WORKS = REPO / "docs" / "how-it-works.md"
#: The README's ceiling, a ratchet toward the guide's ~400 lines: it only goes down (400 when set).
README_MAX_LINES = 400
NEEDS = re.compile(r"<!--\s*needs:\s*(\w+)\s*-->")
KNOWN_NEEDS = {"server", "cluster"}
BLOCK_TIMEOUT_S = 600  # a bound on a hung block, not a speed requirement


def python_blocks(text: str) -> list[tuple[int, str | None, str]]:
    """``(line number, need, code)`` of every ```python block; ``need`` is from a marker on the line before it."""
    lines = text.splitlines()
    blocks: list[tuple[int, str | None, str]] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            assert end < len(lines), f"README.md:{i + 1}: the python block is never closed"
            previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
            match = NEEDS.search(previous)
            blocks.append((i + 1, match.group(1) if match else None, "\n".join(lines[start:end]) + "\n"))
            i = end
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_blocks_and_known_markers() -> None:
    assert len(BLOCKS) >= 3
    for line, need, _ in BLOCKS:
        assert need is None or need in KNOWN_NEEDS, f"README.md:{line}: unknown marker 'needs: {need}'"
    # a marker that does not sit right before a python block would be silently ignored
    text = README.read_text()
    assert len(NEEDS.findall(text)) == sum(1 for _, need, _ in BLOCKS if need)


def test_the_block_parser_reads_markers_and_bodies() -> None:
    text = "intro\n\n<!-- needs: cluster -->\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = 2\n```\n"
    assert python_blocks(text) == [(4, "cluster", "x = 1\n"), (11, None, "y = 2\n")]


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster() as c:
        yield c


def _keys_left(need: str | None, request: pytest.FixtureRequest) -> int:
    if need == "server":
        return request.getfixturevalue("server").client().dbsize()
    if need == "cluster":
        c = request.getfixturevalue("cluster")
        return sum(c.node_client(i).dbsize() for i in range(3))
    return 0


@pytest.mark.parametrize(("line", "need", "code"), BLOCKS, ids=[f"line{line}" for line, _, _ in BLOCKS])
def test_readme_python_block_runs(line: int, need: str | None, code: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    prelude = ""
    if need is not None:
        target = request.getfixturevalue(need)
        assert _keys_left(need, request) == 0, "the server must be empty before the block"
        prelude = f"url = {target.url!r}  # set by tests/project/test_readme.py (needs: {need})\n"
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(prelude + code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, f"README.md:{line}: the block failed\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert _keys_left(need, request) == 0, f"README.md:{line}: the block left keys on the server (clear_redis() what it makes)"


def test_the_test_command_is_where_ci_reads_it() -> None:
    """``.ci/run`` runs the line two lines after the ``<!-- test-command -->`` marker (the fence, then the command)."""
    lines = README.read_text().splitlines()
    at = [i for i, line in enumerate(lines) if line.strip() == "<!-- test-command -->"]
    assert len(at) == 1
    i = at[0]
    assert lines[i + 1] == "```bash" and lines[i + 3] == "```"
    command = lines[i + 2]
    assert "pip install" in command and "pytest" in command and "ruff check" in command


def test_the_docs_link_only_inside_the_repository() -> None:
    """README.md, lua/README.md and tools/README.md: relative links to files that exist, no web links."""
    link = re.compile(r"\]\(([^)]+)\)")
    for doc in (README, REPO / "lua" / "README.md", REPO / "tools" / "README.md", HOW_IT_WORKS):
        text = doc.read_text()
        for target in link.findall(text):
            assert "://" not in target, f"{doc.relative_to(REPO)}: a link out of the repository: {target}"
            path = (doc.parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(REPO) and path.exists(), (
                f"{doc.relative_to(REPO)}: a link to {target}, which is not a file of the repository"
            )


def test_the_docs_tell_no_history() -> None:
    """The docs say what is, not how it came to be: no sessions, no issue numbers (figures of older runs go)."""
    history = re.compile(r"\b(this|earlier|previous|last) sessions?\b|\bissue #?\d+|\(#\d+\)", re.IGNORECASE)
    for doc in (README, REPO / "lua" / "README.md", REPO / "tools" / "README.md", HOW_IT_WORKS):
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            assert not history.search(line), f"{doc.relative_to(REPO)}:{number}: history in the docs: {line.strip()}"


def test_the_map_is_on_the_first_screen_and_the_readme_stays_short() -> None:
    """A new engineer finds the map (docs/how-it-works.md) in the README's first 30 lines; the README, a user's
    guide, stays within its ceiling; the map names where each of the four calls is decided, and the protocol."""
    lines = README.read_text().splitlines()
    assert any("(docs/how-it-works.md)" in line for line in lines[:30])
    assert len(lines) <= README_MAX_LINES, len(lines)
    text = HOW_IT_WORKS.read_text()
    for needle in ("store[i] = td", "`extend`", "prioritized `sample`", "fan-out", "lua/README.md"):
        assert needle in text, needle
    for path in re.findall(r"`((?:_\w+|torchrl|cli)/\w+\.py)`", text):
        assert (REPO / "tdstore" / path).is_file(), path
