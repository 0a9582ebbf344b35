"""A file-size limit (``ulimit -f``, RLIMIT_FSIZE) smaller than a segment the ring must make.

Batch systems and hardened shells set it; the kernel then refuses to size a segment file past it
with EFBIG (and Python ignores the SIGXFSZ that comes with it). The defect: the loader passed the
bare ``OSError: [Errno 27] File too large`` on, naming neither the segment's size, nor the
directory, nor the limit. Each case runs in a child process, so the limit never reaches the test
process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
LIMIT = 1 << 20

SCRIPT = textwrap.dedent("""
    import os, resource, sys
    import adv3_ext_datasets as ds
    from shmloader import DataLoader
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
    kw = {{"shm_dir": sys.argv[1]}} if len(sys.argv) > 1 else {{}}
    got = 0
    try:
        # batches 0-4 small: the first that outgrows the ring (task 5) is sent only after batch 1
        # was handed out (2 workers x prefetch_factor 2 tasks in flight)
        for batch in DataLoader(ds.Growing(40, 40000, flat=4), batch_size=4, num_workers=2, **kw):
            got += 1
    except OSError as exc:
        print(got, type(exc).__name__, exc.errno, str(exc).replace(chr(10), " "))
    else:
        print(got, "no error")
""")


def _run(tmp_path: Path, *args: str) -> tuple[str, str]:
    script = tmp_path / "fsize.py"
    script.write_text(SCRIPT.format(limit=LIMIT))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS_DIR]))
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=90, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["default", "shm_dir"])
def test_a_segment_past_the_file_size_limit_names_the_limit_size_and_directory(tmp_path: Path, where: str) -> None:
    directory = tmp_path / "shm"
    directory.mkdir()
    out, err = _run(tmp_path, *([str(directory)] if where == "shm_dir" else []))
    got, name, code, message = out.split(" ", 3)
    assert int(got) >= 2  # the batches that fitted came first
    assert (name, int(code)) == ("OSError", 27), out
    shown = str(directory) if where == "shm_dir" else "/dev/shm"
    assert f"in {shown}" in message, message
    assert "RLIMIT_FSIZE" in message and f"= {LIMIT} bytes" in message and "ulimit -f" in message, message
    assert "bytes" in message.split("RLIMIT_FSIZE")[0], message  # the segment's size, before the limit
    assert "Traceback" not in err, err
    assert os.listdir(directory) == []
