"""Tests of ``python -m shmloader`` (config, doctor, bench forwarding) and of shmloader.transport.sweep.

The commands run as subprocesses from the repository root with a clean ``SHMLOADER_*``
environment; doctor runs against a temporary SHMLOADER_SHM_DIR holding fake segment files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from shmloader import __main__ as cli
from shmloader.cli import doctor
from shmloader.config_fields import FIELDS
from shmloader.transport import segment, sweep
from shmloader.transport.segment import Segment

REPO = Path(__file__).resolve().parents[1]
DEAD_PID = 4_194_304 + 7  # above the largest pid_max Linux allows, so never a live process
SMALL_RING = ["--workers", "1", "--prefetch-factor", "1", "--slot-bytes", "4KiB"]


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHMLOADER_")}
    return subprocess.run(
        [sys.executable, "-m", "shmloader", *args], cwd=REPO, env={**base, **env},
        capture_output=True, text=True, timeout=50,
    )


def make_segment(directory: Path, pid: int, tag: str = "ring0", size: int = 4096) -> Path:
    path = directory / f"shml_{pid}_{tag}"
    path.write_bytes(b"\0" * size)
    return path


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_config_prints_every_option_value_source_and_variable() -> None:
    result = run_cli("config", SHMLOADER_NUM_WORKERS="3")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:] if line.strip()}
    for spec in FIELDS:
        assert spec.name in lines and lines[spec.name][-1] == spec.env
    assert lines["num_workers"][1:3] == ["3", "environment"]
    assert lines["timeout"][1:3] == ["0", "default"]


@pytest.mark.timeout(60)
def test_config_json() -> None:
    result = run_cli("config", "--json", SHMLOADER_SLOT_BYTES="1MiB", SHMLOADER_PIN_MEMORY="on")
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert list(body) == [f.name for f in FIELDS]
    assert body["slot_bytes"] == {"value": 1048576, "source": "environment",
                                  "variable": "SHMLOADER_SLOT_BYTES", "note": ""}
    assert body["pin_memory"]["value"] is True
    assert body["multiprocessing_context"] == {"value": None, "source": "default",
                                               "variable": "SHMLOADER_START_METHOD", "note": ""}


@pytest.mark.timeout(60)
def test_config_bad_value_exits_2_with_the_message() -> None:
    result = run_cli("config", SHMLOADER_PREFETCH_FACTOR="two", SHMLOADER_NUM_WORKERS="2")
    assert result.returncode == 2
    assert "SHMLOADER_PREFETCH_FACTOR='two' is not an integer (expected an integer >= 1)" in result.stderr
    assert result.stdout == ""


@pytest.mark.timeout(60)
def test_config_unknown_variable_warns_with_suggestion() -> None:
    result = run_cli("config", SHMLOADER_TIMOUT="5")
    assert result.returncode == 0
    assert "SHMLOADER_TIMOUT (did you mean SHMLOADER_TIMEOUT?)" in result.stderr


@pytest.mark.timeout(60)
def test_no_command_prints_help_and_exits_2() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "config" in result.stdout and "doctor" in result.stdout and "bench" in result.stdout


@pytest.mark.timeout(60)
def test_importing_the_cli_modules_does_not_import_torch() -> None:
    code = ("import sys, shmloader, shmloader.config, shmloader.cli.doctor, shmloader.log, shmloader.transport.sweep, "
            "shmloader.__main__; assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr


# -- doctor ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_doctor_reports_a_dead_owners_segment_and_clean_removes_only_it(tmp_path) -> None:
    dead = make_segment(tmp_path, DEAD_PID)
    live = make_segment(tmp_path, os.getpid(), "live")  # this test process: alive throughout
    other = tmp_path / "not_ours"
    other.write_text("")
    env = {"SHMLOADER_SHM_DIR": str(tmp_path)}

    found = run_cli("doctor", *SMALL_RING, **env)
    assert found.returncode == 1, found.stdout + found.stderr
    assert "[problem] leftovers" in found.stdout and dead.name in found.stdout
    assert "doctor --clean" in found.stdout and dead.exists()

    cleaned = run_cli("doctor", "--clean", *SMALL_RING, **env)
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    assert f"removed 1 segment(s) of dead owners (pids {DEAD_PID}" in cleaned.stdout
    assert not dead.exists() and live.exists() and other.exists()

    again = run_cli("doctor", *SMALL_RING, **env)
    assert again.returncode == 0 and "1 segment(s) of running loaders" in again.stdout


@pytest.mark.parametrize(("line", "status", "words"), [
    ("tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=1024k 0 0", "info", "huge=never: slots get 4 KiB pages"),
    ("tmpfs /dev/shm tmpfs rw,huge=advise 0 0", "info", "remount,huge=within_size /dev/shm"),
    ("tmpfs /dev/shm tmpfs rw,huge=within_size 0 0", "ok", "huge=within_size: slots of 2 MiB and more"),
    ("shm /dev/shm ext4 rw 0 0", "info", "not on a tmpfs"),
])
def test_doctor_says_whether_the_shm_dir_gives_slots_huge_pages(tmp_path, line, status, words) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(f"proc /proc proc rw 0 0\ntmpfs / tmpfs rw,huge=always 0 0\n"  # the deepest mount wins,
                      f"tmpfs /dev/shm tmpfs rw,huge=always 0 0\n{line}\n")  # and of two on one path the later
    found = doctor.check_huge_pages("/dev/shm/jobs", str(mounts))
    assert found.check == "huge pages" and found.status == status and words in found.message


def test_doctor_huge_pages_check_survives_an_unreadable_mount_table(tmp_path) -> None:
    found = doctor.check_huge_pages("/dev/shm", str(tmp_path / "missing"))
    assert found.status == "info" and "page size not checked" in found.message


@pytest.mark.timeout(60)
def test_doctor_flags_a_ring_larger_than_the_free_space(tmp_path) -> None:
    result = run_cli("doctor", "--workers", "4", "--slot-bytes", "1000000GiB", SHMLOADER_SHM_DIR=str(tmp_path))
    assert result.returncode == 1
    problem = [line for line in result.stdout.splitlines() if line.startswith("[problem] shm dir")]
    assert problem and "the ring needs" in problem[0]
    assert "10 slots" in result.stdout and "remedy:" in result.stdout


@pytest.mark.timeout(60)
def test_doctor_json_and_bad_variable_is_a_finding(tmp_path) -> None:
    result = run_cli("doctor", "--json", *SMALL_RING, SHMLOADER_SHM_DIR=str(tmp_path), SHMLOADER_MAX_SLOTS="x")
    assert result.returncode == 1
    body = json.loads(result.stdout)
    assert body["ring"]["slots"] == 3 and body["ring"]["ring_bytes"] == 3 * 4096
    checks = {f["check"] for f in body["findings"]}
    assert {"config", "shm dir", "memlock", "start methods", "cpus", "torch", "cuda", "leftovers"} <= checks
    config = [f for f in body["findings"] if f["check"] == "config"]
    assert config[0]["status"] == "problem" and "SHMLOADER_MAX_SLOTS='x'" in config[0]["message"]


@pytest.mark.timeout(60)
def test_doctor_counts_an_unknown_variable_as_a_warning(tmp_path) -> None:
    env = {"SHMLOADER_SHM_DIR": str(tmp_path)}
    clean = run_cli("doctor", *SMALL_RING, **env)
    typo = run_cli("doctor", *SMALL_RING, **env, SHMLOADER_TIMOUT="5")
    assert clean.returncode == typo.returncode == 0, typo.stdout + typo.stderr

    def warnings_counted(stdout: str) -> int:
        return int(stdout.splitlines()[-1].split(", ")[1].split(" ")[0])

    assert warnings_counted(typo.stdout) == warnings_counted(clean.stdout) + 1
    (line,) = [line for line in typo.stdout.splitlines() if line.startswith("[warning] config")]
    assert "SHMLOADER_TIMOUT (did you mean SHMLOADER_TIMEOUT?)" in line
    assert "ConfigWarning" not in typo.stderr  # reported once, as a finding, not also as a warning
    body = json.loads(run_cli("doctor", "--json", *SMALL_RING, **env, SHMLOADER_TIMOUT="5").stdout)
    assert [f["status"] for f in body["findings"] if f["check"] == "config"] == ["warning"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, bad, good", [("SHMLOADER_DISABLE_PLUGIN_AUTOLOAD", "maybe", "1"),
                                             ("SHMLOADER_PIN_BACKEND", "bogus", "mlock")])
def test_doctor_flags_a_bad_variable_that_is_not_a_loader_option(tmp_path, name: str, bad: str, good: str) -> None:
    env = {"SHMLOADER_SHM_DIR": str(tmp_path)}
    result = run_cli("doctor", *SMALL_RING, **env, **{name: bad})
    assert result.returncode == 1, result.stdout
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("[problem] config")]
    assert f"{name}={bad!r}" in line and f"remedy: fix or unset {name}" in result.stdout
    assert run_cli("doctor", *SMALL_RING, **env, **{name: good}).returncode == 0


def test_doctor_parses_those_variables_with_the_library_s_own_code(monkeypatch) -> None:
    from shmloader.errors import ConfigError
    from shmloader.gpu import pinning
    from shmloader.plugins import autoload_enabled

    env = {"SHMLOADER_PIN_BACKEND": " Bogus", "SHMLOADER_DISABLE_PLUGIN_AUTOLOAD": "maybe"}
    expected = []
    for read in (lambda: autoload_enabled(env), lambda: pinning.requested_backend(environ=env)):
        with pytest.raises(ConfigError) as info:
            read()
        expected.append(str(info.value))
    _, found = doctor.run_checks(env, 1, 1, 4096)
    assert [f.message for f in found if f.status == "problem" and f.check == "config"] == expected

    def stand_in(name: str | None = None, environ: object = None) -> str:
        raise ConfigError("the library's answer", name="SHMLOADER_PIN_BACKEND")

    monkeypatch.setattr(pinning, "requested_backend", stand_in)
    _, found = doctor.run_checks({}, 1, 1, 4096)
    assert "the library's answer" in [f.message for f in found]  # doctor has no parser of its own


@pytest.mark.skipif(__import__("shmloader.gpu.pinning").gpu.pinning.accelerator_available(),
                    reason="this machine has an accelerator")
@pytest.mark.parametrize("pin_memory, status", [("0", "warning"), ("1", "problem")])
def test_doctor_flags_a_pin_backend_that_cannot_work_here(pin_memory: str, status: str) -> None:
    env = {"SHMLOADER_PIN_BACKEND": "torch", "SHMLOADER_PIN_MEMORY": pin_memory}
    _, found = doctor.run_checks(env, 1, 1, 4096)
    (finding,) = [f for f in found if f.check == "pin backend"]
    assert finding.status == status and "sees no CUDA device" in finding.message
    assert "SHMLOADER_PIN_BACKEND" in finding.remedy


@pytest.mark.parametrize("workers, slot_bytes, hint", [
    (None, None, " (guessed: workers, slot size; pass --workers/--slot-bytes)"),
    (None, 4096, " (guessed: workers; pass --workers)"),
    (2, None, " (guessed: slot size; pass --slot-bytes)"),
    (2, 4096, ""),
])  # fmt: skip
def test_doctor_says_which_part_of_the_ring_plan_is_guessed(workers, slot_bytes, hint: str) -> None:
    from shmloader.config import Config

    plan = doctor.plan_ring(Config(), workers, None, slot_bytes)
    assert plan.describe().endswith(f"= {doctor.format_bytes(plan.ring_bytes)}{hint}")
    assert plan.guessed == bool(hint)


def test_doctor_with_slot_bytes_0_guesses_as_the_loader_sizes_from_the_first_batch() -> None:
    """0 means "size the slots from the first batch" (docs/config.md): doctor cannot know that size,
    so it guesses, as when the option is left out; it used to plan a ring of 0 bytes."""
    from shmloader.config import Config

    plan = doctor.plan_ring(Config(), 2, None, 0)
    assert plan.slot_bytes == doctor.GUESS_SLOT_BYTES and "slot_bytes" in plan.guessed_parts


@pytest.mark.timeout(60)
def test_doctor_with_slot_bytes_given_does_not_call_it_a_guess(tmp_path) -> None:
    result = run_cli("doctor", "--slot-bytes", "4KiB", SHMLOADER_SHM_DIR=str(tmp_path))
    plan = result.stdout.splitlines()[0]
    assert "4.0 KiB" in plan and "--slot-bytes" not in plan and "pass --workers" in plan
    body = json.loads(run_cli("doctor", "--json", "--slot-bytes", "4KiB", SHMLOADER_SHM_DIR=str(tmp_path)).stdout)
    assert body["ring"]["guessed"] is True and body["ring"]["guessed_parts"] == ["workers"]


@pytest.mark.timeout(60)
def test_doctor_rejects_a_bad_size_option() -> None:
    result = run_cli("doctor", "--slot-bytes", "big")
    assert result.returncode == 2 and "'big' is not a size" in result.stderr


# -- without torch -----------------------------------------------------------------------------------

_NO_TORCH_SCRIPT = """
import sys
{hide}
import shmloader                       # the numpy flavour needs no torch
assert 'torch' not in sys.modules or sys.modules['torch'] is None
loader = shmloader.DataLoader(shmloader.ArrayDataset(list(range(4))), batch_size=2)
assert [x.tolist() for (x,) in loader] == [[0, 1], [2, 3]]
try:
    from shmloader.torch import DataLoader
except ImportError as exc:
    print(type(exc).__name__, exc.name, str(exc), sep="|")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["sys.modules", "package"])
def test_the_torch_flavour_without_torch_says_how_to_install_it(tmp_path, how: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMLOADER_")}
    if how == "sys.modules":
        hide = "sys.modules['torch'] = None"
    else:  # a torch package that fails as a missing one does, first on the path
        (tmp_path / "torch").mkdir()
        (tmp_path / "torch" / "__init__.py").write_text(
            "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
        hide = f"sys.path.insert(0, {str(tmp_path)!r})"
    result = subprocess.run([sys.executable, "-c", _NO_TORCH_SCRIPT.format(hide=hide)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    kind, name, message = result.stdout.strip().split("|")
    assert kind == "ModuleNotFoundError" and name == "torch"
    assert "pip install 'shmloader[torch]'" in message and "from shmloader import DataLoader" in message


# -- bench forwarding (in process, with a stand-in bench module) -----------------------------------


def test_bench_forwards_the_rest_of_the_command_line(monkeypatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("shmloader.cli.bench")

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 5

    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "shmloader.cli.bench", fake)
    assert cli.main(["bench", "--workers", "2", "--help"]) == 5
    assert seen == [["--workers", "2", "--help"]]


# -- sweep -----------------------------------------------------------------------------------------


def test_sweep_removes_dead_owners_segments_only(tmp_path) -> None:
    dead = [make_segment(tmp_path, DEAD_PID, "a"), make_segment(tmp_path, DEAD_PID, "b_c")]
    keep = [make_segment(tmp_path, os.getpid(), "live"), tmp_path / "shml_abc_x", tmp_path / "shml_0_x",
            tmp_path / "shml_12", tmp_path / "unrelated"]
    for path in keep[1:]:
        path.write_text("")
    (tmp_path / f"shml_{DEAD_PID}_dir").mkdir()
    assert sweep.dead_segments(str(tmp_path)) == sorted(p.name for p in dead)
    assert sweep.sweep_dead_segments(str(tmp_path)) == sorted(p.name for p in dead)
    assert not any(p.exists() for p in dead) and all(p.exists() for p in keep)
    assert sweep.sweep_dead_segments(str(tmp_path)) == []


def test_sweep_of_given_pids_removes_only_their_unlocked_segments(tmp_path) -> None:
    listed = make_segment(tmp_path, DEAD_PID, "a")
    other = make_segment(tmp_path, DEAD_PID + 1, "b")
    live = Segment.create(str(tmp_path), 4096)  # this process's, its lock held
    try:
        assert sweep.sweep_segments_of(str(tmp_path), {DEAD_PID, os.getpid()}) == [listed.name]
        assert not listed.exists() and other.exists() and (tmp_path / live.name).exists()
    finally:
        live.unlink()
        live.close()


def test_sweep_tolerates_a_segment_vanishing_meanwhile(tmp_path, monkeypatch) -> None:
    gone = make_segment(tmp_path, DEAD_PID, "gone")
    listed = sweep.dead_segments(str(tmp_path))
    gone.unlink()  # another sweeper got there first
    monkeypatch.setattr(sweep, "dead_segments", lambda shm_dir: listed)
    assert sweep.sweep_dead_segments(str(tmp_path)) == []


def test_sweep_of_a_missing_directory_is_empty(tmp_path) -> None:
    assert sweep.dead_segments(str(tmp_path / "missing")) == []


@pytest.mark.timeout(60)
def test_a_zombie_owner_counts_as_dead(tmp_path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        segment = make_segment(tmp_path, child.pid)
        assert sweep.sweep_dead_segments(str(tmp_path)) == [segment.name]
    finally:
        child.wait()


def test_owner_pid() -> None:
    assert segment.owner_pid("shml_123_x_y") == 123
    assert segment.owner_pid("shml_123") is None and segment.owner_pid("psm_123_x") is None
