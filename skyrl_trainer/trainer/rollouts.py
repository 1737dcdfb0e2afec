"""Sampling groups of responses through a Tinker SamplingClient and scoring them."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from tinker import types

from skyrl_trainer.rewards import RewardRunner
from skyrl_trainer.trainer.datums import Rollout
from skyrl_trainer.trainer.progress import PhaseTimer


@dataclass
class Group:
    """The `group_size` responses to one prompt."""

    problem: object  # skyrl_trainer.data.Problem
    prompt_tokens: list[int]
    rollouts: list[Rollout]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]


def sample_seed(*parts: int) -> int:
    """A deterministic 31-bit seed for (run seed, step, round, prompt index, ...)."""
    return zlib.crc32(",".join(map(str, parts)).encode()) & 0x7FFFFFFF


def sample_groups(
    sampler,
    prompts: list[list[int]],
    num_samples: int,
    params: types.SamplingParams,
    seeds: list[int | None],
    progress: PhaseTimer | None = None,
    label: str = "sampling",
) -> list[list[Rollout]]:
    """`num_samples` responses per prompt; every request is in flight at once. With `progress`,
    a long wait prints status lines under `label`."""
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(p),
            num_samples,
            params.model_copy(update={"seed": seed}),
        )
        for p, seed in zip(prompts, seeds, strict=True)
    ]
    progress = progress or PhaseTimer(every_s=0)
    responses = progress.results(futures, label, "groups" if num_samples > 1 else "prompts")
    groups = []
    for prompt, response in zip(prompts, responses, strict=True):
        groups.append(
            [
                Rollout(
                    prompt_tokens=list(prompt),
                    tokens=list(seq.tokens),
                    sampler_logprobs=[float(x) for x in (seq.logprobs or [])],
                    stop_reason=seq.stop_reason,
                )
                for seq in response.sequences
            ]
        )
    return groups


def score_groups(
    groups: list[Group], runner: RewardRunner, decode, correct_threshold: float
) -> None:
    """Fill in each rollout's reward (a reward that raises or hangs scores 0 and is recorded)."""
    items, rollouts = [], []
    for group in groups:
        for rollout in group.rollouts:
            items.append((decode(rollout.tokens), group.problem.sample))
            rollouts.append(rollout)
    for rollout, result in zip(rollouts, runner.score_many(items), strict=True):
        rollout.reward = result.total
        rollout.reward_components = dict(result.components)
        rollout.reward_error = result.error
        rollout.correct = result.error is None and result.total >= correct_threshold
