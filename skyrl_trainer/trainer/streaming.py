"""Streaming off-policy batches: groups enter training in the order they finish.

Workers each roll out one group at a time with the newest published weights. At most
`(k + 1) * batch_size` groups are in play (started and neither trained nor discarded), so under
first-in-first-out a group is trained at most k steps after the version that sampled it; one
overtaken by many faster groups can be older by the time it finishes, and is then dropped and
counted (never trained). A trained group leaves play when the weights it trained are published,
so with k = 0 nothing is ever sampled with outdated weights.

Every group gets an index in the order it started (its sampling seed derives from it). A
checkpoint holds the finished-but-untrained groups and the problems still in flight, which are
rolled out again (same index, new weights) after a resume: no group is trained twice, and none
disappears without being counted.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import nullcontext

from skyrl_trainer.trainer.advantages import is_zero_variance
from skyrl_trainer.trainer.collect import Batch, sampling_params
from skyrl_trainer.trainer.pipeline import (
    POLL_S,
    IdleClock,
    PipelineClosed,
    staleness_metrics,
    stamp,
)
from skyrl_trainer.trainer.rollouts import RolloutsStopped, sample_seed

MAX_WORKERS = 64


class StreamingBatches:
    def __init__(self, run, k: int, start_step: int, pending: dict | None = None):
        """`pending`: a checkpoint's payload (finished groups, problems in flight, counters)."""
        pending = pending or {}
        a = run.cfg.algorithm
        self.run, self.k, self.batch_size = run, k, a.batch_size
        self.capacity = (k + 1) * a.batch_size
        self.idle = IdleClock()
        self._cond = threading.Condition()
        self._finished: deque = deque(pending.get("finished", []))
        self._requeue: deque = deque(pending.get("in_flight", []))  # (index, problem)
        self._in_flight: dict[int, object] = {}
        self._in_play = len(self._finished)
        self._taken = 0  # groups of the batch being trained (in play until it is published)
        self._started = pending.get("started", 0)
        self._version: int | None = None
        self._sampler = None
        self._admitting = True
        self._error: BaseException | None = None
        self._closed = False
        self.resampled_after_resume = len(self._requeue)
        self.dropped_total = pending.get("dropped_total", 0)
        self._workers = [
            threading.Thread(target=self._work, name=f"producer-{i}", daemon=True)
            for i in range(min(self.capacity, MAX_WORKERS))
        ]
        for worker in self._workers:
            worker.start()

    def publish(self, version: int, sampler) -> None:
        with self._cond:
            self._version, self._sampler = version, sampler
            self._in_play -= self._taken
            self._taken = 0
            self._cond.notify_all()

    # ----- producers ----------------------------------------------------------------------

    def _admit(self):
        """Wait for room in play; take the next problem. None once closed."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._closed
                    or (
                        self._admitting
                        and self._sampler is not None
                        and self._in_play < self.capacity
                    )
                )
            )
            if self._closed:
                return None
            if self._requeue:
                index, problem = self._requeue.popleft()
            else:
                index, problem = self._started, self.run.stream.next_batch(1)[0]
                self._started += 1
            self._in_play += 1
            self._in_flight[index] = problem
            return index, problem, self._sampler, self._version

    def _work(self) -> None:
        run = self.run
        params = sampling_params(run.cfg)
        while True:
            admitted = self._admit()
            if admitted is None:
                return
            index, problem, sampler, version = admitted
            seed = sample_seed(run.cfg.seed, "stream", index)
            try:
                with self.idle.busy():
                    group = run.rollouts.run(
                        sampler, [problem], run.cfg.algorithm.group_size, params, [seed]
                    )[0]
            except RolloutsStopped:
                return
            except Exception as exc:
                with self._cond:
                    del self._in_flight[index]
                    if version < self._version - self.k:
                        # Its weights may no longer be served; it was too old to train anyway.
                        self._in_play -= 1
                        self.dropped_total += 1
                        self._cond.notify_all()
                        continue
                    self._error = exc
                    self._cond.notify_all()
                return
            group.index = index
            stamp([group], version)
            with self._cond:
                del self._in_flight[index]
                self._finished.append(group)
                self._cond.notify_all()

    # ----- the learner's side -------------------------------------------------------------

    def next_batch(self, step: int) -> Batch:
        """`batch_size` groups of versions >= step - k, in the order they finished. With dynamic
        sampling, zero-variance groups are skipped until `batch_size` groups are found or
        `(1 + max_refill_rounds) * batch_size` groups were looked at."""
        a = self.run.cfg.algorithm
        limit = a.batch_size * (1 + (a.max_refill_rounds if a.dynamic_sampling else 0))
        start = time.monotonic()
        batch = Batch(groups=[])
        with self._cond:
            while len(batch.groups) < a.batch_size and len(batch.sampled) < limit:
                while not self._finished:
                    if self._error is not None:
                        raise self._error
                    if self._closed:
                        raise PipelineClosed("the batch pipeline was shut down")
                    self._cond.wait(POLL_S)
                group = self._finished.popleft()
                if group.version < step - self.k:
                    batch.dropped.append(group)
                    self.dropped_total += 1
                    self._in_play -= 1
                    continue
                batch.sampled.append(group)
                if is_zero_variance(group.rewards):
                    batch.zero_variance += 1
                    if a.dynamic_sampling:
                        self._in_play -= 1
                        continue
                batch.groups.append(group)
            self._taken = len(batch.groups)
            if step == self.run.cfg.steps - 1:
                self._admitting = False  # the last step has its batch: start no more groups
            self._cond.notify_all()
        batch.seconds = batch.wait_s = time.monotonic() - start
        return batch

    def checkpoint_state(self, steps_done: int):
        """The stream position, finished-but-untrained groups, and the problems in flight (with
        their indices), taken together under the lock so that they are consistent."""
        with self._cond:
            in_flight = sorted(self._in_flight.items()) + list(self._requeue)
            payload = {
                "mode": "streaming",
                "k": self.k,
                "finished": list(self._finished),
                "in_flight": in_flight,
                "started": self._started,
                "dropped_total": self.dropped_total,
            }
            return self.run.stream.state_dict(), payload

    def exclusive(self):
        """Streaming makes no promise of reproducibility: evaluation runs alongside."""
        return nullcontext()

    def metrics(self, batch: Batch, step: int) -> dict[str, float]:
        with self._cond:
            untrained = len(self._finished) + len(self._in_flight) + len(self._requeue)
        return {
            **staleness_metrics(batch, step, self.k),
            "async/sampler_idle_s": self.idle.take(),
            "async/dropped_total": self.dropped_total,
            "async/groups_started": self._started,
            "async/groups_untrained": untrained,
            "async/resampled_after_resume": self.resampled_after_resume,
        }

    def close(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.run.rollouts.stop.set()
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.join(max(deadline - time.monotonic(), 0))
