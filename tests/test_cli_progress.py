"""The bench's progress indicator: numbered lines without tqdm, a bar with it; never stdout."""

from __future__ import annotations

import io
import sys

import pytest

from shmloader.cli.progress import Progress


def test_without_tqdm_each_step_is_a_numbered_line_and_a_note_a_plain_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    stream = io.StringIO()
    with Progress(2, stream) as progress:
        progress.step("shmloader w=0")
        progress.note("copy limit")
        progress.step("torch w=0")
    assert stream.getvalue() == "[1/2] shmloader w=0\ncopy limit\n[2/2] torch w=0\n"


def test_with_tqdm_the_bar_counts_the_steps_done_and_shows_the_latest_words() -> None:
    pytest.importorskip("tqdm")
    stream = io.StringIO()
    with Progress(3, stream) as progress:
        progress.step("first")
        progress.step("second")
        assert progress._bar.n == 1  # the first is done, the second under way
        progress.note("aside")  # after the step announced last: that step is done
        assert progress._bar.n == 2 and progress._bar.desc == "aside"
        progress.step("third")
        assert progress._bar.n == 2 and progress._bar.desc == "third"
    assert progress._bar.n == 3  # closed with every step done
