"""``doctor``'s configuration checks: the loader options and the variables read outside them.

Owns the findings about ``SHMLOADER_*`` variables. Runs in the CLI process. Promises: each variable
is parsed by the code a loader reads it with, never a copy of it: the loader options by
:func:`shmloader.config.resolve_config`, ``SHMLOADER_DISABLE_PLUGIN_AUTOLOAD`` by
:func:`shmloader.plugins.autoload_enabled`, ``SHMLOADER_PIN_BACKEND`` by
:func:`shmloader.gpu.pinning.requested_backend` and :func:`~shmloader.gpu.pinning.check_usable`;
so a value is a problem exactly when a loader would raise ConfigError for it. An unknown
``SHMLOADER_*`` name is a warning; a pin backend that cannot work here is a problem when
``SHMLOADER_PIN_MEMORY`` is on, else a warning (only ``pin_memory=True`` loaders read it). The
configuration returned leaves the bad variables out, so that the other checks can still run.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from shmloader.cli.findings import PROBLEM, WARNING, Finding
from shmloader.config import Config, ConfigWarning, resolve_config
from shmloader.errors import ConfigError
from shmloader.gpu import pinning
from shmloader.plugins import autoload_enabled

__all__ = ["check_configuration"]

_CONFIG_WARNING_REMEDY = "fix the variable's name or unset it ('python -m shmloader config' lists the valid ones)"


def check_configuration(environ: Mapping[str, str]) -> tuple[Config, list[Finding]]:
    """Resolve the configuration from ``environ`` and check every ``SHMLOADER_*`` variable in it."""
    config, found = _resolve_reporting(environ)
    found += _check_other_variables(environ)
    found += _check_pin_backend(environ, config.pin_memory)
    return config, found


def _resolve_reporting(environ: Mapping[str, str]) -> tuple[Config, list[Finding]]:
    """Resolve the configuration; each bad variable becomes a problem and is then left out, and
    each configuration warning (an unknown ``SHMLOADER_*`` name) becomes a warning finding, counted
    in the summary, instead of a line on stderr."""
    env = dict(environ)
    found: list[Finding] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        config = _resolve_leaving_out_bad(env, found)
    messages = list(dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, ConfigWarning)))
    found[:0] = [Finding("config", WARNING, text, _CONFIG_WARNING_REMEDY) for text in messages]
    for w in caught:  # anything else is not ours to swallow
        if not issubclass(w.category, ConfigWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return config, found


def _resolve_leaving_out_bad(env: dict[str, str], found: list[Finding]) -> Config:
    while True:
        try:
            return resolve_config({}, env)
        except ConfigError as exc:
            found.append(_problem(exc))
            if env.pop(exc.name, None) is None:
                return Config()


def _check_other_variables(environ: Mapping[str, str]) -> list[Finding]:
    """The variables that are not loader options, each parsed by the function that reads it."""
    found = []
    for read in (lambda: autoload_enabled(environ), lambda: pinning.requested_backend(environ=environ)):
        try:
            read()
        except ConfigError as exc:
            found.append(_problem(exc))
    return found


def _check_pin_backend(environ: Mapping[str, str], pin_memory: bool) -> list[Finding]:
    """A valid ``SHMLOADER_PIN_BACKEND`` that names a backend unable to work here (no CUDA device)."""
    try:
        name = pinning.requested_backend(environ=environ)
    except ConfigError:
        return []  # not a backend at all: _check_other_variables reported it
    try:
        pinning.check_usable(name)
    except ConfigError as exc:
        return [Finding("pin backend", PROBLEM if pin_memory else WARNING,
                        f"{exc}: every loader with pin_memory=True raises it at iter()",
                        f"unset {pinning.ENV_BACKEND} (auto) or name a backend that works here (mlock, none)")]
    return []


def _problem(exc: ConfigError) -> Finding:
    return Finding("config", PROBLEM, str(exc), f"fix or unset {exc.name}")
