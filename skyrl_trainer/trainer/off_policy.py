"""Off-policy correction for the sampler/learner mismatch (ALGORITHMS.md section 5)."""

from __future__ import annotations

import numpy as np


def truncated_importance_weights(
    learner_logprobs: np.ndarray, sampler_logprobs: np.ndarray, cap: float
) -> np.ndarray:
    """Token-level TIS: min(exp(lp_old - slp), cap), a stop-gradient factor on the advantage."""
    ratio = np.exp(
        np.asarray(learner_logprobs, np.float64) - np.asarray(sampler_logprobs, np.float64)
    )
    return np.minimum(ratio, cap)
