"""Evaluation: greedy pass@1 (and pass@k at the training temperature) on a fixed set of prompts."""

from __future__ import annotations

from tinker import types

from skyrl_trainer.rewards import RewardRunner
from skyrl_trainer.trainer.progress import PhaseTimer
from skyrl_trainer.trainer.rollouts import Group, sample_groups, sample_seed, score_groups


def evaluate(
    sampler,
    problems: list,
    prompts: list[list[int]],
    runner: RewardRunner,
    decode,
    max_tokens: int,
    correct_threshold: float,
    pass_k: int = 1,
    temperature: float = 1.0,
    seed: int = 0,
    progress: PhaseTimer | None = None,
) -> dict[str, float]:
    """`eval/pass@1` (greedy) and, with pass_k > 1, `eval/pass@k` (k samples, any correct)."""
    metrics: dict[str, float] = {}
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs = [(1, greedy, [None] * len(prompts))]
    if pass_k > 1:
        sampled = types.SamplingParams(max_tokens=max_tokens, temperature=temperature)
        runs.append((pass_k, sampled, [sample_seed(seed, -1, i) for i in range(len(prompts))]))
    for k, params, seeds in runs:
        rollouts = sample_groups(sampler, prompts, k, params, seeds, progress, f"eval pass@{k}")
        groups = [Group(p, t, r) for p, t, r in zip(problems, prompts, rollouts, strict=True)]
        score_groups(groups, runner, decode, correct_threshold)
        solved = [any(r.correct for r in g.rollouts) for g in groups]
        metrics[f"eval/pass@{k}"] = sum(solved) / max(len(solved), 1)
        if k == 1:
            metrics["eval/reward_mean"] = sum(g.rollouts[0].reward for g in groups) / max(
                len(groups), 1
            )
    return metrics
