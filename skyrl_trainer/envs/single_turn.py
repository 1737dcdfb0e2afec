"""The single-turn environment: one response, scored by a reward function, done.

Today's tasks (gsm8k, math, arithmetic and any user reward `module:function`) run as this
environment, so the trainer has one rollout path. `env_config={"reward_fn": spec}` names the
reward exactly as `reward.fn` does; the row given to the reward is `extras["sample"]`.
"""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_trainer.envs.registry import register_env
from skyrl_trainer.rewards import get_reward_fn, normalize_reward


@register_env("single_turn")
class SingleTurnRewardEnv(BaseTextEnv):
    """`step(response)` returns the reward function's total, its components in
    `metadata["reward_components"]`, and done. A reward that raises or returns an invalid value
    raises here (the guarded call turns that into reward 0 and a counted error)."""

    def __init__(self, env_config: dict | None = None, extras: dict | None = None):
        super().__init__()
        env_config, extras = env_config or {}, extras or {}
        self.reward_fn = get_reward_fn(env_config.get("reward_fn", "gsm8k"))
        self.sample: dict[str, Any] = extras.get("sample", {})

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        total, components = normalize_reward(self.reward_fn(action, self.sample))
        return BaseTextEnvStepOutput(
            observations=[], reward=total, done=True, metadata={"reward_components": components}
        )
