"""The loader's configuration: explicit argument > ``SHMLOADER_*`` variable > default.

Owns: :class:`Config` (every tunable, with where each value came from) and
:func:`resolve_config`, the one place that reads ``SHMLOADER_*`` variables. Runs in the main
process when a DataLoader is built, and in ``python -m shmloader config``/``doctor``. Promises:
the environment is read at call time, never at import; a variable's text is parsed and validated
once, strictly, and a bad value raises :class:`~shmloader.errors.ConfigError` naming the variable,
the value and what is accepted; an explicit argument always wins and is kept as given (torch's own
options are validated by the loader in torch's words; shmloader's own options are checked here);
an unknown ``SHMLOADER_*`` name draws one warning (a :class:`ConfigWarning`, one of
``shmloader.warning_types``) that suggests the closest valid variable.

Four environment values only make sense with worker processes: ``SHMLOADER_PREFETCH_FACTOR``,
``SHMLOADER_PERSISTENT_WORKERS``, ``SHMLOADER_START_METHOD`` and ``SHMLOADER_TIMEOUT`` are ignored
(and noted in ``Config.notes``) when the effective ``num_workers`` is 0, so a site-wide setting
never breaks a single-process loader; passed as arguments they keep torch's errors.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from shmloader.config_fields import FIELDS, FIELDS_BY_NAME, Field
from shmloader.transport.segment import DEFAULT_SHM_DIR
from shmloader.warning_types import ConfigWarning

__all__ = [
    "Config",
    "ConfigWarning",
    "FIELDS",
    "Field",
    "Row",
    "check_environment",
    "describe",
    "known_variables",
    "register_variable",
    "resolve_config",
]

ENV_PREFIX = "SHMLOADER_"
ARGUMENT, ENVIRONMENT, DEFAULT = "argument", "environment", "default"
_WORKER_ONLY = ("prefetch_factor", "persistent_workers", "multiprocessing_context", "timeout")
# Variables read elsewhere (bench, tests) that are not loader options; see register_variable().
_OTHER_VARIABLES: dict[str, str] = {}


@dataclass(frozen=True)
class Config:
    """Every tunable of a loader, resolved; ``provenance`` says where each value came from.

    ``provenance[name]`` is ``"argument"``, ``"environment"`` or ``"default"``; ``notes[name]``
    explains an environment value that was read but not used.
    """

    num_workers: int = 0
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    multiprocessing_context: Any = None  # a start method name (or a context object passed by the caller)
    timeout: float = 0
    in_order: bool = True
    pin_memory: bool = False
    slot_bytes: int = 0
    max_slots: int = 0
    shm_dir: str = DEFAULT_SHM_DIR
    sweep: bool = True
    on_worker_death: str = "raise"
    max_restarts: int = 16
    max_task_attempts: int = 3
    task_seeding: bool = False
    dispatch: str = "round_robin"
    task_timeout_s: float = 0
    collate_threads: int = 0
    log_level: str = "WARNING"
    provenance: Mapping[str, str] = field(default_factory=dict, compare=False)
    notes: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        full = {f.name: self.provenance.get(f.name, DEFAULT) for f in FIELDS}
        # Plain dicts (copies), not MappingProxyType: a Config must pickle to spawned workers.
        object.__setattr__(self, "provenance", full)
        object.__setattr__(self, "notes", dict(self.notes))


class Row(NamedTuple):
    """One line of ``python -m shmloader config``: option, effective value, source, variable."""

    name: str
    value: Any
    source: str
    variable: str
    note: str


def register_variable(name: str, meaning: str) -> None:
    """Declare a ``SHMLOADER_*`` variable read outside the config (so it draws no warning)."""
    if not name.startswith(ENV_PREFIX):
        raise ValueError(f"variable {name!r} does not start with {ENV_PREFIX}")
    _OTHER_VARIABLES[name] = meaning


def known_variables() -> dict[str, str]:
    """Every ``SHMLOADER_*`` variable shmloader reads -> its one-line meaning."""
    known = {f.env: f.meaning for f in FIELDS}
    known.update(_OTHER_VARIABLES)
    return known


def resolve_config(explicit: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Config:
    """Resolve every option as explicit argument > ``SHMLOADER_*`` variable > default.

    ``explicit`` holds only the options the caller actually passed (``None`` for one of shmloader's
    own options counts as not passed: it is what their signature shows); ``environ`` defaults to
    ``os.environ`` read now. Raises ConfigError for a bad variable or a bad value of one of
    shmloader's own options, TypeError for a name that is not an option.
    """
    env = os.environ if environ is None else environ
    unknown = sorted(set(explicit) - set(FIELDS_BY_NAME))
    if unknown:
        raise TypeError(f"resolve_config() got unknown option(s): {', '.join(unknown)}")
    _warn_unknown_variables(env)
    values: dict[str, Any] = {}
    provenance: dict[str, str] = {}
    for spec in FIELDS:
        values[spec.name], provenance[spec.name] = _resolve_one(spec, explicit, env)
    notes = _drop_worker_only(values, provenance, env)
    return Config(**values, provenance=provenance, notes=notes)


def check_environment() -> Config:
    """Every ``SHMLOADER_*`` variable of this process checked at once, as a command starts: the
    loader options (the config they resolve to is returned) and the variables read elsewhere, where
    they apply (the pin backend's, the plugin manager's); a bad value raises its ConfigError."""
    from shmloader import plugins
    from shmloader.gpu import pinning

    config = resolve_config({})
    pinning.requested_backend()
    plugins.autoload_enabled()
    return config


def _resolve_one(spec: Field, explicit: Mapping[str, Any], env: Mapping[str, str]) -> tuple[Any, str]:
    # None for one of shmloader's own options (``check`` set) is its signature's default: unset, so a
    # wrapper forwarding its own None defaults gets the variable or the default (tests/test_config_none.py)
    # the variable is parsed even where an argument wins: a bad value is a mistake either way, and it
    # used to fail only once the argument was dropped (tests/test_config.py)
    from_env = spec.from_env(env[spec.env]) if spec.env in env else None
    if spec.name in explicit and not (explicit[spec.name] is None and spec.check is not None):
        return spec.from_argument(explicit[spec.name]), ARGUMENT
    if spec.env in env:
        return from_env, ENVIRONMENT
    return spec.default, DEFAULT


def _drop_worker_only(values: dict[str, Any], provenance: dict[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """Ignore worker-only environment values when there are no workers (see the module docstring)."""
    notes: dict[str, str] = {}
    if values["num_workers"] != 0:
        return notes
    for name in _WORKER_ONLY:
        if provenance[name] == ENVIRONMENT:
            spec = FIELDS_BY_NAME[name]
            notes[name] = f"{spec.env}={env[spec.env]!r} ignored: num_workers is 0"
            values[name], provenance[name] = spec.default, DEFAULT
    return notes


def _warn_unknown_variables(env: Mapping[str, str]) -> None:
    known = known_variables()
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    warnings.warn(
        f"unknown shmloader environment variable(s) ignored: {'; '.join(parts)}. "
        "Run 'python -m shmloader config' to list the valid ones.",
        ConfigWarning,
        stacklevel=3,
    )


def describe(config: Config) -> list[Row]:
    """One row per option, in FIELDS order: name, value, source, variable, note (may be empty)."""
    return [
        Row(f.name, getattr(config, f.name), config.provenance[f.name], f.env, config.notes.get(f.name, ""))
        for f in FIELDS
    ]
