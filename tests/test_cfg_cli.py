"""``python -m shmloader config``: a bad value of any ``SHMLOADER_*`` variable exits 2, naming it."""

from __future__ import annotations

import pytest

from shmloader.__main__ import main


@pytest.mark.parametrize("variable, value", [
    ("SHMLOADER_PIN_BACKEND", "bogus"),
    ("SHMLOADER_DISABLE_PLUGIN_AUTOLOAD", "maybe"),
    ("SHMLOADER_NUM_WORKERS", "two"),
])
def test_config_exits_2_naming_a_bad_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                              variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert variable in err and value in err, err


def test_config_accepts_good_values_of_those_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMLOADER_PIN_BACKEND", " None ")
    monkeypatch.setenv("SHMLOADER_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert main(["config"]) == 0


def test_bench_exits_2_at_once_naming_a_bad_variable(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """It ran every round, each measurement failing on the variable, and exited 1."""
    from shmloader.cli import bench

    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("a measurement ran with a bad SHMLOADER_LOG_LEVEL")

    monkeypatch.setattr(bench, "measure", measured)
    monkeypatch.setenv("SHMLOADER_LOG_LEVEL", "loud")
    assert bench.main(["--workloads", "tiny", "--workers", "0", "--repeat", "1", "--no-torch"]) == 2
    err = capsys.readouterr().err
    assert "SHMLOADER_LOG_LEVEL" in err and "loud" in err, err
