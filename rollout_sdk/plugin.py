"""Plugin base class and the loader the `rollout` binary and `rollout_sdk.testing` share."""

from __future__ import annotations

import dataclasses
import difflib
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
    parts = attr.split(".")
    for index, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            is_last = index == len(parts) - 1
            where = ":".join([module_name, ".".join(parts[:index])]) if index else module_name
            hint = _missing_attribute_hint(obj, where, part, expected if is_last else None)
            raise PluginSpecError(f"module `{module_name}` has no attribute `{attr}`{hint}") from None
    if not (isinstance(obj, type) and issubclass(obj, expected)):
        raise PluginSpecError(f"`{spec}` is not a subclass of rollout_sdk.{expected.__name__}")
    return obj


def _missing_attribute_hint(namespace: Any, where: str, name: str, expected: type | None) -> str:
    """``"; did you mean `X`?"`` and the candidates, for an attribute ``name`` not found.

    With ``expected`` the candidates are the public subclasses of it that ``namespace`` (named
    ``where``) holds, and they are listed; without it (an inner part of a dotted class path)
    they are its public attributes.
    """
    candidates = sorted(
        {
            key
            for key, value in _public_attributes(namespace)
            if expected is None or _is_plugin_class(value, expected)
        }
    )
    folded = [c for c in candidates if c.casefold() == name.casefold()]
    close = folded or difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    if expected is not None:
        known = ", ".join(f"`{c}`" for c in candidates) or "none"
        hint += f" (rollout_sdk.{expected.__name__} subclasses in `{where}`: {known})"
    return hint


def _is_plugin_class(value: Any, expected: type) -> bool:
    """A class deriving from ``expected`` that is not one of rollout_sdk's own base classes."""
    try:
        if not (isinstance(value, type) and issubclass(value, expected)):
            return False
    except TypeError:  # e.g. `list[int]`, which passes for a type but not for issubclass
        return False
    module = getattr(value, "__module__", "") or ""
    return module != "rollout_sdk" and not module.startswith("rollout_sdk.")


def _public_attributes(namespace: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` for the names ``namespace`` exports (``__all__``) or does not hide."""
    exported = getattr(namespace, "__all__", None)
    if isinstance(exported, list | tuple):
        names = [name for name in exported if isinstance(name, str)]
    else:
        names = dir(namespace)
    attributes = []
    for key in names:
        if key.startswith("_"):
            continue
        try:
            attributes.append((key, getattr(namespace, key)))
        except Exception:  # a broken attribute is just not a candidate
            continue
    return attributes


def load_plugin(spec: str, options: Mapping[str, Any] | None = None, expected: type[P] = Plugin) -> P:
    """Resolve ``spec``, build its ``Config`` from ``options`` and instantiate it."""
    cls = resolve_plugin_class(spec, expected)
    config_cls = getattr(cls, "Config", None)
    if config_cls is None or not dataclasses.is_dataclass(config_cls):
        raise PluginSpecError(f"`{spec}` must define a nested `Config` dataclass")
    config = build_config(config_cls, options or {})
    return cls(config)
