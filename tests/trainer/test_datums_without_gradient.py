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
