"""The example messages of docs/errors.md and docs/reliability.md are what the code words.

Each message below is built by the function that words it for the loader (engine/faults.py,
errors.py), from the facts the example shows; the page's example must fit it: each part of the
example between ``...`` elisions appears in the message, in order, blanks aside.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import shmloader
from shmloader.engine import faults
from shmloader.errors import batch_rebuild_error, rebuild_worker_exception

REPO = Path(__file__).resolve().parents[1]
SHM = "/dev/shm"


def _flat(text: str) -> str:
    return " ".join(text.split())


def fits(example: str, message: str) -> bool:
    """Whether each part of ``example`` between ``...`` elisions is in ``message``, in order."""
    at, flat = 0, _flat(message)
    for part in (p.strip() for p in _flat(example).split("...")):
        found = flat.find(part, at)
        if found < 0:
            return False
        at = found + len(part)
    return True


def errors_page_examples(error: str) -> list[str]:
    """The example messages (backticked) of docs/errors.md's table rows for ``error``."""
    page = (REPO / "docs" / "errors.md").read_text(encoding="utf-8")
    rows = [line.split(" | ") for line in page.splitlines()
            if line.startswith(f"| `{error}`") or line.startswith(f"| {error}")]
    return [example for cells in rows for example in re.findall(r"`([^`]+)`", cells[2])]


def reliability_examples() -> list[str]:
    """The messages of docs/reliability.md's "Examples, as raised" block, one per paragraph."""
    page = (REPO / "docs" / "reliability.md").read_text(encoding="utf-8")
    block = page.split("Examples, as raised:", 1)[1].split("```", 2)[1]
    return [p for p in block.split("\n\n") if p.strip()]


def _caught() -> str:
    return str(rebuild_worker_exception(KeyError, "KeyError", "Traceback (most recent call last): ...",
                                        worker_id=0, pid=4242, task=2, indices=[4, 5]))


def _raised(make: Callable[[], object]) -> str:
    """The message of the error ``make`` raises (nothing here starts a worker)."""
    try:
        make()
    except Exception as exc:  # noqa: BLE001 - any error: its words are the point
        return str(exc)
    raise AssertionError("nothing was raised")


def _iter_after(**changes: object) -> Callable[[], object]:
    """``iter(loader)`` of a loader whose attributes were changed after construction."""
    def make() -> object:
        loader: shmloader.DataLoader[Any] = shmloader.DataLoader(range(8), batch_size=2, num_workers=2)
        for name, value in changes.items():
            setattr(loader, name, value)
        return iter(loader)
    return make


DEATHS = [f"worker 0 (pid {pid}) died with signal SIGKILL (9)" for pid in (4242, 4250, 4257)]

MESSAGES: dict[str, Callable[[], str]] = {
    "WorkerDied": lambda: str(faults.died(0, 4242, -9, {1: [2, 3], 2: [4, 5]}, SHM)),
    "RestartBudgetExceeded": lambda: str(faults.budget_spent(0, 4242, -9, {1: [2, 3]}, 16)),
    "PoisonTask": lambda: str(faults.poison(2, [4, 5], 3, DEATHS)),
    "WorkerTimeout": lambda: str(faults.timed_out(0.5, {0: [0, 1]}, {0: 4242})),
    "WorkerHung": lambda: str(faults.hung(0, 4242, 0, [0, 1], 0.5)),
    "LoaderError": lambda: str(faults.stopped_after(
        "MultiProcessIter", faults.first_line(faults.died(0, 4242, -9, {1: [2, 3]}, SHM)))),
    "*the worker's own exception type*": _caught,
    "*the same type as the original*": lambda: str(batch_rebuild_error(
        ValueError("bad"), worker_id=1, pid=4242, task=3, indices=[6, 7])),
    "NumWorkersError": lambda: _raised(_iter_after(num_workers=-1)),
    "PrefetchFactorError": lambda: _raised(_iter_after(prefetch_factor=0)),
    "PrefetchFactorError at construction": lambda: _raised(
        lambda: shmloader.DataLoader(range(8), num_workers=2, prefetch_factor=0)),
    "TimeoutWithoutWorkersError": lambda: _raised(lambda: iter(shmloader.DataLoader(range(8), timeout=5))),
}


@pytest.mark.parametrize("error", sorted(MESSAGES))
def test_the_errors_page_example_is_the_message(error: str) -> None:
    examples = errors_page_examples(error.removesuffix(" at construction"))
    assert examples, f"docs/errors.md has no example for {error}"
    message = MESSAGES[error]()
    assert any(fits(e, message) for e in examples), f"no example of {error} fits:\n{message}\nexamples: {examples}"


RELIABILITY = {
    "died": lambda: str(faults.died(0, 4242, -9, {1: [2, 3], 2: [4, 5]}, SHM)),
    "died starting": lambda: str(faults.died(0, 4242, 3, {0: [0, 1], 1: [2, 3]}, SHM, starting=True)),
    "timed out": lambda: str(faults.timed_out(0.5, {0: [0, 1], 1: [2, 3]}, {0: 4242})),
    "hung": lambda: str(faults.hung(0, 4242, 0, [0, 1], 0.5)),
    "poison": lambda: str(faults.poison(2, [4, 5], 3, DEATHS)),
}


@pytest.mark.parametrize("case", sorted(RELIABILITY))
def test_the_reliability_page_example_is_the_message(case: str) -> None:
    message = RELIABILITY[case]()
    assert any(fits(e, message) for e in reliability_examples()), f"no example fits:\n{message}"


def test_fits_reads_elisions() -> None:
    assert fits("... the restart budget of 16 ...", "x, and the restart budget of 16 restarts")
    assert not fits("... the restart budget of 16 restarts ...", "the restart budget of max_restarts=16 restarts")
    assert fits("a b ... d", "a   b c\nd") and not fits("d ... a", "a b d")
