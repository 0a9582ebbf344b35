"""No noise: a process that uses loaders in every ordinary way writes no traceback to stderr.

Issue 13 (and the engine-ownership issue): a forked worker that collects garbage it inherited from
the parent ran the parent's finalizers, and the resource tracker printed ``KeyError: '/shml_…'``
tracebacks; a strict job (``-W error``) failed where numpy deprecates what a shmloader module does.
Each case here runs in a fresh interpreter through the public API only (``SHMLOADER_PIN_BACKEND=fake``
for pinning), over the matrix start method (fork, spawn) × pinned or not, and within each run:
persistent or not × how the loader ends — closed, dropped, left alive at interpreter exit, after a
worker died (``on_worker_death='restart'``), and one loader after another whose workers collect the
first one's garbage at start. Each must exit with 0 and leave stderr free of tracebacks, ``KeyError``
and ignored exceptions. One interpreter per (start method, pinning) keeps the whole file fast.

Also here: no shmloader module assigns an array's ``shape``/``strides``/``dtype`` (deprecated since
numpy 2.5, an error under ``-W error``), and the collate path that replaced it stays correct when
the output's axes cannot merge.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import shmloader
from shmloader.collate.rules import stack_into

NOISE = ("Traceback", "KeyError", "Exception ignored", "leaked shared_memory")

SCRIPT = textwrap.dedent("""
    import gc, os, sys
    import numpy as np
    import shmloader

    METHOD, PIN, MARKS = sys.argv[1], sys.argv[2] == "pin", sys.argv[3]
    DATA = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    KEEP = []  # loaders (and a batch) still alive at interpreter exit


    class DiesOnce(shmloader.Dataset):
        \"\"\"Sample 20 kills its worker (os._exit) the first time any process fetches it.\"\"\"

        def __len__(self):
            return 64

        def __getitem__(self, i):
            if i == 20:
                try:
                    os.close(os.open(os.path.join(MARKS, "died"), os.O_CREAT | os.O_EXCL))
                    os._exit(3)
                except FileExistsError:
                    pass
            return DATA[i]


    def collect(worker_id):
        gc.collect()


    def make(dataset=None, **kwargs):
        return shmloader.DataLoader(dataset if dataset is not None else shmloader.ArrayDataset(DATA),
                                    batch_size=8, num_workers=2, pin_memory=PIN,
                                    multiprocessing_context=METHOD, **kwargs)


    def closed(persistent):
        loader = make(persistent_workers=persistent)
        assert sum(len(x) for (x,) in loader) == 64
        loader.close()


    def dropped(persistent):
        loader = make(persistent_workers=persistent)
        it = iter(loader)
        first = next(it)
        next(it)
        del it, loader, first  # no close(): an abandoned epoch, then nothing refers to the loader
        gc.collect()


    def at_exit(persistent):
        loader = make(persistent_workers=persistent)
        it = iter(loader)
        KEEP.extend([loader, it, next(it)])  # all still alive when the interpreter exits


    def after_death(persistent):
        for name in os.listdir(MARKS):
            os.unlink(os.path.join(MARKS, name))
        loader = make(DiesOnce(), persistent_workers=persistent, on_worker_death="restart")
        assert sum(len(x) for x in loader) == 64
        loader.close()


    def one_after_another(persistent):
        first = make(persistent_workers=persistent)
        held = list(first)
        cycle = [held, first]
        cycle.append(cycle)  # the first loader and its batches are garbage in a reference cycle
        gc.disable()  # still uncollected when the second loader forks (or spawns) its workers
        del held, cycle, first
        second = make(persistent_workers=persistent, worker_init_fn=collect)
        assert sum(len(x) for (x,) in second) == 64
        second.close()
        gc.enable()
        gc.collect()


    for persistent in (False, True):
        for case in (closed, dropped, after_death, one_after_another, at_exit):
            case(persistent)
            print("ok", case.__name__, persistent, flush=True)
""")

CASES = [f"ok {case} {persistent}" for persistent in (False, True)
         for case in ("closed", "dropped", "after_death", "one_after_another", "at_exit")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pinned", ["pin", "nopin"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_loaders_used_every_way_leave_stderr_clean(method: str, pinned: str, tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "SHMLOADER_PIN_BACKEND": "fake" if pinned == "pin" else "none"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pathlib.Path(shmloader.__file__).parents[1]),
                                                      env.get("PYTHONPATH")]))
    marks = tmp_path / "marks"
    marks.mkdir()
    done = subprocess.run([sys.executable, "-c", SCRIPT, method, pinned, str(marks)], capture_output=True,
                          text=True, env=env, timeout=110, cwd=tmp_path)
    report = f"exit code {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, report
    assert done.stdout.splitlines() == CASES, report
    assert not [word for word in NOISE if word in done.stderr], report


def test_no_shmloader_module_assigns_an_array_attribute() -> None:
    """``x.shape = …`` (and ``strides``, ``dtype``) is deprecated by numpy 2.5: reshape or view."""
    package = pathlib.Path(shmloader.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            found += [f"{path.relative_to(package)}:{node.lineno}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr in ("shape", "strides", "dtype")
                      and not (isinstance(t.value, ast.Name) and t.value.id == "self")]
    assert found == []


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_stack_into_writes_the_output_whatever_its_layout(layout: str) -> None:
    samples = [np.full((3, 4), i, np.float32) for i in range(5)]
    out = np.empty((5, 3, 4), np.float32) if layout == "contiguous" else np.empty((3, 5, 4), np.float32).transpose(1, 0, 2)
    assert stack_into(samples, out) is out
    np.testing.assert_array_equal(out, np.stack(samples))
