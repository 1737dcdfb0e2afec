"""Loss reductions, as per-token loss weights folded into the advantages (ALGORITHMS.md section 3).

Tinker losses are sums over tokens and datums; multiplying each token's advantage (and dro's
penalty) by its weight turns that sum into the chosen mean over the whole mini-batch, however the
backend chunks it.
"""

from __future__ import annotations

import numpy as np

LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")


def loss_weights(
    masks: list[np.ndarray], reduction: str, max_seq_len: int | None = None
) -> list[np.ndarray]:
    """Per-token loss weights of one mini-batch from its 0/1 loss masks (one array per sequence;
    a masked-out token, e.g. of an overlong-filtered response, gets weight 0 and is not counted).
    With B = sequences with at least one loss token and N = loss tokens in the mini-batch:
    - token_mean: 1 / N
    - sequence_mean: 1 / (B * len_i), len_i = loss tokens of sequence i
    - seq_mean_token_sum_norm: 1 / (B * max_seq_len)  (Dr. GRPO; `max_seq_len` fixed in config)
    """
    masks = [np.asarray(m, dtype=np.float64) for m in masks]
    num_seqs = sum(1 for m in masks if m.sum() > 0)
    if reduction == "token_mean":
        return [m / max(sum(x.sum() for x in masks), 1.0) for m in masks]
    if reduction == "sequence_mean":
        return [m / (max(num_seqs, 1) * max(m.sum(), 1.0)) for m in masks]
    if reduction == "seq_mean_token_sum_norm":
        if not max_seq_len or max_seq_len < 1:
            raise ValueError(
                "algorithm.max_seq_len: seq_mean_token_sum_norm needs a positive max_seq_len "
                "(the generation budget, e.g. sampling.max_tokens)"
            )
        return [m / (max(num_seqs, 1) * max_seq_len) for m in masks]
    raise ValueError(
        f"algorithm.loss_reduction: unknown reduction {reduction!r}; choose one of {LOSS_REDUCTIONS}"
    )
