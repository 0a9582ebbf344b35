"""The benchmark's progress indicator on stderr: tqdm when installed, else one line per step.

Owns nothing but the indicator. Runs in the benchmark's main process. Promises: it advances only
between measurements, so it costs nothing inside a timed loop, and it never writes to stdout (where
``--json`` puts its document).
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """A progress indicator on stderr, one step per measurement: tqdm if installed, else a line."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self._total = total
        self._done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, file=self._stream, unit="case", leave=False)

    def step(self, description: str) -> None:
        """Mark the previous step done and announce the next one."""
        self._show(description, f"[{self._done + 1}/{self._total}] {description}")
        self._done += 1

    def note(self, description: str) -> None:
        """Announce extra work that is not one of the counted steps."""
        self._show(description, description)

    def _show(self, description: str, line: str) -> None:
        """``description`` on the bar, brought up to the steps done; without tqdm, ``line`` alone."""
        if self._bar is not None:
            self._bar.update(self._done - self._bar.n)
            self._bar.set_description_str(description)
        else:
            self._stream.write(f"{line}\n")
            self._stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        if self._bar is not None:
            self._bar.update(self._done - self._bar.n)
            self._bar.close()
