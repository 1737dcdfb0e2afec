"""KL penalty against the reference (base) policy, in the reward/advantage (ALGORITHMS.md section 4)."""

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


def apply_kl_penalty(
    advantages: list[np.ndarray], kl: list[np.ndarray], coef: float
) -> tuple[list[np.ndarray], float]:
    """A_t -= coef * (kl_t - mean kl) (the cookbook's in-advantage form); returns the new
    advantages and the batch's mean KL over all response tokens."""
    flat = np.concatenate(kl) if kl else np.zeros(0)
    mean_kl = float(flat.mean()) if flat.size else 0.0
    return [a - coef * (k - mean_kl) for a, k in zip(advantages, kl, strict=True)], mean_kl
