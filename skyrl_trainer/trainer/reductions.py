"""Loss reductions, folded into advantages (ALGORITHMS.md section 3).

Tinker losses are sums over tokens and datums; scaling each token's advantage by the reduction's
weight turns that sum into the chosen mean over the whole mini-batch, however the backend chunks it.
"""

from __future__ import annotations

import numpy as np

LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")


def fold_loss_reduction(
    advantages: list[np.ndarray], reduction: str, max_seq_len: int | None = None
) -> list[np.ndarray]:
    """Scale the per-token advantages of one mini-batch (one array per sequence):
    - token_mean: A / (loss tokens in the mini-batch)
    - sequence_mean: A / (B * len_i)
    - seq_mean_token_sum_norm: A / (B * max_seq_len)  (Dr. GRPO; `max_seq_len` fixed in config)
    """
    num_seqs = len(advantages)
    if num_seqs == 0:
        return []
    if reduction == "token_mean":
        num_tokens = sum(len(a) for a in advantages)
        return [a / max(num_tokens, 1) for a in advantages]
    if reduction == "sequence_mean":
        return [a / (num_seqs * max(len(a), 1)) for a in advantages]
    if reduction == "seq_mean_token_sum_norm":
        if not max_seq_len or max_seq_len < 1:
            raise ValueError(
                "algorithm.max_seq_len: seq_mean_token_sum_norm needs a positive max_seq_len "
                "(the generation budget, e.g. sampling.max_tokens)"
            )
        return [a / (num_seqs * max_seq_len) for a in advantages]
    raise ValueError(
        f"algorithm.loss_reduction: unknown reduction {reduction!r}; choose one of {LOSS_REDUCTIONS}"
    )
