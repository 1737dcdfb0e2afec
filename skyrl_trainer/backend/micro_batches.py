"""Split variable-length sequences into padded micro-batches under a token budget.

Sequences are sorted by length and cut into consecutive runs, so each micro-batch holds
sequences of similar length: padding waste stays small, and `rows * longest <= budget`
bounds activation memory whatever the request size. A sequence longer than the budget
gets a micro-batch of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sequence indices so each group's padded size (rows x longest) fits the budget.

    Returns index lists, longest sequences first; every index appears exactly once.
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@dataclass
class PaddedBatch:
    """Right-padded token ids for one micro-batch; `mask_BT` is True on real tokens."""

    input_ids_BT: torch.Tensor
    mask_BT: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.mask_BT.sum())


def pad_right(sequences: Sequence[torch.Tensor], pad_id: int = 0) -> PaddedBatch:
    """Stack 1-D int64 sequences into a right-padded (B, T) batch with its mask."""
    longest = max(int(s.shape[0]) for s in sequences)
    input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        input_ids[row, : seq.shape[0]] = seq
        mask[row, : seq.shape[0]] = True
    return PaddedBatch(input_ids, mask)
