"""Where each step's batch comes from: sampled now with the current weights (synchronous), or by a
producer that keeps sampling while the learner trains (asynchronous, bounded staleness).

Versions: the weights after `v` steps are version `v`. The learner publishes version `t + 1` after
step `t`; every trajectory records the version that sampled it (`Rollout.sampler_version`), and
the learner at step `t` trains only on versions >= t - k (k = `algorithm.max_steps_off_policy`).
The ratio in the loss is always taken against the sampler's log-probs (the Tinker contract), so
a stale trajectory is corrected by construction; `tis_cap` applies to it like to any other.

- `SynchronousBatches` (k = 0): batch t is sampled with version t, then trained; today's loop.
- `ScheduledBatches` (deterministic): batch t is sampled with version max(t - k, 0) by one
  producer thread running up to k batches ahead. The schedule is fixed, so seeded runs reproduce,
  and a checkpoint holds the k batches already sampled, so resume is exact.
- `StreamingBatches` (streaming.py): groups enter training in the order they finish.

Each source: `publish(version, sampler)` after every step, `next_batch(step)`,
`checkpoint_state(steps_done)` -> (stream state, pending payload), `exclusive()` (a context in
which no batch is being sampled, for evaluation), `close()` (bounded time).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager, nullcontext

from skyrl_trainer.trainer.collect import Batch, collect_batch
from skyrl_trainer.trainer.rollouts import RolloutsStopped

POLL_S = 0.25  # how often a waiting learner looks for a producer's error or a shutdown


class PipelineClosed(RuntimeError):
    """The pipeline was shut down while the learner waited for a batch."""


class IdleClock:
    """How long the sampling side had nothing in flight (the share of time it waits)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        self._idle_since: float | None = time.monotonic()
        self._idle_s = 0.0

    @contextmanager
    def busy(self):
        with self._lock:
            if self._active == 0 and self._idle_since is not None:
                self._idle_s += time.monotonic() - self._idle_since
                self._idle_since = None
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._idle_since = time.monotonic()

    def take(self) -> float:
        """Idle seconds since the last call."""
        with self._lock:
            now = time.monotonic()
            idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0)
            self._idle_s = 0.0
            if self._idle_since is not None:
                self._idle_since = now
            return idle


def stamp(groups, version: int) -> None:
    for group in groups:
        for rollout in group.rollouts:
            rollout.sampler_version = version


class SynchronousBatches:
    """Batch t sampled with the newest weights when the learner asks for it."""

    def __init__(self, run):
        self.run = run
        self._sampler = None

    def publish(self, version: int, sampler) -> None:
        self._sampler = sampler

    def next_batch(self, step: int) -> Batch:
        return collect_batch(self.run, self._sampler, step)

    def checkpoint_state(self, steps_done: int):
        return self.run.stream.state_dict(), None

    def exclusive(self):
        return nullcontext()

    def metrics(self, batch: Batch, step: int) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class ScheduledBatches:
    """Deterministic off-policy: batch t is sampled with version max(t - k, 0)."""

    def __init__(self, run, k: int, start_step: int, pending: dict | None = None):
        """`pending`: a checkpoint's payload (the batches already sampled after `start_step`
        and the stream position after them); None for a fresh start."""
        self.run, self.k = run, k
        self._start = start_step
        self.idle = IdleClock()
        self._cond = threading.Condition()
        self._samplers: dict[int, object] = {}
        self._ready: dict[int, Batch] = dict((pending or {}).get("batches", {}))
        self._stream_after: dict[int, dict] = {
            t: b.stream_state for t, b in self._ready.items() if b.stream_state
        }
        self._error: BaseException | None = None
        self._closed = False
        # Held while a batch is sampled; evaluation takes it too, so that no batch is sampled
        # alongside an evaluation's requests (the engine's float rounding depends on what shares
        # its batch: with the lock, seeded runs reproduce with evaluation on).
        self._engine_lock = threading.Lock()
        first = start_step + len(self._ready)
        self._thread = threading.Thread(
            target=self._produce, args=(first,), name="producer", daemon=True
        )
        self._thread.start()

    def version_of(self, step: int) -> int:
        """max(step - k, 0); never older than the version the run (re)started with: a run
        extended past the `steps` it checkpointed at has no batches sampled ahead, and only its
        current weights to sample the first k with."""
        return max(step - self.k, self._start)

    def publish(self, version: int, sampler) -> None:
        with self._cond:
            self._samplers[version] = sampler
            for old in [v for v in self._samplers if v < version - self.k]:
                del self._samplers[old]
            self._cond.notify_all()

    def _produce(self, first: int) -> None:
        try:
            for t in range(first, self.run.cfg.steps):
                v = self.version_of(t)
                with self._cond:
                    self._cond.wait_for(lambda v=v: v in self._samplers or self._closed)
                    if self._closed:
                        return
                    sampler = self._samplers[v]
                with self._engine_lock, self.idle.busy():
                    batch = collect_batch(self.run, sampler, t)
                batch.stream_state = self.run.stream.state_dict()
                stamp(batch.sampled, v)
                with self._cond:
                    self._ready[t] = batch
                    self._stream_after[t] = batch.stream_state
                    self._cond.notify_all()
        except RolloutsStopped:
            return
        except BaseException as exc:  # the learner raises it from next_batch
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _wait_for(self, predicate) -> None:
        """Wait (interruptibly) until `predicate()`, raising a producer's error or a shutdown."""
        with self._cond:
            while not predicate():
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise PipelineClosed("the batch pipeline was shut down")
                self._cond.wait(POLL_S)

    def next_batch(self, step: int) -> Batch:
        start = time.monotonic()
        self._wait_for(lambda: step in self._ready)
        with self._cond:
            batch = self._ready.pop(step)
            self._stream_after = {t: s for t, s in self._stream_after.items() if t >= step}
        batch.wait_s = time.monotonic() - start
        return batch

    def checkpoint_state(self, steps_done: int):
        """After step `steps_done - 1`: the batches of steps `steps_done .. + k - 1` (waiting
        for the ones still being sampled; their weights are all published) and the stream
        position after the last of them."""
        wanted = range(steps_done, min(steps_done + self.k, self.run.cfg.steps))
        self._wait_for(lambda: all(t in self._ready for t in wanted))
        with self._cond:
            batches = {t: self._ready[t] for t in wanted}
            stream = self._stream_after[max(wanted, default=steps_done - 1)]
        return stream, {"mode": "deterministic", "k": self.k, "batches": batches}

    def exclusive(self):
        """Hold the engine against the producer (for an evaluation)."""
        return self._engine_lock

    def metrics(self, batch: Batch, step: int) -> dict[str, float]:
        return {**staleness_metrics(batch, step, self.k), "async/sampler_idle_s": self.idle.take()}

    def close(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.run.rollouts.stop.set()
        self._thread.join(timeout_s)


def staleness_metrics(batch: Batch, step: int, k: int) -> dict[str, float]:
    """Per step: how old the trained trajectories' weights were (a histogram over 0..k), the
    groups dropped as too old, and how long the learner waited for its batch."""
    ages = [step - r.sampler_version for r in batch.rollouts if r.sampler_version is not None]
    metrics = {
        "async/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
        "async/staleness_max": max(ages, default=0),
        "async/dropped_groups": len(batch.dropped),
        "async/learner_wait_s": batch.wait_s,
    }
    for age in range(k + 1):
        metrics[f"async/staleness_{age}"] = sum(a == age for a in ages)
    return metrics
