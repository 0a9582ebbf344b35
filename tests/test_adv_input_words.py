"""Words typed in ``SHMLOADER_*`` variables are ASCII, in any case, as documented.

The defect: a case-insensitive word was compared after ``str.upper()``/``str.lower()``, which map
some other letters onto ASCII ones: the dotless 'ı' uppercases to 'I' and the long 's' to 'S', and
the Kelvin sign 'K' lowercases to 'k', so ``SHMLOADER_LOG_LEVEL=ınfo`` set INFO and
``SHMLOADER_PIN_BACKEND=mloc\u212a`` chose mlock. Now such a value is refused, naming the variable.
"""

from __future__ import annotations

import pytest

from shmloader.config import resolve_config
from shmloader.errors import ConfigError
from shmloader.gpu import pinning


@pytest.mark.parametrize("raw", ["\u0131nfo", "CR\u0131T\u0131CAL", "warn\u0131ng", "deBug"])
def test_a_log_level_spelled_with_letters_that_case_onto_ascii_is_refused(raw: str) -> None:
    if raw.isascii():  # the control: ASCII in any case is accepted
        assert resolve_config({}, {"SHMLOADER_LOG_LEVEL": raw}).log_level == raw.upper()
        return
    with pytest.raises(ConfigError, match=r"^SHMLOADER_LOG_LEVEL=.* is not a log level") as exc:
        resolve_config({}, {"SHMLOADER_LOG_LEVEL": raw})
    assert exc.value.name == "SHMLOADER_LOG_LEVEL"
    with pytest.raises(ConfigError, match=r"^log_level=.* is not a log level"):
        resolve_config({"log_level": raw}, {})


@pytest.mark.parametrize("raw", ["mloc\u212a", "fa\u212ae", "MLOC\u212a"])
def test_a_pin_backend_spelled_with_a_kelvin_sign_is_refused(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"is not a pin backend") as exc:
        pinning.requested_backend(environ={pinning.ENV_BACKEND: raw})
    assert exc.value.name == pinning.ENV_BACKEND and exc.value.value == raw


def test_a_pin_backend_in_any_ascii_case_is_read() -> None:
    assert pinning.requested_backend(environ={pinning.ENV_BACKEND: " MLock "}) == "mlock"
