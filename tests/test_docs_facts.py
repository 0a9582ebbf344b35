"""What the docs say about the package's own names holds (tests/test_docs.py runs their examples).

- Every dotted name of ours the docs give in backticks resolves: ``shmloader.a.b`` by import and
  attribute; ``ring.Ring``-style, a module's short name and then attributes; ``Ledger.assign``-style,
  a class of ours and then an attribute it or its methods set. Others' names are not checked.
- Every exception tree drawn in a fenced block puts each class under its real base, and a tree
  that shows one of our classes shows every public subclass of it.
- docs/errors.md shows every public exception class of the package.
- docs/config.md has a section for exactly the variables shmloader reads, and no doc names a
  ``SHMLOADER_*`` variable that nothing reads but as a misspelling.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import inspect
import pkgutil
import re
from functools import cache
from pathlib import Path
from types import ModuleType

import shmloader
from shmloader.config import known_variables
from shmloader.config_fields import FIELDS

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]

# Short names the docs' examples use for objects, not for the modules of the same name.
VARIABLES = {"loader", "config"}
# Dotted names of ours that are not importable names, each with what it is.
NOT_IMPORTABLE = {"shmloader.builtin.pin": "the name of the built-in pin plugin, not a module"}
# Exception classes in a module's __all__ that no user meets, each with why.
NOT_MET = {
    "SlotFull": "a collate rule's signal that the slot is too small; docs/plugins.md says to let it pass",
    "TooManyDigits": "raised by the integer parser and turned into ConfigError or a usage error",
}
# A doc may show a misspelt variable to show the warning it draws.
MISSPELT = {"SHMLOADER_NUM_WORKRS"}

CODE_NAME = re.compile(r"`((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*)(?:\(\))?`")
FILE_SUFFIXES = {"py", "md", "txt", "json", "sh", "toml", "png"}


UNIMPORTABLE: set[str] = set()  # modules of ours that need what is not installed here (torch, accelerate)


@cache
def our_modules() -> dict[str, ModuleType]:
    """Every importable module of the package by full name (torch's flavour only where torch is)."""
    found = {"shmloader": shmloader}
    for info in pkgutil.walk_packages(shmloader.__path__, "shmloader."):
        if info.name.endswith("__main__"):
            continue
        try:
            found[info.name] = importlib.import_module(info.name)
        except ImportError:  # its optional dependency is missing here
            UNIMPORTABLE.add(info.name)
    return found


@cache
def our_classes() -> dict[str, list[type]]:
    """Every class the package defines, by its name."""
    classes: dict[str, list[type]] = {}
    for module in our_modules().values():
        for obj in vars(module).values():
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                classes.setdefault(obj.__name__, []).append(obj)
    return classes


def _has(owner: object, attribute: str) -> bool:
    if hasattr(owner, attribute):
        return True
    if not inspect.isclass(owner):
        return False
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{attribute}\b|^\s+{attribute}\s*[:=]", source, re.M) is not None


def _walk(start: object, attributes: list[str]) -> bool:
    owner = start
    for i, attribute in enumerate(attributes):
        if not _has(owner, attribute):
            return False
        if not hasattr(owner, attribute):  # an instance attribute: nothing further to follow
            return i == len(attributes) - 1
        owner = getattr(owner, attribute)
    return True


def resolves(name: str) -> bool | None:
    """Whether a dotted name of ours exists; None when it is not ours (or not importable here)."""
    parts = name.split(".")
    if parts[-1] in FILE_SUFFIXES or name in NOT_IMPORTABLE:
        return None
    modules, classes = our_modules(), our_classes()
    if any(name == m or name.startswith(m + ".") for m in UNIMPORTABLE):
        return None
    if parts[0] == "shmloader":
        for cut in range(len(parts), 0, -1):
            if ".".join(parts[:cut]) in modules:
                return _walk(modules[".".join(parts[:cut])], parts[cut:])
        return None
    if parts[0] in classes:
        return any(_walk(cls, parts[1:]) for cls in classes[parts[0]])
    if parts[0] in VARIABLES or importlib.util.find_spec(parts[0]) is not None:  # another package's name
        return None
    for cut in range(len(parts) - 1, 0, -1):
        suffix = "." + ".".join(parts[:cut])
        starts = [m for full, m in modules.items() if full.endswith(suffix)]
        if starts:
            return any(_walk(m, parts[cut:]) for m in starts)
    return None


def test_every_dotted_name_of_ours_the_docs_give_exists() -> None:
    missing = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            missing += [f"{doc.relative_to(REPO)}:{number}: {name}" for name in CODE_NAME.findall(line)
                        if resolves(name) is False]
    assert not missing, "names the docs give that the code does not have:\n" + "\n".join(missing)


def test_the_name_check_finds_what_it_should() -> None:
    assert resolves("shmloader.config.resolve_config") and resolves("shmloader.collate.threads.SPLIT_MIN_BYTES")
    assert resolves("shmloader.config.no_such_name") is False and resolves("shmloader.no_module.x") is False
    assert resolves("ring.Ring") and resolves("codec.no_such_function") is False
    assert resolves("Ring.whole_slots") and resolves("Ring.no_such_attribute") is False  # set in __init__
    assert resolves("torch.cuda.is_available") is None and resolves("loader.stats") is None
    assert resolves("owner.py") is None


# -- exception trees ------------------------------------------------------------------------------

TREE_NAME = re.compile(r"(?:^|(?<=[─┬├└] ))\s*([A-Z]\w+)")


def fenced_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced block of a markdown text."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.strip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def tree_edges(lines: list[str]) -> list[tuple[str | None, str]]:
    """(parent, child) for each class of an ASCII tree: a class's parent is the class before it on
    its line (``A ── B``), else the nearest class above whose name starts no further right than
    the child's branch (``├``, ``└``); a class with no branch before it is a root."""
    edges: list[tuple[str | None, str]] = []
    seen: list[tuple[int, str]] = []  # (column, name), latest last
    for line in lines:
        previous = None
        for match in re.finditer(r"(?:^|(?<=[─┬├└]))[ ]*([A-Z]\w+)", line):
            name, column = match.group(1), match.start(1)
            if previous is None:
                branch = max(line.rfind(c, 0, column) for c in "├└")
                previous = next((n for c, n in reversed(seen) if c <= branch), None) if branch >= 0 else None
            edges.append((previous, name))
            seen.append((column, name))
            previous = name
    return edges


def exception_trees() -> list[tuple[Path, list[tuple[str | None, str]]]]:
    trees = []
    for doc in DOCS:
        for block in fenced_blocks(doc.read_text(encoding="utf-8")):
            first = next((line.strip() for line in block if line.strip()), "")
            if first in ("RuntimeError", "Exception", "ValueError", "UserWarning"):
                trees.append((doc, tree_edges(block)))
    return trees


def exception_class(name: str) -> type:
    found = [c for c in our_classes().get(name, []) if issubclass(c, BaseException)]
    return found[0] if found else getattr(builtins, name)


def public_errors() -> dict[str, type]:
    """Every exception class a module of ours exports (its __all__), or errors.py defines."""
    errors: dict[str, type] = {}
    for module in our_modules().values():
        exported = set(getattr(module, "__all__", ()))
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, Exception) and not issubclass(obj, Warning)
                    and obj.__module__ == module.__name__ and not name.startswith("_")
                    and (name in exported or module.__name__ == "shmloader.errors")):
                errors[name] = obj
    return errors


def test_exception_trees_put_each_class_under_its_base_and_show_all_its_subclasses() -> None:
    trees = exception_trees()
    assert {doc.name for doc, _ in trees} >= {"errors.md", "reliability.md"}
    wrong = []
    for doc, edges in trees:
        shown = {child for _, child in edges}
        for parent, child in edges:
            if parent is not None and exception_class(parent) not in exception_class(child).__bases__:
                wrong.append(f"{doc.name}: {child} drawn under {parent}")
        for name in shown & set(public_errors()):
            for sub, cls in public_errors().items():
                if exception_class(name) in cls.__bases__ and sub not in shown and sub not in NOT_MET:
                    wrong.append(f"{doc.name}: {sub}, a subclass of {name}, is missing")
    assert not wrong, "exception trees in the docs:\n" + "\n".join(wrong)


def test_the_tree_reader_reads_parents() -> None:
    lines = ["RuntimeError", "├── Aa ── Bb", "│   └── Cc", "└── Dd", "ValueError", "└── Ee ─┬─ Ff",
             "        ├─ Gg (also an Hh)"]
    assert tree_edges(lines) == [(None, "RuntimeError"), ("RuntimeError", "Aa"), ("Aa", "Bb"), ("Aa", "Cc"),
                                 ("RuntimeError", "Dd"), (None, "ValueError"), ("ValueError", "Ee"), ("Ee", "Ff"),
                                 ("Ee", "Gg")]


def test_the_errors_page_shows_every_public_exception_class() -> None:
    page = (REPO / "docs" / "errors.md").read_text(encoding="utf-8")
    missing = sorted(set(public_errors()) - set(NOT_MET) - set(re.findall(r"`?(\w+)`?", page)))
    assert not missing, f"exception classes missing from docs/errors.md: {missing}"
    rows = re.findall(r"^\| `(\w+)`", page, re.M)
    unknown = [name for name in rows if not (name in public_errors() or
                                             isinstance(getattr(builtins, name, None), type))]
    assert len(rows) > 20 and not unknown, f"docs/errors.md's table names errors that do not exist: {unknown}"


# -- variables ------------------------------------------------------------------------------------


def config_sections() -> tuple[set[str], set[str]]:
    """The variables docs/config.md has a section for: (loader options, the others)."""
    page = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    options, others = page.split("## Variables that are not loader options", 1)
    section = re.compile(r"^### `(SHMLOADER_\w+)`", re.M)
    return set(section.findall(options)), set(section.findall(others))


def test_config_page_has_a_section_for_exactly_the_variables_read() -> None:
    options, others = config_sections()
    assert options == {f.env for f in FIELDS}
    assert others == {v for v in known_variables() if v not in options and not v.startswith("SHMLOADER_TEST")}


def test_config_page_says_what_each_option_accepts() -> None:
    page = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    for spec in FIELDS:
        body = page.split(f"### `{spec.env}`", 1)[1].split("###", 1)[0]
        assert f"- accepts: {spec.accepts}\n" in body, spec.env


def test_every_variable_the_docs_name_is_read() -> None:
    known = set(known_variables()) | MISSPELT
    unknown = [f"{doc.relative_to(REPO)}: {name}" for doc in DOCS
               for name in sorted(set(re.findall(r"SHMLOADER_[A-Z0-9_]*[A-Z0-9]", doc.read_text(encoding="utf-8"))))
               if name not in known]
    assert not unknown, "variables the docs name that shmloader does not read:\n" + "\n".join(unknown)


def test_the_readme_test_command_is_what_ci_runs() -> None:
    """README.md says its test command "is what `.ci/run` runs"."""
    run = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    command = next(line for line in reversed(run) if line.strip() and not line.startswith("#"))
    assert "`.ci/run`" in (REPO / "README.md").read_text(encoding="utf-8")
    assert command in (REPO / "README.md").read_text(encoding="utf-8")


SECTION_REF = re.compile(r"([\w/.-]+\.md)\)?`?,? (?:section )?\"([^\"]+)\"")


def section_titles(page: Path) -> list[str]:
    """The headings of a page and the bold lead words of its list items (``- **Lease.**``)."""
    text = page.read_text(encoding="utf-8")
    return re.findall(r"^#+ (.+)$", text, re.M) + re.findall(r"^\s*- \*\*(.+?)\*\*", text, re.M)


def test_every_section_the_docs_point_to_exists() -> None:
    """``docs/performance.md, "Huge pages"``: that page has a heading (or bold item) starting so."""
    missing, seen = [], 0
    for doc in DOCS:
        for page, title in SECTION_REF.findall(" ".join(doc.read_text(encoding="utf-8").split())):
            target = next((p for p in (doc.parent / page, REPO / page, REPO / "docs" / page) if p.is_file()), None)
            seen += 1
            if target is None or not any(t.startswith(title.rstrip(".")) for t in section_titles(target)):
                missing.append(f"{doc.relative_to(REPO)}: {page}, \"{title}\"")
    assert seen >= 10, "the reference collector found too few references"
    assert not missing, "sections the docs point to that do not exist:\n" + "\n".join(missing)


def test_the_plugins_page_gives_each_hook_its_arguments() -> None:
    """docs/plugins.md shows each hook of shmloader/hookspecs.py with exactly its arguments: in the
    hook's heading (``### `shmloader_pin_backend(device: str)```) or in its row of the observers' table."""
    from shmloader import hookspecs

    page = (REPO / "docs" / "plugins.md").read_text(encoding="utf-8")
    wrong = []
    for name, spec in vars(hookspecs).items():
        if not (name.startswith("shmloader_") and inspect.isfunction(spec)):
            continue
        wanted = set(inspect.signature(spec).parameters)
        heading = re.search(rf"^### `{name}\(([^)]*)\)", page, re.M)
        row = re.search(rf"^\| `{name}` \|.*\| ([^|]*) \|$", page, re.M)
        if heading is not None:
            shown = {p.split(":")[0].strip() for p in heading.group(1).split(",") if p.strip()}
        elif row is not None:
            shown = set(re.findall(r"`(\w+)`", row.group(1)))
        else:
            wrong.append(f"{name}: not shown")
            continue
        if shown != wanted:
            wrong.append(f"{name}: shown with {sorted(shown)}, takes {sorted(wanted)}")
    assert not wrong, "hooks in docs/plugins.md:\n" + "\n".join(wrong)
