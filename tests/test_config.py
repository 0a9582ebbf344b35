"""Tests of shmloader.config and shmloader.config_fields: resolution order, provenance, every bad
value of every variable, unknown-name warnings (the logging level: test_log.py)."""

from __future__ import annotations

import multiprocessing
import pickle
import warnings
from pathlib import Path

import pytest

from shmloader.config import (
    Config,
    ConfigWarning,
    describe,
    known_variables,
    register_variable,
    resolve_config,
)
from shmloader.config_fields import FIELDS, FIELDS_BY_NAME, env_name, parse_size
from shmloader.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
WORKERS = {"SHMLOADER_NUM_WORKERS": "2"}  # so worker-only variables are used, not ignored


def resolve_quiet(explicit: dict, environ: dict) -> Config:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # no test here expects an unknown variable
        return resolve_config(explicit, environ)


# -- resolution order and provenance ---------------------------------------------------------------


def test_nothing_set_gives_the_defaults_with_default_provenance() -> None:
    config = resolve_quiet({}, {})
    assert config == Config()
    assert all(getattr(config, f.name) == f.default for f in FIELDS)
    assert set(config.provenance.values()) == {"default"}
    assert set(config.provenance) == {f.name for f in FIELDS}


@pytest.mark.parametrize("spec", FIELDS, ids=lambda f: f.name)
def test_environment_fills_an_unset_option(spec) -> None:
    config = resolve_quiet({}, {**WORKERS, spec.env: spec.example})
    assert getattr(config, spec.name) == spec.from_env(spec.example)
    assert config.provenance[spec.name] == "environment"


@pytest.mark.parametrize("spec", FIELDS, ids=lambda f: f.name)
def test_explicit_argument_wins_over_environment(spec) -> None:
    given = spec.from_env(spec.example)
    config = resolve_quiet({spec.name: given}, {**WORKERS, spec.env: spec.example})
    assert getattr(config, spec.name) == given
    assert config.provenance[spec.name] == "argument"


@pytest.mark.parametrize("spec", FIELDS, ids=lambda f: f.name)
def test_a_bad_variable_is_an_error_even_where_an_argument_wins(spec) -> None:
    """A malformed variable is a mistake whether or not an argument shadows it: it used to be ignored
    silently while the argument was passed, and to fail only once the argument was dropped."""
    given = spec.from_env(spec.example)
    with pytest.raises(ConfigError) as caught:
        resolve_quiet({spec.name: given}, {**WORKERS, spec.env: " "})
    assert caught.value.name == spec.env and spec.env in str(caught.value)


def test_environment_fills_only_what_the_caller_left_unset() -> None:
    env = {"SHMLOADER_NUM_WORKERS": "8", "SHMLOADER_TIMEOUT": "2.5", "SHMLOADER_PIN_MEMORY": "yes"}
    config = resolve_quiet({"num_workers": 3}, env)
    assert (config.num_workers, config.timeout, config.pin_memory) == (3, 2.5, True)
    assert config.provenance["num_workers"] == "argument"
    assert config.provenance["timeout"] == config.provenance["pin_memory"] == "environment"
    assert config.provenance["in_order"] == "default"


def test_torch_options_passed_as_arguments_are_kept_as_given() -> None:
    context = multiprocessing.get_context("spawn")
    config = resolve_quiet({"num_workers": -1, "prefetch_factor": 0, "multiprocessing_context": context}, {})
    assert config.num_workers == -1 and config.prefetch_factor == 0
    assert config.multiprocessing_context is context


def test_environment_is_read_at_call_time(monkeypatch) -> None:
    monkeypatch.setenv("SHMLOADER_MAX_SLOTS", "7")
    assert resolve_config({}).max_slots == 7
    monkeypatch.setenv("SHMLOADER_MAX_SLOTS", "9")
    assert resolve_config({}).max_slots == 9


def test_unknown_explicit_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="batch_size"):
        resolve_config({"batch_size": 4}, {})


@pytest.mark.parametrize("name", ["prefetch_factor", "persistent_workers"])
def test_worker_only_environment_values_are_ignored_without_workers(name) -> None:
    spec = FIELDS_BY_NAME[name]
    config = resolve_quiet({}, {spec.env: spec.example})
    assert getattr(config, name) == spec.default
    assert config.provenance[name] == "default"
    assert config.notes[name] == f"{spec.env}={spec.example!r} ignored: num_workers is 0"
    with_workers = resolve_quiet({"num_workers": 2}, {spec.env: spec.example})
    assert with_workers.provenance[name] == "environment" and not with_workers.notes


def test_config_pickles_and_compares_equal() -> None:
    config = resolve_quiet({"num_workers": 2}, {"SHMLOADER_SLOT_BYTES": "1MiB"})
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config and copy.provenance == config.provenance


def test_describe_gives_one_row_per_field_in_order() -> None:
    config = resolve_quiet({"num_workers": 2}, {"SHMLOADER_LOG_LEVEL": "info"})
    rows = describe(config)
    assert [r.name for r in rows] == [f.name for f in FIELDS]
    by_name = {r.name: r for r in rows}
    assert by_name["num_workers"][:4] == ("num_workers", 2, "argument", "SHMLOADER_NUM_WORKERS")
    assert by_name["log_level"][:4] == ("log_level", "INFO", "environment", "SHMLOADER_LOG_LEVEL")
    assert by_name["multiprocessing_context"].variable == "SHMLOADER_START_METHOD"


def test_variable_names() -> None:
    assert env_name("multiprocessing_context") == "SHMLOADER_START_METHOD"
    assert [f.env for f in FIELDS if f.name != "multiprocessing_context"] == [
        "SHMLOADER_" + f.name.upper() for f in FIELDS if f.name != "multiprocessing_context"
    ]


# -- value syntax ----------------------------------------------------------------------------------

TRUE_SPELLINGS = ["1", "true", "True", "TRUE", "yes", "Yes", "on", "ON", " true "]
FALSE_SPELLINGS = ["0", "false", "False", "no", "NO", "off", "Off", " 0 "]


@pytest.mark.parametrize("raw", TRUE_SPELLINGS)
def test_boolean_true_spellings(raw) -> None:
    assert resolve_quiet({}, {"SHMLOADER_PIN_MEMORY": raw}).pin_memory is True


@pytest.mark.parametrize("raw", FALSE_SPELLINGS)
def test_boolean_false_spellings(raw) -> None:
    assert resolve_quiet({}, {"SHMLOADER_IN_ORDER": raw}).in_order is False


@pytest.mark.parametrize(
    "raw, expected",
    [("4096", 4096), ("0", 0), ("64KiB", 64 * 1024), ("64k", 64 * 1024), ("64MiB", 64 * 1024**2),
     ("64M", 64 * 1024**2), ("1GiB", 1024**3), ("100MB", 100 * 10**6), ("2 GiB", 2 * 1024**3),
     ("1000", 1000), ("5kB", 5000)],
)
def test_sizes(raw, expected) -> None:
    assert parse_size(raw) == expected
    assert resolve_quiet({}, {"SHMLOADER_SLOT_BYTES": raw}).slot_bytes == expected


def test_log_level_is_case_insensitive_and_normalised() -> None:
    assert resolve_quiet({}, {"SHMLOADER_LOG_LEVEL": "debug"}).log_level == "DEBUG"


def test_shm_dir_accepts_an_existing_directory(tmp_path) -> None:
    assert resolve_quiet({}, {"SHMLOADER_SHM_DIR": str(tmp_path)}).shm_dir == str(tmp_path)


# -- every bad value of every variable -------------------------------------------------------------

BAD_VALUES = [
    ("SHMLOADER_NUM_WORKERS", "two", "is not an integer (expected an integer >= 0)"),
    ("SHMLOADER_NUM_WORKERS", "1.5", "is not an integer (expected an integer >= 0)"),
    ("SHMLOADER_NUM_WORKERS", "-1", "is out of range (expected an integer >= 0)"),
    ("SHMLOADER_PREFETCH_FACTOR", "two", "is not an integer (expected an integer >= 1)"),
    ("SHMLOADER_PREFETCH_FACTOR", "0", "is out of range (expected an integer >= 1)"),
    ("SHMLOADER_PERSISTENT_WORKERS", "maybe", "is not a boolean (expected one of 1/0/true/false/yes/no/on/off)"),
    ("SHMLOADER_PERSISTENT_WORKERS", "2", "is not a boolean (expected one of 1/0/true/false/yes/no/on/off)"),
    ("SHMLOADER_START_METHOD", "thread", "is not a start method (expected one of fork, spawn, forkserver)"),
    ("SHMLOADER_START_METHOD", "Spawn", "is not a start method (expected one of fork, spawn, forkserver)"),
    ("SHMLOADER_TIMEOUT", "soon", "is not a number (expected a finite number >= 0 (seconds))"),
    ("SHMLOADER_TIMEOUT", "-1", "is out of range (expected a finite number >= 0 (seconds))"),
    ("SHMLOADER_TIMEOUT", "inf", "is not finite (expected a finite number >= 0 (seconds))"),
    ("SHMLOADER_TIMEOUT", "nan", "is not finite (expected a finite number >= 0 (seconds))"),
    ("SHMLOADER_IN_ORDER", "sometimes", "is not a boolean (expected one of 1/0/true/false/yes/no/on/off)"),
    ("SHMLOADER_PIN_MEMORY", "yes please", "is not a boolean (expected one of 1/0/true/false/yes/no/on/off)"),
    ("SHMLOADER_SLOT_BYTES", "64 parsecs", "is not a size (expected bytes as an integer >= 0"),
    ("SHMLOADER_SLOT_BYTES", "-1", "is not a size (expected bytes as an integer >= 0"),
    ("SHMLOADER_SLOT_BYTES", "1.5MiB", "is not a size (expected bytes as an integer >= 0"),
    ("SHMLOADER_SLOT_BYTES", "MiB", "is not a size (expected bytes as an integer >= 0"),
    ("SHMLOADER_MAX_SLOTS", "many", "is not an integer (expected an integer >= 0)"),
    ("SHMLOADER_MAX_SLOTS", "-3", "is out of range (expected an integer >= 0)"),
    ("SHMLOADER_NUM_WORKERS", "\u0662", "is not an integer (expected an integer >= 0)"),  # an Arabic-Indic 2
    ("SHMLOADER_TASK_TIMEOUT_S", "\u0665", "is not a number (expected a finite number >= 0 (seconds))"),
    ("SHMLOADER_SHM_DIR", "/no/such/shm/dir", "is not an existing directory (expected the absolute path of an existing directory this user can write)"),
    ("SHMLOADER_SWEEP", "never", "is not a boolean (expected one of 1/0/true/false/yes/no/on/off)"),
    ("SHMLOADER_ON_WORKER_DEATH", "retry", "is not a worker-death policy (expected one of raise, restart)"),
    ("SHMLOADER_ON_WORKER_DEATH", "RAISE", "is not a worker-death policy (expected one of raise, restart)"),
    ("SHMLOADER_MAX_RESTARTS", "x", "is not an integer (expected an integer >= 0)"),
    ("SHMLOADER_MAX_RESTARTS", "-1", "is out of range (expected an integer >= 0)"),
    ("SHMLOADER_MAX_TASK_ATTEMPTS", "three", "is not an integer (expected an integer >= 1)"),
    ("SHMLOADER_MAX_TASK_ATTEMPTS", "0", "is out of range (expected an integer >= 1)"),
    ("SHMLOADER_TASK_SEEDING", "seeded", "is not a boolean (expected one of 1/0/true/false/yes/no/on/off)"),
    ("SHMLOADER_DISPATCH", "fastest", "is not a dispatch policy (expected one of round_robin, least_loaded)"),
    ("SHMLOADER_DISPATCH", "ROUND_ROBIN", "is not a dispatch policy (expected one of round_robin, least_loaded)"),
    ("SHMLOADER_TASK_TIMEOUT_S", "5m", "is not a number (expected a finite number >= 0 (seconds))"),
    ("SHMLOADER_TASK_TIMEOUT_S", "-0.5", "is out of range (expected a finite number >= 0 (seconds))"),
    # a positive value that rounds to 0.0 would silently mean "off" (timeout: wait forever)
    ("SHMLOADER_TIMEOUT", "1e-400", "is too small: it rounds to 0, which means no timeout (expected a finite"),
    ("SHMLOADER_TASK_TIMEOUT_S", "0.1e-330", "is too small: it rounds to 0, which means no timeout (expected a"),
    ("SHMLOADER_COLLATE_THREADS", "-1", "is out of range (expected an integer from 0 to 256)"),
    ("SHMLOADER_COLLATE_THREADS", "auto", "is not an integer (expected an integer from 0 to 256)"),
    ("SHMLOADER_LOG_LEVEL", "LOUD", "is not a log level (expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("SHMLOADER_LOG_LEVEL", "verbose", "is not a log level (expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
]


@pytest.mark.parametrize("variable, raw, words", BAD_VALUES, ids=lambda v: str(v)[:24])
def test_bad_environment_value_names_variable_value_and_what_is_accepted(variable, raw, words) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_quiet({}, {**WORKERS, variable: raw})
    assert str(info.value).startswith(f"{variable}={raw!r} {words}")
    assert info.value.name == variable and info.value.value == raw
    assert isinstance(info.value, ValueError)


def test_zero_written_any_way_is_still_zero() -> None:
    for raw in ("0", "0.0", "0e-400", "-0", "00"):
        assert resolve_quiet({}, {**WORKERS, "SHMLOADER_TIMEOUT": raw}).timeout == 0


def test_bad_shm_dir_that_is_a_file(tmp_path) -> None:
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(ConfigError, match=r"^SHMLOADER_SHM_DIR='.*file' is not an existing directory"):
        resolve_quiet({}, {"SHMLOADER_SHM_DIR": str(path)})


@pytest.mark.parametrize("spec", FIELDS, ids=lambda f: f.name)
def test_every_variable_has_bad_values_tested(spec) -> None:
    assert any(variable == spec.env for variable, _raw, _words in BAD_VALUES)


@pytest.mark.parametrize("spec", FIELDS, ids=lambda f: f.name)
@pytest.mark.parametrize("raw", ["", "   "])
def test_empty_value_of_every_variable_is_an_error(spec, raw) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_quiet({}, {**WORKERS, spec.env: raw})
    assert str(info.value) == (f"{spec.env}={raw!r} is empty (expected {spec.accepts}) "
                               "(or unset the variable to use the default)")


@pytest.mark.parametrize("spec", FIELDS, ids=lambda f: f.name)
def test_documented_example_parses(spec) -> None:
    spec.from_env(spec.example)  # raises ConfigError if docs and parser disagree
    assert spec.env in known_variables()


# -- shmloader's own options passed as arguments ---------------------------------------------------

BAD_ARGUMENTS = [
    ("slot_bytes", -1, "slot_bytes=-1 is out of range"),
    ("slot_bytes", "lots", "slot_bytes='lots' is not a size"),
    ("slot_bytes", 1.5, "slot_bytes=1.5 is not an integer"),
    ("max_slots", -1, "max_slots=-1 is out of range (expected an integer >= 0)"),
    ("max_slots", True, "max_slots=True is not an integer"),
    ("shm_dir", "/no/such/shm/dir", "shm_dir='/no/such/shm/dir' is not an existing directory"),
    ("shm_dir", 3, "shm_dir=3 is not a path"),
    ("sweep", 0, "sweep=0 is not a boolean"),
    ("on_worker_death", "ignore", "on_worker_death='ignore' is not a worker-death policy (expected one of raise, restart)"),
    ("max_restarts", -2, "max_restarts=-2 is out of range"),
    ("max_task_attempts", 0, "max_task_attempts=0 is out of range (expected an integer >= 1)"),
    ("task_seeding", 1, "task_seeding=1 is not a boolean"),
    ("dispatch", "random", "dispatch='random' is not a dispatch policy (expected one of round_robin, least_loaded)"),
    ("dispatch", 1, "dispatch=1 is not a string"),
    ("task_timeout_s", -1, "task_timeout_s=-1 is out of range"),
    ("task_timeout_s", float("inf"), "task_timeout_s=inf is not finite"),
    ("task_timeout_s", "5", "task_timeout_s='5' is not a number"),
    ("collate_threads", -1, "collate_threads=-1 is out of range (expected an integer from 0 to 256)"),
    ("collate_threads", 2.0, "collate_threads=2.0 is not an integer"),
    # one helper thread per chunk, kept for the process's life: 10**6 started one per sample
    ("collate_threads", 10**6, "collate_threads=1000000 is out of range (expected an integer from 0 to 256)"),
    ("collate_threads", 257, "collate_threads=257 is out of range"),
    ("log_level", "LOUD", "log_level='LOUD' is not a log level"),
]


@pytest.mark.parametrize("name, value, start", BAD_ARGUMENTS, ids=lambda v: str(v)[:20])
def test_bad_own_argument_names_the_argument(name, value, start) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_quiet({name: value}, {})
    assert str(info.value).startswith(start)
    assert info.value.name == name


def test_own_arguments_are_normalised_where_documented(tmp_path) -> None:
    config = resolve_quiet({"slot_bytes": "2MiB", "log_level": "info", "shm_dir": tmp_path}, {})
    assert (config.slot_bytes, config.log_level, config.shm_dir) == (2 * 1024**2, "INFO", str(tmp_path))


# -- unknown variables -----------------------------------------------------------------------------


def test_unknown_variable_warns_once_with_the_closest_valid_name() -> None:
    env = {"SHMLOADER_NUM_WORKRS": "4", "SHMLOADER_PREFETCH": "2", "HOME": "/"}
    with pytest.warns(ConfigWarning) as caught:
        config = resolve_config({}, env)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "SHMLOADER_NUM_WORKRS (did you mean SHMLOADER_NUM_WORKERS?)" in text
    assert "SHMLOADER_PREFETCH (did you mean SHMLOADER_PREFETCH_FACTOR?)" in text
    assert config.num_workers == 0


def test_unknown_variable_far_from_any_name_is_named_without_suggestion() -> None:
    with pytest.warns(ConfigWarning, match=r"ignored: SHMLOADER_ZZZZZZZZZZZZZZZZZZZZZZ\. "):
        resolve_config({}, {"SHMLOADER_ZZZZZZZZZZZZZZZZZZZZZZ": "1"})


def test_known_and_registered_variables_do_not_warn() -> None:
    register_variable("SHMLOADER_TEST_ONLY_KNOB", "a variable read by a test")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_config({}, {"SHMLOADER_TEST_ONLY_KNOB": "1", "SHMLOADER_NUM_WORKERS": "1", "OTHER": "x"})
    with pytest.raises(ValueError, match="does not start with SHMLOADER_"):
        register_variable("OTHER_KNOB", "not ours")


# -- docs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", FIELDS, ids=lambda f: f.name)
def test_docs_list_every_field(spec) -> None:
    text = (REPO / "docs" / "config.md").read_text()
    section = text.split(f"### `{spec.env}`", 1)
    assert len(section) == 2, f"docs/config.md has no section for {spec.env}"
    body = section[1].split("###", 1)[0]
    for fact in (f"`{spec.name}`", spec.type, f"`{spec.default!r}`", spec.meaning, f"`{spec.env}={spec.example}`"):
        assert fact in body


def test_numpy_integers_are_accepted_as_integer_options():
    import numpy as np

    cfg = resolve_config({"max_slots": np.int64(8), "max_restarts": np.int32(2)}, environ={})
    assert cfg.max_slots == 8 and type(cfg.max_slots) is int and cfg.max_restarts == 2


# -- the start-up sweep switch (issue 15) -----------------------------------------------------------


def test_sweep_is_on_by_default_and_switched_off_by_variable_or_argument() -> None:
    assert resolve_quiet({}, {}).sweep is True
    off = resolve_quiet({}, {"SHMLOADER_SWEEP": "0"})
    assert off.sweep is False and off.provenance["sweep"] == "environment"
    on = resolve_quiet({"sweep": True}, {"SHMLOADER_SWEEP": "0"})
    assert on.sweep is True and on.provenance["sweep"] == "argument"
    row = next(r for r in describe(off) if r.name == "sweep")
    assert row[:4] == ("sweep", False, "environment", "SHMLOADER_SWEEP")
