"""Batches whose types the main script defines, under spawn and forkserver.

Under those start methods the worker spec is cloudpickled, so a class defined in the main script
(``__main__``) reaches the worker by value; the batch's pickle must still name it so that the
main process gets back its own class, as torch's loader does (the class pickled by reference to
``__main__``). Each case runs a real script (``sys.executable script.py``): only then is there a
``__main__`` module of the user's, re-imported by the workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])

SCRIPT = textwrap.dedent('''
    import collections, dataclasses, json, sys
    import numpy as np

    Pair = collections.namedtuple("Pair", "x y")
    SCALE = 1

    @dataclasses.dataclass
    class Batch:
        x: object
        n: int
        made = []  # the main process's class state: a batch must neither replace it nor the methods

        def scaled(self):
            return self.x * SCALE

    class Samples:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return Pair(np.float32(i), i)

    class BadSample(ValueError):  # raised in a worker: the caller's `except BadSample` must catch it
        pass

    class Flaky(Samples):
        def __getitem__(self, i):
            if i == 2:
                raise BadSample(f"sample {i} is bad")
            return super().__getitem__(i)

    def to_batch(samples):  # 1 MiB of heap memory, copied into the slot once a 4 KiB one was too small
        return Batch(np.repeat(np.array([s.x for s in samples], dtype=np.float64)[:, None], 65536, 1), len(samples))

    def to_local(samples):
        class Local:  # named by no module: neither the worker nor the main process can name it
            pass
        return [Local(), np.zeros(2)]

    if __name__ == "__main__":
        ctx, flavour, which = sys.argv[1:4]
        if flavour == "torch":
            from shmloader.torch import DataLoader
        else:
            from shmloader import DataLoader
        made, scaled = Batch.made, Batch.scaled
        SCALE = 10
        kw = dict(batch_size=2, num_workers=1, multiprocessing_context=ctx, timeout=60)
        out = {}
        if which == "error":
            try:
                list(DataLoader(Flaky(), **kw))
            except BadSample as exc:
                out["error"] = ["BadSample", str(exc).splitlines()[0]]
            except Exception as exc:
                out["error"] = [type(exc).__name__, str(exc).splitlines()[0]]
        elif which == "local":
            try:
                list(DataLoader(Samples(), collate_fn=to_local, **kw))
            except Exception as exc:
                out["error"] = [type(exc).__name__, str(exc)]
        else:
            out["default"] = [[isinstance(b, Pair), type(b) is Pair, [float(v) for v in b.x], [int(v) for v in b.y]]
                              for b in DataLoader(Samples(), **kw)]
            out["collate_fn"] = [[isinstance(b, Batch), type(b) is Batch, b.n, b.scaled()[:, -1].tolist()]
                                 for b in DataLoader(Samples(), collate_fn=to_batch, slot_bytes=4096, **kw)]
            out["class_untouched"] = Batch.made is made and Batch.scaled is scaled
        print("RESULT", json.dumps(out))
''')

CONTEXTS = ["spawn", "forkserver"]


def _flavour(name: str) -> str:
    if name == "torch":
        pytest.importorskip("torch")
    return name


def _run(tmp_path: Path, *args: str, as_file: bool = True) -> Any:
    """Run SCRIPT with ``args``: as a file (spawned workers re-import it), or with ``-c`` (no file to
    re-import, as from a notebook: a worker's ``__main__`` holds none of the script's classes)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
    source = [str(script)] if as_file else ["-c", SCRIPT]
    proc = subprocess.run([sys.executable, "-W", "ignore", *source, *args], capture_output=True, text=True,
                          timeout=100, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("flavour,as_file", [("numpy", True), ("torch", True), ("numpy", False)],
                         ids=["numpy", "torch", "numpy-no-file"])
@pytest.mark.parametrize("ctx", CONTEXTS)
def test_main_script_batch_types_come_back_as_the_main_process_classes(tmp_path: Path, ctx: str, flavour: str,
                                                                       as_file: bool) -> None:
    """A namedtuple sample (default collate) and a dataclass a collate_fn returns: every batch is
    an instance of the main script's own class, with its values; that class is left as it was
    (its class state and methods are the main process's, not copies sent back by a worker)."""
    out = _run(tmp_path, ctx, _flavour(flavour), "batches", as_file=as_file)
    assert out["default"] == [[True, True, [0.0, 1.0], [0, 1]], [True, True, [2.0, 3.0], [2, 3]],
                              [True, True, [4.0, 5.0], [4, 5]]]
    assert out["collate_fn"] == [[True, True, 2, [0.0, 10.0]], [True, True, 2, [20.0, 30.0]],
                                 [True, True, 2, [40.0, 50.0]]]
    assert out["class_untouched"] is True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ctx", CONTEXTS)
def test_a_batch_class_no_process_can_name_still_fails_per_task(tmp_path: Path, ctx: str) -> None:
    """A class local to a function pickles under no start method: the worker's error, as before,
    names the worker, its pid, the task and the sample indices."""
    name, text = _run(tmp_path, ctx, "numpy", "local")["error"]
    assert name in ("AttributeError", "PicklingError")  # "Can't pickle local object" (3.14: PicklingError)
    assert text.startswith(f"Caught {name} in DataLoader worker process 0 (pid ")
    assert "task 0, sample indices [0..1]" in text and "to_local.<locals>.Local" in text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("as_file", [True, False], ids=["file", "no-file"])
@pytest.mark.parametrize("ctx", CONTEXTS)
def test_an_exception_class_of_the_main_script_comes_back_as_itself(tmp_path: Path, ctx: str, as_file: bool) -> None:
    """A worker raised the main script's own exception class, which reached it by value: pickle
    refused to name it ("not the same object as __main__.BadSample"), and the caller got a
    RuntimeError that its ``except BadSample`` (or ``except ValueError``) did not catch."""
    name, first = _run(tmp_path, ctx, "numpy", "error", as_file=as_file)["error"]
    assert name == "BadSample"
    assert first.startswith("Caught BadSample in DataLoader worker process 0 (pid ")
    assert first.endswith(", task 1, sample indices [2..3]).")
