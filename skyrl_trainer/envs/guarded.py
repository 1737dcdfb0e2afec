"""Environment calls that cannot stop a run: bounded concurrency, a time-out, exceptions caught.

Every `init` / `step` of an environment goes through `GuardedEnvCalls.call`. At most
`max_concurrency` calls run at once (tool calls are real work: sandboxes, databases); each is
bounded by `timeout_s` counted from when it starts. A call that raises or runs out of time returns
an `EnvCallResult` with `error` set; the trainer ends that trajectory with reward 0 and counts it.
A timed-out call's thread is abandoned (Python cannot kill a thread) and its concurrency slot is
given back, so a hung environment blocks neither the others nor interpreter exit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class EnvCallResult:
    value: Any = None
    error: str | None = None  # "raised ValueError: ..." | "timed out after 10 s"
    seconds: float = 0.0  # time the call ran (not the wait for a slot)


class GuardedEnvCalls:
    """Runs environment calls on daemon threads, `max_concurrency` at a time, each bounded by
    `timeout_s`."""

    def __init__(self, max_concurrency: int = 32, timeout_s: float = 30.0):
        if max_concurrency < 1:
            raise ValueError(f"env.max_concurrency must be >= 1, got {max_concurrency}")
        if not timeout_s > 0:
            raise ValueError(f"env.step_timeout_s must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self._slots = threading.BoundedSemaphore(max_concurrency)

    def call(self, fn: Callable[..., Any], *args: Any) -> EnvCallResult:
        """`fn(*args)` on its own thread; blocks until it returns, raises or times out."""
        with self._slots:
            box: dict[str, Any] = {}
            done = threading.Event()

            def run() -> None:
                try:
                    box["value"] = fn(*args)
                except BaseException as exc:  # even SystemExit: an env must not end the run
                    box["error"] = f"raised {type(exc).__name__}: {exc}"
                done.set()

            start = time.monotonic()
            threading.Thread(target=run, name="env-call", daemon=True).start()
            finished = done.wait(self.timeout_s)
            seconds = time.monotonic() - start
        if not finished:
            return EnvCallResult(error=f"timed out after {self.timeout_s:g} s", seconds=seconds)
        return EnvCallResult(box.get("value"), box.get("error"), seconds)
