"""Splitting a request's examples across workers by token count."""

from __future__ import annotations

import numpy as np
import pytest

from skyrl_trainer.backend.distributed.partition import partition_by_tokens


@pytest.mark.parametrize("num_parts", [1, 2, 3, 8])
def test_every_index_once_in_order_and_balanced(num_parts):
    rng = np.random.default_rng(num_parts)
    lengths = rng.integers(1, 300, size=50).tolist()
    parts = partition_by_tokens(lengths, num_parts)
    assert len(parts) == num_parts
    assert sorted(i for p in parts for i in p) == list(range(50))
    assert all(p == sorted(p) for p in parts)
    loads = [sum(lengths[i] for i in p) for p in parts]
    # Longest-first greedy: no part exceeds the mean by more than the longest example.
    assert max(loads) - sum(lengths) / num_parts <= max(lengths)
    assert partition_by_tokens(lengths, num_parts) == parts  # deterministic


def test_balances_tokens_not_counts():
    assert partition_by_tokens([100, 10, 10, 10, 10, 10], 2) == [[0], [1, 2, 3, 4, 5]]


def test_fewer_examples_than_parts():
    assert partition_by_tokens([5], 3) == [[0], [], []]
    assert partition_by_tokens([], 2) == [[], []]
    assert partition_by_tokens([4, 4, 4], 3) == [[0], [1], [2]]


def test_refuses_no_parts():
    with pytest.raises(ValueError):
        partition_by_tokens([1], 0)
