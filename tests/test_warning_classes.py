"""Every warning shmloader gives in its own words is a ``shmloader.ShmloaderWarning`` (a
``UserWarning``), so ``warnings.filterwarnings("ignore" or "error", category=shmloader.ShmloaderWarning)``
acts on all of them; one that was a ``RuntimeWarning`` still is one, so filters on that category keep
working. The warnings given in torch's words keep torch's category and module (they are not
shmloader's: tests/test_torch_warning_filters.py).

The list of warnings is read from the source: every ``warnings.warn``/``warn_explicit`` call and
every call of ``shmloader.warning_origin.warn`` in the package is found and must be one of those
listed here, so a new warning has to be classified before the suite passes.
"""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest

import shmloader
from shmloader.config import ConfigWarning, resolve_config
from shmloader.gpu.mlock import MlockBackend

PACKAGE = Path(shmloader.__file__).resolve().parent

# (file under shmloader/, function that warns) -> the warning's category, as the call names it
OWN: dict[tuple[str, str], str] = {
    ("config.py", "_warn_unknown_variables"): "ConfigWarning",
    ("gpu/backends.py", "register_segment"): "PinWarning",
    ("torch/accelerate.py", "adopt"): "AccelerateWarning",
}
# torch's words, torch's category (UserWarning): not shmloader's own
TORCH_WORDS = {
    ("datasets.py", "_lengths_from_fractions"),  # random_split's "Length of split at index i is 0"
    ("engine/payload.py", "warn_if_unpicklable"),  # "Got pickle error when attempting to start a worker Process"
    ("engine/iterator.py", "__next__"),  # "Length of IterableDataset ... was reported to be"
    ("loader_checks.py", "warn_worker_number"),  # "This DataLoader will create N worker processes"
    ("loader.py", "_warn_pinning"),  # "pin_memory_device is deprecated"
    ("gpu/pinning.py", "warn_if_unpinned"),  # "no accelerator is found" / "not supported on MPS"
    ("torch/datapipes.py", "adopt"),  # "`shuffle=True` was set, but the datapipe does not contain"
}
# not a warning of its own: passes on a warning it was given
PASSED_ON = {
    ("warning_origin.py", "warn"),  # the helper behind the torch-words warnings
    ("cli/doctor_config.py", "_resolve_reporting"),  # re-issues what resolving the config warned but a ConfigWarning
}


def _is_warn_call(node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Attribute):
        return (isinstance(func.value, ast.Name) and func.value.id == "warnings"
                and func.attr in ("warn", "warn_explicit"))
    return isinstance(func, ast.Name) and func.id == "warn"


def _category(node: ast.Call) -> str | None:
    """The category the call names (its second argument or ``category=``), as source; None for the default."""
    for keyword in node.keywords:
        if keyword.arg == "category":
            return ast.unparse(keyword.value)
    if isinstance(node.func, ast.Attribute) and len(node.args) >= 2:
        return ast.unparse(node.args[1])
    return None


class _Sites(ast.NodeVisitor):
    """Each warning call of one file, by its innermost enclosing function."""

    def __init__(self, rel: str) -> None:
        self.rel, self.function = rel, "<module>"
        self.sites: dict[tuple[str, str], list[str | None]] = {}

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        if _is_warn_call(node):
            self.sites.setdefault((self.rel, self.function), []).append(_category(node))
        self.generic_visit(node)


def _warning_sites() -> dict[tuple[str, str], list[str | None]]:
    """(file, enclosing function) -> the category of each warning call there."""
    sites: dict[tuple[str, str], list[str | None]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        visitor = _Sites(path.relative_to(PACKAGE).as_posix())
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        sites.update(visitor.sites)
    return sites


def _module(rel: str) -> Any:
    name = "shmloader." + rel.removesuffix(".py").replace("/", ".")
    if name.startswith("shmloader.torch"):
        pytest.importorskip("torch")
        if name.endswith("accelerate"):
            pytest.importorskip("accelerate")
    return importlib.import_module(name)


def test_every_warning_call_in_the_package_is_classified() -> None:
    found = set(_warning_sites())
    known = set(OWN) | TORCH_WORDS | PASSED_ON
    assert found - known == set(), "a warning that is neither shmloader's own nor torch's words: classify it"
    assert known - found == set(), "listed here, but no longer warns there"


@pytest.mark.parametrize("site", sorted(OWN))
def test_each_of_shmloaders_own_warnings_is_a_shmloader_warning(site: tuple[str, str]) -> None:
    categories = _warning_sites()[site]
    assert categories == [OWN[site]], categories  # named in the call, not the default UserWarning
    category = getattr(_module(site[0]), OWN[site])  # the class that name means in that module
    assert isinstance(category, type) and issubclass(category, shmloader.ShmloaderWarning), category


def test_the_torch_words_warnings_keep_torchs_category() -> None:
    sites = _warning_sites()
    for site in TORCH_WORDS:
        assert sites[site] == [None] * len(sites[site]), site  # UserWarning, as torch gives them


def test_the_base_is_a_user_warning_and_the_runtime_one_is_both() -> None:
    from shmloader.warning_types import AccelerateWarning, PinWarning

    assert issubclass(shmloader.ShmloaderWarning, UserWarning) and "ShmloaderWarning" in shmloader.__all__
    assert issubclass(ConfigWarning, shmloader.ShmloaderWarning)
    assert issubclass(PinWarning, shmloader.ShmloaderWarning) and issubclass(PinWarning, RuntimeWarning)
    assert issubclass(AccelerateWarning, shmloader.ShmloaderWarning)


class _RefusingLibc:
    """libc whose mlock is refused (EPERM); munlock is never reached."""

    def __init__(self) -> None:
        self.mlock = self.munlock = self._refuse

    @staticmethod
    def _refuse(address: int, nbytes: int) -> int:
        import ctypes
        import errno

        ctypes.set_errno(errno.EPERM)
        return -1


def _pin_refused(tmp_path: Path) -> None:
    from ring_helpers import OWNER

    from shmloader.transport.ring import Ring
    from shmloader.transport.segment import PAGE_BYTES

    backend = MlockBackend(libc=_RefusingLibc())
    ring = Ring(str(tmp_path), on_create=backend.register_segment, on_retire=backend.unregister_segment)
    try:
        ring.grow(PAGE_BYTES, OWNER)
    finally:
        ring.close()


@pytest.mark.timeout(60)
def test_an_error_filter_on_the_base_raises_each_own_warning(tmp_path: Path) -> None:
    givers = [lambda: resolve_config({}, {"SHMLOADER_NUM_WORKRS": "4"}), lambda: _pin_refused(tmp_path)]
    for give in givers:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.filterwarnings("error", category=shmloader.ShmloaderWarning)
            with pytest.raises(shmloader.ShmloaderWarning):
                give()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", category=shmloader.ShmloaderWarning)
            give()
        assert caught == []
    with pytest.warns(RuntimeWarning, match="could not pin slot memory"):  # a RuntimeWarning filter still acts
        _pin_refused(tmp_path)


@pytest.mark.timeout(60)
def test_accelerates_unadopted_loader_warning_is_a_shmloader_warning() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    import shmloader.torch as st
    import shmloader.torch.accelerate as sta

    loader = st.DataLoader(list(range(4)), batch_size=2)
    with pytest.warns(shmloader.ShmloaderWarning, match="does not know how to adopt"):
        sta.adopt(["not a loader"], loader)
