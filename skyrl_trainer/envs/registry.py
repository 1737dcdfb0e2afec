"""Environments by name: ours (`@register_env`), skyrl-gym's registry, or the user's own class.

An environment is a skyrl-gym `BaseTextEnv`: constructed as `cls(env_config=..., extras=...)`,
then `init(prompt_messages) -> (messages, metadata)` and `step(action_text)` returning
`{"observations": [messages], "reward": float, "done": bool, "metadata": {...}}`.
`env.name` in the config names one, exactly as `reward.fn` names a reward function:

- a name registered here with `@register_env(name)` (`single_turn`, `guess_number`, ...);
- an id in skyrl-gym's registry (`gsm8k_multi_turn`, `gsm8k`, ...), used unchanged;
- `"module.path:ClassName"`, imported from anywhere on `sys.path`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv

__all__ = ["ENVS", "BaseTextEnv", "get_env_class", "make_env", "register_env"]

EnvClass = Callable[..., BaseTextEnv]

#: Our environments by name; add one with `@register_env(name)`.
ENVS: dict[str, EnvClass] = {}

_FIELD = "env.name"


def register_env(name: str) -> Callable[[EnvClass], EnvClass]:
    """Decorator: register an environment class under `name` (what `env.name` uses).

    Raises ValueError for an empty name, one containing ':' (reserved for module paths), or one
    already registered to another class.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"environment name must be non-empty and without ':', got {name!r}")

    def decorator(cls: EnvClass) -> EnvClass:
        existing = ENVS.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"environment {name!r} is already registered to {existing!r}")
        ENVS[name] = cls
        return cls

    return decorator


def _skyrl_gym_ids() -> dict[str, Any]:
    from skyrl_gym.envs.registration import registry

    return registry


def get_env_class(spec: str) -> EnvClass:
    """The environment class that the `env.name` value `spec` names; a ValueError naming
    `env.name`, what is wrong and how to fix it otherwise."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{_FIELD} must name an environment, got {spec!r}; {_known()}")
    spec = spec.strip()
    if ":" not in spec:
        if spec in ENVS:
            return ENVS[spec]
        gym_spec = _skyrl_gym_ids().get(spec)
        if gym_spec is None:
            raise ValueError(
                f"{_FIELD}={spec!r} is not a known environment; {_known()}. For your own, "
                f"set {_FIELD} to 'module.path:ClassName' (importable, e.g. on PYTHONPATH)."
            )
        entry = gym_spec.entry_point
        return entry if callable(entry) else _import(entry, spec)
    return _import(spec, spec)


def _import(path: str, spec: str) -> EnvClass:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{_FIELD}={spec!r} is not of the form 'module.path:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(
            f"{_FIELD}={spec!r}: importing module {module_name!r} failed "
            f"({type(exc).__name__}: {exc}); check the name and that it is on PYTHONPATH"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{_FIELD}={spec!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{_FIELD}={spec!r}: {attr!r} is a {type(obj).__name__}, not a class")
    return obj


def make_env(spec: str, env_config: dict | None = None, extras: dict | None = None) -> BaseTextEnv:
    """A fresh environment: `cls(env_config=env_config, extras=extras)` (skyrl-gym's convention)."""
    return get_env_class(spec)(env_config=env_config or {}, extras=extras or {})


def _known() -> str:
    return f"ours: {sorted(ENVS)}; skyrl-gym: {sorted(_skyrl_gym_ids())}"
