"""Short, bounded runs of the stress scripts, each in its own process, as CI runs them.

Each script must end with exactly one ``PASS ...`` line and exit 0. kill_workers must survive a
meaningful number of worker deaths; shm_pressure uses a small tmpfs when this process may mount one
and otherwise a reported budget. The scripts check by themselves that nothing is left behind; this
test checks it again from outside (no process, no segment of the script's pid).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

STRESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stress")


def run(script: str, *args: str, timeout_s: float) -> tuple[str, int]:
    proc = subprocess.run([sys.executable, os.path.join(STRESS, script), *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=STRESS)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    last = lines[-1]
    assert proc.returncode == 0 and last.startswith("PASS "), f"{last}\n{proc.stderr[-3000:]}"
    assert [ln for ln in lines if ln.startswith(("PASS ", "FAIL "))] == [last]  # one verdict, the last line
    return last, proc.returncode


@pytest.mark.timeout(120)
def test_kill_workers_short() -> None:
    last, _ = run("kill_workers.py", "--kills", "60", "--seconds", "60", timeout_s=110)
    deaths = int(re.search(r"survived (\d+) worker deaths", last).group(1))  # type: ignore[union-attr]
    assert deaths >= 60
    assert "0 lost, 0 duplicated" in last
    assert "seed 0," in last  # the figures say how to rerun them


@pytest.mark.timeout(120)
def test_kill_workers_without_a_task_deadline() -> None:
    """No deadline: the wait sleeps on the due batch's worker alone, and every death is still seen."""
    last, _ = run("kill_workers.py", "--kills", "200", "--seconds", "60", "--task-timeout", "0", timeout_s=110)
    deaths = int(re.search(r"survived (\d+) worker deaths", last).group(1))  # type: ignore[union-attr]
    assert deaths >= 200
    assert "0 lost, 0 duplicated" in last and "hang 0" in last and "SIGSTOP" not in last


@pytest.mark.timeout(120)
def test_soak_short() -> None:
    last, _ = run("soak.py", "--epochs", "12", "--seconds", "30", timeout_s=110)
    assert re.search(r"soak: 12 epochs, 192 batches", last), last


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [False, True])
def test_resume_pieces_short(persistent: bool) -> None:
    # 12 epochs (about 60 pieces, every planted fault fired) in 2-4 s; 15 s stays the bound on a slow machine
    last, _ = run("resume.py", "--epochs", "12", "--seconds", "15", *(["--persistent"] if persistent else []),
                  timeout_s=110)
    pieces = int(re.search(r"in (\d+) pieces", last).group(1))  # type: ignore[union-attr]
    assert pieces >= 20 and "batches as uninterrupted" in last
    assert "seed 0," in last  # the figures say how to rerun them


@pytest.mark.timeout(120)
def test_shm_pressure() -> None:
    last, _ = run("shm_pressure.py", timeout_s=110)
    for scenario in ("preflight:", "growth:", "filled:"):
        assert scenario in last
    # held batches cost their own pages: 200 of 64 bytes fit in 16 MiB (13 did when each kept a slot)
    assert "held: 200 batches of 64 bytes held and intact" in last, last


@pytest.mark.timeout(90)
def test_a_failing_run_says_fail() -> None:
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "soak.py"), "--epochs", "1", "--warmup", "3"],
                          capture_output=True, text=True, timeout=60, cwd=STRESS)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines()[-1].startswith("FAIL soak: only 1 epochs")


@pytest.mark.timeout(150)
def test_combos_with_killed_helpers() -> None:
    """``--helper-rate``: the resource tracker and, under forkserver, the fork server (its workers
    with it) SIGKILLed between epochs and amid them; every batch still arrives exactly once and
    nothing is left behind but the killed helpers' zombies, which CPython reaps at its next start."""
    last, _ = run("combos.py", "--seconds", "20", "--seed", "3", "--methods", "forkserver,spawn,fork",
                  "--helper-rate", "1", "--kill-rate", "0.05", timeout_s=140)
    assert "batches exactly once" in last
    kills = [int(n) for n in re.findall(r"(?:resource tracker|fork server) killed [a-z ]+ (\d+)", last)]
    assert sum(kills) >= 2, last


@pytest.mark.timeout(150)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_kill_workers_with_failing_worker_init_fn(method: str) -> None:
    """``--init-fail-every``: restarted workers whose ``worker_init_fn`` raises answer one task each
    with the error, caught in the place of that batch, and serve on; every other batch arrives once."""
    last, _ = run("kill_workers.py", "--kills", "20", "--seconds", "30", "--method", method,
                  "--init-fail-every", "3", timeout_s=140)
    raised, planted = map(int, re.search(r"worker_init_fn failures raised (\d+) of (\d+) planted", last).groups())  # type: ignore[union-attr]
    assert 1 <= raised <= planted, last
    assert "0 lost, 0 duplicated" in last


@pytest.mark.timeout(150)
def test_combos_with_failing_worker_init_fn() -> None:
    """``--init-fail-rate``: worker starts (restarts included) whose ``worker_init_fn`` raises, amid
    every other fault of the map-style lives; each such error is caught in the place of one batch,
    no more are raised than planted, and every other batch arrives exactly once."""
    last, _ = run("combos.py", "--seconds", "20", "--seed", "5", "--methods", "fork,forkserver",
                  "--init-fail-rate", "0.3", "--iterable-share", "0", "--extra-share", "0", timeout_s=140)
    assert "batches exactly once" in last
    raised, planted = map(int, re.search(r"worker_init_fn failures raised (\d+) of (\d+) planted", last).groups())  # type: ignore[union-attr]
    assert 1 <= raised <= planted, last
