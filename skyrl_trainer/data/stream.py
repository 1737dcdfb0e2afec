"""An endless, resumable stream of prompt batches over a fixed list of problems."""

from __future__ import annotations

import math
import numbers

import numpy as np

from skyrl_trainer.data.tasks import Problem


class PromptStream:
    """Batches of `batch_size` problems, epoch after epoch.

    Epoch `e` visits every problem once, in a permutation seeded by (seed, e) (or in list order when
    `shuffle` is False). A batch that runs past the end of an epoch continues into the next one, so every
    batch is full. The position is two integers, so `state_dict()` / `load_state_dict()` resume exactly.
    """

    def __init__(self, problems: list[Problem], batch_size: int, seed: int, shuffle: bool = True):
        if not problems:
            raise ValueError("PromptStream needs at least one problem; the dataset is empty")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        _check_seed(seed)
        self._problems = list(problems)
        self._batch_size = batch_size
        self._seed = int(seed)
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order: np.ndarray | None = None  # the current epoch's permutation, built lazily

    @property
    def epoch(self) -> int:
        """The epoch of the next problem to be served (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many problems of the current epoch have been served."""
        return self._position

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def num_batches_per_epoch(self) -> int:
        """ceil(len(problems) / batch_size): the batches needed to cover one epoch (the last may
        straddle into the next epoch)."""
        return math.ceil(len(self._problems) / self._batch_size)

    def next_batch(self, size: int | None = None) -> list[Problem]:
        """The next `size` problems (default `batch_size`)."""
        size = self._batch_size if size is None else size
        batch = []
        while len(batch) < size:
            order = self._epoch_order()
            take = min(size - len(batch), len(order) - self._position)
            batch.extend(self._problems[i] for i in order[self._position : self._position + take])
            self._position += take
            if self._position == len(order):
                self._epoch += 1
                self._position = 0
                self._order = None
        return batch

    def state_dict(self) -> dict:
        """JSON-serialisable position: seed, epoch, position (plus num_problems and shuffle, checked
        on load)."""
        return {
            "seed": self._seed,
            "epoch": self._epoch,
            "position": self._position,
            "num_problems": len(self._problems),
            "shuffle": self._shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (its seed and shuffle replace this stream's): the following batches are
        those the saved stream would have produced. Raises ValueError if the state does not fit."""
        missing = [key for key in ("seed", "epoch", "position") if key not in state]
        if missing:
            raise ValueError(f"prompt stream state lacks {missing}: {state}")
        seed, epoch, position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        _check_seed(seed)
        num_problems = state.get("num_problems", len(self._problems))
        if num_problems != len(self._problems):
            raise ValueError(
                f"prompt stream state was saved over {num_problems} problems, but there are "
                f"{len(self._problems)} now; resume with the same dataset"
            )
        if epoch < 0 or not 0 <= position < len(self._problems):
            raise ValueError(
                f"prompt stream state out of range: epoch {epoch}, position {position}"
            )
        self._seed, self._epoch, self._position = seed, epoch, position
        self._shuffle = bool(state.get("shuffle", self._shuffle))
        self._order = None

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            n = len(self._problems)
            if self._shuffle:
                rng = np.random.default_rng([self._seed, self._epoch])
                self._order = rng.permutation(n)
            else:
                self._order = np.arange(n)
        return self._order


def _check_seed(seed: int) -> None:
    # numpy's SeedSequence takes non-negative integers only.
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
