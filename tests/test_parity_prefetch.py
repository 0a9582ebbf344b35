"""torch parity of the pipeline's depth: with workers, ``iter(loader)`` sends ``prefetch_factor`` tasks
per worker at once, and each ``next()`` sends the next task before it returns its batch, so that
many are in flight while the caller works — the sampler is read exactly as far ahead as torch's
loader reads it, and a sampler that draws from torch's global RNG interleaves with the training
loop's own draws as it does under torch."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader.torch as st  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class CountingSampler:
    """``range(n)``, counting the indices read so far."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read = 0

    def __iter__(self) -> Any:
        for i in range(self.n):
            self.read += 1
            yield i

    def __len__(self) -> int:
        return self.n


class GlobalRngSampler:
    """Each index drawn from torch's global RNG as it is read (a custom sampler's common way)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        for _ in range(self.n):
            yield int(torch.randint(0, self.n, ()).item())

    def __len__(self) -> int:
        return self.n


def _reads(loader_cls: type, **kwargs: Any) -> list[int]:
    """The indices the sampler has given after ``iter()`` and after each of four ``next()``."""
    sampler = CountingSampler(40)
    loader = loader_cls(list(range(40)), sampler=sampler, **kwargs)
    try:
        it = iter(loader)
        reads = [sampler.read]
        for _ in range(4):
            next(it)
            reads.append(sampler.read)
        return reads
    finally:
        if hasattr(loader, "close"):
            loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_workers", "prefetch_factor", "batch_size"),
                         [(1, 2, 2), (2, 2, 2), (2, 1, None), (1, 1, 3)])
def test_the_sampler_is_read_as_far_ahead_as_torchs_loader_reads_it(num_workers: int, prefetch_factor: int,
                                                                    batch_size: int | None) -> None:
    kwargs = {"num_workers": num_workers, "prefetch_factor": prefetch_factor, "batch_size": batch_size}
    theirs = _reads(tdata.DataLoader, **kwargs)
    assert _reads(st.DataLoader, **kwargs) == theirs
    per_batch = batch_size or 1
    assert theirs[0] == num_workers * prefetch_factor * per_batch  # in flight while the caller works


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, False])
def test_a_sampler_drawing_from_the_global_rng_interleaves_with_the_loop_as_under_torch(in_order: bool) -> None:
    def run(loader_cls: type) -> list[Any]:
        torch.manual_seed(0)
        loader = loader_cls(list(range(16)), sampler=GlobalRngSampler(16), batch_size=2, num_workers=2,
                            in_order=in_order)
        batches, draws = [], []
        try:
            for batch in loader:  # the training step draws too (dropout, augmentation, ...)
                batches.append(batch.tolist())
                draws.append(torch.rand(()).item())
        finally:
            if hasattr(loader, "close"):
                loader.close()
        return [batches if in_order else sorted(batches), draws]  # unordered: arrival order is the workers'

    assert run(st.DataLoader) == run(tdata.DataLoader)


@pytest.mark.timeout(60)
def test_the_smallest_ring_still_loads_while_the_loop_holds_its_batch() -> None:
    """At ``max_slots`` (the pipeline plus the batch in use) the task sent before a batch is handed
    out waits for a slot to come free instead of raising RingExhausted."""
    loader = st.DataLoader(list(range(24)), batch_size=2, num_workers=2, prefetch_factor=2, max_slots=5)
    try:
        seen = [batch.tolist() for batch in loader]  # the loop variable holds each batch across next()
    finally:
        loader.close()
    assert seen == [[i, i + 1] for i in range(0, 24, 2)]


class FailsAt:
    """``range(n)``, raising ValueError when index ``at`` is read (a sampler's own bug)."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at = n, at

    def __iter__(self) -> Any:
        for i in range(self.n):
            if i == self.at:
                raise ValueError(f"sampler failed at index {i}")
            yield i

    def __len__(self) -> int:
        return self.n


@pytest.mark.timeout(60)
def test_a_sampler_error_while_the_next_task_is_sent_never_costs_the_batch_in_hand() -> None:
    """next() sends the next task after taking its batch out of the slot: the sampler's error then
    is raised at the next next(), the batch already made reaching the caller first (torch raises it
    in place of that batch, which is lost to the caller and counted delivered by a saved state)."""
    loader = st.DataLoader(list(range(16)), batch_size=2, sampler=FailsAt(16, 8), num_workers=2)
    it = iter(loader)  # tasks 0-3 (indices 0-7) sent; task 4 would read index 8
    try:
        got = [next(it).tolist()]
        with pytest.raises(ValueError, match="sampler failed at index 8"):
            got.append(next(it).tolist())
        assert got == [[0, 1]]
    finally:
        loader.close()


def _outcomes(loader: Any) -> list[Any]:
    """Each batch of an epoch, or the type of the error raised in its place, going on after errors
    (at most 20 outcomes: a loader that never ends fails the test, not hangs it)."""
    out: list[Any] = []
    it = iter(loader)
    try:
        while len(out) < 20:
            try:
                out.append(next(it).tolist())
            except StopIteration:
                return out
            except Exception as exc:
                out.append(type(exc).__name__)
        return out
    finally:
        if hasattr(loader, "close"):
            loader.close()
        elif hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, False])
def test_after_a_sampler_error_the_tasks_already_sent_are_still_delivered(in_order: bool) -> None:
    """torch raises the sampler's error in place of the batch in hand, then goes on with the tasks
    it had sent, and ends there (the sampler's generator has ended). Ours hands out the batch in
    hand first, then the error, then those same tasks: every batch the sampler gave. It used to stop
    at the error (LoaderError at the next next(): the three batches in flight were lost)."""
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "in_order": in_order}
    rows: Any = list(range(16))  # any __getitem__/__len__ does; torch's stubs ask for a Dataset
    theirs = _outcomes(tdata.DataLoader(rows, sampler=FailsAt(16, 8), **kwargs))
    ours = _outcomes(st.DataLoader(rows, sampler=FailsAt(16, 8), **kwargs))
    assert theirs[0] == "ValueError" and len(theirs) == 4, theirs  # a batch lost in the error's place
    assert ours[1] == "ValueError" and len(ours) == 5, ours
    batches = [ours[0], *ours[2:]]
    assert sorted(batches) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(batch in batches for batch in theirs[1:])
    if in_order:
        assert ours[2:] == theirs[1:]


class RaisesAlways:
    """A sampler whose iterator gives indices 0-7, then raises ``IndexError`` at each later read
    (an iterator, unlike a generator, may raise again when asked again)."""

    def __init__(self) -> None:
        self.read = 0

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> int:
        self.read += 1
        if self.read > 8:
            raise IndexError(f"read {self.read}")
        return self.read - 1

    def __len__(self) -> int:
        return 16


@pytest.mark.timeout(60)
def test_a_sampler_is_not_read_again_after_its_error() -> None:
    """The epoch ends with the tasks sent before the sampler's error: a sampler that raises at
    every read makes one error, not one per next() for ever, and no batch is lost."""
    loader = st.DataLoader(list(range(16)), batch_size=2, sampler=RaisesAlways(), num_workers=2)
    outcomes = _outcomes(loader)
    assert outcomes == [[0, 1], "IndexError", [2, 3], [4, 5], [6, 7]]
