"""A saved numpy generator state that numpy takes only by changing it is refused, whatever numpy.

numpy before 2.0 (the floor is 1.24) wraps an out-of-range integer in a bit generator's state
instead of raising: a PCG64 state of -1 was set as 2**128 - 1. The check that a state is one
numpy can set then passed, and a corrupt state loaded a stream the saving run never drew from.
Here ``PCG64`` is replaced by one whose setter wraps as that numpy does, so the current numpy of
the test venv shows the same behaviour.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import pytest

from shmloader.errors import StateError
from shmloader.state_fields import numpy_state

_PCG64 = np.random.PCG64


class WrappingPCG64(_PCG64):  # type: ignore[misc]
    """PCG64 whose state setter wraps its 128-bit words, as numpy 1.x's does."""

    @property  # type: ignore[override]
    def state(self) -> dict[str, Any]:
        return _PCG64.state.__get__(self)  # type: ignore[attr-defined,no-any-return]

    @state.setter
    def state(self, value: dict[str, Any]) -> None:
        value = copy.deepcopy(value)
        for key in ("state", "inc"):
            value["state"][key] %= 1 << 128
        _PCG64.state.__set__(self, value)  # type: ignore[attr-defined]


WrappingPCG64.__name__ = "PCG64"  # numpy's setter checks the state names its class


@pytest.fixture
def wrapping_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(np.random, "PCG64", WrappingPCG64)


def _saved(**changes: int) -> dict[str, Any]:
    state = dict(np.random.default_rng(7).bit_generator.state)
    state["state"].update(changes)
    return state


@pytest.mark.parametrize("changes", [{"state": -1}, {"inc": -3}, {"state": 1 << 128}])
def test_a_state_numpy_would_wrap_is_refused_by_name(wrapping_numpy: None, changes: dict[str, int]) -> None:
    with pytest.raises(StateError, match=r"the state's random.sources \(generator\) is not a numpy generator "
                                         r"state numpy can set .*numpy stores it changed"):
        numpy_state(_saved(**changes), "random.sources (generator)")


def test_a_good_state_is_taken_as_it_is(wrapping_numpy: None) -> None:
    state = _saved()
    assert numpy_state(copy.deepcopy(state), "random.sources (generator)") == state


@pytest.mark.parametrize("name", ["MT19937", "Philox", "SFC64", "PCG64DXSM"])
def test_every_bit_generator_s_own_state_reads_back_unchanged(name: str) -> None:
    """The round trip the check relies on: a state numpy gave is stored as it is."""
    state = getattr(np.random, name)(11).state
    assert numpy_state(state, "random.sources (generator)")["bit_generator"] == name


class WarningPCG64(WrappingPCG64):
    """As numpy 1.24 to 1.26: the out-of-range word is wrapped with a DeprecationWarning first."""

    @property  # type: ignore[override]
    def state(self) -> dict[str, Any]:
        return _PCG64.state.__get__(self)  # type: ignore[attr-defined,no-any-return]

    @state.setter
    def state(self, value: dict[str, Any]) -> None:
        if any(not 0 <= value["state"][key] < 1 << 128 for key in ("state", "inc")):
            warnings.warn("NumPy will stop allowing conversion of out-of-bound Python integers", DeprecationWarning,
                          stacklevel=2)
        WrappingPCG64.state.__set__(self, value)  # type: ignore[attr-defined]


WarningPCG64.__name__ = "PCG64"


def test_a_state_numpy_takes_with_a_deprecation_warning_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under warnings that ignore DeprecationWarning (a user's default) or make it an error (this
    suite's, for warnings met in shmloader), the same StateError, not the warning."""
    monkeypatch.setattr(np.random, "PCG64", WarningPCG64)
    for action in ("ignore", "error"):
        with warnings.catch_warnings():
            warnings.simplefilter(action, DeprecationWarning)
            with pytest.raises(StateError, match=r"is not a numpy generator state numpy can set"):
                numpy_state(_saved(state=-1), "random.sources (generator)")


def test_checking_a_state_leaves_the_process_s_warning_filters_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``warnings.catch_warnings`` swaps the process-wide filter list: another thread warning while
    a state is checked would see this check's filters (a DeprecationWarning of its own raised as an
    error) and lose the "shown once" registry. The check reads numpy's stored state back instead."""
    seen: list[Any] = []

    class Watching(WarningPCG64):
        def __init__(self, *args: Any) -> None:
            seen.append(list(warnings.filters))
            super().__init__(*args)

    Watching.__name__ = "PCG64"
    monkeypatch.setattr(np.random, "PCG64", Watching)
    before = list(warnings.filters)
    numpy_state(_saved(), "random.sources (generator)")
    assert seen == [before]
