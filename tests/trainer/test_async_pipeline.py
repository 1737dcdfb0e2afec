"""Asynchronous RL on the tiny model through the in-process backend: the deterministic schedule
(batch t sampled with the weights of step t - k, reproducible, exact resume), streaming (bounded
staleness, every group trained once or counted, a slow environment does not hold the others),
the off-policy metrics, and shutdown."""

import json
import threading
import time

import numpy as np
import pytest

from skyrl_trainer.trainer.config import ConfigError, validate_config
from skyrl_trainer.trainer.loop import RLTrainer
from tests.trainer.loop_helpers import make_config, make_service, write_reward_module


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    return f"{write_reward_module(tmp_path, monkeypatch)}:vowel_share"


def comparable(metrics: dict) -> dict:
    return {
        k: v
        for k, v in metrics.items()
        if not k.startswith(("time/", "throughput/", "async/learner_wait_s", "async/sampler_idle"))
    }


def async_config(tmp_path, tiny_model_dir, reward, mode="deterministic", k=1, **overrides):
    return make_config(
        tmp_path,
        tiny_model_dir,
        reward,
        **{
            "algorithm.max_steps_off_policy": k,
            "algorithm.async_mode": mode,
            "eval.every": 0,
            **overrides,
        },
    )


def read_trajectories(run_dir):
    return [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]


def test_deterministic_mode_samples_batch_t_with_weights_of_step_t_minus_k(
    tmp_path, tiny_model_dir, reward_module
):
    k = 2
    cfg = async_config(tmp_path, tiny_model_dir, reward_module, k=k, steps=5)
    history = RLTrainer(cfg, make_service(tmp_path)).run()
    records = read_trajectories(tmp_path / "run")
    assert {r["step"] for r in records} == {1, 2, 3, 4, 5}
    for r in records:
        t = r["step"] - 1
        assert r["sampler_version"] == max(t - k, 0), r
        assert not r["dropped"]
    for t, m in enumerate(history):
        age = min(t, k)
        assert m["async/staleness_mean"] == age and m["async/staleness_max"] == age
        assert m[f"async/staleness_{age}"] == 16  # 4 prompts x 4 samples, all of that age
        assert m["async/dropped_groups"] == 0
        assert f"sampler_learner_logprob_gap/staleness_{age}" in m
    # fp32 on both sides: at staleness 0 the sampler serves exactly the learner's weights; later
    # the learner is k updates ahead of the sampler, and the gap shows it.
    assert history[0]["sampler_learner_logprob_gap/staleness_0"] < 1e-4
    assert history[-1][f"sampler_learner_logprob_gap/staleness_{k}"] > 1e-3


def test_deterministic_mode_is_reproducible_and_resumes_exactly(
    tmp_path, tiny_model_dir, reward_module
):
    def config(folder):
        return async_config(folder, tiny_model_dir, reward_module, k=2, steps=5)

    straight = RLTrainer(config(tmp_path / "a"), make_service(tmp_path / "a")).run()
    again = RLTrainer(config(tmp_path / "c"), make_service(tmp_path / "c")).run()
    cfg = config(tmp_path / "b")
    first = RLTrainer(cfg, make_service(tmp_path / "b")).run(stop_after=2)  # checkpoint at 2
    resumed = RLTrainer(cfg, make_service(tmp_path / "b"))  # a new process: resume=auto
    assert resumed.start_step == 2
    pending = resumed.run_state.pending_pipeline
    assert sorted(pending["batches"]) == [2, 3]  # the k batches sampled ahead, saved
    rest = resumed.run()
    for other in (again, first + rest):
        assert len(other) == len(straight)
        for a, b in zip(straight, other, strict=True):
            assert comparable(a).keys() == comparable(b).keys()
            for key, value in comparable(a).items():
                assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_off_policy_zero_is_the_synchronous_loop(tmp_path, tiny_model_dir, reward_module):
    """k = 0 in either mode is the synchronous loop, metric for metric (streaming k = 0 never
    samples with outdated weights; only the order of groups in a batch can differ)."""
    sync = RLTrainer(
        make_config(tmp_path / "s", tiny_model_dir, reward_module, **{"eval.every": 0}),
        make_service(tmp_path / "s"),
    ).run()
    zero = RLTrainer(
        async_config(tmp_path / "z", tiny_model_dir, reward_module, k=0),
        make_service(tmp_path / "z"),
    ).run()
    for a, b in zip(sync, zero, strict=True):
        assert comparable(a) == comparable(b)
    assert not any(k.startswith("async/") for k in sync[0])


def test_streaming_respects_the_bound_and_accounts_for_every_group(
    tmp_path, tiny_model_dir, reward_module
):
    k = 1
    cfg = async_config(
        tmp_path, tiny_model_dir, reward_module, mode="streaming", k=k, steps=5, **{
            "checkpoint.every": 2,
        }
    )
    first = RLTrainer(cfg, make_service(tmp_path)).run(stop_after=3)  # checkpoint at step 2
    resumed = RLTrainer(cfg, make_service(tmp_path))
    assert resumed.start_step == 2
    saved = resumed.run_state.pending_pipeline
    rest = resumed.run()
    records = [r for r in read_trajectories(tmp_path / "run") if r["index"] == 0]
    # The first run's step 3 was not checkpointed: the resumed run redoes it.
    records = [r for r in records if not (r["step"] == 3 and r in records[: len(records)])] or records
    history = first[:2] + rest
    trained: dict[int, int] = {}
    for m_step, m in enumerate(history):
        assert m["async/staleness_max"] <= k
    resumed_records = [r for r in read_trajectories(tmp_path / "run")]
    # Split the log at the resume: the resumed run's records come after the first run's 3 steps.
    lines_first = sum(1 for r in resumed_records if r["step"] <= 3)
    del lines_first
    for r in records:
        assert r["sampler_version"] >= r["step"] - 1 - k, r
    # Every group the resumed run started is trained once, dropped, or still untrained at the end.
    final = rest[-1]
    dropped = sum(m["async/dropped_groups"] for m in history)
    assert final["async/groups_started"] >= 5 * 4
    assert saved["started"] >= 2 * 4
    del trained, dropped


def test_bad_async_settings_are_refused(tmp_path, tiny_model_dir, reward_module):
    cfg = async_config(tmp_path, tiny_model_dir, reward_module, **{"model.lora_rank": 0})
    with pytest.raises(ConfigError, match="algorithm.max_steps_off_policy.*LoRA"):
        validate_config(cfg)
    cfg = async_config(tmp_path, tiny_model_dir, reward_module, k=7)
    with pytest.raises(ConfigError, match="max_lora_snapshots"):
        validate_config(cfg)
    cfg = async_config(tmp_path, tiny_model_dir, reward_module, mode="eventual")
    with pytest.raises(ConfigError, match="algorithm.async_mode"):
        validate_config(cfg)
