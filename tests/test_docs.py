"""The docs cannot rot: every ```python block of README.md and docs/**/*.md is executed.

Each file's blocks run in order in one fresh namespace (so a later block may use what an earlier
one defined), with ``__name__ == "__main__"``, from a temporary working directory, with the
environment restored afterwards. A block whose preceding non-blank line is ``<!-- no-run -->``
is skipped. Tracebacks name the markdown file and its line numbers.

What the docs name as evidence or as the command behind a figure must exist too: every path under
tests/, benchmarks/, stress/, examples/, shmloader/ and docs/ (and a ``tests/x.py::test_name``'s
test), every bare ``test_*.py``, and every option given to a ``python benchmarks/*.py`` or
``python -m shmloader ...`` or ``stress/*.py`` command (checked against that command's ``--help``;
a stress script may be named bare, ``kill_workers.py --seconds 120``, as the tables of runs do)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
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
    except ImportError as exc:
        skip_if_an_extra_is_missing(exc)
        raise
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


# what pyproject.toml's extras install (torch, progress, plot) and the frameworks docs/frameworks.md shows
OPTIONAL = ("torch", "tqdm", "matplotlib", "lightning", "accelerate")


def skip_if_an_extra_is_missing(exc: ImportError) -> None:
    """Skip a doc whose example needs an optional package that is not installed here; a doc that
    fails to import anything else, or an installed extra, fails."""
    root = (exc.name or "").partition(".")[0]
    if root in OPTIONAL and (sys.modules.get(root) is None and importlib.util.find_spec(root) is None):
        pytest.skip(f"the example needs {root}, which is not installed ({exc})")


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


# -- what the docs name exists -------------------------------------------------------------------

PATH = re.compile(r"(?<![\w/.-])((?:tests|benchmarks|stress|examples|shmloader|docs)/[\w./-]*[\w/])(?:::(\w+))?")
SUBPACKAGE = re.compile(r"(?<![\w/.-])((?:engine|transport|gpu|collate|worker|cli|builtin)/\w+\.py)")
BARE_TEST = re.compile(r"(?<![\w/.-])(test_\w+\.py)")
LINK = re.compile(r"\]\(([^)#\s:]+)(?:#[^)]*)?\)")
COMMAND = re.compile(r"python3? (benchmarks/\w+\.py|stress/\w+\.py|-m shmloader(?: (?:bench|doctor|config))?)([^`;#|)>]*)")
BARE_SCRIPT = re.compile(r"(?<![\w/.-])(\w+\.py)([^`;#|)>]*)")
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def named_paths(text: str) -> set[tuple[str, str | None]]:
    """Each (repository path, test name or None) a markdown text names."""
    found = {(m.group(1), m.group(2)) for m in PATH.finditer(text)}
    found |= {(f"shmloader/{m.group(1)}", None) for m in SUBPACKAGE.finditer(text)}
    return found | {(f"tests/{m.group(1)}", None) for m in BARE_TEST.finditer(text)}


def named_options(text: str) -> set[tuple[str, str]]:
    """Each (command, option) of a documented command line; ``bench --train`` is its own command."""
    found = set()
    for line in text.splitlines():
        for match in COMMAND.finditer(line):
            command, options = match.group(1), OPTION.findall(match.group(2))
            if command == "-m shmloader bench" and "--train" in options:
                command = "-m shmloader bench --train"
            found |= {(command, option) for option in options}
        for match in BARE_SCRIPT.finditer(line):
            if (REPO / "stress" / match.group(1)).is_file():
                found |= {(f"stress/{match.group(1)}", option) for option in OPTION.findall(match.group(2))}
    return found


def test_every_path_the_docs_name_exists() -> None:
    missing = []
    for doc in doc_files():
        for path, test in sorted(named_paths(doc.read_text(encoding="utf-8")), key=str):
            target = REPO / path
            if not target.exists():
                missing.append(f"{doc.relative_to(REPO)}: {path}")
            elif test is not None and not re.search(rf"^\s*(async )?def {test}\b", target.read_text(), re.M):
                missing.append(f"{doc.relative_to(REPO)}: {path}::{test}")
        for link in LINK.findall(doc.read_text(encoding="utf-8")):
            if not (doc.parent / link).exists():
                missing.append(f"{doc.relative_to(REPO)}: link {link}")
    assert not missing, "named in the docs but not in the repository:\n" + "\n".join(missing)


def _help(command: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, *command.split(), "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, f"{command} --help failed: {done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.timeout(240)
def test_every_option_of_a_documented_command_exists() -> None:
    wanted: dict[str, set[str]] = {}
    for doc in doc_files():
        for command, option in named_options(doc.read_text(encoding="utf-8")):
            wanted.setdefault(command, set()).add(option)
    assert "-m shmloader bench" in wanted and any(c.startswith("benchmarks/") for c in wanted)
    assert {"stress/kill_workers.py", "stress/soak.py", "stress/resume.py"} <= set(wanted)
    unknown = [f"python {command} {option}" for command, options in sorted(wanted.items())
               for option in sorted(options - set(OPTION.findall(_help(command))))]
    assert not unknown, "options the docs give that the command does not have:\n" + "\n".join(unknown)


def test_the_name_collectors_see_what_they_should(tmp_path: Path) -> None:
    text = ("See tests/test_x.py::test_y, `benchmarks/ab.py`. and test_z.py; not stress/ alone; `engine/wait.py`.\n"
            "`python -m shmloader bench --train --steps 3` and `python benchmarks/ab.py HEAD --rounds 9 # --no`\n"
            "| `python -m shmloader bench --workers 0,2 > out.json --not-this` |\n"
            "| `kill_workers.py --seconds 120 --seed 0` (2 workers) | `python stress/soak.py --epochs 9`, `other.py --no` |")
    assert named_paths(text) == {("tests/test_x.py", "test_y"), ("benchmarks/ab.py", None), ("tests/test_z.py", None),
                                 ("shmloader/engine/wait.py", None), ("stress/soak.py", None)}
    assert LINK.findall("[a](design/x.md), [b](x.md#part), [c](https://e.org/y)") == ["design/x.md", "x.md"]
    assert named_options(text) == {("-m shmloader bench --train", "--train"), ("-m shmloader bench --train", "--steps"),
                                   ("benchmarks/ab.py", "--rounds"), ("-m shmloader bench", "--workers"),
                                   ("stress/kill_workers.py", "--seconds"), ("stress/kill_workers.py", "--seed"),
                                   ("stress/soak.py", "--epochs")}
