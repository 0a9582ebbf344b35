"""The table of every loader tunable, and how each one's text is parsed and checked.

Owns: ``FIELDS`` (name, ``SHMLOADER_*`` variable, type, default, meaning, example, what is
accepted) and the parsers that turn a variable's text into a value. Runs wherever a configuration
is resolved (the main process, the CLI). Promises: a bad value raises
:class:`~shmloader.errors.ConfigError` naming the variable (or argument), the value and what is
accepted; nothing here reads the environment or imports torch. :mod:`shmloader.config` combines
these fields into a :class:`~shmloader.config.Config`; docs/config.md and ``python -m shmloader
config`` are written from the same table.
"""

from __future__ import annotations

import math
import multiprocessing
import operator
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shmloader.errors import ConfigError
from shmloader.transport.segment import DEFAULT_SHM_DIR, new_name

__all__ = ["DISPATCH_POLICIES", "FIELDS", "FIELDS_BY_NAME", "Field", "LOG_LEVELS", "START_METHODS", "TooManyDigits",
           "bool_switch", "decimal_int", "env_name", "parse_size"]

START_METHODS = ("fork", "spawn", "forkserver")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_BOOL_ACCEPTS = "one of 1/0/true/false/yes/no/on/off"
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2, "g": 1024**3, "gib": 1024**3,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3,
}
# The one rule for typed integers (docs/config.md, "Values"): ASCII decimal digits, optionally after
# a '-' (a negative count is then out of range, named as such). int() and float() read more: '1_0',
# '+3', other scripts' digits ('٣'). [0-9] is ASCII only, where \d is not.
_INT_RE = re.compile(r"-?[0-9]+")
_NUMBER_RE = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_NOT_FINITE = ("inf", "infinity", "nan")
_SIZE_RE = re.compile(r"([0-9]+)[ \t]*([a-z]*)")


class _Invalid(Exception):
    """A value failed a parser; ``what`` completes "<VAR>='<raw>' <what> (expected ...)"."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


Parser = Callable[[str], Any]
Checker = Callable[[Any], Any]


@dataclass(frozen=True)
class Field:
    """One tunable: how it is named, typed, defaulted, documented and parsed.

    ``parse`` turns a variable's (stripped, non-empty) text into a value or raises ``_Invalid``.
    ``check`` is set for shmloader's own options: it validates (and may normalise) a value passed
    as an argument. Options that torch's DataLoader also has are left to the loader, which words
    their errors as torch does.
    """

    name: str
    env: str
    type: str
    default: Any
    meaning: str
    example: str
    accepts: str
    parse: Parser = field(repr=False, compare=False)
    check: Checker | None = field(default=None, repr=False, compare=False)

    def from_env(self, raw: str) -> Any:
        """Parse the text of this field's variable; a bad value raises ConfigError naming it."""
        text = raw.strip()
        try:
            if not text:
                raise _Invalid("is empty")
            return self.parse(text)
        except _Invalid as bad:
            hint = " (or unset the variable to use the default)" if not text else ""
            raise ConfigError(
                f"{self.env}={raw!r} {bad.what} (expected {self.accepts}){hint}", name=self.env, value=raw
            ) from None

    def from_argument(self, value: Any) -> Any:
        """Validate a value passed as an argument (own options only); returns it, maybe normalised."""
        if self.check is None:
            return value
        try:
            return self.check(value)
        except _Invalid as bad:
            raise ConfigError(
                f"{self.name}={value!r} {bad.what} (expected {self.accepts})", name=self.name, value=value
            ) from None


def bool_switch(env: str, meaning: str) -> Field:
    """A boolean variable read outside the loader's options, parsed and worded like theirs."""
    return Field(env.lower(), env, "bool", False, meaning, "1", _BOOL_ACCEPTS, _parse_bool)


def env_name(name: str) -> str:
    """The variable that sets option ``name``: ``SHMLOADER_<NAME>``, but SHMLOADER_START_METHOD."""
    return "SHMLOADER_START_METHOD" if name == "multiprocessing_context" else f"SHMLOADER_{name.upper()}"


# -- parsers: text -> value ------------------------------------------------------------------------


def decimal_int(text: str) -> int:
    """``text`` as an integer by the one rule (ASCII digits, optionally after a '-', nothing around
    them); raises ValueError otherwise. Every typed integer is read with it: variables, CLI counts.
    Leading zeros are read; more significant digits than int() converts (its 4300-digit limit)
    raise :class:`TooManyDigits` (a ValueError): such a number is out of every range, not a typo."""
    if _INT_RE.fullmatch(text) is None:
        raise ValueError(f"not a decimal integer: {text!r}")
    digits = text.removeprefix("-").lstrip("0") or "0"
    if len(digits) > _MAX_DIGITS:
        raise TooManyDigits(f"{len(digits)} digits: too large")
    return -int(digits, 10) if text.startswith("-") else int(digits, 10)


_MAX_DIGITS = 4000  # under int()'s default limit (sys.int_info.default_max_str_digits, 4300)


class TooManyDigits(ValueError):
    """A decimal integer too long to convert: past any count or size (see :func:`decimal_int`)."""


def _int_text(text: str) -> int:
    try:
        return decimal_int(text)
    except TooManyDigits:
        raise _Invalid("is out of range") from None
    except ValueError:
        raise _Invalid("is not an integer") from None


MAX_COLLATE_THREADS = 256  # helper threads live as long as the process: more than any machine's cores is a mistake


def _at_least(minimum: int | float, maximum: int = sys.maxsize) -> Callable[[Any], Any]:
    def check_range(value: Any) -> Any:
        if value < minimum or value > maximum:  # past sys.maxsize: no count of anything, and no index
            raise _Invalid("is out of range")
        return value
    return check_range


def _parse_int(minimum: int, maximum: int = sys.maxsize) -> Parser:
    in_range = _at_least(minimum, maximum)
    return lambda text: in_range(_int_text(text))


def _check_int(minimum: int, maximum: int = sys.maxsize) -> Checker:
    in_range = _at_least(minimum, maximum)

    def check(value: Any) -> int:
        if isinstance(value, bool):
            raise _Invalid("is not an integer")
        try:
            number = operator.index(value)  # int, numpy integers, anything integer-like
        except TypeError:
            raise _Invalid("is not an integer") from None
        return int(in_range(number))
    return check


def _parse_float(text: str) -> float:
    """Decimal digits with an optional '-', fraction and exponent (``2.5``, ``1e3``); float() alone
    reads '1_0', '+3' and other scripts' digits too. inf and nan are named as not finite."""
    if text.lower().removeprefix("-") in _NOT_FINITE:
        raise _Invalid("is not finite")
    if _NUMBER_RE.fullmatch(text) is None:
        raise _Invalid("is not a number")
    value = float(text)
    if value == 0 and any(c in "123456789" for c in text.lower().partition("e")[0]):
        raise _Invalid("is too small: it rounds to 0, which means no timeout")  # e.g. 1e-400
    return _check_seconds(value)


def _check_seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid("is not a number")
    if not math.isfinite(value):
        raise _Invalid("is not finite")
    if value < 0:
        raise _Invalid("is out of range")
    if not math.isfinite(value * 1000):  # a wait counts milliseconds
        raise _Invalid("is too large: no wait can count it in milliseconds")
    return value


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise _Invalid("is not a boolean")


def _check_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid("is not a boolean")
    return value


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``64KiB``, ``64M`` (binary), ``64MB`` (decimal); raises ValueError
    (:class:`TooManyDigits`, one, past int()'s digits: :func:`decimal_int`)."""
    match = _SIZE_RE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r}")
    return decimal_int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def _parse_size(text: str) -> int:
    try:
        return parse_size(text)
    except TooManyDigits:
        raise _Invalid("is too large") from None
    except ValueError:
        raise _Invalid("is not a size") from None


def _check_size(value: Any) -> int:
    if isinstance(value, str):
        return _parse_size(value)
    return int(_check_int(0)(value))


def _parse_start_method(text: str) -> str:
    if text not in START_METHODS:
        raise _Invalid("is not a start method")
    if text not in multiprocessing.get_all_start_methods():
        raise _Invalid("is not available on this platform")
    return text


def _choice(*options: str, what: str) -> Parser:
    def parse(text: str) -> str:
        if text not in options:
            raise _Invalid(f"is not {what}")
        return text
    return parse


def _checked_str(parse: Parser) -> Checker:
    def check(value: Any) -> Any:
        if not isinstance(value, str):
            raise _Invalid("is not a string")
        return parse(value)
    return check


def _parse_log_level(text: str) -> str:
    # ASCII first: str.upper() maps 'ı' to 'I' and 'ſ' to 'S'
    if not text.isascii() or text.upper() not in LOG_LEVELS:
        raise _Invalid("is not a log level")
    return text.upper()


def _parse_dir(text: str) -> str:
    """A directory every process of a loader finds the same and can create segments in: absolute
    (a relative one moves with each process's working directory, and the sweep with it), existing,
    writable and searchable by this user. Whether it is memory-backed is doctor's warning."""
    if not os.path.isabs(text):
        raise _Invalid(f"is a relative path: give it absolute (here {os.path.abspath(text)!r}), "
                       "the same in every process whatever its working directory")
    if not os.path.isdir(text):
        raise _Invalid("is not an existing directory")
    problem = probe_dir(text)
    if problem:
        raise _Invalid(f"is not writable by this user ({problem})")
    return text


_PROBED: set[tuple[int, str]] = set()  # (pid, directory) where this process made a file


def probe_dir(path: str) -> str | None:
    """Why no file can be made in ``path`` (the system's words), or None: a probe file is created
    exclusively and removed. ``os.access`` is no test (it says yes to root even for /proc); the probe
    is named as this process's segment so that one a kill leaves behind is swept. Once per
    directory per process (a forked child may see another directory behind the path): a few
    microseconds a loader, but ``resolve_config`` is called for every one."""
    key = (os.getpid(), path)
    if key in _PROBED:
        return None
    probe = os.path.join(path, new_name())
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    try:
        os.unlink(probe)
    except OSError as exc:  # made but not removable (a sticky directory of another user's): unusable too
        return exc.strerror or type(exc).__name__
    _PROBED.add(key)
    return None


def _check_dir(value: Any) -> str:
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str):  # a bytes path too: segment names and messages are text
        raise _Invalid("is not a path")
    if not path.strip():
        raise _Invalid("is empty")
    return _parse_dir(path)


# -- the table -------------------------------------------------------------------------------------


def _field(name: str, type_: str, default: Any, meaning: str, example: str, accepts: str,
           parse: Parser, check: Checker | None = None) -> Field:
    return Field(name, env_name(name), type_, default, meaning, example, accepts, parse, check)


_ON_DEATH = _choice("raise", "restart", what="a worker-death policy")
DISPATCH_POLICIES = ("round_robin", "least_loaded")
_DISPATCH = _choice(*DISPATCH_POLICIES, what="a dispatch policy")
_START_ACCEPTS = "one of " + ", ".join(START_METHODS)

FIELDS: tuple[Field, ...] = (
    _field("num_workers", "int", 0, "worker processes; 0 loads in the main process", "4",
           "an integer >= 0", _parse_int(0)),
    _field("prefetch_factor", "int or None", None,
           "tasks outstanding per worker; None means 2 when num_workers > 0", "4",
           "an integer >= 1", _parse_int(1)),
    _field("persistent_workers", "bool", False, "keep workers (and their datasets) across epochs", "1",
           _BOOL_ACCEPTS, _parse_bool),
    _field("multiprocessing_context", "str or None", None,
           "start method of the workers; None uses the platform default", "forkserver",
           _START_ACCEPTS, _parse_start_method),
    _field("timeout", "float", 0, "seconds to wait for a batch before raising (workers only); 0 waits forever", "120",
           "a finite number >= 0 (seconds)", _parse_float),
    _field("in_order", "bool", True, "yield batches in sampler order (False: as they arrive)", "false",
           _BOOL_ACCEPTS, _parse_bool),
    _field("pin_memory", "bool", False, "return batches in page-locked memory for fast GPU copies", "true",
           _BOOL_ACCEPTS, _parse_bool),
    _field("slot_bytes", "size", 0, "bytes per slot; 0 sizes slots from the first batch", "64MiB",
           "bytes as an integer >= 0, optionally with a unit: 4096, 512KiB, 64MiB, 1GiB, 100MB",
           _parse_size, _check_size),
    _field("max_slots", "int", 0, "most slots the ring may grow to; 0 means no limit", "64",
           "an integer >= 0", _parse_int(0), _check_int(0)),
    _field("shm_dir", "str", DEFAULT_SHM_DIR, "directory that holds the shared-memory segments", DEFAULT_SHM_DIR,
           "the absolute path of an existing directory this user can write", _parse_dir, _check_dir),
    _field("sweep", "bool", True,
           "at start, remove segments whose owner is gone (pid dead and its lock released)", "0",
           _BOOL_ACCEPTS, _parse_bool, _check_bool),
    _field("on_worker_death", "str", "raise",
           "raise an error when a worker dies, or restart it and re-dispatch its tasks", "restart",
           "one of raise, restart", _ON_DEATH, _checked_str(_ON_DEATH)),
    _field("max_restarts", "int", 16, "worker restarts allowed per epoch (on_worker_death='restart')", "4",
           "an integer >= 0", _parse_int(0), _check_int(0)),
    _field("max_task_attempts", "int", 3, "a task that killed this many workers is a PoisonTask", "2",
           "an integer >= 1", _parse_int(1), _check_int(1)),
    _field("task_seeding", "bool", False,
           "seed random/numpy/torch per task from (base_seed, task), not per worker", "1",
           _BOOL_ACCEPTS, _parse_bool, _check_bool),
    _field("dispatch", "str", "round_robin",
           "which worker runs task t: worker t % num_workers as in torch, or the least loaded one",
           "least_loaded",
           "one of " + ", ".join(DISPATCH_POLICIES), _DISPATCH, _checked_str(_DISPATCH)),
    _field("task_timeout_s", "float", 0, "seconds a task may run before its worker is killed; 0 is off", "300",
           "a finite number >= 0 (seconds)", _parse_float, _check_seconds),
    _field("collate_threads", "int", 0,
           "threads that stack a large batch when num_workers=0; 0 means min(4, usable CPUs), 1 one thread",
           "2", f"an integer from 0 to {MAX_COLLATE_THREADS}", _parse_int(0, MAX_COLLATE_THREADS),
           _check_int(0, MAX_COLLATE_THREADS)),
    _field("log_level", "str", "WARNING", "level of the 'shmloader' logger, set only when given", "DEBUG",
           "one of " + ", ".join(LOG_LEVELS) + " (any case)", _parse_log_level,
           _checked_str(_parse_log_level)),
)

FIELDS_BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}
