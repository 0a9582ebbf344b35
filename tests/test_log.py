"""Tests of shmloader.log: the ``shmloader`` logger prints nothing by default, ``apply_log_level``
sets its level (and a stderr handler when the application has none), and a loader touches the
level only when ``log_level=`` or ``SHMLOADER_LOG_LEVEL`` is given."""

from __future__ import annotations

import logging

import pytest

from shmloader.errors import ConfigError
from shmloader.log import apply_log_level, logger


def test_logger_prints_nothing_by_default() -> None:
    assert logger.name == "shmloader"
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)


def test_apply_log_level_sets_the_level_and_rejects_bad_names() -> None:
    try:
        assert apply_log_level("info") == logging.INFO
        assert logger.level == logging.INFO
        assert apply_log_level(logging.ERROR) == logging.ERROR
        with pytest.raises(ConfigError, match="log_level='LOUD' is not a log level") as info:
            apply_log_level("LOUD")
        assert info.value.name == "log_level"
    finally:
        apply_log_level("WARNING")


def test_verbose_level_attaches_one_stderr_handler_only_without_root_handlers(monkeypatch) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    before = list(logger.handlers)
    try:
        apply_log_level("DEBUG")
        apply_log_level("DEBUG")
        added = [h for h in logger.handlers if h not in before]
        assert len(added) == 1 and isinstance(added[0], logging.StreamHandler)
        apply_log_level("WARNING")
        assert logger.handlers == before
    finally:
        apply_log_level("WARNING")


def test_a_loader_sets_the_level_only_when_log_level_is_given(monkeypatch) -> None:
    """The application's ``getLogger("shmloader").setLevel(...)`` survives a loader built without
    ``log_level=`` or ``SHMLOADER_LOG_LEVEL``; either one, when given, sets it."""
    import shmloader

    monkeypatch.delenv("SHMLOADER_LOG_LEVEL", raising=False)
    before = logger.level
    try:
        for wanted in (logging.DEBUG, logging.ERROR):
            logger.setLevel(wanted)
            shmloader.DataLoader([1, 2]).close()
            assert logger.level == wanted
        shmloader.DataLoader([1, 2], log_level="info").close()
        assert logger.level == logging.INFO
        shmloader.DataLoader([1, 2]).close()  # the logger is process-wide: one loader's level stays
        assert logger.level == logging.INFO
        monkeypatch.setenv("SHMLOADER_LOG_LEVEL", "error")
        shmloader.DataLoader([1, 2]).close()
        assert logger.level == logging.ERROR
    finally:
        apply_log_level("WARNING")  # drops the stderr handler INFO may have attached
        logger.setLevel(before)
