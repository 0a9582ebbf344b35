"""Tests of ``python -m shmloader bench``: its workloads and whole runs (its report: test_bench_report.py).

Whole runs start a fresh interpreter, as a user would, and read the JSON document on stdout. No test
asserts on speed: only that every field is there, every rate is positive, and that the statistics
over the rounds (medians, ranges, ratios of medians, the '!' flag) follow from the recorded rounds.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bench_helpers import DOCUMENT_KEYS

import shmloader
from shmloader.cli import bench
from shmloader.cli.workloads import (
    PAGE_BYTES,
    WORKLOADS,
    CachedSampleDataset,
    touch_batch,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN_MAIN = "import sys, shmloader.cli.bench as b; sys.exit(b.main(sys.argv[1:]))"
HAS_SHMLOADER_LOADER = hasattr(shmloader, "DataLoader")
RESULT_FIELDS = {
    "workload", "num_workers", "loader", "batch_size", "batch_bytes", "batches", "seconds",
    "first_batch_s", "leftover_children", "error", "batches_per_s", "gb_per_s", "cpu_s",
    "cpu_s_per_batch", "round_index", "position",
}  # fmt: skip
HEADER_FIELDS = {"cpu_count", "affinity_cpus", "python", "numpy", "torch", "shmloader",
                 "start_method", "device", "repeat", "spread_rule", "copy_limit_processes",
                 "ring_copy_limit_buffers_per_process"}  # fmt: skip

def _torch_installed() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


needs_torch = pytest.mark.skipif(not _torch_installed(), reason="torch is not installed")
needs_shmloader_loader = pytest.mark.skipif(
    not HAS_SHMLOADER_LOADER, reason="shmloader.DataLoader is not available yet"
)


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUN_MAIN, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )


def run_json(*args: str) -> tuple[int, dict[str, Any], str]:
    proc = run_bench(*args, "--json")
    assert proc.stdout.strip(), f"no JSON on stdout; stderr:\n{proc.stderr}"
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def assert_valid_results(doc: dict[str, Any], loaders: set[str], workers: set[int]) -> None:
    assert set(doc) == DOCUMENT_KEYS
    assert HEADER_FIELDS <= set(doc["header"])
    assert doc["header"]["cpu_count"] >= 1
    results = doc["results"]
    assert {r["loader"] for r in results} == loaders
    assert {r["num_workers"] for r in results} == workers
    for r in results:
        assert RESULT_FIELDS <= set(r), r
        assert r["error"] is None, r["error"]
        assert r["batches"] == 20
        assert r["batches_per_s"] > 0 and r["gb_per_s"] > 0 and r["first_batch_s"] > 0
        assert r["cpu_s"] > 0 and r["cpu_s_per_batch"] == pytest.approx(r["cpu_s"] / 20)
        assert r["leftover_children"] == 0
    rounds = doc["header"]["repeat"]
    assert {r["round_index"] for r in results} == set(range(rounds))
    for s in doc["summaries"]:
        assert s["rounds"] == rounds and s["failed_rounds"] == 0
        rate = s["batches_per_s"]
        assert rate["n"] == rounds and rate["low"] <= rate["median"] <= rate["high"]


# --- whole runs ----------------------------------------------------------------------------------


@needs_torch
@pytest.mark.timeout(180)
def test_torch_only_run_reports_every_field() -> None:
    rc, doc, stderr = run_json("--workloads", "tiny", "--batches", "20", "--workers", "0",
                               "--no-shmloader", "--repeat", "1")  # fmt: skip
    assert rc == 0, stderr
    assert_valid_results(doc, {"torch"}, {0})
    assert doc["ratios"] == [] and doc["h2d"] == []
    assert doc["copy_limit"] == {"runs": [], "summaries": []}  # it bounds shmloader's rows only
    assert doc["ring_copy_limit"] == {"prefetch_factor": 2, "runs": [], "summaries": []}
    assert "batches/s" in stderr  # the human table moved to stderr
    assert "One round: no spread was measured" in stderr


@needs_torch
@needs_shmloader_loader
@pytest.mark.timeout(180)
def test_side_by_side_rounds_alternate_and_ratios_are_ratios_of_medians() -> None:
    rc, doc, stderr = run_json("--workloads", "tiny", "--batches", "20", "--workers", "0",
                               "--repeat", "3")  # fmt: skip
    assert rc == 0, stderr
    assert_valid_results(doc, {"shmloader", "torch"}, {0})
    order = [(r["round_index"], r["position"], r["loader"]) for r in doc["results"]]
    assert order == [(0, 0, "shmloader"), (0, 1, "torch"), (1, 0, "torch"), (1, 1, "shmloader"),
                     (2, 0, "shmloader"), (2, 1, "torch")]  # fmt: skip
    (ratio,) = doc["ratios"]
    assert ratio["workload"] == "tiny" and ratio["num_workers"] == 0
    rates = {name: sorted(r["batches_per_s"] for r in doc["results"] if r["loader"] == name)
             for name in ("shmloader", "torch")}  # fmt: skip
    assert ratio["batches_per_s_ratio"] == pytest.approx(rates["shmloader"][1] / rates["torch"][1])
    assert ratio["first_batch_ratio"] > 0 and len(ratio["round_ratios"]) == 3
    assert "(higher=better)" in stderr and "(lower=better)" in stderr
    assert "vs torch (first)" not in stderr


@needs_shmloader_loader
@pytest.mark.timeout(180)
def test_run_with_one_worker() -> None:
    loaders = ("--no-torch",) if not _torch_installed() else ()
    rc, doc, stderr = run_json("--workloads", "tiny", "--batches", "20", "--workers", "1",
                               "--repeat", "2", *loaders)  # fmt: skip
    shm = [r for r in doc["results"] if r["loader"] == "shmloader"]
    if shm and shm[0]["error"] is not None:
        pytest.skip(f"shmloader with num_workers>0 failed: {shm[0]['error']}")
    assert rc == 0, stderr
    assert_valid_results(doc, {r["loader"] for r in doc["results"]}, {1})
    assert "shmloader" in {r["loader"] for r in doc["results"]}
    # The copy limit ran once per round with max(--workers) = 1 process; shmloader's row is a fraction of it.
    runs = doc["copy_limit"]["runs"]
    assert [(r["workload"], r["processes"], r["round_index"]) for r in runs] == [("tiny", 1, 0), ("tiny", 1, 1)]
    assert all(r["error"] is None and r["batches"] == 20 and r["batches_per_s"] > 0 for r in runs)
    (limit,) = doc["copy_limit"]["summaries"]
    (summary,) = [s for s in doc["summaries"] if s["loader"] == "shmloader"]
    expected = summary["batches_per_s"]["median"] / limit["batches_per_s"]["median"]
    assert summary["copy_limit_fraction"] == pytest.approx(expected)
    assert "copy limit: np.stack" in stderr
    # The ring copy limit too, each of the 1 process rotating over ring_slots(1, 2) = 4 buffers.
    rings = doc["ring_copy_limit"]["runs"]
    assert [(r["processes"], r["buffers_per_process"], r["round_index"]) for r in rings] == [(1, 4, 0), (1, 4, 1)]
    assert all(r["error"] is None and r["batches"] == 20 and r["batches_per_s"] > 0 for r in rings)
    (ring,) = doc["ring_copy_limit"]["summaries"]
    expected = summary["batches_per_s"]["median"] / ring["batches_per_s"]["median"]
    assert summary["ring_limit_fraction"] == pytest.approx(expected)
    assert doc["header"]["ring_copy_limit_buffers_per_process"] == 4 and "of ring limit" in stderr


@pytest.mark.timeout(180)
def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    if not HAS_SHMLOADER_LOADER and not _torch_installed():
        pytest.skip("neither loader is available")
    which = () if HAS_SHMLOADER_LOADER else ("--no-shmloader",)
    png = tmp_path / "bench.png"
    proc = run_bench("--workloads", "tiny", "--batches", "5", "--workers", "0", "--repeat", "2",
                     "--plot", str(png), *which)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png}" in proc.stdout


def test_device_cuda_without_cuda_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    if _torch_installed():
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")
    assert bench.main(["--device", "cuda", "--workloads", "tiny", "--batches", "1"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err
    assert "CUDA is not available" in err or not _torch_installed()


@needs_torch
@pytest.mark.parametrize("device, words", [("nonsense", "not a device torch knows"),
                                           ("cuda:x", "not a device torch knows"),
                                           ("meta", "only cpu and cuda")])
def test_a_device_torch_cannot_parse_is_named_and_exits_2(device: str, words: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert bench.main(["--device", device, "--workloads", "tiny", "--batches", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--device {device!r}" in err and words in err and "CUDA is not available" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--workloads", "huge"],
        ["--workers", "-1"],
        ["--workers", "two"],
        ["--batches", "0"],
        ["--no-torch", "--no-shmloader"],
        ["--start-method", "thread"],
        ["--repeat", "0"],
        ["--repeat", "three"],
        ["--workers", ","],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(argv) == 2
    assert capsys.readouterr().err.strip()


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--help"]) == 0
    assert "--workloads" in capsys.readouterr().out


def test_per_workload_default_batches() -> None:
    opts = bench.parse_args([])
    assert [w.name for w in opts.workloads] == ["tiny", "image", "big"]
    assert opts.workers == (0, 2) and opts.start_method == "fork"
    assert opts.repeat >= 3 and opts.copy_limit and opts.copy_limit_processes == 2
    assert bench.parse_args(["--no-copy-limit"]).copy_limit_processes == 0
    assert bench.parse_args(["--no-shmloader"]).copy_limit_processes == 0
    assert opts.batches_for(WORKLOADS["big"]) == WORKLOADS["big"].default_batches
    assert bench.parse_args(["--batches", "7"]).batches_for(WORKLOADS["big"]) == 7


def _fake_shmloader_class(closed: list[bool], fail: bool = False) -> type:
    """torch's DataLoader standing in for shmloader's, with a ``close()`` that is recorded."""
    from torch.utils.data import DataLoader

    class FakeLoader(DataLoader):  # type: ignore[misc]
        def __iter__(self) -> Any:
            if fail:
                raise RuntimeError("engine exploded")
            return super().__iter__()

        def close(self) -> None:
            closed.append(True)

    return FakeLoader


@needs_torch
def test_side_by_side_flow_with_a_stand_in_loader(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    closed: list[bool] = []
    monkeypatch.setattr(shmloader, "DataLoader", _fake_shmloader_class(closed), raising=False)
    rc = bench.main(["--workloads", "tiny", "--batches", "20", "--workers", "0", "--json",
                     "--repeat", "2"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    assert_valid_results(doc, {"shmloader", "torch"}, {0})
    assert len(doc["ratios"]) == 1 and doc["ratios"][0]["batches_per_s_ratio"] > 0
    assert closed == [True, True]  # close() is called once per measurement


@needs_torch
def test_a_failing_loader_is_reported_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    closed: list[bool] = []
    fake = _fake_shmloader_class(closed, fail=True)
    monkeypatch.setattr(shmloader, "DataLoader", fake, raising=False)
    rc = bench.main(["--workloads", "tiny", "--batches", "5", "--workers", "0", "--json",
                     "--repeat", "1"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 1
    doc = json.loads(out)
    results = {r["loader"]: r for r in doc["results"]}
    assert results["shmloader"]["error"] == "RuntimeError: engine exploded"
    assert results["torch"]["error"] is None and results["torch"]["batches_per_s"] > 0
    assert "engine exploded" in err and closed == [True]
    summaries = {s["loader"]: s for s in doc["summaries"]}
    assert summaries["shmloader"]["failed_rounds"] == 1 and summaries["shmloader"]["batches_per_s"] is None
    assert doc["ratios"] == []


def test_importing_the_benchmark_does_not_import_torch() -> None:
    code = "import sys, shmloader.cli.bench; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.stdout.strip() == "False", proc.stderr


# --- workloads -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_dataset_samples_match_the_workload(name: str) -> None:
    workload = WORKLOADS[name]
    dataset = workload.dataset(num_batches=2)
    assert len(dataset) == 2 * workload.batch_size
    sample = dataset[len(dataset) - 1]
    values = sample if isinstance(sample, tuple) else (sample,)
    assert [np.shape(v) for v in values] == [f.shape for f in workload.fields]
    assert [np.asarray(v).dtype for v in values] == [np.dtype(f.dtype) for f in workload.fields]
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_dataset_pickles_without_its_cache() -> None:
    dataset = WORKLOADS["big"].dataset(num_batches=1)
    first = dataset[0]
    payload = pickle.dumps(dataset)
    assert len(payload) < 4096  # the 4 MiB samples do not travel to spawned workers
    copy = pickle.loads(payload)
    assert isinstance(copy, CachedSampleDataset) and len(copy) == len(dataset)
    np.testing.assert_array_equal(copy[0], first)


@pytest.mark.parametrize("page_offset", [0, 1000, PAGE_BYTES - 1])
@pytest.mark.parametrize("nbytes", [1, 100, 4 * PAGE_BYTES, 4 * PAGE_BYTES + 200])
def test_touch_batch_reads_every_memory_page(page_offset: int, nbytes: int) -> None:
    buffer = np.zeros(nbytes + 3 * PAGE_BYTES, dtype=np.uint8)
    start = (-buffer.ctypes.data) % PAGE_BYTES + page_offset  # the array begins mid-page
    array = buffer[start : start + nbytes]
    address = array.ctypes.data
    base = touch_batch((array,))
    for page in range(address // PAGE_BYTES, (address + nbytes - 1) // PAGE_BYTES + 1):
        lo = max(0, page * PAGE_BYTES - address)
        hi = min(nbytes, (page + 1) * PAGE_BYTES - address)
        array[lo:hi] = 1
        assert touch_batch({"x": [array]}) > base, f"page {page} of the array was not read"
        array[lo:hi] = 0


def test_touch_batch_handles_strided_arrays_and_tensors() -> None:
    array = np.arange(4 * PAGE_BYTES, dtype=np.uint8).reshape(4, PAGE_BYTES)
    assert touch_batch([array[:, ::2]]) == touch_batch([np.ascontiguousarray(array[:, ::2])])
    if _torch_installed():
        import torch

        assert touch_batch([torch.from_numpy(array)]) == touch_batch([array])


# --- copy limit ----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_epoch_bars_use_the_progress_observer_and_header_states_hook_cost():
    pytest.importorskip("tqdm")
    proc = run_bench("--workloads", "tiny", "--batches", "20", "--workers", "1", "--no-torch", "--epoch-bars")
    assert proc.returncode == 0, proc.stderr
    assert "batch/s" in proc.stderr or "batch]" in proc.stderr  # the observer's bar, unit "batch"
    assert "plugin_hook_cost_us_per_batch" in proc.stdout + proc.stderr


# --- ring copy limit -----------------------------------------------------------------------------


def test_an_abbreviated_train_flag_is_refused_not_run_as_the_plain_bench(capsys: pytest.CaptureFixture[str]) -> None:
    """Only the exact --train hands over to the training benchmark: argparse's prefix matching
    took --trai for --train and then ran the plain benchmark."""
    assert bench.main(["--trai", "--workloads", "tiny", "--batches", "1"]) == 2
    assert "--trai" in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [("--workers", "0,2,0"), ("--workloads", "tiny,tiny")])
def test_a_value_given_twice_is_refused_by_name(option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A repeated case would be measured again and pooled with the first as if it were a round."""
    assert bench.main([option, value, "--batches", "1"]) == 2
    err = capsys.readouterr().err
    assert option in err and "twice" in err
