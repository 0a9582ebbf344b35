"""torch's warnings from ``shmloader.torch.DataLoader``, as a user who filters warnings meets them,
side by side with torch 2.13's ``DataLoader``.

torch emits most of its loader's warnings from its own module ``torch.utils.data.dataloader``
(stacklevel 2 names a frame of that file): "This DataLoader will create N worker processes in
total" (at construction and at each ``iter()`` that starts workers), "pin_memory_device is
deprecated", "'pin_memory' argument is set as true but no accelerator is found" (both at
``iter()``), and, for an ``IterDataPipe`` with ``shuffle=True`` and no ``Shuffler``, "`shuffle=True`
was set, but the datapipe does not contain a `Shuffler`" (at construction), and "Got pickle error when
attempting to start a worker Process" (at an ``iter()`` whose worker cannot receive its arguments). So
``warnings.filterwarnings("ignore", module="torch.utils.data.dataloader")`` (or pytest's
``-W ignore::UserWarning:torch.utils.data.dataloader``) silences them, and ``"error"`` raises them
at that call. The same filter does the same to the torch flavour's (docs/frameworks.md), and
Python's default filter still shows each once per code location. The IterableDataset length
warning and ``random_split``'s "Length of split" name the caller's frame in both. The numpy
flavour names its own module, ``shmloader.loader``, for all of its loader's warnings.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402
from torch.utils.data.datapipes.iter import IterableWrapper  # noqa: E402

import shmloader  # noqa: E402
import shmloader.datasets  # noqa: E402
import shmloader.torch as st  # noqa: E402

TORCH_MODULE = r"torch\.utils\.data\.dataloader"
Action = Literal["always", "error", "ignore"]
NO_ACCELERATOR = not torch.accelerator.is_available()


class Rows(tdata.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return np.float32(i)


class Reported(tdata.IterableDataset):  # type: ignore[misc]
    """Three samples that say they are two: the length warning at the third ``next()``."""

    def __len__(self) -> int:
        return 2

    def __iter__(self) -> Any:
        return iter([np.int64(i) for i in range(3)])

    def __repr__(self) -> str:  # the warning names the dataset: the same words for both loaders
        return "Reported()"


# name -> (how to make the loader, whether the machine must seem to have one CPU); the first two
# warn only where torch sees no accelerator
CASES: dict[str, tuple[Callable[[type], Any], bool]] = {
    "no accelerator": (lambda cls: cls(Rows(), batch_size=2, pin_memory=True), False),
    "no accelerator, workers": (lambda cls: cls(Rows(), batch_size=2, pin_memory=True, num_workers=1), False),
    "pin_memory_device": (lambda cls: cls(Rows(), batch_size=2, pin_memory=True, pin_memory_device="cpu"), False),
    "too many workers": (lambda cls: cls(Rows(), batch_size=2, num_workers=2), True),
    "too many persistent workers": (lambda cls: cls(Rows(), batch_size=2, num_workers=2,
                                                    persistent_workers=True), True),
    "datapipe without a Shuffler": (lambda cls: cls(IterableWrapper(range(4)), batch_size=2, shuffle=True), False),
}


def _warns_here(case: str) -> bool:
    return NO_ACCELERATOR or not case.startswith("no accelerator")


def _one_cpu(monkeypatch: pytest.MonkeyPatch, one_cpu: bool) -> None:
    if one_cpu:  # torch asks through torch._utils.cpu_count(), shmloader through os.sched_getaffinity
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0}, raising=False)


def _epochs(make: Callable[[], Any], epochs: int = 2) -> list[str]:
    """Each step's name, or the step and the words of the warning it raised as an error."""
    steps: list[str] = []
    try:
        loader = make()
    except UserWarning as w:
        return [f"construction: {w}"]
    try:
        for epoch in range(epochs):
            try:
                it = iter(loader)
            except UserWarning as w:
                steps.append(f"iter {epoch}: {w}")
                continue
            steps.append(f"epoch {epoch}: {sum(1 for _ in it)} batches")
            del it
    finally:
        if isinstance(loader, shmloader.DataLoader):
            loader.close()
        else:
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None:
                iterator._shutdown_workers()
    return steps


def _recorded(make: Callable[[], Any], *filters: tuple[Action, str]) -> list[str]:
    """The words of each warning two epochs give under ``always`` and then ``filters`` (action, module)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for action, module in filters:
            warnings.filterwarnings(action, module=module)
        _epochs(make)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_a_filter_on_torchs_module_silences_ours_as_it_silences_torchs(monkeypatch: pytest.MonkeyPatch,
                                                                       case: str) -> None:
    if not _warns_here(case):
        pytest.skip("torch sees an accelerator here")
    make, one_cpu = CASES[case]
    _one_cpu(monkeypatch, one_cpu)
    theirs = _recorded(lambda: make(tdata.DataLoader))
    ours = _recorded(lambda: make(st.DataLoader))
    assert theirs and set(ours) == set(theirs), (ours, theirs)  # the same words (counts: docs/gpu.md)
    assert _recorded(lambda: make(tdata.DataLoader), ("ignore", TORCH_MODULE)) == []
    assert _recorded(lambda: make(st.DataLoader), ("ignore", TORCH_MODULE)) == []


@pytest.mark.timeout(120)
# torch's iterator, its __init__ raising the warning, then fails in its __del__ (no _shutdown yet)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("case", list(CASES))
def test_an_error_filter_on_torchs_module_raises_at_the_same_call(monkeypatch: pytest.MonkeyPatch,
                                                                  case: str) -> None:
    """Two epochs: "no accelerator" and ``pin_memory_device`` are warned at each ``iter()`` by both,
    so under ``"error"`` both raise at each ``iter()`` (docs/gpu.md)."""
    if not _warns_here(case):
        pytest.skip("torch sees an accelerator here")
    make, one_cpu = CASES[case]
    _one_cpu(monkeypatch, one_cpu)
    outcomes = []
    for cls in (tdata.DataLoader, st.DataLoader):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.filterwarnings("error", module=TORCH_MODULE)
            outcomes.append(_epochs(lambda: make(cls)))  # noqa: B023  (called at once)
    theirs, ours = outcomes
    assert any(":" in step for step in theirs), theirs  # torch raised it somewhere
    assert ours == theirs


@pytest.mark.timeout(120)
def test_the_default_filter_shows_a_repeated_warning_once_as_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's default action shows a warning once per code location (the module's registry)."""
    _one_cpu(monkeypatch, True)
    counts = []
    for cls in (tdata.DataLoader, st.DataLoader):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for _ in range(3):
                cls(Rows(), batch_size=2, num_workers=2)  # warns at construction, from the same line
        counts.append(len(caught))
    assert counts == [1, 1]


@pytest.mark.timeout(120)
def test_the_numpy_flavour_names_its_own_module_for_each_loader_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its words are torch's, its module shmloader's: ``shmloader.loader``, at construction and at ``iter()``."""
    _one_cpu(monkeypatch, True)
    for case, (make, _) in CASES.items():
        if case == "datapipe without a Shuffler" or not _warns_here(case):
            continue  # DataPipes are the torch flavour's
        assert _recorded(lambda: make(shmloader.DataLoader), ("ignore", TORCH_MODULE))  # noqa: B023
        assert _recorded(lambda: make(shmloader.DataLoader), ("ignore", r"shmloader\.loader\Z")) == []  # noqa: B023


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_length_warning_names_the_callers_module_in_both(num_workers: int) -> None:
    here = re.escape(__name__) + r"\Z"  # torch: stacklevel=2 in its iterator's __next__, the caller's frame
    for cls in (tdata.DataLoader, st.DataLoader):
        def make() -> Any:
            loader = cls(Reported(), batch_size=None, num_workers=num_workers)  # noqa: B023
            len(loader)
            return loader

        assert any(w.startswith("Length of IterableDataset Reported()") for w in _recorded(make))
        assert _recorded(make, ("ignore", here)) == []


def test_random_split_names_the_callers_module_in_both() -> None:
    splits: tuple[Callable[..., Any], ...] = (tdata.random_split, shmloader.datasets.random_split)
    actions: tuple[Action, ...] = ("always", "ignore")
    for split in splits:
        for action in actions:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                warnings.filterwarnings(action, module=re.escape(__name__) + r"\Z")
                split(list(range(2)), [0.5, 0.5, 0.0])
            words = [str(w.message) for w in caught]
            assert words == ([] if action == "ignore" else
                             ["Length of split at index 2 is 0. This might result in an empty dataset."])


def test_a_direct_check_of_the_worker_number_names_the_callers_module_in_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's ``check_worker_number_rationality`` warns with stacklevel 2: a user's call names the user."""
    _one_cpu(monkeypatch, True)
    here = re.escape(__name__) + r"\Z"
    for cls in (tdata.DataLoader, st.DataLoader, shmloader.DataLoader):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader: Any = cls(Rows(), batch_size=2, num_workers=2)
        expectations: tuple[tuple[Action, int], ...] = (("ignore", 0), ("always", 1))
        for action, expected in expectations:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                warnings.filterwarnings(action, module=here)
                loader.check_worker_number_rationality()
            assert len(caught) == expected, (cls, action)


@pytest.mark.timeout(120)
def test_iter_warns_of_the_worker_number_before_pinning_as_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's ``_get_iterator`` checks the worker number, then makes the iterator, whose
    ``__init__`` gives the pin warnings: under ``always`` the words come in that order in both
    flavours, so an ``"error"`` filter on one of them finds the others given before it as torch's."""
    if not NO_ACCELERATOR:
        pytest.skip("torch sees an accelerator here")
    _one_cpu(monkeypatch, True)

    def make(cls: type) -> Any:
        return cls(Rows(), batch_size=2, num_workers=2, pin_memory=True, pin_memory_device="cpu")

    theirs = _recorded(lambda: make(tdata.DataLoader))
    each_iter = ["This", "pin_memory_device", "'pin_memory'"]  # what torch 2.13 gives, in its order
    assert [w.split(" ")[0] for w in theirs] == ["This"] + each_iter * 2, theirs  # construction, two iter()
    assert _recorded(lambda: make(st.DataLoader)) == theirs
    assert _recorded(lambda: make(shmloader.DataLoader)) == theirs


class Locked(tdata.Dataset):  # type: ignore[misc]
    """A dataset holding a lock: a spawned worker cannot receive it (its arguments do not pickle).
    With an event first, shmloader cannot pickle it ahead either: ``Process.start`` pickles it, and fails."""

    def __init__(self, event: bool) -> None:
        if event:  # pickles only while a process starts (multiprocessing's assert_spawning)
            self.event = multiprocessing.get_context("spawn").Event()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return np.float32(i)


PICKLE_WORDS = ("Got pickle error when attempting to start a worker Process. This might be because the worker "
                "Process arguments are not picklable. Python 3.14+ changed the multiprocessing start method in "
                "non-Mac POSIX platforms to 'forkserver', which requires the worker Process arguments to be "
                "picklable. You can also try multiprocessing.set_start_method('fork').")


def _refused_start(cls: type, event: bool, *filters: tuple[Action, str]) -> tuple[list[tuple[type, str]], type]:
    """(category, words) of each warning ``iter()`` gives under ``always`` then ``filters``, and the
    type of what it raises, for a spawn loader whose one worker cannot receive its dataset."""
    loader = cls(Locked(event), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for action, module in filters:
            warnings.filterwarnings(action, module=module)
        with pytest.raises(Exception) as info:
            iter(loader)
    if isinstance(loader, shmloader.DataLoader):
        loader.close()
    return [(w.category, str(w.message)) for w in caught], info.type


@pytest.mark.timeout(120)
# torch's iterator, its __init__ raising, then fails in its __del__ (no _shutdown yet)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("event", [False, True], ids=["a lock", "an event and a lock"])
def test_a_worker_that_cannot_receive_its_arguments_gives_torchs_pickle_warning_then_raises(event: bool) -> None:
    """torch 2.13 warns once ("Got pickle error ...", a UserWarning from ``torch.utils.data.dataloader``)
    when a worker's ``Process.start`` fails to pickle its arguments, then raises pickle's TypeError.
    The torch flavour does the same (its TypeError names the dataset); the numpy flavour raises the
    same TypeError without torch's warning."""
    theirs = _refused_start(tdata.DataLoader, event)
    assert theirs == ([(UserWarning, PICKLE_WORDS)], TypeError), theirs
    assert _refused_start(st.DataLoader, event) == theirs
    assert _refused_start(shmloader.DataLoader, event) == ([], TypeError)
    for cls in (tdata.DataLoader, st.DataLoader):  # named torch's module: its filters act on ours
        assert _refused_start(cls, event, ("ignore", TORCH_MODULE)) == ([], TypeError), cls
        assert _refused_start(cls, event, ("error", TORCH_MODULE)) == ([], UserWarning), cls
