"""The commands the docs give for their figures still run as written, checked without measuring.

Every command line of README.md, docs/**/*.md and benchmarks/gpu_host.sh that runs one of our
commands (``python -m shmloader bench|doctor|config``, ``python benchmarks/*.py``, ``python
stress/*.py`` or a stress script named bare, ``bash benchmarks/gpu_host.sh MODE``) must name a
script that exists and be accepted, options and values, by that script's own parser
(``build_parser()``; the bench's ``parse_args``, which also checks ``--workers`` counts and the
``--plot`` path); the revisions an ``ab.py`` line compares must exist in git history. A ``python -m
timeit`` or ``python -c`` line must compile and import only names of ours that exist; one that
imports what the tree no longer has must say, in the text around it, which commit it ran on.
Nothing is measured and no process is started but one ``git`` call.
"""

from __future__ import annotations

import argparse
import ast
import getopt
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU_HOST = REPO / "benchmarks" / "gpu_host.sh"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]
# ab.py's names that are not revisions, and revisions every checkout has.
NOT_REVISIONS = {"WORKTREE", "TORCH", "HEAD"}
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}
REDIRECTS = {">", ">>", "<", "2>", "&>"}
PYTHONS = {"python", "python3", '"$PY"', "$PY"}
HEX = re.compile(r"(?<![\w/.-])([0-9a-f]{7,40})(?![\w-])")
SPAN = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Command:
    """One command line the docs give: where, and its words (the environment assignments dropped)."""

    where: str  # "docs/performance.md:123"
    words: tuple[str, ...]
    doc: Path
    line: int

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.words)}"


# -- finding the commands ----------------------------------------------------------------------------


def snippets(text: str) -> Iterator[tuple[int, str]]:
    """(line, code) of each line of a fenced block (a line whose quotes are open is joined to the
    next) and of each inline code span (its line breaks made spaces)."""
    prose, lines, fenced, pending, start = [], text.splitlines(), False, "", 0
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            fenced, pending = not fenced, ""
            prose.append("")
            continue
        if not fenced:
            prose.append(line)
            continue
        prose.append("")
        start, pending = (start if pending else number), (pending + "\n" + line if pending else line)
        if _splits(pending):
            yield start, pending
            pending = ""
    joined = "\n".join(prose)
    for match in SPAN.finditer(joined):
        yield joined.count("\n", 0, match.start()) + 1, " ".join(match.group(1).split())


def _splits(code: str) -> bool:
    try:
        return _words(code) is not None
    except ValueError:
        return False


def _words(code: str) -> list[str]:
    lexer = shlex.shlex(code, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    return list(lexer)


def segments(code: str) -> Iterator[list[str]]:
    """Each simple command of a shell line: split at ``;``, ``&&``, ``|``, ..., redirections and
    the environment assignments in front dropped."""
    current: list[str] = []
    words = iter(_words(code))
    for word in words:
        if word in SEPARATORS:
            yield current
            current = []
        elif word in REDIRECTS:
            next(words, None)
        elif not current and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", word):
            continue
        else:
            current.append(word)
    yield current


def ours(words: list[str]) -> bool:
    """Whether a simple command runs one of the commands this test checks."""
    if len(words) >= 2 and words[0] in PYTHONS:
        return (words[1].startswith(("benchmarks/", "stress/")) or words[1] == "-c"
                or words[1:3] in (["-m", "shmloader"], ["-m", "timeit"]))
    if words[:2] == ["bash", "benchmarks/gpu_host.sh"]:
        return True
    return bool(words) and words[0].endswith(".py") and (REPO / "stress" / words[0]).is_file()


def doc_commands(doc: Path) -> list[Command]:
    found = []
    for line, code in snippets(doc.read_text(encoding="utf-8")):
        try:
            parts = list(segments(code))
        except ValueError:  # quotes a span does not close: prose, not a command
            continue
        for words in parts:
            words = [_placeholder(w, doc, line) for w in words]
            if ours(words):
                if words[0].endswith(".py"):
                    words = ["python", f"stress/{words[0]}", *words[1:]]
                found.append(Command(f"{_shown(doc)}:{line}", tuple(words), doc, line))
    return sorted(found, key=lambda c: c.line)


def _placeholder(word: str, doc: Path, line: int) -> str:
    """A one-letter capital the text right after the command gives values for (``--workers N``,
    then ``at N = 1 / 2 / 4``) stands for its first value."""
    if not re.fullmatch(r"[A-Z]", word):
        return word
    after = " ".join(doc.read_text(encoding="utf-8").splitlines()[line - 1:line + 3])
    given = re.search(rf"\b{word} = (\d+)", after)
    return given.group(1) if given else word


def _shown(doc: Path) -> str:
    return str(doc.relative_to(REPO)) if doc.is_relative_to(REPO) else doc.name


def script_commands() -> list[Command]:
    """The commands gpu_host.sh runs through its ``step``/``jstep`` (``"$PY"`` is python, a loop's
    variable its first value)."""
    found = []
    for number, line in enumerate(GPU_HOST.read_text(encoding="utf-8").splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if words[:1] not in (["step"], ["jstep"]):
            continue
        words = ["2" if w == "$n" else w for w in shlex.split(line.replace('"$PY"', "python"))[3:]]
        if ours(words):
            found.append(Command(f"benchmarks/gpu_host.sh:{number}", tuple(words), GPU_HOST, number))
    return found


@cache
def all_commands() -> tuple[Command, ...]:
    return tuple(c for doc in DOCS for c in doc_commands(doc)) + tuple(script_commands())


# -- checking them ------------------------------------------------------------------------------------


def load_script(relative: str) -> ModuleType:
    """A benchmarks/ or stress/ script as a module (its own directory first on sys.path, as when run)."""
    path = REPO / relative
    name = "_docs_cmd_" + relative.replace("/", "_").removesuffix(".py")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    sys.modules[name] = module
    return module


def refused(parse: Callable[[], object]) -> str | None:
    """What argparse said when ``parse`` exited with a usage error, else None (``--help`` is fine)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse()
    except SystemExit as exc:
        if exc.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    return None


def check_shmloader(args: list[str]) -> str | None:
    if args[:1] == ["bench"]:
        rest = args[1:]
        if "--train" in rest:
            from shmloader.cli import train

            return refused(lambda: train.parse_args([a for a in rest if a != "--train"]))
        from shmloader.cli.options import parse_args

        return refused(lambda: parse_args(rest))
    from shmloader.__main__ import _parser

    return refused(lambda: _parser().parse_args(args))


def check_script(script: str, args: list[str]) -> str | None:
    if not (REPO / script).is_file():
        return f"{script} does not exist"
    module = load_script(script)
    build = getattr(module, "build_parser", None)
    if build is None:
        return f"{script} has no build_parser()"
    parser: argparse.ArgumentParser = build()
    if script != "benchmarks/ab.py":
        return refused(lambda: parser.parse_args(args))

    def parse_ab() -> None:  # its checks of options that do not go together, on a 2-CPU machine
        module.checked_depths(parser, parser.parse_args(args), {0, 1})

    return refused(parse_ab)


def gpu_host_modes() -> set[str]:
    return set(re.findall(r"^(\w+)\)$", GPU_HOST.read_text(encoding="utf-8"), re.M))


def check(command: Command) -> str | None:
    """Why ``command`` would not run as written (None: it would, as far as can be told unmeasured)."""
    words = list(command.words)
    if words[0] == "bash":
        modes = [w for w in words[2:] if w != "..."]
        return None if all(m in gpu_host_modes() for m in modes) else f"gpu_host.sh has modes {gpu_host_modes()}"
    if words[1:3] == ["-m", "shmloader"]:
        return check_shmloader(words[3:])
    if words[1] == "-c" or words[1:3] == ["-m", "timeit"]:
        return check_python(command)
    return check_script(words[1], words[2:])


def python_code(words: list[str]) -> tuple[list[str], str]:
    """The code of a ``python -c`` or ``python -m timeit`` line: (pieces to compile, all of it)."""
    if words[1] == "-c":
        return [words[2]], words[2]
    options, statements = getopt.getopt(words[3:], "n:u:s:r:tcpvh", ["number=", "setup=", "repeat=", "process",
                                                                      "verbose", "unit=", "help"])
    setup = "\n".join(value for option, value in options if option in ("-s", "--setup"))
    statement = "\n".join(statements) or "pass"
    return [setup, statement], setup + "\n" + statement


def missing_imports(code: str) -> list[str]:
    """The names of ours that ``code`` imports and the tree does not have (another package missing
    here, torch say, is not counted: it cannot be told)."""
    missing = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            missing += [a.name for a in node.names if a.name.split(".")[0] == "shmloader" and not _imports(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "shmloader":
            module = node.module or ""
            if not _imports(module):
                missing.append(module)
                continue
            missing += [f"{module}.{a.name}" for a in node.names
                        if not hasattr(sys.modules[module], a.name) and not _imports(f"{module}.{a.name}")]
    return missing


def _imports(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:  # ours missing: False; another package missing here: cannot be told
        return not (exc.name or "").startswith("shmloader")
    except ImportError:
        return True
    return True


def check_python(command: Command) -> str | None:
    words = list(command.words)
    try:
        pieces, code = python_code(words)
        for piece in pieces:
            compile(piece, command.where, "exec")
    except (getopt.GetoptError, IndexError, SyntaxError) as exc:
        return f"does not compile: {exc}"
    missing = missing_imports(code)
    if not missing:
        return None
    near = around(command.doc.read_text(encoding="utf-8").splitlines(), command.line)
    named = [h for h in HEX.findall(near) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    known = commits_in_history()
    if any(known is None or h in known for h in named):
        return None
    return f"imports {', '.join(missing)}, which the tree does not have, and the text around it names no commit"


def around(lines: list[str], line: int) -> str:
    """The paragraph (or fenced block) holding ``line`` (1-based), with the paragraphs before and after it."""
    starts = [0] + [i + 1 for i, text in enumerate(lines) if not text.strip()] + [len(lines) + 1]
    at = max(i for i, start in enumerate(starts) if start <= line - 1)
    return "\n".join(lines[starts[max(0, at - 1)]:starts[min(len(starts) - 1, at + 2)]])


@cache
def commits_in_history() -> frozenset[str] | None:
    """Every hex word of the docs and the scripts that names a commit of this repository's history
    (one ``git cat-file --batch-check``); None where that cannot be told: not a git checkout, or a
    shallow one."""
    words = set()
    for path in [*DOCS, GPU_HOST]:
        words |= {h for h in HEX.findall(path.read_text(encoding="utf-8")) if re.search(r"[a-f]", h)}
    try:
        shallow = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True, timeout=30)
        if shallow.returncode != 0 or shallow.stdout.strip() != "false":
            return None
        answer = subprocess.run(["git", "-C", str(REPO), "cat-file", "--batch-check"], capture_output=True,
                                text=True, timeout=30, input="".join(f"{w}^{{commit}}\n" for w in sorted(words)))
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = [line.split()[0] for line in answer.stdout.splitlines() if line.split()[1:2] == ["commit"]]
    return frozenset(w for w in words if any(sha.startswith(w) for sha in found))


def ab_revisions(command: Command) -> list[str]:
    module = load_script("benchmarks/ab.py")
    with contextlib.redirect_stderr(io.StringIO()):
        revisions: list[str] = module.build_parser().parse_args(list(command.words[2:])).revisions
    return [r for r in revisions if r not in NOT_REVISIONS]


# -- the tests -------------------------------------------------------------------------------------------


@pytest.fixture
def at_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths as the docs give them (``--plot docs/bench.png``) are the repository root's; whether
    matplotlib is installed here is not the command's fault."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("shmloader.cli.plot.matplotlib_installed", lambda: True)


def test_the_collector_finds_the_commands_of_every_kind() -> None:
    kinds = {c.words[1] for c in all_commands()}
    kinds |= {" ".join(c.words[1:4]) for c in all_commands() if c.words[1:3] == ("-m", "shmloader")}
    assert {"benchmarks/ab.py", "benchmarks/hotpath.py", "benchmarks/floor.py", "benchmarks/pages.py",
            "benchmarks/first_batch.py", "benchmarks/gpu_host.sh", "stress/kill_workers.py", "stress/soak.py",
            "stress/resume.py", "stress/combos.py", "stress/shm_pressure.py", "-c", "-m shmloader bench",
            "-m shmloader doctor"} <= kinds, kinds
    assert sum(c.words[1:3] == ("-m", "timeit") for c in all_commands()) >= 10
    assert any(c.where.startswith("benchmarks/gpu_host.sh") for c in all_commands())


def test_every_documented_command_is_accepted_as_written(at_the_root: None) -> None:
    assert any(c.words[1:3] == ("-m", "shmloader") and "--train" in c.words for c in all_commands())
    wrong = [f"{c}\n    {why}" for c in all_commands() if (why := check(c)) is not None]
    assert not wrong, "commands the docs give that would not run as written:\n" + "\n".join(wrong)


def test_every_revision_an_ab_line_compares_is_in_the_history() -> None:
    known = commits_in_history()
    if known is None:
        pytest.skip("not a full git checkout: revisions cannot be looked up")
    lines = [c for c in all_commands() if c.words[1] == "benchmarks/ab.py"]
    assert len(lines) > 20
    unknown = [f"{c}\n    {r}" for c in lines for r in ab_revisions(c) if r not in known]
    assert not unknown, "revisions the docs' ab.py lines compare that git does not have:\n" + "\n".join(unknown)


def test_the_checks_refuse_what_they_should(tmp_path: Path, at_the_root: None) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Measured with `OMP_NUM_THREADS=1 python benchmarks/floor.py --work-us\n600 > x.txt` and\n"
        "```\npython -m shmloader bench --workloads huge   # a comment\n"
        "python benchmarks/ab.py 05fabe7 TORCH --hotpath; python -m shmloader doctor --clean\n```\n\nNo commit.\n\n"
        "```\npython -m timeit -s \"from shmloader.collate import no_such_name\" \"1\"\n"
        "PYTHONPATH=tests python -c \"\nimport shmloader\nprint(1)\"\n```\n\nNone here.\n\n"
        "`kill_workers.py --seconds 120 --seed x` (2 workers), `python -m timeit -s \"x = (\" \"x\"`,\n"
        "`... --main-core`, and `python -m timeit -s \"from shmloader.gone import f\" \"f()\"` at a13bd33.\n",
        encoding="utf-8")
    commands = doc_commands(doc)
    assert [c.words[:3] for c in commands] == [
        ("python", "benchmarks/floor.py", "--work-us"), ("python", "-m", "shmloader"), ("python", "benchmarks/ab.py", "05fabe7"),
        ("python", "-m", "shmloader"), ("python", "-m", "timeit"), ("python", "-c", "\nimport shmloader\nprint(1)"),
        ("python", "stress/kill_workers.py", "--seconds"), ("python", "-m", "timeit"), ("python", "-m", "timeit")]
    assert [c.line for c in commands] == [1, 4, 5, 5, 11, 12, 19, 19, 20]
    why = [check(c) for c in commands]
    assert why[0] is None and why[3] is None and why[5] is None
    assert "huge" in str(why[1]) and "--hotpath" in str(why[2]) and "no_such_name" in str(why[4])
    assert "--seed" in str(why[6]) and "does not compile" in str(why[7])
    assert why[8] is None or commits_in_history() is not None  # a13bd33 is named beside the stale import
    assert ab_revisions(commands[2]) == ["05fabe7"]
