"""Records for the benchmark's report tests (tests/test_bench*.py): one loader's rounds."""

from __future__ import annotations

from shmloader.cli.records import Measurement

DOCUMENT_KEYS = {"header", "results", "summaries", "ratios", "copy_limit", "ring_copy_limit", "h2d"}


def measurement(loader: str, seconds: float, first_s: float, error: str | None = None,
                round_index: int = 0, cpu_s: float = 0.01) -> Measurement:  # fmt: skip
    """One tiny-workload measurement of 100 batches in ``seconds``."""
    return Measurement("tiny", 2, loader, 64, 4608, 100, seconds, first_s, 0, error, cpu_s, round_index)


def rounds(loader: str, seconds: list[float], first_s: float = 0.1) -> list[Measurement]:
    """One measurement per round, round ``r`` taking ``seconds[r]``."""
    return [measurement(loader, t, first_s, round_index=r) for r, t in enumerate(seconds)]
