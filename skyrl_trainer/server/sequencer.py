"""Runs each model's training requests in `seq_id` order, whatever order they arrive in.

The SDK numbers a training client's requests 1, 2, 3, ... and POSTs the chunks of one large
`forward_backward` concurrently, lowest `seq_id` last. The backend core runs a model's
requests in submission order, so the server submits them in `seq_id` order: a request
whose predecessor has not arrived waits (at most `gap_timeout_s`, in case the predecessor
never comes), and arriving predecessors release it. A request the server refuses before it
reaches the core gives its `seq_id` back at once (`skip`), so it leaves no gap.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _ModelQueue:
    next_seq: int
    held: dict[int, tuple[float, Callable[[], None]]] = field(default_factory=dict)


class Sequencer:
    def __init__(self, gap_timeout_s: float = 30.0):
        self.gap_timeout_s = gap_timeout_s
        self._lock = threading.Lock()
        self._queues: dict[str, _ModelQueue] = {}

    def start_model(self, model_id: str, next_seq: int = 1) -> None:
        """A new model: its client's first request will carry `next_seq`."""
        with self._lock:
            self._queues[model_id] = _ModelQueue(next_seq)

    def submit(self, model_id: str, seq_id: int | None, start: Callable[[], None]) -> None:
        """Call `start()` once every lower `seq_id` of the model has been started."""
        with self._lock:
            queue = self._queues.get(model_id)
            if queue is None or seq_id is None or seq_id < queue.next_seq:
                ready = [start]  # unordered, a re-sent request, or an unknown model
            elif seq_id > queue.next_seq:
                queue.held[seq_id] = (time.monotonic(), start)
                ready = []
                timer = threading.Timer(self.gap_timeout_s, self._flush_stale, (model_id,))
                timer.daemon = True
                timer.start()
            else:
                queue.next_seq += 1
                ready = [start, *self._release(queue)]
            # Started under the lock, so no other thread can interleave its submissions.
            for fn in ready:
                fn()

    def skip(self, model_id: str, seq_id: int | None) -> None:
        """`seq_id` will never start (its request was refused): the model's later requests
        must not wait for it. Releases what waits behind it, as a start would."""
        self.submit(model_id, seq_id, _nothing)

    def _release(self, queue: _ModelQueue) -> list[Callable[[], None]]:
        ready = []
        while queue.next_seq in queue.held:
            ready.append(queue.held.pop(queue.next_seq)[1])
            queue.next_seq += 1
        return ready

    def _flush_stale(self, model_id: str) -> None:
        """A gap that stayed open too long: skip it and run what waits behind it."""
        with self._lock:
            queue = self._queues.get(model_id)
            if queue is None or not queue.held:
                return
            oldest = min(arrived for arrived, _ in queue.held.values())
            if time.monotonic() - oldest < self.gap_timeout_s * 0.99:
                return
            queue.next_seq = min(queue.held)
            for fn in self._release(queue):
                fn()


def _nothing() -> None:
    pass
