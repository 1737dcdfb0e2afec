"""Rollouts and the Tinker datums built from them (ALGORITHMS.md section 1, datum convention)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker import types


@dataclass
class Rollout:
    """One trajectory (a sampled response, or several turns of actions and observations) after a
    prompt, with what the learner needs about it.

    `tokens` is everything after the prompt, verbatim: each turn's sampled action tokens (with the
    stop token when it stopped) followed by the observation tokens the environment added. Only
    action tokens were sampled: `action_mask` is 1 on them and 0 on observation tokens, whose
    `sampler_logprobs` entries are placeholder zeros; no loss, KL or metric may read those.
    """

    prompt_tokens: list[int]
    tokens: list[int]
    sampler_logprobs: list[float]  # one per token of `tokens` (0.0 on observation tokens)
    stop_reason: str  # "stop" | "length" (the last action was cut, or the context budget ran out)
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    reward_error: str | None = None  # the environment raised or timed out (reward 0)
    correct: bool = False
    action_mask: list[float] | None = None  # None: every token is an action token
    turns: list = field(default_factory=list)  # rollouts.Turn records, for logs and metrics
    end_reason: str = "done"  # done | max_turns | context | env_error
    env_metrics: dict = field(default_factory=dict)  # the environment's get_metrics()
    sampler_version: int | None = None  # optimizer steps behind the sampling weights (async)

    def mask(self) -> np.ndarray:
        """1.0 on the tokens the policy sampled, 0.0 on observation tokens."""
        if self.action_mask is None:
            return np.ones(len(self.tokens))
        return np.asarray(self.action_mask, dtype=np.float64)


def build_rl_datum(
    rollout: Rollout,
    advantages: np.ndarray,
    logprobs: np.ndarray | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> types.Datum:
    """A datum for the `importance_sampling` / `ppo` / ... losses.

    `model_input = prompt + response[:-1]`, `target_tokens = (prompt + response)[1:]`; `logprobs`
    (default: the sampler's), `advantages` and each `extra` input (float, one value per response
    token: gspo's `sequence_ratio_mask`, dro's `weights`) are aligned to the targets, so response
    token j sits at target position len(prompt) - 1 + j. Prompt positions carry 0 in every input:
    advantage 0, weight 0, outside the sequence ratio, and a placeholder log-prob 0 that no loss
    may read where the others are 0.
    """
    prompt, response = rollout.prompt_tokens, rollout.tokens
    reference = rollout.sampler_logprobs if logprobs is None else logprobs
    per_token = {"logprobs": reference, "advantages": advantages, **(extra or {})}
    for key, values in per_token.items():
        if len(values) != len(response):
            raise ValueError(f"{len(values)} {key} for {len(response)} response tokens")
    pad = [0.0] * (len(prompt) - 1)
    full = list(prompt) + list(response)
    n = len(full) - 1
    inputs = {"target_tokens": types.TensorData(data=full[1:], dtype="int64", shape=[n])}
    for key, values in per_token.items():
        data = pad + [float(x) for x in values]
        inputs[key] = types.TensorData(data=data, dtype="float32", shape=[n])
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)


def build_scoring_datum(rollout: Rollout) -> types.Datum:
    """A cross_entropy datum over prompt + response, for `TrainingClient.forward` (learner
    log-probs of the response: positions len(prompt) - 1 onwards of its output)."""
    full = list(rollout.prompt_tokens) + list(rollout.tokens)
    n = len(full) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=full[1:], dtype="int64", shape=[n]),
            "weights": types.TensorData(data=[0.0] * n, dtype="float32", shape=[n]),
        },
    )


def response_logprobs(rollout: Rollout, output_logprobs: list[float]) -> np.ndarray:
    """The response part of a learner `logprobs` output for a datum of `rollout`."""
    start = len(rollout.prompt_tokens) - 1
    return np.asarray(output_logprobs[start : start + len(rollout.tokens)], dtype=np.float64)
