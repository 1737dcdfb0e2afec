"""Live status of a long phase (sampling, training, evaluation, checkpointing).

A phase that is still running after `every_s` seconds prints one status line every `every_s`
seconds, with items done, rate and ETA, and one closing line; a phase that ends sooner prints
nothing, so fast runs stay quiet. Before any item is done, the ETA comes from how long the same
phase took last time.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TextIO, TypeVar

from skyrl_trainer.trainer.metrics_log import format_duration

T = TypeVar("T")


class PhaseTimer:
    """Remembers each phase's last duration (the ETA before its first item is done)."""

    def __init__(self, every_s: float = 15.0, stream: TextIO | None = None):
        self.every_s = every_s
        self.stream = stream or sys.stdout
        self.last_duration_s: dict[str, float] = {}

    def phase(self, label: str, total: int, unit: str) -> Phase:
        return Phase(self, label, total, unit)

    def results(self, futures: list, label: str, unit: str) -> list:
        """Every future's result, in order, while the phase counts them as they complete (in
        any order). Futures need only `result()` (the Tinker SDK's APIFuture): a waiter thread
        per future (at most 32 at a time) tells when each is done."""
        with self.phase(label, len(futures), unit) as phase:
            if self.every_s <= 0 or len(futures) <= 1:
                return [phase.advance(future.result()) for future in futures]
            with ThreadPoolExecutor(min(len(futures), 32), thread_name_prefix="wait") as pool:
                waits = [pool.submit(future.result) for future in futures]
                for _ in as_completed(waits):
                    phase.advance(None)
                return [w.result() for w in waits]


class Phase:
    """One running phase; `advance` counts finished items. Use as a context manager."""

    def __init__(self, timer: PhaseTimer, label: str, total: int, unit: str):
        self.timer, self.label, self.total, self.unit = timer, label, total, unit
        self.key = label.split(" ", 1)[0]  # "sampling step 3" and "sampling step 4" share history
        self.done = 0
        self.started = time.monotonic()
        self.reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name=f"progress-{self.key}", daemon=True)

    def __enter__(self) -> Phase:
        if self.timer.every_s > 0:
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        elapsed = time.monotonic() - self.started
        if exc_type is None and self.total:  # an empty phase (nothing to train) is no estimate
            self.timer.last_duration_s[self.key] = elapsed
            if self.reported:
                self._print(
                    f"{self.label}: {self.done}/{self.total} {self.unit} in {elapsed:.0f} s"
                )

    def advance(self, item: T, n: int = 1) -> T:
        self.done += n
        return item

    def status(self) -> str:
        """`<label>: 3/8 groups, 41 s, 0.07 groups/s, ETA 1m10s`."""
        elapsed = time.monotonic() - self.started
        parts = [f"{self.label}: {self.done}/{self.total} {self.unit}", f"{elapsed:.0f} s"]
        if self.done:
            rate = self.done / elapsed
            parts.append(f"{rate:.2f} {self.unit}/s")
            parts.append(f"ETA {format_duration((self.total - self.done) / rate)}")
        elif self.key in self.timer.last_duration_s:
            last = self.timer.last_duration_s[self.key]
            parts.append(f"ETA ~{format_duration(max(last - elapsed, 0))} (last took {last:.0f} s)")
        else:
            parts.append("ETA ?")
        return ", ".join(parts)

    def _tick(self) -> None:
        while not self._stop.wait(self.timer.every_s):
            self.reported = True
            self._print(self.status())

    def _print(self, line: str) -> None:
        print(f"  {line}", file=self.timer.stream, flush=True)
