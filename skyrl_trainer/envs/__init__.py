"""Environments: the unit of rollout (skyrl-gym's `BaseTextEnv` interface) and their registry."""

from skyrl_trainer.envs.registry import ENVS, BaseTextEnv, get_env_class, make_env, register_env

__all__ = ["ENVS", "BaseTextEnv", "get_env_class", "make_env", "register_env"]
