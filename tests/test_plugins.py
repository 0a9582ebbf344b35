"""The plugin manager: specs, registration, entry points, collate rules in workers, plugin errors."""

from __future__ import annotations

import concurrent.futures
import inspect
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import plugin_fixtures as fx
import pytest

import shmloader
from shmloader import hookspecs
from shmloader.builtin.stats import Stats
from shmloader.collate import register_collate_rule, unregister_collate_rule
from shmloader.hookspecs import hookimpl
from shmloader.plugins import PluginError, build_plugin_manager

START_METHODS = ["fork", "spawn"]
HOOKS = ["shmloader_collate_rules", "shmloader_pin_backend", "shmloader_worker_started", "shmloader_worker_died",
         "shmloader_worker_restarted", "shmloader_batch_ready", "shmloader_epoch_end"]


def _write_dist(site: Path, dist: str, entry_points: str) -> None:
    info = site / f"{dist}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def _on_path(monkeypatch: pytest.MonkeyPatch, *paths: Path) -> None:
    """Prepend to sys.path here and to PYTHONPATH for any process started from here on."""
    for p in reversed(paths):
        monkeypatch.syspath_prepend(str(p))
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*map(str, paths), *([old] if old else [])]))


@pytest.fixture
def example_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The example plugin as pip would install it: its source and a dist-info with the entry point."""
    site = tmp_path / "site"
    _write_dist(site, "shmloader_example_plugin", "[shmloader]\nexample = shmloader_example_plugin\n")
    _on_path(monkeypatch, site, fx.EXAMPLE_SRC)
    return site


# -- specs and the factory ------------------------------------------------------------------------


def test_every_hook_is_specified_prefixed_documented_and_keyword_only():
    specs = {n for n in vars(hookspecs) if n.startswith("shmloader_")}
    assert specs == set(HOOKS)
    pm = build_plugin_manager(entry_points=False).pm
    for name in HOOKS:
        caller = getattr(pm.hook, name)
        assert caller.spec is not None and len(inspect.getdoc(caller.spec.function) or "") > 80, name
    assert pm.hook.shmloader_pin_backend.spec.opts["firstresult"] is True
    with pytest.raises(TypeError):
        pm.hook.shmloader_epoch_end(0, {})  # positional calls are refused: keyword-only


def test_builtins_are_registered_as_plugins_before_explicit_ones():
    rec = fx.Recorder()
    plugins = build_plugin_manager([rec], entry_points=False)
    names = plugins.names()
    assert names[:2] == ["shmloader.builtin.collate", "shmloader.builtin.stats"]
    assert names[-1] == "Recorder" and all(n.startswith("shmloader.builtin.") for n in names[:-1])
    assert plugins.pm.get_plugin("shmloader.builtin.stats") is plugins.stats
    assert isinstance(plugins.stats, Stats)


def test_import_shmloader_loads_no_plugin_dependencies():
    code = "import sys, shmloader, shmloader.plugins; print(sorted({'torch','tqdm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- collate rules reach the workers --------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", START_METHODS)
def test_explicit_plugin_rule_is_used_in_every_worker(method):
    loader = shmloader.DataLoader(fx.PointDataset(), batch_size=3, num_workers=2, multiprocessing_context=method,
                                  plugins=[fx.PointRules()])
    batches = [b.copy() for b in loader]
    assert [b.shape for b in batches] == [(3, 3)] * 4
    assert np.array_equal(np.concatenate(batches)[:, 0], np.arange(12.0))
    pids = {int(p) for b in batches for p in b[:, 2]}
    assert os.getpid() not in pids and len(pids) == 2  # collated in both workers, never here


def test_explicit_plugin_rule_is_used_without_workers():
    loader = shmloader.DataLoader(fx.PointDataset(), batch_size=4, plugins=[fx.PointRules()])
    first = next(iter(loader))
    assert first.shape == (4, 3) and first[0, 2] == os.getpid()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", [*START_METHODS, "forkserver"])
def test_entry_point_plugin_collates_its_type_in_workers(example_installed, method):
    from shmloader_example_plugin import PAD_ID, PaddedTokens

    loader = shmloader.DataLoader(fx.TokenDataset(10), batch_size=4, num_workers=2, multiprocessing_context=method)
    assert "example" in loader._plugins.names()
    batches = list(loader)
    assert [type(b) for b in batches] == [PaddedTokens] * 3
    first = batches[0]
    assert first.lengths.tolist() == [1, 2, 3, 4]
    assert first.ids.shape == (4, 4) and first.ids.dtype == np.int32
    assert first.ids[0].tolist() == [1, PAD_ID, PAD_ID, PAD_ID] and first.ids[3].tolist() == [4, 4, 4, 4]
    assert not first.ids.flags.owndata and not first.lengths.flags.owndata  # views of the slot
    assert batches[2].lengths.tolist() == [4, 5]


@pytest.mark.timeout(60)
def test_entry_point_plugins_are_loaded_in_a_fresh_spawned_process(example_installed):
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        names = pool.submit(fx.rule_names_in_this_process).result(timeout=50)
    assert names == ["shmloader_example_plugin.Tokens"]


@pytest.mark.timeout(60)
def test_registered_rule_reaches_spawned_workers():
    register_collate_rule(fx.Point, fx.collate_points)
    try:
        loader = shmloader.DataLoader(fx.PointDataset(), batch_size=6, num_workers=1,
                                      multiprocessing_context="spawn")
        shapes = [b.shape for b in loader]
    finally:
        unregister_collate_rule(fx.Point)
    assert shapes == [(6, 3), (6, 3)]


@pytest.mark.timeout(60)
def test_autoload_can_be_disabled_here_and_in_workers(example_installed, monkeypatch):
    from shmloader.plugins import ENV_NO_AUTOLOAD

    monkeypatch.setenv(ENV_NO_AUTOLOAD, "1")
    rec = fx.Recorder()
    names = build_plugin_manager([rec]).names()
    assert "example" not in names and names[-1] == "Recorder"  # explicit plugins still register
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        assert pool.submit(fx.rule_names_in_this_process).result(timeout=50) == []
    monkeypatch.setenv(ENV_NO_AUTOLOAD, "off")
    assert "example" in build_plugin_manager().names()


@pytest.mark.parametrize("bad", ["maybe", "", "  "])
def test_a_bad_autoload_switch_names_the_variable(monkeypatch, bad):
    # an empty value is an error, as for every variable (docs/config.md "Values"): unset it instead
    from shmloader.errors import ConfigError
    from shmloader.plugins import ENV_NO_AUTOLOAD

    monkeypatch.setenv(ENV_NO_AUTOLOAD, bad)
    with pytest.raises(ConfigError, match=f"SHMLOADER_DISABLE_PLUGIN_AUTOLOAD={bad!r} is"):
        shmloader.DataLoader(np.zeros(4))


def test_explicit_rules_beat_entry_point_rules(example_installed):
    from shmloader_example_plugin import Tokens, collate_tokens

    def mine(batch, ctx):
        return "mine"

    class Mine:
        def shmloader_collate_rules(self):
            return {Tokens: mine}

    assert build_plugin_manager().collate_rules()[Tokens] is collate_tokens
    assert build_plugin_manager([Mine()]).collate_rules()[Tokens] is mine


def test_a_marked_hook_is_found_under_any_name_but_objects_own():
    """Registration skips only the names every object has (a speed-up: pluggy walks the MRO for
    each name); a marked method under another name, private or a dunder of its own, still counts."""
    class Renamed:
        @hookimpl(specname="shmloader_batch_ready")
        def _on_batch(self, task, worker_id):
            pass

        @hookimpl(specname="shmloader_epoch_end")
        def __call__(self):
            pass

    pm = build_plugin_manager([Renamed()], entry_points=False).pm
    plugin_of = {name: {impl.plugin_name for impl in getattr(pm.hook, name).get_hookimpls()}
                 for name in ("shmloader_batch_ready", "shmloader_epoch_end")}
    assert all("Renamed" in names for names in plugin_of.values()), plugin_of


# -- errors name the plugin and the hook ----------------------------------------------------------


def test_validation_failure_names_plugin_and_hook():
    class WrongArgs:
        @hookimpl
        def shmloader_batch_ready(self, nbytes, colour):
            pass

    with pytest.raises(PluginError, match="WrongArgs.*failed validation") as info:
        build_plugin_manager([WrongArgs()], entry_points=False)
    assert (info.value.plugin, info.value.hook) == ("WrongArgs", "shmloader_batch_ready")
    assert "colour" in str(info.value)


def test_unknown_hook_name_is_refused():
    class Typo:
        def shmloader_batch_redy(self):
            pass

    with pytest.raises(PluginError, match="'shmloader_batch_redy', which is not a shmloader hook") as info:
        build_plugin_manager([Typo()], entry_points=False)
    assert info.value.plugin == "Typo"


def test_one_plugin_not_in_a_list_is_refused_by_name():
    with pytest.raises(TypeError, match=r"plugins= takes a list of plugins.*plugins=\[") :
        shmloader.DataLoader(list(range(4)), plugins=fx.Recorder())


class _HookAttributeRaises:
    @property
    def shmloader_batch_ready(self):  # noqa: ANN201 - reading it raises
        raise RuntimeError("not ready to be read")


def test_a_plugin_whose_hook_cannot_be_read_is_a_plugin_error():
    with pytest.raises(PluginError, match="_HookAttributeRaises.*not ready to be read") as info:
        shmloader.DataLoader(list(range(4)), plugins=[_HookAttributeRaises()])
    assert info.value.plugin == "_HookAttributeRaises"


def test_a_class_instead_of_an_instance_is_refused():
    with pytest.raises(PluginError, match="is a class: pass an instance"):
        build_plugin_manager([fx.Recorder], entry_points=False)


@pytest.mark.parametrize("result, pattern", [
    ([1, 2], "must return a mapping"),
    ({"Point": fx.collate_points}, "keys must be types"),
    ({fx.Point: "not callable"}, "keys must be types"),
])
def test_malformed_rules_name_plugin_and_hook(result, pattern):
    class Bad:
        def shmloader_collate_rules(self):
            return result

    with pytest.raises(PluginError, match=pattern) as info:
        build_plugin_manager([Bad()], entry_points=False).collate_rules()
    assert (info.value.plugin, info.value.hook) == ("Bad", "shmloader_collate_rules")


def test_rules_hook_that_raises_names_plugin():
    class Raises:
        def shmloader_collate_rules(self):
            raise KeyError("nope")

    loader = shmloader.DataLoader(fx.PointDataset(), batch_size=4, plugins=[Raises()])
    with pytest.raises(PluginError, match="plugin 'Raises' raised in shmloader_collate_rules: KeyError") as info:
        next(iter(loader))
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.timeout(60)
def test_observer_that_raises_stops_iteration_with_plugin_and_hook():
    boom = fx.Boom()
    loader = shmloader.DataLoader(np.zeros((20, 2)), batch_size=2, num_workers=2, plugins=[boom])
    it = iter(loader)
    try:
        with pytest.raises(PluginError, match="plugin 'Boom' raised in shmloader_batch_ready") as info:
            for _ in it:
                pass
    finally:
        it.close()
    assert (info.value.plugin, info.value.hook) == ("Boom", "shmloader_batch_ready")
    assert isinstance(info.value.__cause__, ValueError) and boom.seen == 3
    assert isinstance(info.value, RuntimeError)


def test_entry_point_that_cannot_load_is_named(tmp_path, monkeypatch):
    _write_dist(tmp_path, "broken_plugin", "[shmloader]\nbroken = no_such_module_here:plugin\n")
    _on_path(monkeypatch, tmp_path)
    with pytest.raises(PluginError, match="plugin 'broken' \\(entry point 'no_such_module_here:plugin'\\)") as info:
        shmloader.DataLoader(np.zeros(4))
    assert info.value.plugin == "broken" and isinstance(info.value.__cause__, ImportError)
