"""A forked worker never collects, and so never finalizes, the garbage it inherited from the parent.

Issue 13's first defect: a worker's collector ran the parent's finalizers (a CUDA fence recorded
in a process where CUDA was never initialised: SIGABRT). Two guards answer it (docs/design/
ownership.md): our finalizers are inert outside their process, and a worker starts with every
inherited object frozen, so its collector never visits them. The second guard used to be a
``gc.freeze()``/``gc.unfreeze()`` pair around ``Process.start()`` in the parent, skipped whenever
the parent already held frozen objects (to leave an application's own frozen objects frozen). On
Python 3.12 the interpreter itself starts with objects in the permanent generation
(``gc.get_freeze_count()`` is 375 at start-up on 3.12.1), so the guard was never applied there, and
an application that froze objects lost it everywhere. Now the child freezes what it inherited, at
the fork itself (``os.register_at_fork``), before any of its Python code runs; the parent's
permanent generation is never touched.

Each case runs in a fresh interpreter: it freezes and disables the collector, which must not leak
into the test session.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import gc, json, os, sys
    import numpy as np
    import shmloader

    APP_FROZE = sys.argv[1] == "app-froze"
    read_end, write_end = os.pipe()


    class Witness:
        \"\"\"Cyclic garbage whose finalizer says which process ran it.\"\"\"

        def __init__(self):
            self.me = self

        def __del__(self):
            os.write(write_end, b"%d\\n" % os.getpid())


    def collect(_worker_id):
        gc.collect()  # what an ordinary worker's first collection would do, made certain


    def frozen(obj):
        return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())  # not in generations 0-2


    gc.disable()  # the garbage below stays uncollected in the parent until the end
    marker = [object()]  # one of the application's objects
    if APP_FROZE:
        gc.freeze()  # an application (a fork server, say) froze its start-up objects itself
    frozen_before = gc.get_freeze_count(), frozen(marker)
    Witness()  # garbage now: only a cycle keeps it
    loader = shmloader.DataLoader(np.arange(8), batch_size=2, num_workers=2, worker_init_fn=collect,
                                  multiprocessing_context="fork")
    batches = len(list(loader))  # both workers ran worker_init_fn before their first batch
    loader.close()
    frozen_after = gc.get_freeze_count(), frozen(marker)
    gc.enable()
    gc.collect()  # the parent collects its own garbage: the finalizer runs here, once
    os.close(write_end)
    finalized_in = [int(pid) for pid in os.read(read_end, 1 << 16).split()]
    print(json.dumps({"parent": os.getpid(), "finalized_in": finalized_in, "batches": batches,
                      "frozen_before": frozen_before, "frozen_after": frozen_after}))
""")


def _run(case: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["plain", "app-froze"])
def test_a_worker_never_finalizes_the_parents_garbage(case: str) -> None:
    result = _run(case)
    assert result["batches"] == 4
    assert result["finalized_in"] == [result["parent"]], (
        f"the parent's garbage was finalized in {result['finalized_in']} (parent {result['parent']})")


@pytest.mark.timeout(120)
def test_starting_workers_leaves_the_applications_frozen_objects_frozen() -> None:
    result = _run("app-froze")
    (count_before, marker_before), (count_after, marker_after) = result["frozen_before"], result["frozen_after"]
    assert marker_before and marker_after  # not thawed by a worker's start
    assert count_after > count_before / 2  # (frozen objects may still die by reference counting)


@pytest.mark.timeout(120)
def test_starting_workers_leaves_the_interpreters_frozen_objects_frozen() -> None:
    # Python 3.12 starts with objects of its own in the permanent generation; others with none
    result = _run("plain")
    (count_before, marker_before), (count_after, marker_after) = result["frozen_before"], result["frozen_after"]
    assert count_after == count_before and not marker_before and not marker_after


THREADS_SCRIPT = textwrap.dedent("""
    import gc, json, os, threading
    from multiprocessing.context import ForkProcess
    import numpy as np
    import shmloader

    read_end, write_end = os.pipe()
    report_r, report_w = os.pipe()


    class Witness:
        def __init__(self):
            self.me = self

        def __del__(self):
            os.write(write_end, b"%d\\n" % os.getpid())


    def collect(_worker_id):
        gc.collect()


    gc.disable()
    marker = [object()]
    Witness()  # the parent's cyclic garbage

    # Thread A is held inside its worker's start (after the loader decided to fork it, before the
    # fork) while thread B starts and uses a loader of its own, and thread C forks a plain child.
    a_in_start, others_done = threading.Event(), threading.Event()
    real_start = ForkProcess.start


    def held_start(self):
        if threading.current_thread().name == "A" and not a_in_start.is_set():
            a_in_start.set()
            others_done.wait(60)
        real_start(self)


    ForkProcess.start = held_start


    def run_a():
        with shmloader.DataLoader(np.arange(8), batch_size=2, num_workers=1, worker_init_fn=collect,
                                  multiprocessing_context="fork") as loader:
            results["a"] = len(list(loader))


    def run_b():
        a_in_start.wait(60)
        with shmloader.DataLoader(np.arange(8), batch_size=2, num_workers=1,
                                  multiprocessing_context="fork") as loader:
            results["b"] = len(list(loader))
        frozen_here = gc.get_freeze_count()  # 0, or the interpreter's own (3.12)
        pid = os.fork()  # not one of ours: must not freeze what it inherited
        if pid == 0:
            os.write(report_w, b"1" if gc.get_freeze_count() != frozen_here else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        others_done.set()


    results = {}
    threads = [threading.Thread(target=run_a, name="A"), threading.Thread(target=run_b, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    gc.enable()
    gc.collect()
    os.close(write_end)
    finalized_in = [int(pid) for pid in os.read(read_end, 1 << 16).split()]
    print(json.dumps({"parent": os.getpid(), "finalized_in": finalized_in, "results": results,
                      "plain_child_froze": os.read(report_r, 1) == b"1"}))
""")


@pytest.mark.timeout(120)
def test_the_freeze_belongs_to_the_thread_that_starts_the_worker() -> None:
    """Two threads starting workers at once, and a third fork of someone else's: only our workers
    freeze, each whatever the other threads did meanwhile (a process-wide flag was cleared by the
    first start to finish, so a worker forked after it kept the parent's garbage collectable)."""
    out = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["results"] == {"a": 4, "b": 4}
    assert result["finalized_in"] == [result["parent"]], (
        f"the parent's garbage was finalized in {result['finalized_in']} (parent {result['parent']})")
    assert not result["plain_child_froze"]


COLLECT_FIRST = textwrap.dedent("""
    import gc, glob, os


    def allocate_in_child():  # as threading's own at-fork hook, registered before ours, does
        gc.set_threshold(1, 1, 1)  # every allocation now starts a full collection, if one may run
        return [[] for _ in range(100)]


    os.register_at_fork(after_in_child=allocate_in_child)
    import numpy as np
    import shmloader


    def make_garbage():
        loader = shmloader.DataLoader([np.full(2, i) for i in range(8)], batch_size=2, num_workers=1)
        it = iter(loader)
        next(it)
        cycle = [loader, it]
        cycle.append(cycle)  # unreachable after return: only the cyclic collector frees it


    gc.set_threshold(10**6, 10**6, 10**6)  # the parent keeps its garbage until it collects it itself
    make_garbage()
    mine = lambda: set(glob.glob(f"/dev/shm/shml_{os.getpid()}_*"))
    before = mine()
    loader = shmloader.DataLoader([np.full(2, i) for i in range(8)], batch_size=2, num_workers=1)
    batches = [int(b[0, 0]) for b in loader]  # forks a worker, which collects before our hooks run
    print(json.dumps({"unlinked": len(before - mine()), "before": len(before), "batches": batches}))
    loader.close()
    gc.collect()
""").replace("import gc, glob, os", "import gc, glob, json, os")


@pytest.mark.timeout(120)
def test_a_collection_at_the_fork_before_our_hooks_finalizes_nothing_of_the_parent() -> None:
    """threading registers its at-fork hook before any of ours, and an allocation there (or in any
    hook registered before ours) may run the collector in the child while the cached pid is still
    the parent's and nothing is frozen yet: the parent's garbage iterator was closed in the worker,
    unlinking the parent's live segments. The collector is held from before the fork until our
    hooks have run."""
    out = subprocess.run([sys.executable, "-c", COLLECT_FIRST], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] > 0 and got["batches"] == [0, 2, 4, 6]
    assert got["unlinked"] == 0, got
    assert "KeyError" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


INTERRUPTED_HOOK = textwrap.dedent("""
    import ctypes, functools, gc, json, logging, os, signal, sys  # logging's at-fork hooks before ours
    from multiprocessing import util  # (and multiprocessing's)

    hook = sys.argv[1]
    report_r, report_w = os.pipe()


    def report_in_child():  # registered before shmloader's child hook: runs before it
        os.write(report_w, b"held" if not gc.isenabled() else b"free")


    os.register_at_fork(after_in_child=report_in_child)
    # A Ctrl-C that arrives during the fork: a hook with no Python frame (so no signal check of its
    # own) sends SIGINT; Python raises it as the next Python hook starts. The signal is a ctypes
    # int, read at each call: 0 (none) once the first fork is done.
    sig = ctypes.c_int(signal.SIGINT)
    ctrl_c = functools.partial(ctypes.CDLL(None).kill, os.getpid(), sig)
    if hook == "after":  # after-in-parent hooks run in the order registered: this one just before ours
        os.register_at_fork(after_in_parent=ctrl_c)
    from shmloader import owner
    if hook == "before":  # before hooks run in reverse order: this one just before ours
        os.register_at_fork(before=ctrl_c)


    def fork():
        \"\"\"Fork a child that exits at once: what it saw, and what the parent has after.\"\"\"
        mark = owner.fork_mark()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        sig.value = 0
        return {"child": os.read(report_r, 4).decode(), "enabled_after": gc.isenabled(),
                "counted": owner.fork_mark() == mark + 1}


    if hook == "skipped-after":  # both after-hook registrations cut short (two Ctrl-Cs): direct calls
        with owner.our_fork():
            owner._before_fork()
        forks = [{"enabled_after": gc.isenabled()}]
    else:
        forks = [fork(), fork()]  # the interrupted fork, and the next one
    print(json.dumps(forks))
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hook", ["before", "after"])
def test_a_ctrl_c_inside_a_fork_hook_leaves_the_collector_held_around_every_fork(hook: str) -> None:
    """A Ctrl-C at a fork is raised as our next fork hook starts, and os.fork only prints it. It
    used to skip the before-hook's count (the count went negative: the collector was never held
    around a fork again, and every fork looked under way) or the after-hook's (the collector was
    never enabled again in the parent)."""
    out = subprocess.run([sys.executable, "-c", INTERRUPTED_HOOK, hook], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "KeyboardInterrupt" in out.stderr and "owner.py" in out.stderr, out.stderr[-3000:]  # it hit our hook
    forks = json.loads(out.stdout.strip().splitlines()[-1])
    assert forks == [{"child": "held", "enabled_after": True, "counted": True}] * 2


@pytest.mark.timeout(120)
def test_a_hold_whose_after_hooks_were_both_cut_short_ends_with_our_fork() -> None:
    out = subprocess.run([sys.executable, "-c", INTERRUPTED_HOOK, "skipped-after"], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [{"enabled_after": True}]
