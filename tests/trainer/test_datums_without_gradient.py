"""Datums that add nothing to the gradient are not sent: a GRPO group whose rewards were all equal
has all-zero advantages, so its forward (and backward) would be wasted work. The update is the
same as sending them (the loss is a sum; reductions are taken over the whole mini-batch first)."""

from __future__ import annotations

import numpy as np
import pytest

from skyrl_trainer.trainer.advantages import is_zero_variance
from skyrl_trainer.trainer.loop import RLTrainer
from skyrl_trainer.trainer.policy_losses import POLICY_LOSSES
from tests.trainer.loop_helpers import (
    make_config,
    make_service,
    record,
    spy_on_batches,
    write_reward_module,
)


@pytest.mark.parametrize("loss_fn", sorted(POLICY_LOSSES))
def test_has_gradient(loss_fn):
    loss = POLICY_LOSSES[loss_fn]
    w = np.array([0.5, 0.5, 0.0])
    assert loss.has_gradient(np.array([0.0, 0.3, 0.0]), w)
    assert loss.has_gradient(np.zeros(3), np.zeros(3)) is False
    # dro's penalty acts on every weighted token, advantage or not.
    assert loss.has_gradient(np.zeros(3), w) is (loss_fn == "dro")


def test_zero_variance_groups_are_not_sent_and_the_rest_are(tmp_path, tiny_model_dir, monkeypatch):
    """About half the groups have zero reward variance (odd_vowel_share): exactly their datums are
    left out, every other rollout is sent once per epoch, and the skipped count is reported."""
    reward = f"{write_reward_module(tmp_path, monkeypatch)}:odd_vowel_share"
    cfg = make_config(
        tmp_path,
        tiny_model_dir,
        reward,
        steps=2,
        **{"eval.every": 0, "checkpoint.every": 0, "algorithm.num_mini_batches": 2},
    )
    trainer = RLTrainer(cfg, make_service(tmp_path))
    calls = record(trainer)
    batches = spy_on_batches(monkeypatch)
    history = trainer.run()
    groups_seen = [b.groups for b in batches]
    sent = sum(len(datums) for datums, *_ in calls.calls)
    live = sum(
        len(g.rollouts) for groups in groups_seen for g in groups if not is_zero_variance(g.rewards)
    )
    dead = sum(len(g.rollouts) for groups in groups_seen for g in groups) - live
    assert dead > 0 and live > 0, "the reward should give both kinds of groups"
    assert sent == live
    assert sum(m["train/datums_without_gradient"] for m in history) == dead
    for datums, *_ in calls.calls:
        for datum in datums:
            assert np.any(datum.loss_fn_inputs["advantages"].to_numpy() != 0)


def test_a_step_without_gradient_still_takes_its_optimizer_step(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Step 0 has reward signal; in step 1 every group's rewards are equal. Step 1 sends no
    forward_backward, but each mini-batch still takes its AdamW step: the momentum of step 0
    moves the weights again (as TRL's AdamW does on a zero loss), and a new sampler is used."""
    (tmp_path / "first_batch_rewards.py").write_text(
        "calls = [0]\n"
        "def reward(response, sample):\n"
        "    calls[0] += 1\n"
        "    text = response.replace(' ', '')\n"
        "    return sum(c in 'aeiou' for c in text) / max(len(text), 1) if calls[0] <= 16 else 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make_config(
        tmp_path,
        tiny_model_dir,
        "first_batch_rewards:reward",
        steps=2,
        **{"eval.every": 0, "checkpoint.every": 0, "algorithm.num_mini_batches": 2},
    )
    trainer = RLTrainer(cfg, make_service(tmp_path))
    calls = record(trainer)
    optim_steps = []
    optim_step = trainer.training._inner.optim_step
    trainer.training.optim_step = lambda adam: optim_steps.append(adam) or optim_step(adam)
    probe = trainer.training.forward  # a fixed datum's log-probs show whether the weights moved
    datum = make_probe_datum()

    first = trainer.step(0)
    sent_in_first = len(calls.calls)
    after_first = probe([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    second = trainer.step(1)
    after_second = probe([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()

    assert sent_in_first > 0 and first["train/datums_without_gradient"] < first["train/sequences"]
    assert len(calls.calls) == sent_in_first, "step 1 had no gradient: nothing may be sent"
    assert second["train/datums_without_gradient"] == second["train/sequences"]
    assert len(optim_steps) == 4  # two mini-batches in each step
    assert max(abs(a - b) for a, b in zip(after_first, after_second, strict=True)) > 1e-5


def make_probe_datum():
    from tinker import types

    tokens = [1, 504, 3300, 314, 253, 1789, 30]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
