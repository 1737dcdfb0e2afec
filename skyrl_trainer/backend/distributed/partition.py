"""Split a request's examples across training workers so each gets a similar number of tokens.

Balanced greedy (longest processing time first): examples are taken longest first and each
goes to the worker with the fewest tokens so far (ties: fewer examples, then lower rank). The
split is deterministic, every index appears exactly once, and each worker's indices keep
their original order. Compute per example grows with its length, so balancing tokens (not
example counts) keeps the slowest worker, which every collective waits for, close to the mean.
"""

from __future__ import annotations

from collections.abc import Sequence


def partition_by_tokens(lengths: Sequence[int], num_parts: int) -> list[list[int]]:
    """Indices of `lengths` split into `num_parts` lists with balanced token sums.

    A part is empty when there are fewer examples than parts.
    """
    if num_parts <= 0:
        raise ValueError(f"num_parts must be positive, got {num_parts}")
    loads = [0] * num_parts
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(num_parts), key=lambda r: (loads[r], len(parts[r]), r))
        parts[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(part) for part in parts]
