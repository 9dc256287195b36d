"""Plugin base class and the loader the `rollout` binary and `rollout_sdk.testing` share."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any, TypeVar

from rollout_sdk.config import ConfigError, build_config

__all__ = ["ConfigError", "Plugin", "PluginSpecError", "load_plugin", "resolve_plugin_class"]


class Plugin:
    """Base of every plugin kind.

    A plugin declares its options as a nested ``Config`` dataclass; the host builds it from the
    plugin's TOML table (unknown keys and wrong types are errors) and passes it to ``__init__``.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        pass

    def __init__(self, config: Any) -> None:
        self.config = config


class PluginSpecError(ValueError):
    """A ``"module:Class"`` spec that cannot be resolved to a plugin class."""


P = TypeVar("P", bound=Plugin)


def resolve_plugin_class(spec: str, expected: type[P] = Plugin) -> type[P]:
    """Import ``"package.module:ClassName"`` and check it subclasses ``expected``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PluginSpecError(f"plugin spec `{spec}` must look like `package.module:ClassName`")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginSpecError(f"module `{module_name}` has no attribute `{attr}`") from None
    if not (isinstance(obj, type) and issubclass(obj, expected)):
        raise PluginSpecError(f"`{spec}` is not a subclass of rollout_sdk.{expected.__name__}")
    return obj


def load_plugin(spec: str, options: Mapping[str, Any] | None = None, expected: type[P] = Plugin) -> P:
    """Resolve ``spec``, build its ``Config`` from ``options`` and instantiate it."""
    cls = resolve_plugin_class(spec, expected)
    config_cls = getattr(cls, "Config", None)
    if config_cls is None or not dataclasses.is_dataclass(config_cls):
        raise PluginSpecError(f"`{spec}` must define a nested `Config` dataclass")
    config = build_config(config_cls, options or {})
    return cls(config)
