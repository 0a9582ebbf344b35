"""A script ends every ordinary way while it holds loaders in every state; its end is its own.

tests/test_shutdown.py and tests/test_clean_stderr.py cover a script that falls off its end with a
live iterator. Here each script holds, at once: a live iterator mid-epoch, a persistent loader
between epochs, a batch (a module global) of a loader closed since, and a persistent loader whose
iterator and batch are reachable only through a reference cycle (collector off); and ends by
falling off its end, ``sys.exit(3)``, an uncaught exception or a ``KeyboardInterrupt`` at top level,
under fork and spawn. Also: a worker busy in a 30 s sample at exit (bounded by the join's 5 s),
``pin_memory=True`` (numpy and torch flavours, CPU build), and ``num_workers=0`` with a stack large
enough for the collate helper threads, in the main thread and in a daemon thread. Each: the exit
code is the script's, stderr carries only the script's own traceback (no "Exception ignored", no
frame of ours, no resource tracker warning), no child is left, no segment.
"""

from __future__ import annotations

import pathlib
import signal

import pytest
from adv3_exit_helpers import run_script

HOLD_ALL = """
    def hold_all(method):
        make = lambda **kw: shmloader.DataLoader(shmloader.ArrayDataset(DATA), batch_size=4, num_workers=2,
                                                multiprocessing_context=method, **kw)
        live = make()
        it = iter(live)
        persistent = make(persistent_workers=True)
        assert sum(len(x) for (x,) in persistent) == 64  # between epochs: workers idle
        closed = make()
        batch = next(iter(closed))
        closed.close()
        cyclic = make(persistent_workers=True)
        cit = iter(cyclic)
        cycle = [cyclic, cit, next(cit)]
        cycle.append(cycle)
        gc.disable()  # the cycle stays uncollected until the end
        return [live, it, next(it), persistent, batch]

    if __name__ == "__main__":
        KEEP = hold_all(sys.argv[1])
        HELD = KEEP[-1]
        print_children()
        how = sys.argv[2]
        if how == "exit3":
            sys.exit(3)
        if how == "raise":
            raise ValueError("the script's own error")
        if how == "interrupt":
            raise KeyboardInterrupt
"""

EXPECTED_CODE = {"fall": 0, "exit3": 3, "raise": 1, "interrupt": -signal.SIGINT}
OWN_ERROR = {"raise": "ValueError: the script's own error", "interrupt": "KeyboardInterrupt"}


def _assert_clean(end, code: int, own_error: str | None = None) -> None:  # type: ignore[no-untyped-def]
    assert end.returncode == code, end.report()
    assert "Exception ignored" not in end.stderr and "resource_tracker" not in end.stderr, end.report()
    assert not [line for line in end.stderr.splitlines()
                if line.lstrip().startswith("File ") and "/shmloader/" in line], end.report()  # no frame of ours
    assert end.stderr.count("Traceback") == (own_error is not None), end.report()
    if own_error is not None:
        assert own_error in end.stderr, end.report()
    assert end.alive == [] and end.segments == [], end.report()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", sorted(EXPECTED_CODE))
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_script_that_ends_holding_loaders_in_every_state(method: str, how: str, tmp_path: pathlib.Path) -> None:
    end = run_script(HOLD_ALL, tmp_path, args=(method, how))
    _assert_clean(end, EXPECTED_CODE[how], OWN_ERROR.get(how))
    assert len(end.children) >= 6, end.report()  # three loaders' workers alive as it ended
    assert end.seconds < 30, end.report()


BUSY_WORKER = """
    if __name__ == "__main__":
        loader = shmloader.DataLoader(Slow(), batch_size=4, num_workers=2, multiprocessing_context=sys.argv[1])
        it = iter(loader)
        batches = [next(it) for _ in range(4)]  # samples 0..15; the workers are inside sample 16 and on
        print_children()
        sys.exit(3)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_busy_in_a_long_sample_delays_exit_by_the_join_bound_only(method: str,
                                                                         tmp_path: pathlib.Path) -> None:
    end = run_script(BUSY_WORKER, tmp_path, args=(method,))
    _assert_clean(end, 3)
    assert end.seconds < 20, end.report()  # 5 s join, then SIGTERM; not the sample's 30 s


PINNED = """
    if __name__ == "__main__":
        if sys.argv[1] == "torch":
            import torch
            import shmloader.torch
            dataset = torch.utils.data.TensorDataset(torch.from_numpy(DATA))
            loader = shmloader.torch.DataLoader(dataset, batch_size=4, num_workers=2, pin_memory=True)
        else:
            loader = shmloader.DataLoader(shmloader.ArrayDataset(DATA), batch_size=4, num_workers=2,
                                          pin_memory=True)
        it = iter(loader)
        HELD = next(it)
        print_children()
        sys.exit(3)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("flavour", ["numpy", "torch"])
def test_pin_memory_on_a_cpu_build_at_exit(flavour: str, tmp_path: pathlib.Path) -> None:
    pytest.importorskip("torch")
    end = run_script(PINNED, tmp_path, args=(flavour,))
    _assert_clean(end, 3)
    assert len(end.children) >= 2, end.report()


BIG_STACK = """
    BIG = np.ones((8, 1024, 1024), np.float32)  # a batch of 8 is 32 MiB: split over helper threads

    class Big(shmloader.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return BIG[i % 8]

    if __name__ == "__main__":
        loader = shmloader.DataLoader(Big(), batch_size=8, num_workers=0, collate_threads=2)
        def helpers_are_running():
            assert any(t.name.startswith("shmloader-collate") for t in threading.enumerate())
            print_children()

        if sys.argv[1] == "daemon":
            iterate_in_a_daemon_thread(loader, while_open=helpers_are_running)
        else:
            it = iter(loader)
            HELD = next(it)
            helpers_are_running()
        sys.exit(3)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("where", ["main", "daemon"])
def test_collate_helper_threads_at_exit(where: str, tmp_path: pathlib.Path) -> None:
    end = run_script(BIG_STACK, tmp_path, args=(where,))
    _assert_clean(end, 3)
    assert end.seconds < 30, end.report()
