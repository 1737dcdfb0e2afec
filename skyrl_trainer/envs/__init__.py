"""Environments: the unit of rollout (skyrl-gym's `BaseTextEnv` interface) and their registry.

Importing this package registers the built-in environments: `single_turn` (a reward function),
`guess_number` (a multi-turn game) and `python_tool` (a sandboxed Python tool)."""

from skyrl_trainer.envs import guess_number, python_tool, single_turn  # noqa: F401  (registration)
from skyrl_trainer.envs.registry import ENVS, BaseTextEnv, get_env_class, make_env, register_env

__all__ = ["ENVS", "BaseTextEnv", "get_env_class", "make_env", "register_env"]
