"""The scripts in benchmarks/ still run: ab.py (the A/B of revisions behind docs/performance.md's
measured changes) prints one row per revision with the three figures it promises, hotpath.py,
floor.py and pages.py print theirs, and gpu_host.sh (the GPU machine's runbook) parses and names its modes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "ab.py"
ROW = re.compile(r"^WORKTREE \| [0-9.,]+ \[[0-9.,]+-[0-9.,]+\] \| [0-9.,]+ \[[0-9.,]+-[0-9.,]+\] \| "
                 r"[0-9.,]+ \[[0-9.,]+-[0-9.,]+\]$")


_CPUS = os.sched_getaffinity(0)
_MAIN_CORE = pytest.mark.skipif(len(_CPUS) < 2 or 0 not in _CPUS,
                                reason="--main-core pins the main process to CPU 0 and the workers to the others")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("extra, header", [
    ([], "tiny, num_workers=2, 40 batches, 1 rounds"),
    pytest.param(["--main-core"], "tiny, num_workers=2, main process on CPU 0, workers on the others, 40 batches",
                 marks=_MAIN_CORE),
])
def test_ab_script_times_the_checkout_and_prints_a_row(extra, header):
    out = subprocess.run([sys.executable, str(SCRIPT), "WORKTREE", *extra, "--rounds", "1", "--batches", "40"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(header)
    assert ROW.match(lines[-1]), lines[-1]


@pytest.mark.timeout(180)
def test_ab_script_rusage_adds_the_main_processs_system_cpu_and_sleeps():
    out = subprocess.run([sys.executable, str(SCRIPT), "WORKTREE", "--rusage", "--rounds", "1", "--batches", "40"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    header, row = out.stdout.strip().splitlines()[-2:]
    assert header.endswith("| main system CPU per batch (us) | main sleeps per batch"), header
    cells = row.split(" | ")
    assert ROW.match(" | ".join(cells[:4])) and len(cells) == 6, row
    sys_cpu, sleeps = (float(c.split()[0].replace(",", "")) for c in cells[4:])
    # 40 batches: the kernel's tick-sampled user/system split is too coarse to compare with the
    # CPU column here; that both figures are read and sane is what can be asserted
    assert sys_cpu >= 0 and sleeps >= 0


@pytest.mark.timeout(240)
def test_ab_script_paced_consumer_times_next_for_shmloader_and_torch():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, str(SCRIPT), "WORKTREE", "TORCH", "--consumer-us", "50", "--rounds", "1",
                          "--batches", "40"], capture_output=True, text=True, timeout=230)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("tiny, num_workers=2, consumer 50 us per batch (main CPU: inside next()), 40 batches")
    assert ROW.match(lines[-2]), lines[-2]
    assert re.match(r"^TORCH \| [0-9.,]+ \[", lines[-1]), lines[-1]


@pytest.mark.timeout(180)
def test_ab_script_runs_each_revision_at_each_prefetch_factor():
    out = subprocess.run([sys.executable, str(SCRIPT), "WORKTREE", "--prefetch-factors", "2,4", "--rounds", "1",
                          "--batches", "40"], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = out.stdout.strip().splitlines()[-2:]
    assert [r.split(" | ")[0] for r in rows] == ["WORKTREE pf=2", "WORKTREE pf=4"]
    assert all(ROW.match(r.replace(" pf=2", "").replace(" pf=4", "")) for r in rows), rows
    bad = subprocess.run([sys.executable, str(SCRIPT), "WORKTREE", "--prefetch-factors", "0"],
                         capture_output=True, text=True, timeout=50)
    assert bad.returncode == 2 and "--prefetch-factors" in bad.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag, named", [("TORCH", "TORCH"), ("--rusage", "--rusage")])
def test_ab_script_refuses_what_hotpath_cannot_time(flag, named):
    args = ["WORKTREE", flag] if flag.startswith("--") else [flag]
    out = subprocess.run([sys.executable, str(SCRIPT), *args, "--hotpath"], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 2 and "--hotpath" in out.stderr and named in out.stderr


@pytest.mark.timeout(60)
def test_ab_script_rejects_an_unknown_workload():
    out = subprocess.run([sys.executable, str(SCRIPT), "WORKTREE", "--workload", "huge"],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 2 and "--workload" in out.stderr


@pytest.mark.timeout(180)
def test_ab_script_hotpath_times_the_iterator_without_pipes():
    out = subprocess.run([sys.executable, str(SCRIPT), "WORKTREE", "--hotpath", "--rounds", "1", "--batches", "200"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("hotpath.py: tiny, num_workers=2, 200 batches, 1 rounds")
    net, raw, harness = (float(v.split()[0]) for v in lines[-1].split(" | ")[1:])
    assert 0 < harness < raw and net == pytest.approx(raw - harness, abs=0.11)


@pytest.mark.timeout(120)
def test_hotpath_cold_run_with_more_workers_prints_three_figures():
    out = subprocess.run([sys.executable, str(SCRIPT.with_name("hotpath.py")), "--batches", "50", "--repeats", "1",
                          "--evict-mib", "1", "--workers", "3", "--poll"], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    net, raw, harness = map(float, out.stdout.split())
    assert raw > 0 and harness > 0 and net == pytest.approx(raw - harness, abs=0.011)


@pytest.mark.timeout(120)
def test_floor_script_prints_the_pipes_costs():
    out = subprocess.run([sys.executable, str(SCRIPT.with_name("floor.py")), "--tasks", "300"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip()
    assert re.search(r"main CPU [0-9.]+ us per task, [0-9,]+ tasks/s; ping-pong [0-9.]+ us", line), line
    assert re.search(r"send_bytes [0-9.]+ us, wire.write_frame [0-9.]+ us;", line), line
    waking, plain = map(float, re.search(r"asleep in poll ([0-9.]+) us, to a reader awake ([0-9.]+) us$", line).groups())
    assert waking >= 0 and plain >= 0


@pytest.mark.timeout(120)
def test_pages_script_times_the_three_destinations():
    out = subprocess.run([sys.executable, str(SCRIPT.with_name("pages.py")), "--workload", "image", "--rounds", "1",
                          "--batches", "1"], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert re.match(r"^image: \(64, 224, 224, 3\) uint8, 1 rounds x 1 batches; .* mounted huge=\w+, ", lines[0])
    names = [line.split(":")[0] for line in lines[1:]]
    assert names == ["private, huge pages", "private, 4 KiB pages", "shared"]
    assert all(float(re.search(r": ([0-9.]+) ms per batch", line).group(1)) > 0 for line in lines[1:])


@pytest.mark.timeout(60)
def test_gpu_host_script_parses_and_names_its_modes(tmp_path):
    script = SCRIPT.with_name("gpu_host.sh")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    out = subprocess.run(["bash", str(script), "nonsense"], capture_output=True, text=True, timeout=50,
                         env={**os.environ, "OUT": str(tmp_path)})
    assert out.returncode == 2 and "tests|scale|cuda" in out.stderr


@pytest.mark.timeout(120)
def test_first_batch_script_times_both_loaders_alternated() -> None:
    """benchmarks/first_batch.py (docs/performance.md's figures of the first batch without workers)."""
    pytest.importorskip("torch")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                          "first_batch.py")
    for workers in ("0", "2"):
        out = subprocess.run([sys.executable, script, "--workload", "tiny", "--rounds", "2", "--batches", "3",
                              "--workers", workers], capture_output=True, text=True, timeout=50, check=True).stdout
        lines = out.strip().splitlines()
        assert [ln.split(":")[0] for ln in lines] == ["shmloader", "torch"]
        for ln in lines:  # two rounds: two times, then their median
            assert len(re.findall(r"\d+\.\d", ln.split("ms;")[0])) == 2 and "median" in ln
