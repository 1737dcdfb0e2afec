"""KL estimates against the reference (base) policy (ALGORITHMS.md section 4); where the penalty
enters (advantage or token reward) is the advantage estimator's business (advantages.py)."""

from __future__ import annotations

import numpy as np

KL_ESTIMATORS = ("k1", "k2", "k3")


def estimate_kl(logprobs: np.ndarray, ref_logprobs: np.ndarray, estimator: str) -> np.ndarray:
    """Per-token KL estimates from d = lp - lp_ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1."""
    d = np.asarray(logprobs, dtype=np.float64) - np.asarray(ref_logprobs, dtype=np.float64)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return np.expm1(-d) + d
    raise ValueError(
        f"algorithm.kl_estimator: unknown {estimator!r}; choose one of {KL_ESTIMATORS}"
    )
