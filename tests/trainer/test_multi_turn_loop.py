"""The RL loop on a multi-turn environment (tiny model, in-process backend): observation tokens
carry no advantage, every trajectory is logged turn by turn, and the multi-turn metrics count."""

from __future__ import annotations

import json

import numpy as np
import pytest

from skyrl_trainer.trainer.loop import RLTrainer
from tests.trainer.loop_helpers import make_config, make_service, record, spy_on_batches
from tests.trainer.test_rollouts import SCRIPTED_ENVS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def scripted(tmp_path, monkeypatch) -> str:
    (tmp_path / "scripted_envs.py").write_text(SCRIPTED_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "scripted_envs:Scripted"


def multi_turn_config(tmp_path, tiny_model_dir, scripted, **overrides):
    return make_config(
        tmp_path,
        tiny_model_dir,
        "arithmetic",
        steps=2,
        **{
            "env.name": scripted,
            "env.config": {"turns": 3, "vowel_reward": True},
            "env.max_turns": 4,
            "eval.every": 2,
            "checkpoint.every": 0,
            "logging.print_samples": 1,
            **overrides,
        },
    )


def test_multi_turn_loop(tmp_path, tiny_model_dir, scripted, monkeypatch, capsys):
    cfg = multi_turn_config(tmp_path, tiny_model_dir, scripted)
    trainer = RLTrainer(cfg, make_service(tmp_path))
    calls = record(trainer)
    batches = spy_on_batches(monkeypatch)
    history = trainer.run()

    rollouts = {
        tuple(r.prompt_tokens + r.tokens[:-1]): r
        for b in batches
        for g in b.groups
        for r in g.rollouts
    }
    sent = 0
    for datums, *_ in calls.calls:
        for datum in datums:
            rollout = rollouts[tuple(datum.model_input.to_ints())]
            start = len(rollout.prompt_tokens) - 1
            advantages = datum.loss_fn_inputs["advantages"].to_numpy()[start:]
            mask = rollout.mask()
            assert (mask == 0).any()  # three turns: observation tokens in between
            assert np.all(advantages[mask == 0] == 0)  # no loss on observations
            assert np.all(advantages[mask > 0] != 0)
            sent += 1
    assert sent > 0

    for metrics in history:
        assert metrics["rollout/turns_mean"] == 3
        assert metrics["env/tool_calls_mean"] == 3  # every step was a "tool call"
        assert metrics["env/tool_errors"] == metrics["groups/sampled"] * 4  # turn 2 of each
        assert metrics["env/steps_taken"] == 3
        assert metrics["rollout/action_tokens_mean"] < metrics["response/mean_tokens"]
    assert history[-1]["eval/turns_mean"] == 3

    lines = (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == sum(m["groups/sampled"] for m in history) * 4
    first = records[0]
    assert first["step"] == 1 and len(first["turns"]) == 3
    assert first["turns"][0]["observation"] == [{"role": "user", "content": "Turn 1 done."}]
    assert first["turns"][1]["tool_error"] == "bad"
    assert first["turns"][2]["observation_tokens"] == 0
    printed = capsys.readouterr().out
    assert "    1> " in printed and "    1< [user] Turn 1 done." in printed


def test_env_faults_count_and_do_not_stop_the_run(tmp_path, tiny_model_dir, scripted):
    cfg = multi_turn_config(
        tmp_path,
        tiny_model_dir,
        scripted,
        **{"env.config": {"raise_at_turn": 2, "vowel_reward": True}},
    )
    history = RLTrainer(cfg, make_service(tmp_path)).run()
    for metrics in history:
        assert metrics["reward/errors"] == metrics["groups/sampled"] * 4
        assert metrics["reward/mean"] == 0.0
        assert metrics["rollout/turns_mean"] == 2


def test_a_bad_env_config_stops_the_run_before_it_starts(tmp_path, tiny_model_dir):
    from skyrl_trainer.trainer.config import ConfigError

    cfg = make_config(
        tmp_path,
        tiny_model_dir,
        "arithmetic",
        **{"env.name": "guess_number", "env.config": {"hihg": 20}, "data.format": "guess_number"},
    )
    with pytest.raises(ConfigError, match="env.config=.*hihg"):
        RLTrainer(cfg, service=None)  # refused before the service is touched
