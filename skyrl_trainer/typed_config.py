"""Typed configuration dataclasses from plain dicts (a composed Hydra config, a JSON body), with
every unknown key and wrong type refused by its dotted name."""

from __future__ import annotations

import dataclasses
import types as pytypes
import typing
from typing import Any


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the fix."""


def build_config(data: dict, cls: type, prefix: str = "") -> Any:
    """`cls` filled from a plain dict (e.g. `OmegaConf.to_container(cfg, resolve=True)`), with
    unknown keys and wrong types refused by name."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"{where}{unknown[0]}: unknown field; {prefix or 'the config'} has {sorted(names)}"
        )
    values = {}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        values[name] = _convert(value, hints[name], path)
    return cls(**values)


def _convert(value: Any, hint: Any, path: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return build_config(value or {}, hint, path)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, pytypes.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value
