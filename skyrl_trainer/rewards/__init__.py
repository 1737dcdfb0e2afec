"""Reward functions for RL on verifiable tasks, selected by the `reward.fn` config field.

Importing this package registers the built-ins: `gsm8k`, `arithmetic` and `math`.
"""

# Importing the built-in rewards registers them.
from skyrl_trainer.rewards import arithmetic, gsm8k, math  # noqa: F401
from skyrl_trainer.rewards.registry import (
    REWARD_FNS,
    RewardFn,
    get_reward_fn,
    normalize_reward,
    register_reward,
)

__all__ = [
    "REWARD_FNS",
    "RewardFn",
    "get_reward_fn",
    "normalize_reward",
    "register_reward",
]
