"""Resolving ``"module:Class"`` plugin specs: a misspelled class gets a did-you-mean."""

from __future__ import annotations

import importlib
import re
import sys
import textwrap

import pytest

from rollout_sdk import PluginSpecError, Policy, Reward, load_plugin, resolve_plugin_class

MODULE = textwrap.dedent(
    """
    from rollout_sdk import Callback, Reward


    class ExactMatch(Reward):
        pass


    class ExactMatchStrict(Reward):
        pass


    class ExactMatcher:  # close to the typo, but not a Reward
        pass


    class ExactMatchLogger(Callback):  # a plugin, of another kind
        pass


    class _ExactMatchImpl(Reward):  # private
        pass


    class Outer:
        class ExactMatch(Reward):
            pass
    """
)


@pytest.fixture
def plugins_module(tmp_path, monkeypatch):
    """A module `resolution_plugins` on sys.path, imported fresh by each test."""
    (tmp_path / "resolution_plugins.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "resolution_plugins", raising=False)
    return "resolution_plugins"


def test_misspelled_class_suggests_the_close_plugin_class():
    with pytest.raises(PluginSpecError) as err:
        resolve_plugin_class("python_plugins.rewards:ExactMatchh", Reward)
    message = str(err.value)
    assert "has no attribute `ExactMatchh`" in message
    assert "did you mean `ExactMatch`?" in message
    assert "`ExactMatch`, `Format`" in message


def test_load_plugin_reports_the_suggestion_too():
    with pytest.raises(PluginSpecError, match="did you mean `ExactMatch`"):
        load_plugin("python_plugins.rewards:ExactMach", {}, Reward)


def test_case_only_typo_is_suggested():
    with pytest.raises(PluginSpecError, match="did you mean `ExactMatch`"):
        resolve_plugin_class("python_plugins.rewards:exactmatch", Reward)


def test_candidates_are_public_subclasses_of_the_expected_base(plugins_module):
    with pytest.raises(PluginSpecError) as err:
        resolve_plugin_class(f"{plugins_module}:ExactMatchr", Reward)
    message = str(err.value)
    # `ExactMatcher` is closer but no Reward; `ExactMatchLogger` is a Callback; the private
    # class and rollout_sdk's own base classes are never offered.
    assert "did you mean `ExactMatch`?" in message, message
    listed = re.search(r"subclasses in `resolution_plugins`: (.*)\)$", message)
    assert listed is not None, message
    assert listed.group(1) == "`ExactMatch`, `ExactMatchStrict`"


def test_the_expected_base_decides_the_candidates(plugins_module):
    with pytest.raises(PluginSpecError) as err:
        resolve_plugin_class(f"{plugins_module}:ExactMatchLoger")
    message = str(err.value)
    assert "did you mean `ExactMatchLogger`?" in message, message
    assert "`Reward`" not in message and "`Callback`" not in message, message


def test_no_suggestion_when_nothing_is_close():
    with pytest.raises(PluginSpecError) as err:
        resolve_plugin_class("python_plugins.rewards:Nope", Reward)
    message = str(err.value)
    assert "has no attribute `Nope`" in message
    assert "did you mean" not in message


def test_no_candidates_of_the_expected_kind():
    with pytest.raises(PluginSpecError) as err:
        resolve_plugin_class("python_plugins.rewards:ExactMatchh", Policy)
    message = str(err.value)
    assert "did you mean" not in message
    assert "rollout_sdk.Policy subclasses in `python_plugins.rewards`: none" in message


def test_dotted_path_suggests_at_the_level_that_failed(plugins_module):
    with pytest.raises(PluginSpecError, match="did you mean `Outer`"):
        resolve_plugin_class(f"{plugins_module}:Outr.ExactMatch", Reward)
    with pytest.raises(PluginSpecError, match="did you mean `ExactMatch`") as err:
        resolve_plugin_class(f"{plugins_module}:Outer.ExactMatc", Reward)
    assert "subclasses in `resolution_plugins:Outer`" in str(err.value)
    assert resolve_plugin_class(f"{plugins_module}:Outer.ExactMatch", Reward).__name__ == "ExactMatch"


def test_module_with_odd_attributes_still_gets_a_message(plugins_module):
    module = importlib.import_module(plugins_module)
    module.__all__ = ["ExactMatch", 3, "missing_name"]  # not all strings, one absent
    module.Alias = list[int]  # passes isinstance(type) but breaks issubclass
    with pytest.raises(PluginSpecError, match="did you mean `ExactMatch`"):
        resolve_plugin_class(f"{plugins_module}:ExactMatchh", Reward)
