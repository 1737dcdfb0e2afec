"""Advantage estimators: sequence rewards of a group of samples -> per-token advantages.

Every estimator takes the groups of one batch (`rewards_GN[g][i]`: the scalar reward of sample i of
prompt g) and the response lengths, and returns per-token advantages for every sample
(`advantages[g][i]` has one value per response token). Register your own with
`@register_advantage_estimator("name")` in a module named by `algorithm.plugins`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

GroupAdvantages = list[list[np.ndarray]]  # [group][sample] -> per-token advantages (float64)


@dataclass(frozen=True)
class EstimatorSettings:
    gamma: float = 1.0  # reinforce++ discount
    epsilon: float = 1e-6  # grpo: std floor


AdvantageEstimator = Callable[
    [list[list[float]], list[list[int]], EstimatorSettings], GroupAdvantages
]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    def decorate(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorate


def _broadcast(scores_GN: list[np.ndarray], lengths_GN: list[list[int]]) -> GroupAdvantages:
    return [
        [np.full(n, float(s)) for s, n in zip(scores, lengths, strict=True)]
        for scores, lengths in zip(scores_GN, lengths_GN, strict=True)
    ]


@register_advantage_estimator("grpo")
def compute_grpo_advantages(rewards_GN, lengths_GN, settings: EstimatorSettings) -> GroupAdvantages:
    """(s - mean_g) / (std_g + eps), unbiased std; a group of one has advantage 0."""
    scores = []
    for rewards in rewards_GN:
        r = np.asarray(rewards, dtype=np.float64)
        std = r.std(ddof=1) if len(r) > 1 else 1.0
        scores.append((r - r.mean()) / (std + settings.epsilon))
    return _broadcast(scores, lengths_GN)


@register_advantage_estimator("dr_grpo")
def compute_dr_grpo_advantages(rewards_GN, lengths_GN, settings) -> GroupAdvantages:
    """s - mean_g (GRPO without the std division; the tinker-cookbook's rl_loop)."""
    scores = [np.asarray(r, dtype=np.float64) - np.mean(r) for r in rewards_GN]
    return _broadcast(scores, lengths_GN)


@register_advantage_estimator("rloo")
def compute_rloo_advantages(rewards_GN, lengths_GN, settings) -> GroupAdvantages:
    """Reward minus the mean of the group's other samples: (s - mean_g) * n / (n - 1)."""
    scores = []
    for rewards in rewards_GN:
        r = np.asarray(rewards, dtype=np.float64)
        n = len(r)
        scores.append((r - r.mean()) * n / (n - 1) if n > 1 else np.zeros(n))
    return _broadcast(scores, lengths_GN)


@register_advantage_estimator("reinforce++")
def compute_reinforce_pp_advantages(rewards_GN, lengths_GN, settings) -> GroupAdvantages:
    """Discounted return of the outcome reward (given at the last token), G_t = gamma^(T-1-t) s,
    whitened over every response token of the batch."""
    returns = [
        [s * settings.gamma ** np.arange(n - 1, -1, -1, dtype=np.float64) for s, n in zip(r, ls)]
        for r, ls in zip(rewards_GN, lengths_GN, strict=True)
    ]
    flat = np.concatenate([x for group in returns for x in group]) if returns else np.zeros(0)
    if flat.size == 0:
        return returns
    mean, std = flat.mean(), flat.std()
    return [[(x - mean) / (std + settings.epsilon) for x in group] for group in returns]


def compute_advantages(
    name: str,
    rewards_GN: list[list[float]],
    lengths_GN: list[list[int]],
    settings: EstimatorSettings,
) -> GroupAdvantages:
    """Per-token advantages from the estimator registered as `name`."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"algorithm.advantage_estimator: unknown estimator {name!r}; "
            f"choose one of {sorted(ADVANTAGE_ESTIMATORS)} or register your own"
        )
    return ADVANTAGE_ESTIMATORS[name](rewards_GN, lengths_GN, settings)


def is_zero_variance(rewards: list[float]) -> bool:
    """All samples of the group scored the same: the group carries no learning signal."""
    return len(rewards) == 0 or float(np.ptp(np.asarray(rewards, dtype=np.float64))) == 0.0
