"""Reward functions: the registry, config-spec lookup, and the check of what a reward returns.

A reward function is called as `fn(response_text, sample)`, where `sample` is the dataset row
(the ground truth is under `"answer"`), and returns a float or a dict of named float components
(their sum is the reward). `reward.fn` in the config names one: a registered name (`"gsm8k"`)
or `"module.path:function"`.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable
from typing import Any

RewardFn = Callable[[str, dict], float | dict[str, float]]

REWARD_FNS: dict[str, RewardFn] = {}

_CONFIG_FIELD = "reward.fn"


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register the function under `name` (what `reward.fn` uses) and return it unchanged.

    Raises ValueError when `name` is empty, contains `:` (reserved for module paths), or is
    already registered to a different function.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(
            f"reward name must be a non-empty string without ':' (':' marks a "
            f"'module:function' path), got {name!r}"
        )

    def decorator(fn: RewardFn) -> RewardFn:
        existing = REWARD_FNS.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"reward {name!r} is already registered (to {_describe(existing)}); "
                f"pick another name for {_describe(fn)}"
            )
        REWARD_FNS[name] = fn
        return fn

    return decorator


def get_reward_fn(spec: str) -> RewardFn:
    """The reward function that the `reward.fn` config value `spec` names.

    `spec` is a registered name (see `REWARD_FNS`) or `"module.path:function"` (the module is
    imported, so it may live anywhere on `sys.path`; `function` may be dotted, `Class.method`).
    Every failure is a ValueError that names `reward.fn`, says what is wrong and how to fix it.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"{_CONFIG_FIELD} must be a registered reward name ({_registered()}) or "
            f"'module.path:function', got {spec!r}"
        )
    spec = spec.strip()
    if ":" not in spec:
        fn = REWARD_FNS.get(spec)
        if fn is None:
            raise ValueError(
                f"{_CONFIG_FIELD}={spec!r} is not a registered reward; registered: "
                f"{_registered()}. To use your own function, set {_CONFIG_FIELD} to "
                f"'module.path:function' (the module must be importable, e.g. on PYTHONPATH)."
            )
        return fn

    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(
            f"{_CONFIG_FIELD}={spec!r} is not of the form 'module.path:function'; "
            f"write e.g. 'my_pkg.rewards:score'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if (
            e.name is not None
            and module_name != e.name
            and not module_name.startswith(e.name + ".")
        ):
            # The module exists but one of its own imports is missing.
            raise ValueError(
                f"{_CONFIG_FIELD}={spec!r}: importing module {module_name!r} failed: {e}. "
                f"Install the missing dependency."
            ) from e
        raise ValueError(
            f"{_CONFIG_FIELD}={spec!r}: module {module_name!r} cannot be imported ({e}). "
            f"Check the spelling and that the folder containing it is on PYTHONPATH."
        ) from e
    except Exception as e:
        raise ValueError(
            f"{_CONFIG_FIELD}={spec!r}: importing module {module_name!r} raised "
            f"{type(e).__name__}: {e}. Fix the error in that module."
        ) from e

    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            if len(public) > 20:
                public = [*public[:20], "..."]
            raise ValueError(
                f"{_CONFIG_FIELD}={spec!r}: module {module_name!r} has no attribute "
                f"{attr_path!r}; it defines: {', '.join(public) or '(nothing public)'}. "
                f"Fix the name after ':'."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(
            f"{_CONFIG_FIELD}={spec!r}: {attr_path!r} in module {module_name!r} is a "
            f"{type(obj).__name__}, not a function; point {_CONFIG_FIELD} at a function "
            f"fn(response_text, sample) -> float | dict[str, float]."
        )
    return obj


def normalize_reward(value: Any) -> tuple[float, dict[str, float]]:
    """A reward function's return value as `(total, components)`.

    A real number (float, int, bool, numpy scalar or any 0-d value with `.item()`) gives
    `(value, {})`; a dict of named real components gives `(sum of components, components)`
    (an empty dict gives `(0.0, {})`). Anything else raises: TypeError for a wrong type (None,
    str, nested dicts, non-string keys), ValueError for NaN or infinity.
    """
    if isinstance(value, dict):
        components: dict[str, float] = {}
        for key, component in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"reward function returned a dict with a non-string key {key!r}; "
                    f"component names must be strings"
                )
            components[key] = _as_real(component, f"component {key!r}")
        return math.fsum(components.values()), components
    return _as_real(value, "value"), {}


def _as_real(value: Any, what: str) -> float:
    if not isinstance(value, numbers.Real) and _is_scalar_array(value):
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"reward function returned {what} {_preview(value)} of type {type(value).__name__}; "
            f"expected a float or a dict of named float components"
        )
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"reward function returned {what} {result}; rewards must be finite")
    return result


def _is_scalar_array(value: Any) -> bool:
    # numpy scalars (incl. np.bool_, which is not a numbers.Real) and 0-d arrays/tensors.
    return callable(getattr(value, "item", None)) and getattr(value, "ndim", None) == 0


def _registered() -> str:
    return ", ".join(sorted(REWARD_FNS)) or "(none)"


def _describe(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
