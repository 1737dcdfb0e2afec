"""Polling helper for tests that wait on background work (engine threads, actors, servers)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether `condition()` holds within `timeout` seconds (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
