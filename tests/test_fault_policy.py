"""The fault policy's decisions as pure functions (engine/faults.py): no processes.

The poison rule: a task is poison only when the workers running it died ``max_task_attempts`` times
in a row; a death while another task ran breaks the streak (deaths spread over tasks come from
outside: a stress script, an OOM killer, a scheduler) and only ``max_restarts`` bounds them.
"""

from __future__ import annotations

from shmloader import PoisonTask, RestartBudgetExceeded, WorkerDied
from shmloader.engine.faults import (
    FaultPolicy,
    Streak,
    after_death,
    count_start_failure,
    death_error,
)

RESTART = FaultPolicy("restart", max_restarts=100, max_task_attempts=3)


def decide(policy: FaultPolicy, streak: Streak, restarts: int = 1, *, starting: bool = False,
           iterable: bool = False) -> BaseException | None:
    return death_error(policy, streak, restarts=restarts, iterable=iterable, starting=starting, worker_id=1,
                       pid=1234, exitcode=-9, tasks={5: [10, 11]}, shm_dir="/nonexistent")


def test_three_deaths_in_a_row_of_one_task_make_it_poison() -> None:
    streak = Streak()
    for n in range(3):
        streak = after_death(streak, (0, 5), f"death {n}")
        verdict = decide(RESTART, streak, restarts=n + 1)
    assert isinstance(verdict, PoisonTask)
    assert (verdict.task, verdict.indices, verdict.attempts) == (5, [10, 11], 3)
    assert list(verdict.deaths) == ["death 0", "death 1", "death 2"]


def test_a_poison_task_of_many_attempts_names_a_few_deaths_and_keeps_them_all() -> None:
    policy = FaultPolicy("restart", max_restarts=10_000, max_task_attempts=1000)
    streak = Streak()
    for n in range(1000):
        streak = after_death(streak, (0, 5), f"worker 1 (pid {n}) died")
    verdict = decide(policy, streak, restarts=1000)
    assert isinstance(verdict, PoisonTask) and len(verdict.deaths) == 1000
    text = str(verdict)
    assert len(text) < 1000, len(text)
    assert "(pid 0)" in text and "(pid 999)" in text and "994 more" in text and "(pid 500)" not in text


def test_a_death_of_another_task_in_between_breaks_the_streak() -> None:
    streak = Streak()
    for head in [(0, 5), (0, 5), (0, 6), (0, 5), (0, 5)]:  # an outside killer picking workers at random
        streak = after_death(streak, head, "SIGKILL")
        assert decide(RESTART, streak) is None
    assert streak.key == (0, 5) and len(streak.deaths) == 2


def test_deaths_while_starting_or_idle_neither_count_nor_break_a_streak() -> None:
    streak = after_death(after_death(Streak(), (0, 5), "a"), (0, 5), "b")
    streak = after_death(streak, None, "idle")
    assert len(streak.deaths) == 2
    assert decide(RESTART, after_death(streak, (0, 5), "c"), starting=True) is None  # start-up: never poison
    assert isinstance(decide(RESTART, after_death(streak, (0, 5), "c")), PoisonTask)


def test_the_restart_budget_bounds_deaths_spread_over_tasks() -> None:
    policy = FaultPolicy("restart", max_restarts=4, max_task_attempts=3)
    assert decide(policy, after_death(Streak(), (0, 1), "x"), restarts=4) is None
    spent = decide(policy, after_death(Streak(), (0, 2), "x"), restarts=5)
    assert isinstance(spent, RestartBudgetExceeded) and "max_restarts=4" in str(spent)


def test_without_restart_or_for_an_iterable_dataset_a_death_is_an_error() -> None:
    streak = after_death(Streak(), (0, 5), "x")
    assert type(decide(FaultPolicy("raise"), streak)) is WorkerDied
    died = decide(RESTART, streak, iterable=True)
    assert type(died) is WorkerDied and "cannot be restarted" in str(died)


def test_only_self_inflicted_start_up_deaths_count_towards_giving_up() -> None:
    assert count_start_failure(0, starting=True, exitcode=1) == 1  # bootstrap error, import error
    assert count_start_failure(1, starting=True, exitcode=3) == 2  # os._exit in worker_init_fn
    assert count_start_failure(1, starting=True, exitcode=-9) == 1  # killed from outside: no evidence
    assert count_start_failure(1, starting=True, exitcode=-11) == 1
    assert count_start_failure(1, starting=False, exitcode=3) == 0  # it had started: the count restarts
    gave_up = death_error(RESTART, Streak(), restarts=2, iterable=False, starting=True, worker_id=0, pid=1,
                          exitcode=1, tasks={}, shm_dir="/nonexistent", start_failures=2, start_method="spawn")
    assert isinstance(gave_up, WorkerDied) and "__main__" in str(gave_up) and "restart" not in str(gave_up)
    assert death_error(RESTART, Streak(), restarts=2, iterable=False, starting=True, worker_id=0, pid=1,
                       exitcode=-9, tasks={}, shm_dir="/nonexistent", start_failures=1) is None
