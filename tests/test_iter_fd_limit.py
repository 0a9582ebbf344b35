"""``iter(loader)`` at the open-file limit: whichever descriptor is refused, the error names the
limit and ``num_workers``, and nothing is left behind.

The iterator needs descriptors before its workers start (its step guard's pipe, the listing of the
shared-memory directory that sweeps dead segments, the pool's pipe; and, the first time, the file
of its own module). Those were refused with a bare ``OSError: [Errno 24] Too many open files``,
where a worker's pipes or a slot's segment refused later named RLIMIT_NOFILE and what to do.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]


def probe(method: str, most: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(HERE / "fd_limit_probe.py"), method, str(most)],
                          capture_output=True, text=True, timeout=150, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_every_refused_descriptor_names_the_limit(method: str) -> None:
    found = probe(method, 40)
    outcomes = dict((free, tuple(o)) for free, o in found["outcomes"])
    refused = {free: o for free, o in outcomes.items() if o[0] != "ok"}
    assert refused and 0 in refused, outcomes  # with no descriptor free, iter() cannot start
    assert outcomes[40] == ("ok", True), outcomes  # with enough, the epoch is whole
    for free, (name, errno_, message) in refused.items():
        assert errno_ == 24 and "RLIMIT_NOFILE" in message, (free, name, message)
        assert "num_workers=2" in message or name == "TooManyOpenFiles", (free, name, message)
    assert all(o == ("ok", True) for o in outcomes.values() if o[0] == "ok"), outcomes
    assert found["left"] == {"children": 0, "segments": [], "semaphores": []}
