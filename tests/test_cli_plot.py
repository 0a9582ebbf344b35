"""Tests of ``python -m shmloader bench --plot PATH``: the path is checked before anything is measured.

A directory that does not exist or cannot be written, a path that names a directory, a format
matplotlib cannot write, or matplotlib missing: each exits 2 at once with a message naming
``--plot`` and the value (cli/options.py's promise), not a traceback after the whole run. A path
without an extension gets ``.png``, and the message names the file actually written; with
``--json`` the document is printed before the figure is drawn, so a figure that fails to be written
at the end costs the figure only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from shmloader.cli import bench, plot
from shmloader.cli.options import parse_args
from shmloader.cli.report import collect_header

REPO = Path(__file__).resolve().parents[1]
TINY = ["--no-torch", "--workloads", "tiny", "--workers", "0", "--batches", "2", "--warmup", "1",
        "--repeat", "1", "--no-copy-limit"]  # fmt: skip


def run_bench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMLOADER_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "shmloader", "bench", *args, *TINY], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)  # fmt: skip


@pytest.mark.timeout(150)
@pytest.mark.parametrize("target", ["/nonexistent-dir/sub/plot.png", "plot.txt"])
def test_a_plot_path_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path, target: str) -> None:
    proc = run_bench("--plot", target, "--json", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-2000:]
    assert proc.returncode == 2, out[-2000:]
    assert f"--plot {target!r}" in proc.stderr
    assert "round 1/1" not in proc.stderr and proc.stdout == ""  # nothing was measured


@pytest.mark.timeout(150)
def test_the_message_names_the_file_written_and_json_comes_whole(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "figure"  # no extension: the figure goes to figure.png
    proc = run_bench("--plot", str(target), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["results"]
    line = next(line for line in proc.stderr.splitlines() if line.startswith("plot written to "))
    assert line == f"plot written to {target}.png"
    assert (tmp_path / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_parse_args_checks_directory_and_format(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    installed = "matplotlib" in sys.modules or plot.matplotlib_installed()
    monkeypatch.setattr(plot, "matplotlib_installed", lambda: True)  # the path checks, with or without it
    assert parse_args(["--plot", str(tmp_path / "a")]).plot == str(tmp_path / "a.png")
    assert parse_args(["--plot", str(tmp_path / "a.PDF")]).plot == str(tmp_path / "a.PDF")
    assert parse_args([]).plot is None
    assert "is a directory" in _refused(["--plot", str(tmp_path)], capsys)
    assert "is a directory" in _refused(["--plot", f"{tmp_path}{os.sep}"], capsys)
    assert "does not exist" in _refused(["--plot", str(tmp_path / "no" / "a.png")], capsys)
    (tmp_path / "file").write_text("")
    assert "is not a directory" in _refused(["--plot", str(tmp_path / "file" / "a.png")], capsys)
    if installed:
        err = _refused(["--plot", str(tmp_path / "a.txt")], capsys)
        assert "'.txt'" in err and ".png" in err and ".svg" in err


def test_an_unwritable_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(plot, "matplotlib_installed", lambda: True)  # the path check, with or without it
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root may write anywhere: stand in the answer an ordinary user gets
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    assert "cannot be written" in _refused(["--plot", str(locked / "a.png")], capsys)


def test_matplotlib_missing_is_said_up_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(plot, "matplotlib_installed", lambda: False)
    err = _refused(["--plot", str(tmp_path / "a.png")], capsys)
    assert "--plot" in err and "matplotlib" in err and "not installed" in err


def test_the_formats_taken_without_asking_matplotlib_are_ones_it_writes() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.backend_bases import FigureCanvasBase

    assert plot.CORE_FORMATS <= set(FigureCanvasBase.get_supported_filetypes())


def test_json_is_printed_before_the_plot_and_a_failed_plot_costs_only_the_plot(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    def failing_plot(*args: object, **kwargs: object) -> None:
        assert json.loads(capsys.readouterr().out)["results"] == []  # the document is out already
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot, "write_plot", failing_plot)
    opts = replace(parse_args(["--json", "--no-copy-limit"]), plot="/tmp/x.png")
    header = collect_header("fork", "cpu", {})
    assert bench._emit(opts, header, [], [], [], []) is False
    assert "--plot: could not write /tmp/x.png: [Errno 28] No space left on device" in capsys.readouterr().err

