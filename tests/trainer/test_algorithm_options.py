"""Each algorithm option does what it says (issue 14, points 1-8), through the real loop on the
tiny model where the point is about the loop, against hand-computed values where it is a rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from skyrl_trainer.backend.losses import LOSS_FNS, get_loss, resolve_loss_config
from skyrl_trainer.trainer.config import ConfigError, TrainerConfig, build_config, validate_config
from skyrl_trainer.trainer.loop import RLTrainer, learning_rate
from skyrl_trainer.trainer.policy_losses import POLICY_LOSSES
from tests.trainer.loop_helpers import (
    make_config,
    make_service,
    record,
    spy_on_batches,
    write_reward_module,
)
from tests.trainer.test_configs import composed


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    return write_reward_module(tmp_path, monkeypatch)


def quick_config(tmp_path, tiny_model_dir, reward, **overrides) -> TrainerConfig:
    base = {
        "steps": 1,
        "eval.every": 0,
        "checkpoint.every": 0,
        "algorithm.num_mini_batches": 1,
    }
    return make_config(tmp_path, tiny_model_dir, reward, **(base | overrides))


def response_slice(datum) -> np.ndarray:
    """Target positions of the response tokens: where the (nonzero) loss inputs start. The
    trainer's datums put every prompt position first, so the response starts at the first
    position whose placeholder log-prob is replaced by a real (negative) one."""
    logprobs = np.asarray(datum.loss_fn_inputs["logprobs"].tolist())
    return np.arange(len(logprobs)) >= int(np.argmax(logprobs != 0.0))


def lp_gradient(loss_fn, config, datum, learner_logprobs) -> np.ndarray:
    """d loss / d learner log-prob of one datum, with the backend's own loss."""
    spec = get_loss(loss_fn)
    inputs = {k: v.to_torch() for k, v in datum.loss_fn_inputs.items()}
    lp = torch.tensor(learner_logprobs, dtype=torch.float64, requires_grad=True)
    loss = spec.fn(lp, inputs, resolve_loss_config(spec, config))
    (grad,) = torch.autograd.grad(loss, lp)
    return grad.numpy()


# ---- 1. gspo ------------------------------------------------------------------------------


def test_gspo_runs_and_its_ratio_covers_the_response(tmp_path, tiny_model_dir, rewards):
    """Before: the datums lacked sequence_ratio_mask and the first forward_backward was refused."""
    cfg = quick_config(
        tmp_path, tiny_model_dir, f"{rewards}:vowel_share", **{"algorithm.loss_fn": "gspo"}
    )
    trainer = RLTrainer(cfg, make_service(tmp_path))
    calls = record(trainer)
    (metrics,) = trainer.run()
    assert math.isfinite(metrics["train/loss_sum"]) and "train/clip_frac" in metrics
    for datum in calls.calls[0][0]:
        mask = np.asarray(datum.loss_fn_inputs["sequence_ratio_mask"].tolist())
        np.testing.assert_array_equal(mask, response_slice(datum).astype(float))


# ---- 2. dro ---------------------------------------------------------------------------------


def test_dro_trains_no_prompt_position_and_reduces_its_penalty(tmp_path, tiny_model_dir, rewards):
    """Before: the penalty pulled every prompt position towards its placeholder log-prob 0, and
    the token_mean reduction scaled the advantages but not the penalty."""
    cfg = quick_config(
        tmp_path, tiny_model_dir, f"{rewards}:vowel_share", **{"algorithm.loss_fn": "dro"}
    )
    trainer = RLTrainer(cfg, make_service(tmp_path))
    calls = record(trainer)
    trainer.run()
    (datums, loss_fn, config, future) = calls.calls[0]
    outputs = future.result().loss_fn_outputs
    num_tokens = sum(int(response_slice(d).sum()) for d in datums)
    for datum, out in zip(datums, outputs, strict=True):
        response = response_slice(datum)
        weights = np.asarray(datum.loss_fn_inputs["weights"].tolist())
        np.testing.assert_allclose(weights[response], 1.0 / num_tokens, rtol=1e-6)
        assert np.all(weights[~response] == 0)
        grad = lp_gradient(loss_fn, config, datum, out["logprobs"].tolist())
        assert np.all(grad[~response] == 0)


# ---- 3. overlong filter with KL ---------------------------------------------------------------


def test_overlong_filter_wins_over_kl(tmp_path, tiny_model_dir, rewards):
    """Step 1 trains the policy away from the base (so step 2 has a real KL); step 2 resumes with
    the overlong filter on: every response is cut at max_tokens, so nothing may be trained. Before,
    the KL term was added after the filter and every truncated response got gradient again."""
    reward = f"{rewards}:vowel_share"
    common = {"eval.every": 0, "algorithm.kl_coef": 0.5, "sampling.max_tokens": 4}
    first = make_config(tmp_path, tiny_model_dir, reward, steps=1, **common)
    RLTrainer(first, make_service(tmp_path)).run()
    cfg = make_config(
        tmp_path, tiny_model_dir, reward, steps=2, **common, **{"algorithm.overlong_filter": True}
    )
    trainer = RLTrainer(cfg, make_service(tmp_path))
    assert trainer.start_step == 1
    calls = record(trainer)
    (metrics,) = trainer.run()
    assert metrics["response/truncated_frac"] == 1.0
    assert abs(metrics["kl/mean"]) > 1e-4  # the policy moved: a KL term would be nonzero
    # Nothing with a gradient: no datum sent, or only all-zero ones.
    assert metrics["train/datums_without_gradient"] == metrics["train/sequences"]
    for datums, *_ in calls.calls:
        for datum in datums:
            assert not np.any(np.asarray(datum.loss_fn_inputs["advantages"].tolist()))


# ---- 4 / 5. presets ---------------------------------------------------------------------------


def test_presets():
    rpp = composed("algorithm=reinforce_pp").get("algorithm")
    assert rpp["advantage_estimator"] == "reinforce++"
    assert rpp["kl_coef"] > 0 and rpp["kl_estimator"] == "k1"  # KL in the reward: k1
    drg = composed("algorithm=dr_grpo").get("algorithm")
    assert drg["advantage_estimator"] == "dr_grpo"
    assert drg["loss_reduction"] == "seq_mean_token_sum_norm"


# ---- 6. clip fraction -------------------------------------------------------------------------


def test_clip_rules_against_hand_computed_tokens():
    lo, hi = 0.8, 1.2
    ratio = np.array([1.5, 1.5, 0.5, 0.5, 1.0, 1.5, 0.5])
    adv = np.array([1.0, -1.0, 1.0, -1.0, 1.0, 0.0, 0.0])
    lp, ref = np.log(ratio), np.zeros(7)
    # ppo: the clipped term is active for A > 0 above hi and A < 0 below lo only
    ppo = POLICY_LOSSES["ppo"].clipped(lp, ref, adv, lo, hi)
    assert ppo.tolist() == [True, False, False, True, False, False, False]
    # cispo: the weight is clamped wherever the ratio is outside, on tokens with an advantage
    cispo = POLICY_LOSSES["cispo"].clipped(lp, ref, adv, lo, hi)
    assert cispo.tolist() == [True, True, True, True, False, False, False]
    # gspo: one sequence ratio exp(mean log r) for every token
    s_lp = np.log([1.5, 1.3, 1.4])  # mean log-ratio -> s ~ 1.397 > hi
    gspo = POLICY_LOSSES["gspo"].clipped(s_lp, np.zeros(3), np.array([1.0, -1.0, 0.0]), lo, hi)
    assert gspo.tolist() == [True, False, False]
    for name in ("importance_sampling", "dro"):
        assert POLICY_LOSSES[name].clipped is None


def test_clip_frac_in_the_loop(tmp_path, tiny_model_dir, rewards, monkeypatch):
    """ppo with two mini-batches (the second is off-policy): train/clip_frac is the share of
    response tokens whose clipped term was active, recomputed here from the requests and the
    learner's log-probs; importance_sampling reports no clip fraction at all."""
    cfg = quick_config(
        tmp_path,
        tiny_model_dir,
        f"{rewards}:vowel_share",
        **{
            "algorithm.loss_fn": "ppo",
            "algorithm.num_mini_batches": 2,
            "algorithm.learning_rate": 0.1,
            "algorithm.loss_fn_config": {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
        },
    )
    trainer = RLTrainer(cfg, make_service(tmp_path))
    calls = record(trainer)
    batches = spy_on_batches(monkeypatch)
    (metrics,) = trainer.run()
    prompts = [g.prompt_tokens for b in batches for g in b.sampled]
    clipped = response_tokens = 0
    for datums, _, _, future in calls.calls:
        for datum, out in zip(datums, future.result().loss_fn_outputs, strict=True):
            ints = datum.model_input.to_ints()
            prompt_len = next(len(p) for p in prompts if ints[: len(p)] == p)
            response_tokens += len(ints) - (prompt_len - 1)
            ratio = np.exp(
                np.asarray(out["logprobs"].tolist(), dtype=np.float64)
                - np.asarray(datum.loss_fn_inputs["logprobs"].tolist())
            )
            adv = np.asarray(datum.loss_fn_inputs["advantages"].tolist())
            clipped += int((((adv > 0) & (ratio > 1.05)) | ((adv < 0) & (ratio < 0.95))).sum())
    assert clipped > 0
    assert metrics["train/clip_frac"] == pytest.approx(clipped / response_tokens, rel=1e-9)

    cfg = quick_config(tmp_path / "is", tiny_model_dir, f"{rewards}:vowel_share")
    (metrics,) = RLTrainer(cfg, make_service(tmp_path / "is")).run()
    assert "train/clip_frac" not in metrics


# ---- 7. loss_fn_config and what the loss needs, at start-up ----------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+algorithm.loss_fn_config.clip_ratio=0.2"], "algorithm.loss_fn_config.clip_ratio"),
        (
            ["algorithm.loss_fn=dro", "+algorithm.loss_fn_config.clip_low_threshold=0.9"],
            "algorithm.loss_fn_config.clip_low_threshold: unknown key for loss 'dro'",
        ),
        (
            ["algorithm.loss_fn=importance_sampling", "+algorithm.loss_fn_config.beta=0.1"],
            "algorithm.loss_fn_config.beta: unknown key",
        ),
        (
            ["+algorithm.loss_fn_config.clip_low_threshold=1.5"],
            "clip_low_threshold: 1.5 is outside",
        ),
        (
            ["+algorithm.loss_fn_config.clip_high_threshold=0.2"],
            "clip_high_threshold: 0.2 is outside",
        ),
        (["+algorithm.loss_fn_config.clip_high_threshold=true"], "must be a number"),
        (["+algorithm.loss_fn_config.clip_high_threshold=nan"], "clip_high_threshold: nan"),
        (["algorithm.loss_fn=dro", "+algorithm.loss_fn_config.beta=-0.1"], "beta: -0.1 is outside"),
        (["algorithm.gamma=0"], "algorithm.gamma"),
        (["algorithm.gamma=1.5"], "algorithm.gamma"),
        (["algorithm.max_seq_len=0"], "algorithm.max_seq_len"),
        (
            ["algorithm.dynamic_sampling=true", "algorithm.group_size=1"],
            "algorithm.dynamic_sampling",
        ),
    ],
)
def test_bad_algorithm_settings_fail_at_start_up(overrides, message):
    cfg = build_config(composed(*overrides), TrainerConfig)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate_config(cfg)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        RLTrainer(cfg, service=None)  # refused before it touches the service


def test_trainer_loss_table_matches_the_backend_registry():
    """The trainer's knowledge of each loss (config keys and defaults, inputs it adds) agrees
    with the backend's registry, so start-up checks refuse exactly what the backend would."""
    for name, loss in POLICY_LOSSES.items():
        spec = LOSS_FNS[name]
        assert {k: r.default for k, r in loss.config.items()} == spec.config_defaults, name
        extra = loss.extra_inputs(np.ones(3)) if loss.extra_inputs else {}
        assert set(spec.required_inputs) <= {"logprobs", "advantages", *extra}, name
        assert set(extra) <= {*spec.required_inputs, *spec.optional_inputs}, name


# ---- 8. dynamic sampling takes exactly what it needs ------------------------------------------


def test_dynamic_sampling_samples_every_prompt_it_takes(tmp_path, tiny_model_dir, rewards):
    """Before: each refill round took a full batch from the stream and dropped the prompts it
    did not need. Now the stream advances by exactly the prompts sampled, and a step never
    trains more than batch_size groups."""
    cfg = quick_config(
        tmp_path,
        tiny_model_dir,
        f"{rewards}:odd_vowel_share",
        steps=3,
        **{"algorithm.dynamic_sampling": True, "algorithm.max_refill_rounds": 3},
    )
    trainer = RLTrainer(cfg, make_service(tmp_path))
    history = trainer.run()
    sampled = sum(m["groups/sampled"] for m in history)
    stream = trainer.run_state.stream
    assert stream.epoch * len(stream._problems) + stream.position == sampled
    assert any(m["groups/sampled"] > cfg.algorithm.batch_size for m in history)  # refills ran
    for m in history:
        assert m["train/sequences"] <= cfg.algorithm.batch_size * cfg.algorithm.group_size


# ---- learning-rate schedule -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # steps=6, warmup 2, lr 1.0: warm-up (s+1)/2, then progress p = (s-2)/4
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]),
        (
            "cosine",
            [
                0.5,
                1.0,
                1.0,
                0.5 * (1 + math.cos(math.pi / 4)),
                0.5,
                0.5 * (1 - math.cos(math.pi / 4)),
            ],
        ),
    ],
)
def test_learning_rate_schedules(schedule, expected):
    cfg = TrainerConfig(steps=6)
    cfg.algorithm.learning_rate, cfg.algorithm.warmup_steps = 1.0, 2
    cfg.algorithm.lr_schedule = schedule
    assert [learning_rate(cfg, s) for s in range(6)] == pytest.approx(expected, abs=1e-15)
    cfg.algorithm.warmup_steps = 0
    assert learning_rate(cfg, 0) == 1.0
