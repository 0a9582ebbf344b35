"""Two errors that said less than the loader's others: a sample dict missing a key, and a failed
pin copy without workers.

A sample dict that lacks a key the batch's first sample has: torch raises a bare ``KeyError('b')``,
so did we, naming neither the field nor the entry. The error keeps its class and torch's args (an
``except KeyError`` and ``e.args`` see what torch's give) and carries a note naming the field and
the entry that lacks the key, as the other collate errors name them; its sample indices are named
as every batch error names them (a note without workers, the message with them).

With ``num_workers=0`` a batch's own error carries a note naming the batch and its sample indices;
an error of the pin copy there carried none.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

import shmloader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class MissingKey:
    """Samples ``{'a': i, 'b': {'c': i, 'd': i}}``; sample 4 lacks 'd' inside 'b' and sample 5 lacks 'b'."""

    def __init__(self, nested: bool) -> None:
        self.nested = nested

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, Any]:
        inner = {"c": i} if (i == 4 and self.nested) else {"c": i, "d": i}
        return {"a": i} if (i == 5 and not self.nested) else {"a": i, "b": inner}


def _loader(flavour: str, dataset: Any, workers: int) -> shmloader.DataLoader[Any]:
    cls = shmloader.DataLoader if flavour == "numpy" else pytest.importorskip("shmloader.torch").DataLoader
    return cls(dataset, batch_size=3, num_workers=workers)  # type: ignore[no-any-return]


def _text(error: BaseException) -> str:
    """``error``'s message and its notes (a worker's error quotes the worker's traceback, notes included)."""
    return "\n".join([str(error), *getattr(error, "__notes__", [])])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("flavour", ["numpy", "torch"])
@pytest.mark.parametrize("nested", [False, True], ids=["top", "nested"])
def test_a_missing_key_names_the_field_and_the_entry(flavour: str, workers: int, nested: bool) -> None:
    with pytest.raises(KeyError) as info:
        list(_loader(flavour, MissingKey(nested), workers))
    error = info.value
    field, entry = ("batch['b']['d']", 1) if nested else ("batch['b']", 2)
    key = "'d'" if nested else "'b'"
    if workers == 0:
        assert error.args == (key.strip("'"),)  # torch's args, unchanged
    text = _text(error) if workers == 0 or sys.version_info >= (3, 11) else ""
    if text:
        assert f"at {field}: entry {entry} has no key {key}, which entry 0 has" in text
        assert "sample indices [3..5]" in text


def test_the_missing_key_matches_torchs_error() -> None:
    torch = pytest.importorskip("torch")
    ours = theirs = None
    try:
        list(torch.utils.data.DataLoader(MissingKey(False), batch_size=3))
    except KeyError as exc:
        theirs = exc
    try:
        list(_loader("torch", MissingKey(False), 0))
    except KeyError as exc:
        ours = exc
    assert type(ours) is type(theirs) and ours is not None and theirs is not None
    assert ours.args == theirs.args and str(ours) == str(theirs)


def test_a_key_error_of_a_mapping_that_has_the_key_is_left_as_it_is() -> None:
    """A mapping whose ``__getitem__`` raises KeyError for a key it lists is the dataset's error,
    not a missing key: no note claims an entry lacks it."""

    class Lying(dict):  # type: ignore[type-arg]
        def __getitem__(self, key: Any) -> Any:
            raise KeyError("inner")

    batch = [{"x": 1}, Lying(x=2)]
    with pytest.raises(KeyError) as info:
        shmloader.collate.collate(batch)
    assert not any("has no key" in n for n in getattr(info.value, "__notes__", []))


@pytest.mark.timeout(60)
def test_a_failed_pin_copy_names_the_batch_and_its_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    from shmloader.gpu import pinning

    calls = []

    def pin(batch: Any) -> Any:
        calls.append(batch)
        if len(calls) == 2:
            raise RuntimeError("pinning failed")
        return batch

    monkeypatch.setattr(pinning, "accelerator_available", lambda: True)
    monkeypatch.setattr(pinning, "warn_if_unpinned", lambda loader: None)
    monkeypatch.setattr(pinning, "pin_copy", pin)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(list(range(8)), batch_size=2, pin_memory=True)
    with pytest.raises(RuntimeError, match="pinning failed") as info:
        list(loader)
    assert getattr(info.value, "__notes__", None) == [
        "while loading batch 1 (sample indices [2..3]) in the main process (num_workers=0)"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1])
def test_an_empty_batch_says_it_is_empty(workers: int) -> None:
    """A batch sampler that yields an empty list: torch's bare IndexError('list index out of
    range'), kept (class and args), with a note saying the batch had no sample."""
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(list(range(4)), batch_sampler=[[0, 1], []],
                                                             num_workers=workers)
    with pytest.raises(IndexError) as info:
        list(loader)
    if workers == 0:
        assert info.value.args == ("list index out of range",)
    if workers == 0 or sys.version_info >= (3, 11):
        assert "the batch is empty" in _text(info.value)
