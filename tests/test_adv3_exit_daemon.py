"""A script that ends while a daemon thread of its own is inside a loader's ``next()`` or ``iter()``.

The exit hook (engine/live.py) stops every live iterator; the ``next()`` it stops in a daemon
thread used to raise ``LoaderClosed`` there, and threading printed its traceback ("Exception in
thread …") on the way out, often cut off half-way by the interpreter's end. A daemon thread that
went on (a loop that makes a fresh loader) started workers and segments after the hook had run:
the resource tracker then warned of leaked shared_memory. torch's daemon thread stays inside its
``next()`` until the interpreter ends it, silently. Each script must exit with its own code within
a bound, print nothing, and leave no child and no segment.
"""

from __future__ import annotations

import pathlib

import pytest
from adv3_exit_helpers import run_script

IN_NEXT = """
    if __name__ == "__main__":
        dataset = Slow() if sys.argv[2] == "hung" else shmloader.ArrayDataset(DATA)
        loader = shmloader.DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context=sys.argv[1])
        iterate_in_a_daemon_thread(loader)  # it lists the children inside the first epoch
        sys.exit(3)
"""

NEW_LOADERS = """
    if __name__ == "__main__":
        started = threading.Event()

        def run():
            while True:  # a fresh loader each round; the error of a stopped one is shrugged off
                try:
                    for batch in shmloader.DataLoader(shmloader.ArrayDataset(DATA), batch_size=4, num_workers=2,
                                                      multiprocessing_context=sys.argv[1]):
                        started.set()
                except Exception:
                    pass

        threading.Thread(target=run, daemon=True).start()
        assert started.wait(30)
        print_children()
        sys.exit(3)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", ["hung", "busy"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_daemon_thread_inside_next_at_exit_prints_nothing(method: str, workers: str, tmp_path: pathlib.Path) -> None:
    end = run_script(IN_NEXT, tmp_path, args=(method, workers))
    assert end.returncode == 3, end.report()
    assert end.seconds < 30, end.report()  # hung workers: the join's 5 s, then SIGTERM
    assert end.noise() == [], end.report()
    assert len(end.children) >= 2 and end.alive == [], end.report()
    assert end.segments == [], end.report()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_daemon_thread_that_makes_new_loaders_starts_none_after_the_exit_hook(method: str,
                                                                               tmp_path: pathlib.Path) -> None:
    for _ in range(3):  # the hook lands at a different point of the thread's loop each time
        end = run_script(NEW_LOADERS, tmp_path, args=(method,))
        assert end.returncode == 3, end.report()
        assert end.noise() == [], end.report()
        assert end.alive == [] and end.segments == [], end.report()
