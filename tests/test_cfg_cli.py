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
