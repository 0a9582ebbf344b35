"""The docs cannot rot: every ```python block of README.md and docs/**/*.md is executed.

Each file's blocks run in order in one fresh namespace (so a later block may use what an earlier
one defined), with ``__name__ == "__main__"``, from a temporary working directory, with the
environment restored afterwards. A block whose preceding non-blank line is ``<!-- no-run -->``
is skipped. Tracebacks name the markdown file and its line numbers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NO_RUN = "<!-- no-run -->"


@dataclass(frozen=True)
class Block:
    """One fenced python block: its code and the markdown line its first code line is on."""

    code: str
    line: int


def python_blocks(text: str) -> list[Block]:
    """The runnable ```python blocks of a markdown text, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```"):
            i += 1
            continue
        language = fence[3:].strip().split(" ")[0]
        start, i = i + 1, i + 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        previous = next((l.strip() for l in reversed(lines[: start - 1]) if l.strip()), "")
        if language == "python" and previous != NO_RUN:
            blocks.append(Block("\n".join(lines[start:i]), start + 1))
        i += 1
    return blocks


def doc_files() -> list[Path]:
    files = [REPO / "README.md"] if (REPO / "README.md").exists() else []
    return files + sorted((REPO / "docs").glob("**/*.md"))


def files_with_code() -> list[Path]:
    return [p for p in doc_files() if python_blocks(p.read_text(encoding="utf-8"))]


def run_blocks(path: Path, blocks: list[Block]) -> dict:
    namespace: dict = {"__name__": "__main__", "__file__": str(path)}
    for block in blocks:
        # Pad with blank lines so a traceback's line numbers are the markdown file's.
        code = compile("\n" * (block.line - 1) + block.code, str(path), "exec")
        exec(code, namespace)
    return namespace


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", files_with_code(), ids=lambda p: str(p.relative_to(REPO)))
def test_doc_examples_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks(path.read_text(encoding="utf-8"))
    assert blocks, f"{path} has no runnable python block"
    saved_env = dict(os.environ)
    monkeypatch.chdir(tmp_path)
    try:
        run_blocks(path, blocks)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def test_collector_runs_blocks_in_order_and_skips_no_run(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# t\n\n```python\nx = 1\n```\n\n<!-- no-run -->\n\n```python\nraise SystemExit('skipped')\n```\n"
        "```bash\nexit 1\n```\n```python\ny = x + 1\n```\n",
        encoding="utf-8",
    )
    blocks = python_blocks(doc.read_text(encoding="utf-8"))
    assert [b.code for b in blocks] == ["x = 1", "y = x + 1"]
    assert [b.line for b in blocks] == [4, 16]
    assert run_blocks(doc, blocks)["y"] == 2


def test_collector_reports_the_markdown_line(tmp_path: Path) -> None:
    doc = tmp_path / "bad.md"
    doc.write_text("text\n\n```python\nok = 1\nraise ValueError('rotted')\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="rotted") as info:
        run_blocks(doc, python_blocks(doc.read_text(encoding="utf-8")))
    assert info.traceback[-1].lineno + 1 == 5 and str(info.traceback[-1].path) == str(doc)
