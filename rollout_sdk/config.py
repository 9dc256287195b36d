"""Building a plugin's ``Config`` dataclass from its TOML table, strictly.

Unknown keys, missing required keys and values of the wrong type raise :class:`ConfigError`,
which carries the key path so the binary can point at the line in the user's config file.
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["ConfigError", "build_config"]


class ConfigError(ValueError):
    """An option that does not fit a plugin's ``Config``; ``key`` is the path inside the table."""

    def __init__(self, key: tuple[str, ...], reason: str) -> None:
        self.key = key
        self.reason = reason
        where = ".".join(key) if key else "options"
        super().__init__(f"`{where}`: {reason}")


def build_config(config_cls: type, options: Mapping[str, Any], _path: tuple[str, ...] = ()) -> Any:
    """Instantiate the dataclass ``config_cls`` from ``options``, checking every key and type."""
    if not isinstance(options, Mapping):
        raise ConfigError(_path, f"expected a table, got {type(options).__name__}")
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    hints = typing.get_type_hints(config_cls)
    for key in options:
        if key not in fields:
            raise ConfigError((*_path, key), _unknown_key_reason(key, fields))
    values: dict[str, Any] = {}
    for name, field in fields.items():
        if name in options:
            values[name] = _coerce(options[name], hints[name], (*_path, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError((*_path, name), "required option is missing")
    try:
        return config_cls(**values)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(_path, str(err)) from err


def _unknown_key_reason(key: str, fields: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    known = ", ".join(f"`{name}`" for name in fields) or "none"
    return f"unknown option{hint} (known options: {known})"


def _coerce(value: Any, hint: Any, path: tuple[str, ...]) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, args, path)
    if origin is typing.Literal:
        if value in args:
            return value
        allowed = ", ".join(repr(a) for a in args)
        raise ConfigError(path, f"must be one of {allowed}, got {value!r}")
    if origin in (list, tuple) or hint in (list, tuple):
        return _coerce_sequence(value, origin or hint, args, path)
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a table, got {type(value).__name__}")
        value_hint = args[1] if len(args) == 2 else Any
        return {k: _coerce(v, value_hint, (*path, k)) for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return build_config(hint, value, path)
    return _coerce_scalar(value, hint, path)


def _coerce_union(value: Any, args: tuple[Any, ...], path: tuple[str, ...]) -> Any:
    """The value as the first member of the union that takes it."""
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(value, arg, path)
        except ConfigError as err:
            errors.append(err.reason)
    raise ConfigError(path, " or ".join(errors))


def _coerce_sequence(value: Any, kind: type, args: tuple[Any, ...], path: tuple[str, ...]) -> Any:
    """An array as a list, a homogeneous tuple (`tuple[int, ...]`) or a fixed tuple."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(path, f"expected an array, got {type(value).__name__}")
    if kind is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(path, f"expected {len(args)} values, got {len(value)}")
        pairs = enumerate(zip(value, args, strict=True))
        return tuple(_coerce(v, h, (*path, str(i))) for i, (v, h) in pairs)
    item_hint = args[0] if args else Any
    items = [_coerce(v, item_hint, (*path, str(i))) for i, v in enumerate(value)]
    return tuple(items) if kind is tuple else items


def _coerce_scalar(value: Any, hint: Any, path: tuple[str, ...]) -> Any:
    """A bool, int, float, str or path, checked strictly (a bool is not an int); any other
    type passes as it is."""
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(path, f"expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, f"expected a string, got {value!r}")
    if hint is pathlib.Path:
        if isinstance(value, str):
            return pathlib.Path(value)
        raise ConfigError(path, f"expected a path string, got {value!r}")
    return value
