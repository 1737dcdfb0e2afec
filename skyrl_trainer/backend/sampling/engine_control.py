"""Model changes (weight updates, adapter loads) queued with an engine's requests and run by its
loop thread between steps, so that they never race a forward."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineControl:
    fn: Callable[[], object]
    # Given what the engine has in flight (engine-specific): must the change wait until that
    # has finished? It then waits at the head of the queue, and the requests behind it wait too.
    must_wait: Callable[[Any], bool]
    future: Future = field(default_factory=Future)

    def run(self) -> None:
        """Apply the change; its outcome (or exception) goes to `future`."""
        try:
            self.future.set_result(self.fn())
        except Exception as exc:
            self.future.set_exception(exc)
