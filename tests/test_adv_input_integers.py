"""One rule for every integer the user types, in a ``SHMLOADER_*`` variable or on a command line.

The defect: ``int()`` reads more than decimal digits: ``1_0`` is 10, ``+3`` is 3, and the CLI's
``--workers 1_0`` ran ten workers. The rule (docs/config.md, "Values"): ASCII decimal digits,
optionally after a '-' (a negative count is then refused as out of range, naming it); a variable's
surrounding blanks are ignored, as a command line's around each comma-separated value. Sizes are
such an integer with an optional unit; numbers (seconds) may add a fraction and an exponent.
"""

from __future__ import annotations

import argparse
import re
import sys

import pytest

from shmloader.cli import bench, options
from shmloader.config import resolve_config
from shmloader.config_fields import FIELDS, parse_size
from shmloader.errors import ConfigError

NOT_DECIMAL = ["1_0", "+3", "0x10", "\u0663", "3.0", "1 0", "\uff13", "0b1", "3e0", "--3", "-+3", "3_"]
INT_VARIABLES = [f.env for f in FIELDS if f.type.startswith("int")]


@pytest.mark.parametrize("raw", NOT_DECIMAL)
@pytest.mark.parametrize("env", INT_VARIABLES)
def test_an_integer_variable_takes_decimal_digits_only(env: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=r"is not an integer \(expected an integer") as exc:
        resolve_config({}, {env: raw, "SHMLOADER_NUM_WORKERS": "2"} if env != "SHMLOADER_NUM_WORKERS" else {env: raw})
    assert exc.value.name == env and exc.value.value == raw and repr(raw) in str(exc.value)


@pytest.mark.parametrize("env", INT_VARIABLES)
def test_an_integer_variable_ignores_surrounding_blanks_and_reads_leading_zeros(env: str) -> None:
    name = next(f.name for f in FIELDS if f.env == env)
    base = {"SHMLOADER_NUM_WORKERS": "2"}
    assert getattr(resolve_config({}, {**base, env: " 3 "}), name) == 3
    assert getattr(resolve_config({}, {**base, env: "\t03\n"}), name) == 3


@pytest.mark.parametrize("raw", ["-1", "-0001"])
def test_a_negative_count_is_out_of_range_naming_it(raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"^SHMLOADER_MAX_SLOTS={re.escape(repr(raw))} is out of range"):
        resolve_config({}, {"SHMLOADER_MAX_SLOTS": raw})


@pytest.mark.parametrize("raw", ["1_000", "1_0MiB", "+4096", "\u0663k", "0x10", "4096_"])
def test_a_size_takes_decimal_digits_only(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_size(raw)
    with pytest.raises(ConfigError, match=rf"^SHMLOADER_SLOT_BYTES={re.escape(repr(raw))} is not a size"):
        resolve_config({}, {"SHMLOADER_SLOT_BYTES": raw})
    with pytest.raises(ConfigError, match=rf"^slot_bytes={re.escape(repr(raw))} is not a size"):
        resolve_config({"slot_bytes": raw}, {})


@pytest.mark.parametrize("raw", ["1_0", "+3", "1_0.5", "0x10", "3.0_1", "1e1_0", "\u0663"])
@pytest.mark.parametrize("env", ["SHMLOADER_TIMEOUT", "SHMLOADER_TASK_TIMEOUT_S"])
def test_a_number_of_seconds_takes_decimal_digits_only(env: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{env}={re.escape(repr(raw))} is not a number"):
        resolve_config({}, {env: raw, "SHMLOADER_NUM_WORKERS": "1"})


@pytest.mark.parametrize("raw, seconds", [("2.5", 2.5), ("1e3", 1000.0), (".5", 0.5), ("5.", 5.0), ("2E-1", 0.2)])
def test_a_number_of_seconds_may_have_a_fraction_and_an_exponent(raw: str, seconds: float) -> None:
    assert resolve_config({}, {"SHMLOADER_TASK_TIMEOUT_S": raw}).task_timeout_s == seconds


@pytest.mark.parametrize("raw", NOT_DECIMAL + [" 3", "3 "])
def test_a_cli_count_takes_decimal_digits_only(raw: str) -> None:
    """An argparse value is taken as typed: blanks are no part of a count there (the shell split
    the words already); ``--workers`` strips blanks around each comma-separated value."""
    with pytest.raises(argparse.ArgumentTypeError, match=rf"must be a decimal integer, got {re.escape(repr(raw))}"):
        options.int_at_least(0)(raw)


@pytest.mark.parametrize("argv", [["--workers", "1_0"], ["--workers", "0,+2"], ["--batches", "1_0"],
                                  ["--repeat", "+3"], ["--warmup", "٣"]])
def test_bench_refuses_a_count_that_is_not_decimal_naming_the_option(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args([*argv, "--workloads", "tiny"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and argv[0] in err and "decimal integer" in err


HUGE = "1" + "0" * 5000  # past int()'s 4300-digit limit: int() raises ValueError, as for a typo


def test_a_count_too_long_for_int_is_out_of_range_and_leading_zeros_are_read() -> None:
    with pytest.raises(ConfigError, match=r"^SHMLOADER_MAX_SLOTS='10+' is out of range"):
        resolve_config({}, {"SHMLOADER_MAX_SLOTS": HUGE})
    assert resolve_config({}, {"SHMLOADER_MAX_SLOTS": "0" * 5000 + "7"}).max_slots == 7
    with pytest.raises(argparse.ArgumentTypeError, match=rf"must be at most {sys.maxsize}"):
        options.int_at_least(0)(HUGE)
    assert options.int_at_least(0)("0" * 5000 + "7") == 7


def test_a_size_too_long_for_int_is_named_too_large() -> None:
    with pytest.raises(ConfigError, match=r"^SHMLOADER_SLOT_BYTES='10+' is too large"):
        resolve_config({}, {"SHMLOADER_SLOT_BYTES": HUGE})
    assert parse_size("0" * 5000 + "1KiB") == 1024
