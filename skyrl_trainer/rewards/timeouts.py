"""Bounding a call in time without signals (which only work on the main thread)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class CallTimedOut(Exception):
    """The call did not return within its time limit."""


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """`fn()`'s return value, re-raising what it raises, or CallTimedOut after `timeout_s`.

    The call runs on a daemon thread. On timeout that thread is abandoned, not stopped: it
    runs on (and uses CPU) until `fn` returns, but it never blocks the caller or interpreter
    exit. It cannot bound a call that holds the GIL in one long C operation.
    """
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as e:  # handed to the caller, who decides
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name="bounded-call", daemon=True).start()
    if not done.wait(timeout_s):
        raise CallTimedOut(f"did not return within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
