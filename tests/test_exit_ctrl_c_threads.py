"""A Ctrl-C while the interpreter waits, at exit, for a non-daemon thread that is inside ``next()``.

Python's exit first joins the non-daemon threads (``threading._shutdown``); a Ctrl-C there is
printed ("Exception ignored in: <module 'threading'>") and the exit goes on to the exit hooks with
the thread still running. shmloader's hook (engine/live.py) stops every live iterator: the
thread's ``next()`` raised ``LoaderClosed``, and threading printed "Exception in thread ..." (often
cut off half-way as the interpreter went down). torch 2.13's thread stays inside its ``next()``
until the interpreter ends it, silently. The script must end within a bound, print no traceback
of the thread, and leave no child and no segment.
"""

from __future__ import annotations

import pathlib

import pytest
from adv3_exit_helpers import run_script

CTRL_C_IN_SHUTDOWN = """
    import signal

    if __name__ == "__main__":
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the suite runs with it ignored
        loader = shmloader.DataLoader(Slow(), batch_size=4, num_workers=2, multiprocessing_context=sys.argv[1])
        started = threading.Event()

        def run():
            for batch in loader:  # its workers block in sample 16: next() waits when the script ends
                started.set()

        threading.Thread(target=run).start()  # not a daemon: the exit waits for it
        assert started.wait(30)
        main = threading.main_thread()

        def ctrl_c_once_the_exit_waits():
            while sys._current_frames()[main.ident].f_code.co_name != "_shutdown":
                time.sleep(0.01)  # polls the main thread's state, bounded by the test's timeout
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=ctrl_c_once_the_exit_waits, daemon=True).start()
        print_children()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_ctrl_c_at_exit_leaves_a_non_daemon_thread_inside_next_silent(method: str, tmp_path: pathlib.Path) -> None:
    end = run_script(CTRL_C_IN_SHUTDOWN, tmp_path, args=(method,))
    assert end.returncode == 0, end.report()  # the Ctrl-C in threading's join is Python's to print and ignore
    assert "KeyboardInterrupt" in end.stderr, end.report()  # it did land in the join
    assert end.seconds < 30, end.report()  # busy workers: the join's bound, then SIGTERM
    assert "Exception in thread" not in end.stderr and "LoaderClosed" not in end.stderr, end.report()
    assert len(end.children) >= 2 and end.alive == [], end.report()
    assert end.segments == [], end.report()
