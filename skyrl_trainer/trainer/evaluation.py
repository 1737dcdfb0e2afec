"""Evaluation: greedy pass@1 (and pass@k at the training temperature) on a fixed set of problems,
rolled out in the training environment."""

from __future__ import annotations

from tinker import types

from skyrl_trainer.trainer.rollouts import EnvRollouts, sample_seed


def evaluate(
    sampler,
    problems: list,
    rollouts: EnvRollouts,
    max_tokens: int,
    pass_k: int = 1,
    temperature: float = 1.0,
    seed: int = 0,
    progress=None,
) -> dict[str, float]:
    """`eval/pass@1` (greedy) and `eval/reward_mean`; with pass_k > 1, `eval/pass@k` (k samples
    at `temperature`, any correct). A problem is solved when its trajectory is `correct`."""
    metrics: dict[str, float] = {}
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs = [(1, greedy, [None] * len(problems))]
    if pass_k > 1:
        sampled = types.SamplingParams(max_tokens=max_tokens, temperature=temperature)
        runs.append((pass_k, sampled, [sample_seed(seed, -1, i) for i in range(len(problems))]))
    for k, params, seeds in runs:
        groups = rollouts.run(sampler, problems, k, params, seeds, progress, f"eval pass@{k}")
        solved = [any(r.correct for r in g.rollouts) for g in groups]
        metrics[f"eval/pass@{k}"] = sum(solved) / max(len(solved), 1)
        if k == 1:
            rewards = [g.rollouts[0].reward for g in groups]
            metrics["eval/reward_mean"] = sum(rewards) / max(len(groups), 1)
            metrics["eval/turns_mean"] = sum(len(g.rollouts[0].turns) for g in groups) / max(
                len(groups), 1
            )
    return metrics
