"""The RL loop end to end on the tiny model through the in-process backend: metrics, checkpoints
and eval results appear, reward improves on a trivially learnable task, and an interrupted and
resumed run reproduces the uninterrupted one."""

import json

import pytest

from skyrl_trainer.trainer.loop import RLTrainer
from tests.trainer.loop_helpers import make_config, make_service, write_reward_module


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A dense, trivially learnable reward from a user module (loaded by "module:function")."""
    return f"{write_reward_module(tmp_path, monkeypatch)}:vowel_share"


def comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "throughput/"))}


def test_run_writes_metrics_checkpoints_and_eval(tmp_path, tiny_model_dir, reward_module):
    cfg = make_config(tmp_path, tiny_model_dir, reward_module)
    history = RLTrainer(cfg, make_service(tmp_path)).run()
    assert len(history) == 4
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    for key in (
        "reward/mean",
        "reward/vowels",
        "pass_rate",
        "response/mean_tokens",
        "groups/zero_variance_frac",
        "train/grad_norm",
        "train/learning_rate",
        "sampler_learner_logprob_gap/mean",
        "throughput/tokens_per_s",
        "time/rollouts_s",
        "rollout/turns_mean",
        "time/weight_sync_s",
    ):
        assert key in lines[-1], key
    assert "train/clip_frac" not in lines[-1]  # importance_sampling never clips
    assert "eval/pass@1" in lines[1] and "eval/pass@1" in lines[3]
    # fp32 on both sides: the sampler serves exactly the learner's weights
    assert lines[0]["sampler_learner_logprob_gap/max"] < 1e-4
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["step-000002", "step-000004"]


def test_reward_improves_on_a_learnable_task(tmp_path, tiny_model_dir, reward_module):
    cfg = make_config(
        tmp_path,
        tiny_model_dir,
        reward_module,
        steps=6,
        **{
            "eval.every": 0,
            "checkpoint.every": 0,
            # top-k 4: the tiny random model's choices narrow to a few tokens per position,
            # so a handful of samples covers them and GRPO can shift mass between them.
            "sampling.top_k": 4,
            "algorithm.learning_rate": 3e-2,
            "algorithm.group_size": 8,
        },
    )
    history = RLTrainer(cfg, make_service(tmp_path)).run()
    first, last = history[0]["reward/mean"], sum(m["reward/mean"] for m in history[-2:]) / 2
    assert last > first + 0.1, [round(m["reward/mean"], 3) for m in history]


def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, tiny_model_dir, reward_module):
    straight = RLTrainer(
        make_config(tmp_path / "a", tiny_model_dir, reward_module), make_service(tmp_path / "a")
    ).run()
    cfg = make_config(tmp_path / "b", tiny_model_dir, reward_module)
    first = RLTrainer(cfg, make_service(tmp_path / "b")).run(stop_after=2)  # "killed" after step 2
    resumed_trainer = RLTrainer(cfg, make_service(tmp_path / "b"))  # a new process, resume=auto
    assert resumed_trainer.start_step == 2
    rest = resumed_trainer.run()
    assert len(first) == 2 and len(rest) == 2
    for a, b in zip(straight, first + rest, strict=True):
        assert comparable(a).keys() == comparable(b).keys()
        for key, value in comparable(a).items():
            assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_kl_tis_dynamic_sampling_and_overlong_filter(tmp_path, tiny_model_dir, reward_module):
    cfg = make_config(
        tmp_path,
        tiny_model_dir,
        reward_module,
        steps=2,
        **{
            "eval.every": 0,
            "checkpoint.every": 0,
            "algorithm.kl_coef": 0.1,
            "algorithm.tis_cap": 2.0,
            "algorithm.dynamic_sampling": True,
            "algorithm.overlong_filter": True,
            "algorithm.loss_fn": "ppo",
            "algorithm.loss_reduction": "sequence_mean",
            "algorithm.advantage_estimator": "rloo",
        },
    )
    history = RLTrainer(cfg, make_service(tmp_path)).run()
    for metrics in history:
        # The policy starts at the base weights: KL ~ 0 at step 1; fp32 learner == sampler: TIS
        # weights are 1 (capped ratios of identical log-probs).
        assert metrics["tis/weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert metrics["kl/mean"] >= 0.0
        assert metrics["train/sequences"] % 4 == 0  # whole groups only
    assert history[0]["kl/mean"] == pytest.approx(0.0, abs=1e-4)
