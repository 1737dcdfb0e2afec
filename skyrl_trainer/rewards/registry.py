"""Reward functions: the registry, config-spec lookup, and a runner that scores batches safely.

A reward function is called as `fn(response_text, sample)`, where `sample` is the dataset row
(the ground truth is under `"answer"`), and returns a float or a dict of named float components
(their sum is the reward). `reward.fn` in the config names one: a registered name (`"gsm8k"`)
or `"module.path:function"`.
"""

from __future__ import annotations

import importlib
import math
import numbers
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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


@dataclass
class RewardResult:
    """The score of one response: `total` (the reward), its named `components` (empty for a plain
    float reward), and `error` when the reward raised, returned an invalid value or timed out
    (then `total` is 0.0 and `components` is empty)."""

    total: float
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None


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


class RewardRunner:
    """Scores batches of responses concurrently, never letting one bad reward call hurt the rest.

    Each call runs on one of `max_workers` daemon threads and is bounded by `timeout_s`, counted
    from when that call started. A call that raises, returns an invalid value or runs out of
    time scores `RewardResult(0.0, {}, error=...)`. A timed-out call's thread is abandoned (it
    can only be stopped by finishing) and a fresh worker takes its place, so a hung reward
    neither blocks later items or calls nor interpreter exit; it keeps its thread (and any CPU
    it burns) until it returns. Threads cannot interrupt a reward that holds the GIL in one long
    C call (a catastrophic regex, a huge integer power); rewards must avoid those.
    """

    def __init__(self, fn: RewardFn, timeout_s: float = 10.0, max_workers: int = 4):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self.fn = fn
        self.timeout_s = float(timeout_s)
        self.max_workers = int(max_workers)
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live_workers = 0
        self._closed = False

    def score_many(self, items: list[tuple[str, dict]]) -> list[RewardResult]:
        """One `RewardResult` per `(response_text, sample)` item, in order.

        Never raises for what the reward does. Returns once every item has finished or run out
        of time; with more hung items than workers, later items start as hung ones time out, so
        the worst case is about `ceil(len(items) / max_workers) * timeout_s`.
        """
        if self._closed:
            raise RuntimeError("RewardRunner is closed")
        if not items:
            return []
        self._start_workers()
        inbox: queue.SimpleQueue[tuple[str, int, Any]] = queue.SimpleQueue()
        tasks = [_Task(i, response, sample, inbox) for i, (response, sample) in enumerate(items)]
        for task in tasks:
            self._tasks.put(task)

        results: list[RewardResult | None] = [None] * len(tasks)
        deadlines: dict[int, float] = {}  # started, unfinished items
        remaining = len(tasks)
        while remaining:
            wait = None
            if deadlines:
                wait = max(0.0, min(deadlines.values()) - time.monotonic())
            try:
                kind, index, payload = inbox.get(timeout=wait)
            except queue.Empty:
                pass
            else:
                if kind == "started":
                    deadlines[index] = payload + self.timeout_s
                elif results[index] is None:
                    results[index] = payload
                    deadlines.pop(index, None)
                    remaining -= 1
            now = time.monotonic()
            for index, deadline in list(deadlines.items()):
                if deadline > now:
                    continue
                del deadlines[index]
                if tasks[index].abandon():
                    results[index] = RewardResult(
                        0.0, {}, error=f"timed out after {self.timeout_s:g} s"
                    )
                    remaining -= 1
                    self._replace_abandoned_worker()
                # else it finished just in time and its result is already in the inbox
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the idle workers; abandoned (hung) ones exit when their call returns.
        Idempotent; `score_many` afterwards raises RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in range(self._live_workers):
                self._tasks.put(None)
            self._live_workers = 0

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start_workers(self) -> None:
        with self._lock:
            while self._live_workers < self.max_workers:
                self._spawn_worker()
                self._live_workers += 1

    def _replace_abandoned_worker(self) -> None:
        # The live count is unchanged: the abandoned worker exits once its call returns.
        with self._lock:
            if not self._closed:
                self._spawn_worker()

    def _spawn_worker(self) -> None:
        name = f"reward-worker-{id(self):x}"
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            task.inbox.put(("started", task.index, time.monotonic()))
            result = self._score(task.response, task.sample)
            if not task.finish():
                return  # abandoned after a timeout: a replacement worker has taken this place
            task.inbox.put(("done", task.index, result))

    def _score(self, response: str, sample: dict) -> RewardResult:
        try:
            value = self.fn(response, sample)
        except BaseException as e:  # even SystemExit: a reward must never take a worker down
            return RewardResult(0.0, {}, error=f"raised {type(e).__name__}: {e}")
        try:
            total, components = normalize_reward(value)
        except (TypeError, ValueError) as e:
            return RewardResult(0.0, {}, error=f"invalid return value: {e}")
        return RewardResult(total, components)


class _Task:
    """One item of a `score_many` call; `finish` and `abandon` decide, once, who owns the result."""

    def __init__(self, index: int, response: str, sample: dict, inbox: queue.SimpleQueue):
        self.index = index
        self.response = response
        self.sample = sample
        self.inbox = inbox
        self._lock = threading.Lock()
        self._state = "running"

    def finish(self) -> bool:
        """Called by the worker when the call returned: False if it was abandoned meanwhile."""
        with self._lock:
            if self._state == "abandoned":
                return False
            self._state = "finished"
            return True

    def abandon(self) -> bool:
        """Called on timeout: False if the call finished meanwhile (its result is on the way)."""
        with self._lock:
            if self._state == "finished":
                return False
            self._state = "abandoned"
            return True


def _registered() -> str:
    return ", ".join(sorted(REWARD_FNS)) or "(none)"


def _describe(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
