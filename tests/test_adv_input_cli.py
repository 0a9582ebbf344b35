"""Hostile values on the command lines of ``bench``, ``bench --train`` and ``doctor``: each is a
usage error (exit 2) that names the option and the value, before anything is measured; never a
case that cannot run, a round that fails deep inside, nor a value read in a way the docs do not say.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from shmloader.cli import bench, options, train

REPO = Path(__file__).resolve().parent.parent


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The parse alone (bench.main exits 2 on any SystemExit of it): nothing runs if it is accepted."""
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value", ["٣", "0x2", "1e3", "2.0", "-1", "0,-2", "2__0"])
def test_a_workers_value_that_is_not_plain_decimal_is_refused_by_name(value: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """int() reads '٣' as 3: the workers counts are ASCII decimal, read as every SHMLOADER_*
    integer is (docs/config.md)."""
    err = _usage_error(["--workers", value, "--workloads", "tiny"], capsys)
    assert "--workers" in err


@pytest.mark.parametrize("value", ["2,02", "0,00", "1, 1"])
def test_a_workers_count_given_twice_in_two_spellings_is_refused(value: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """'2' and '02' are the same case: measured twice, it would be pooled as another round."""
    err = _usage_error(["--workers", value, "--workloads", "tiny"], capsys)
    assert "--workers" in err and "twice" in err


@pytest.mark.parametrize("value", ["100000", str(sys.maxsize + 1), "99999999999999999999999", "0,100000"])
def test_more_workers_than_this_process_can_start_are_refused_before_any_round(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """100000 workers need more descriptors than the open-file limit allows (and more processes
    than most limits): a usage error naming --workers, the count and the limit, not a round that
    fails with EMFILE (or a fork storm) after the other cases ran."""
    err = _usage_error(["--workers", value, "--workloads", "tiny"], capsys)
    count = value.split(",")[-1]
    assert "--workers" in err and count in err
    assert ("RLIMIT_NOFILE" in err) if int(count) <= sys.maxsize else (f"at most {sys.maxsize}" in err)


def test_the_workers_bound_follows_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is the open-file limit's room over each worker's descriptors (and RLIMIT_NPROC)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = options.open_descriptors()
    limit = min(hard, in_use + 40 * options.FDS_PER_WORKER)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        most = options.startable_workers()
        assert most == (limit - in_use) // options.FDS_PER_WORKER
        assert bench.parse_args(["--workers", f"0,{most}"]).workers == (0, most)
        with pytest.raises(SystemExit):
            bench.parse_args(["--workers", str(most + 1)])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("argv, option", [
    (["--batches", "100000000000000000000"], "--batches"),
    (["--warmup", str(sys.maxsize)], "--warmup"),
    (["--repeat", "٣"], "--repeat"),
    (["--batches", "١٠"], "--batches"),
])  # fmt: skip
def test_counts_no_dataset_can_hold_are_usage_errors(argv: list[str], option: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The dataset is (warmup + batches) x batch_size samples long: past sys.maxsize len() raises
    OverflowError inside every round; refused by name instead, like a non-decimal count."""
    err = _usage_error([*argv, "--workloads", "tiny", "--workers", "0"], capsys)
    assert option in err


@pytest.mark.parametrize("argv, option", [
    (["--steps", "100000000000000000000"], "--steps"),
    (["--batch-size", str(sys.maxsize)], "--batch-size"),
    (["--workers", "100000"], "--workers"),
    (["--workers", "٢"], "--workers"),
    (["--repeat", "0"], "--repeat"),
])  # fmt: skip
def test_train_counts_that_cannot_run_are_usage_errors(argv: list[str], option: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The training benchmark's counts are checked like the plain benchmark's."""
    with pytest.raises(SystemExit) as exc:
        train.parse_args([*argv, "--quick", "--device", "cpu"])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [["--workers", "٣"], ["--prefetch-factor", "0"],
                                  ["--workers", "99999999999999999999999"], ["--slot-bytes", "-1"]])
def test_doctor_refuses_hostile_counts_by_name(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "shmloader", "doctor", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=50)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert argv[0] in proc.stderr and "Traceback" not in proc.stderr
