"""Tests of ``python -m shmloader bench``'s report: ratios of medians, the spread rule and its '!'
flag, failed rounds left out, the table's labels, the round order and the plot. No test asserts on
speed: the statistics must follow from the recorded rounds."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import measurement as _measurement
from bench_helpers import rounds as _rounds

from shmloader.cli import bench
from shmloader.cli.records import (
    SPREAD_LIMIT,
    Spread,
    compare_loaders,
    summarize,
    summarize_loaders,
)
from shmloader.cli.report import format_results

# --- report --------------------------------------------------------------------------------------


def test_ratios_divide_shmloader_by_torch() -> None:
    results = [_measurement("shmloader", 1.0, 0.1), _measurement("torch", 2.0, 0.4)]
    (ratio,) = compare_loaders(results)
    assert ratio.batches_per_s_ratio == pytest.approx(2.0)
    assert ratio.first_batch_ratio == pytest.approx(0.25)
    assert "2.00x" in format_results(results)


def test_ratios_are_ratios_of_medians_with_each_rounds_ratio() -> None:
    # shmloader: 100 batches in 1, 2 and 4 s (100, 50, 25 batches/s); torch: 10 batches/s each round.
    results = _rounds("shmloader", [1.0, 2.0, 4.0]) + _rounds("torch", [10.0, 10.0, 10.0], first_s=0.2)
    (ratio,) = compare_loaders(results)
    assert ratio.batches_per_s_ratio == pytest.approx(5.0)  # median 50 / median 10
    assert ratio.first_batch_ratio == pytest.approx(0.5)
    assert ratio.round_ratios == pytest.approx((10.0, 5.0, 2.5))
    assert ratio.wide  # shmloader's range 25-100 around 50 is 150% of its median


def test_spread_rule() -> None:
    narrow = summarize([100.0, 110.0, 120.0])
    assert narrow == Spread(110.0, 100.0, 120.0, 3)
    assert narrow.relative == pytest.approx(20 / 110) and not narrow.wide
    edge = Spread(100.0, 100.0 - 100 * SPREAD_LIMIT / 2, 100.0 + 100 * SPREAD_LIMIT / 2, 3)
    assert not edge.wide  # the rule is strictly "above" the limit
    assert Spread(100.0, 80.0, 110.0, 3).wide
    assert summarize([5.0]) == Spread(5.0, 5.0, 5.0, 1) and summarize([5.0]).relative is None  # type: ignore[union-attr]
    assert summarize([]) is None


def test_summaries_leave_failed_rounds_out() -> None:
    results = _rounds("shmloader", [1.0, 2.0]) + [_measurement("shmloader", 0.0, 0.0, "RuntimeError: x", 2)]
    (summary,) = summarize_loaders(results)
    assert summary.rounds == 3 and summary.failed_rounds == 1
    assert summary.batches_per_s == Spread(75.0, 50.0, 100.0, 2)
    assert summary.cpu_s_per_batch is not None and summary.cpu_s_per_batch.median == pytest.approx(1e-4)
    text = format_results(results)
    assert "(1 failed)" in text and "round 3: RuntimeError: x" in text


def test_a_wide_spread_is_flagged_in_the_table_with_a_footnote() -> None:
    wide = _rounds("shmloader", [1.0, 2.0, 4.0]) + _rounds("torch", [10.0, 10.5, 11.0])
    text = format_results(wide)
    shm_row = next(line for line in text.splitlines() if line.startswith("tiny") and "shmloader" in line)
    torch_row = next(line for line in text.splitlines() if line.startswith("tiny") and "torch" in line)
    # 50 / (100 / 10.5); the rounds' own ratios are 10, 5.25 and 2.75
    assert "150% !" in shm_row and "5.25x (2.75-10.00) !" in shm_row
    assert "!" not in torch_row and "10%" in torch_row
    assert "! spread too wide to trust" in text
    narrow = format_results(_rounds("shmloader", [1.0, 1.1, 1.05]) + _rounds("torch", [10.0, 10.5, 11.0]))
    assert "!" not in narrow


def test_a_drift_that_both_loaders_share_leaves_the_ratio_trusted() -> None:
    # The machine slows down 4x over the run, for both loaders alike: each round's ratio is 10.
    results = _rounds("shmloader", [1.0, 2.0, 4.0]) + _rounds("torch", [10.0, 20.0, 40.0])
    (ratio,) = compare_loaders(results)
    assert ratio.round_ratios == pytest.approx((10.0, 10.0, 10.0)) and not ratio.wide
    shm_row = next(line for line in format_results(results).splitlines() if "shmloader" in line)
    assert "150% !" in shm_row and "10.00x (10.00-10.00)" in shm_row and "10.00x (10.00-10.00) !" not in shm_row


def test_table_labels_the_direction_of_each_ratio() -> None:
    text = format_results(_rounds("shmloader", [1.0]) + _rounds("torch", [2.0]))
    header = "\n".join(text.splitlines()[:2])
    assert "rate ratio (rounds' min-max)" in header and "(higher=better)" in header
    assert "first-batch time ratio" in header and "(lower=better)" in header
    assert "main CPU" in header and "One round: no spread was measured" in text


def test_failed_measurement_is_reported_not_divided() -> None:
    results = [_measurement("shmloader", 0.0, 0.0, error="RuntimeError: boom"),
               _measurement("torch", 2.0, 0.4)]  # fmt: skip
    assert compare_loaders(results) == []
    assert results[0].batches_per_s == 0.0
    text = format_results(results)
    assert "failed" in text and "RuntimeError: boom" in text


def test_round_order_alternates() -> None:
    assert bench.round_order(("shmloader", "torch"), 0) == ("shmloader", "torch")
    assert bench.round_order(("shmloader", "torch"), 1) == ("torch", "shmloader")
    assert bench.round_order(("torch",), 1) == ("torch",)


def test_plot_draws_median_bars_with_min_max_error_bars(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from shmloader.cli.plot import write_plot

    results = _rounds("shmloader", [1.0, 2.0, 4.0]) + _rounds("torch", [10.0, 10.5, 11.0])
    png = tmp_path / "p.png"
    fig = write_plot(results, str(png), "test", out=open(tmp_path / "out.txt", "w"))
    assert png.read_bytes()[:4] == b"\x89PNG"
    containers = [c for c in fig.axes[0].containers if hasattr(c, "errorbar")]
    assert [c.get_label() for c in containers] == ["shmloader", "torch"]
    (bar,) = containers[0].patches
    assert bar.get_height() == pytest.approx(50.0)  # the median, not the mean (58.3)
    (segments,) = containers[0].errorbar.lines[2][0].get_segments()
    assert sorted(y for _, y in segments) == pytest.approx([25.0, 100.0])  # min and max
