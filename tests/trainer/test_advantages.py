"""Advantage estimators, reductions, KL and TIS against hand-computed values."""

import math

import numpy as np
import pytest

from skyrl_trainer.trainer.advantages import (
    ADVANTAGE_ESTIMATORS,
    EstimatorSettings,
    compute_advantages,
    is_zero_variance,
    register_advantage_estimator,
)
from skyrl_trainer.trainer.kl import apply_kl_penalty, estimate_kl
from skyrl_trainer.trainer.off_policy import truncated_importance_weights
from skyrl_trainer.trainer.reductions import fold_loss_reduction

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5], [2.0]]
LENGTHS = [[2, 3, 1, 4], [1, 2], [3]]
S = EstimatorSettings()


def scalars(per_group):
    """Each sample's (constant) advantage, checking it is broadcast over its tokens."""
    out = []
    for group, lengths in zip(per_group, LENGTHS, strict=True):
        row = []
        for adv, n in zip(group, lengths, strict=True):
            assert len(adv) == n and np.all(adv == adv[0])
            row.append(float(adv[0]))
        out.append(row)
    return out


def test_grpo():
    got = scalars(compute_advantages("grpo", REWARDS, LENGTHS, S))
    std = math.sqrt(sum((x - 0.5) ** 2 for x in REWARDS[0]) / 3)  # unbiased: 0.5774
    assert got[0] == pytest.approx(
        [0.5 / (std + 1e-6), -0.5 / (std + 1e-6)] * 1 + [-0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    )
    assert got[1] == [0.0, 0.0]  # equal rewards
    assert got[2] == [0.0]  # group of one: mean 0 after centring


def test_dr_grpo_and_rloo():
    assert scalars(compute_advantages("dr_grpo", REWARDS, LENGTHS, S))[0] == [0.5, -0.5, -0.5, 0.5]
    rloo = scalars(compute_advantages("rloo", REWARDS, LENGTHS, S))
    # reward minus the mean of the other three: 1 - 1/3, 0 - 2/3
    assert rloo[0] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert rloo[2] == [0.0]


def test_reinforce_pp_discounts_and_whitens():
    rewards, lengths = [[1.0, 0.0]], [[3, 2]]
    got = compute_advantages("reinforce++", rewards, lengths, EstimatorSettings(gamma=0.5))
    returns = np.array([0.25, 0.5, 1.0, 0.0, 0.0])  # gamma^(T-1-t) * s
    expected = (returns - returns.mean()) / (returns.std() + 1e-6)
    np.testing.assert_allclose(np.concatenate(got[0]), expected, rtol=1e-12)


def test_unknown_estimator_and_registering_one():
    with pytest.raises(ValueError, match="algorithm.advantage_estimator"):
        compute_advantages("nope", REWARDS, LENGTHS, S)

    @register_advantage_estimator("test_constant")
    def constant(rewards_GN, lengths_GN, settings):
        return [[np.full(n, 7.0) for n in ls] for ls in lengths_GN]

    try:
        assert scalars(compute_advantages("test_constant", REWARDS, LENGTHS, S))[1] == [7.0, 7.0]
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_constant")(constant)
    finally:
        del ADVANTAGE_ESTIMATORS["test_constant"]


def test_zero_variance():
    assert is_zero_variance([1.0, 1.0]) and is_zero_variance([0.0]) and is_zero_variance([])
    assert not is_zero_variance([0.0, 1.0])


def test_loss_reductions():
    adv = [np.array([1.0, 1.0]), np.array([2.0, 2.0, 2.0, 2.0])]
    token = fold_loss_reduction(adv, "token_mean")
    np.testing.assert_allclose(np.concatenate(token), [1 / 6, 1 / 6, 2 / 6, 2 / 6, 2 / 6, 2 / 6])
    seq = fold_loss_reduction(adv, "sequence_mean")
    np.testing.assert_allclose(np.concatenate(seq), [1 / 4, 1 / 4, 2 / 8, 2 / 8, 2 / 8, 2 / 8])
    drg = fold_loss_reduction(adv, "seq_mean_token_sum_norm", max_seq_len=10)
    np.testing.assert_allclose(np.concatenate(drg), [1 / 20] * 2 + [2 / 20] * 4)
    # token_mean: the summed loss equals the mean over tokens however the batch is chunked
    assert sum(a.sum() for a in token) == pytest.approx(np.concatenate(adv).mean())
    with pytest.raises(ValueError, match="algorithm.max_seq_len"):
        fold_loss_reduction(adv, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="algorithm.loss_reduction"):
        fold_loss_reduction(adv, "mean")


def test_kl_estimators_and_penalty():
    lp, ref = np.array([-1.0, -2.0, -0.5]), np.array([-1.5, -2.0, -0.1])
    d = lp - ref
    np.testing.assert_allclose(estimate_kl(lp, ref, "k1"), d)
    np.testing.assert_allclose(estimate_kl(lp, ref, "k2"), 0.5 * d**2)
    np.testing.assert_allclose(estimate_kl(lp, ref, "k3"), np.exp(-d) + d - 1)
    assert np.all(estimate_kl(lp, ref, "k3") >= 0)
    with pytest.raises(ValueError, match="algorithm.kl_estimator"):
        estimate_kl(lp, ref, "k4")
    adv = [np.ones(2), np.zeros(1)]
    kl = [np.array([0.1, 0.3]), np.array([0.2])]
    new, mean_kl = apply_kl_penalty(adv, kl, coef=0.5)
    assert mean_kl == pytest.approx(0.2)
    np.testing.assert_allclose(np.concatenate(new), [1 + 0.05, 1 - 0.05, 0.0], atol=1e-12)


def test_truncated_importance_weights():
    w = truncated_importance_weights(np.log([0.5, 0.9]), np.log([0.25, 0.9]), cap=1.5)
    np.testing.assert_allclose(w, [1.5, 1.0])
