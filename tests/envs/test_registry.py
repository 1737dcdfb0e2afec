"""The environment registry: ours, skyrl-gym's, and a user's `module:Class`; the single-turn
reward environment."""

from __future__ import annotations

import pytest

from skyrl_trainer.envs import ENVS, get_env_class, make_env, register_env
from skyrl_trainer.envs.single_turn import SingleTurnRewardEnv


def test_builtin_names_and_skyrl_gym_ids():
    assert {"single_turn", "guess_number", "python_tool"} <= set(ENVS)
    from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

    assert get_env_class("gsm8k_multi_turn") is GSM8kMultiTurnEnv


def test_user_module_class(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        "from skyrl_gym.envs.base_text_env import BaseTextEnv\n"
        "class Echo(BaseTextEnv):\n"
        "    def __init__(self, env_config=None, extras=None):\n"
        "        super().__init__()\n"
        "    def step(self, action):\n"
        "        return {'observations': [], 'reward': len(action), 'done': True, 'metadata': {}}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("my_envs:Echo")
    assert env.step("abc")["reward"] == 3
    with pytest.raises(ValueError, match="has no 'Missing'"):
        get_env_class("my_envs:Missing")


def test_register_refuses_clashes_and_bad_names():
    with pytest.raises(ValueError, match="already registered"):
        register_env("single_turn")(type("Other", (), {}))
    with pytest.raises(ValueError, match="without ':'"):
        register_env("a:b")


def test_single_turn_scores_with_the_reward_fn_and_keeps_components():
    env = make_env("single_turn", {"reward_fn": "arithmetic"}, {"sample": {"answer": "68"}})
    assert isinstance(env, SingleTurnRewardEnv)
    out = env.step("68")
    assert out["done"] and out["reward"] == 1.0 and out["observations"] == []
    assert (
        make_env("single_turn", {"reward_fn": "arithmetic"}, {"sample": {"answer": "68"}}).step(
            "67"
        )["reward"]
        == 0.0
    )


def test_single_turn_refuses_an_invalid_reward_value(tmp_path, monkeypatch):
    """The env raises (so the guarded call scores the trajectory 0 and records why)."""
    (tmp_path / "bad_rewards.py").write_text("def none(response, sample):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("single_turn", {"reward_fn": "bad_rewards:none"}, {"sample": {}})
    with pytest.raises(TypeError, match="expected a float or a dict"):
        env.step("x")
