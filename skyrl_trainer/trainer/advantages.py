"""Advantage estimators: sequence rewards of a group of samples -> per-token advantages.

Every estimator takes the groups of one batch (`rewards_GN[g][i]`: the scalar reward of sample i of
prompt g), the response lengths and, when the KL penalty is on, the per-token KL estimates to the
reference policy (`kl_GN[g][i]`, one per response token; None when it is off), and returns
per-token advantages for every sample (`advantages[g][i]` has one value per response token).
Where KL enters is the estimator's business: group-baseline estimators subtract it, centred, from
the advantage (the tinker-cookbook's form); reinforce++ puts it in the token rewards before the
return. Register your own with `@register_advantage_estimator("name")` in a module named by
`plugins`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

GroupAdvantages = list[list[np.ndarray]]  # [group][sample] -> per-token advantages (float64)
TokenKL = list[list[np.ndarray]] | None  # [group][sample] -> per-token KL estimates, or None


@dataclass(frozen=True)
class EstimatorSettings:
    gamma: float = 1.0  # reinforce++ discount
    epsilon: float = 1e-6  # grpo / reinforce++: std floor
    kl_coef: float = 0.0  # weight of the KL penalty (kl_GN)


AdvantageEstimator = Callable[
    [list[list[float]], list[list[int]], EstimatorSettings, TokenKL], GroupAdvantages
]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    def decorate(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorate


def _broadcast(
    scores_GN: list[np.ndarray], lengths_GN: list[list[int]], kl_GN: TokenKL, coef: float
) -> GroupAdvantages:
    """Each sample's score on every token, minus coef * (kl_t - mean kl) when KL is on (mean over
    every response token of the batch: the cookbook's in-advantage KL)."""
    advantages = [
        [np.full(n, float(s)) for s, n in zip(scores, lengths, strict=True)]
        for scores, lengths in zip(scores_GN, lengths_GN, strict=True)
    ]
    if kl_GN is None:
        return advantages
    flat = np.concatenate([np.asarray(k, np.float64) for group in kl_GN for k in group] or [[]])
    mean_kl = float(flat.mean()) if flat.size else 0.0
    return [
        [a - coef * (np.asarray(k, dtype=np.float64) - mean_kl) for a, k in zip(ga, gk)]
        for ga, gk in zip(advantages, kl_GN, strict=True)
    ]


@register_advantage_estimator("grpo")
def compute_grpo_advantages(rewards_GN, lengths_GN, settings, kl_GN=None) -> GroupAdvantages:
    """(s - mean_g) / (std_g + eps), unbiased std; a group of one has advantage 0."""
    scores = []
    for rewards in rewards_GN:
        r = np.asarray(rewards, dtype=np.float64)
        std = r.std(ddof=1) if len(r) > 1 else 1.0
        scores.append((r - r.mean()) / (std + settings.epsilon))
    return _broadcast(scores, lengths_GN, kl_GN, settings.kl_coef)


@register_advantage_estimator("dr_grpo")
def compute_dr_grpo_advantages(rewards_GN, lengths_GN, settings, kl_GN=None) -> GroupAdvantages:
    """s - mean_g (GRPO without the std division; the tinker-cookbook's rl_loop)."""
    scores = [np.asarray(r, dtype=np.float64) - np.mean(r) for r in rewards_GN]
    return _broadcast(scores, lengths_GN, kl_GN, settings.kl_coef)


@register_advantage_estimator("rloo")
def compute_rloo_advantages(rewards_GN, lengths_GN, settings, kl_GN=None) -> GroupAdvantages:
    """Reward minus the mean of the group's other samples: (s - mean_g) * n / (n - 1)."""
    scores = []
    for rewards in rewards_GN:
        r = np.asarray(rewards, dtype=np.float64)
        n = len(r)
        scores.append((r - r.mean()) * n / (n - 1) if n > 1 else np.zeros(n))
    return _broadcast(scores, lengths_GN, kl_GN, settings.kl_coef)


@register_advantage_estimator("reinforce++")
def compute_reinforce_pp_advantages(
    rewards_GN, lengths_GN, settings, kl_GN=None
) -> GroupAdvantages:
    """REINFORCE++ (Hu et al. 2025; OpenRLHF, verl): token rewards r_t = -kl_coef * kl_t, plus
    the outcome reward s on the last token; discounted returns G_t = r_t + gamma * G_{t+1}; then
    whitened over every response token of the batch: (G - mean) / (std + eps), population std."""
    returns = []
    for g, (rewards, lengths) in enumerate(zip(rewards_GN, lengths_GN, strict=True)):
        row = []
        for i, (s, n) in enumerate(zip(rewards, lengths, strict=True)):
            r = np.zeros(n)
            if kl_GN is not None:
                r -= settings.kl_coef * np.asarray(kl_GN[g][i], dtype=np.float64)
            if n:
                r[-1] += s
            G, acc = np.zeros(n), 0.0
            for t in range(n - 1, -1, -1):
                acc = r[t] + settings.gamma * acc
                G[t] = acc
            row.append(G)
        returns.append(row)
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
    kl_GN: TokenKL = None,
) -> GroupAdvantages:
    """Per-token advantages from the estimator registered as `name` (`kl_GN`: per-token KL
    estimates when the KL penalty is on)."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"algorithm.advantage_estimator: unknown estimator {name!r}; "
            f"choose one of {sorted(ADVANTAGE_ESTIMATORS)} or register your own"
        )
    return ADVANTAGE_ESTIMATORS[name](rewards_GN, lengths_GN, settings, kl_GN)


def is_zero_variance(rewards: list[float]) -> bool:
    """All samples of the group scored the same: the group carries no learning signal."""
    return len(rewards) == 0 or float(np.ptp(np.asarray(rewards, dtype=np.float64))) == 0.0
