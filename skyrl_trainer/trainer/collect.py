"""A step's batch of groups: roll out the next prompts' environments, and with dynamic sampling
drop zero-variance groups and refill with exactly as many new prompts as are missing (no prompt
is taken from the stream and left unsampled). The prompt stream's position is the resumable
state (`PromptStream.state_dict`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from tinker import types

from skyrl_trainer.trainer.advantages import is_zero_variance
from skyrl_trainer.trainer.rollouts import Group, sample_seed


@dataclass
class Batch:
    groups: list[Group]  # the groups to train on
    sampled: list[Group] = field(default_factory=list)  # every group sampled (metrics, logs)
    zero_variance: int = 0
    seconds: float = 0.0
    # Asynchronous pipelines only:
    dropped: list[Group] = field(default_factory=list)  # too old to train on (counted, logged)
    wait_s: float = 0.0  # how long the learner waited for this batch
    stream_state: dict | None = None  # the prompt stream's position after this batch's prompts

    @property
    def rollouts(self):
        return [r for g in self.groups for r in g.rollouts]


def sampling_params(cfg) -> types.SamplingParams:
    s = cfg.sampling
    return types.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k
    )


def collect_batch(run, sampler, step: int) -> Batch:
    """Roll out `algorithm.batch_size` groups of `group_size` trajectories with `sampler`."""
    cfg, a = run.cfg, run.cfg.algorithm
    start = time.monotonic()
    batch = Batch(groups=[])
    for round_ in range(1 + (a.max_refill_rounds if a.dynamic_sampling else 0)):
        problems = run.stream.next_batch(a.batch_size - len(batch.groups))
        seeds = [sample_seed(cfg.seed, step, round_, i) for i in range(len(problems))]
        groups = run.rollouts.run(
            sampler,
            problems,
            a.group_size,
            sampling_params(cfg),
            seeds,
            run.progress,
            f"rollouts step {step + 1}",
        )
        for group in groups:
            batch.sampled.append(group)
            if is_zero_variance(group.rewards):
                batch.zero_variance += 1
                if a.dynamic_sampling:
                    continue
            batch.groups.append(group)
        if not a.dynamic_sampling or len(batch.groups) >= a.batch_size:
            break
    batch.seconds = time.monotonic() - start
    return batch


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """Rewards, pass rate, lengths, turns, environment time and faults of every sampled group."""
    everything = [r for g in batch.sampled for r in g.rollouts]
    if not everything:
        return {"groups/sampled": 0}
    turns = [t for r in everything for t in r.turns]
    metrics = {
        "reward/mean": float(np.mean([r.reward for r in everything])),
        "pass_rate": float(np.mean([r.correct for r in everything])),
        "response/mean_tokens": float(np.mean([len(r.tokens) for r in everything])),
        "response/truncated_frac": float(np.mean([r.stop_reason == "length" for r in everything])),
        "groups/zero_variance_frac": batch.zero_variance / len(batch.sampled),
        "groups/sampled": len(batch.sampled),
        "reward/errors": sum(r.reward_error is not None for r in everything),
        "rollout/turns_mean": float(np.mean([len(r.turns) for r in everything])),
        "rollout/action_tokens_mean": float(np.mean([r.mask().sum() for r in everything])),
        "rollout/context_truncated_frac": float(
            np.mean([r.end_reason == "context" for r in everything])
        ),
        "rollout/max_turns_frac": float(np.mean([r.end_reason == "max_turns" for r in everything])),
        "time/env_s": float(sum(t.env_seconds for t in turns)),
        "env/tool_calls_mean": float(sum(t.tool_call for t in turns) / len(everything)),
        "env/tool_errors": sum(t.tool_error is not None for t in turns),
        "time/rollouts_s": batch.seconds,
    }
    for key in sorted({k for r in everything for k in r.reward_components}):
        metrics[f"reward/{key}"] = float(
            np.mean([r.reward_components.get(key, 0.0) for r in everything])
        )
    for key in sorted({k for r in everything for k in r.env_metrics}):
        values = [r.env_metrics[key] for r in everything if key in r.env_metrics]
        if all(isinstance(v, (int, float)) for v in values):
            metrics[f"env/{key}"] = float(np.mean(values))
    return metrics
