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
from skyrl_trainer.trainer.kl import estimate_kl
from skyrl_trainer.trainer.off_policy import truncated_importance_weights
from skyrl_trainer.trainer.reductions import loss_weights

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
    def constant(rewards_GN, lengths_GN, settings, kl_GN):
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
    masks = [np.ones(2), np.ones(4)]
    token = loss_weights(masks, "token_mean")
    np.testing.assert_allclose(np.concatenate(token), [1 / 6] * 6)
    seq = loss_weights(masks, "sequence_mean")
    np.testing.assert_allclose(np.concatenate(seq), [1 / 4, 1 / 4] + [1 / 8] * 4)
    drg = loss_weights(masks, "seq_mean_token_sum_norm", max_seq_len=10)
    np.testing.assert_allclose(np.concatenate(drg), [1 / 20] * 6)
    # token_mean: the weighted sum equals the mean over tokens however the batch is chunked
    adv = [np.array([1.0, 1.0]), np.full(4, 2.0)]
    assert sum((a * w).sum() for a, w in zip(adv, token)) == pytest.approx(5 / 3)
    with pytest.raises(ValueError, match="algorithm.max_seq_len"):
        loss_weights(masks, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="algorithm.loss_reduction"):
        loss_weights(masks, "mean")


def test_masked_tokens_leave_the_reduction():
    """An overlong-filtered response (mask 0) gets weight 0 and is not counted: the others are
    reduced as if it were not in the mini-batch."""
    masks = [np.ones(2), np.zeros(3), np.ones(4)]
    kept = [masks[0], masks[2]]
    for reduction in ("token_mean", "sequence_mean", "seq_mean_token_sum_norm"):
        got = loss_weights(masks, reduction, max_seq_len=10)
        want = loss_weights(kept, reduction, max_seq_len=10)
        assert np.all(got[1] == 0)
        np.testing.assert_allclose(np.concatenate([got[0], got[2]]), np.concatenate(want))
    assert all(np.all(w == 0) for w in loss_weights([np.zeros(3)], "token_mean"))


def test_kl_estimators_and_penalty():
    lp, ref = np.array([-1.0, -2.0, -0.5]), np.array([-1.5, -2.0, -0.1])
    d = lp - ref
    np.testing.assert_allclose(estimate_kl(lp, ref, "k1"), d)
    np.testing.assert_allclose(estimate_kl(lp, ref, "k2"), 0.5 * d**2)
    np.testing.assert_allclose(estimate_kl(lp, ref, "k3"), np.exp(-d) + d - 1)
    assert np.all(estimate_kl(lp, ref, "k3") >= 0)
    with pytest.raises(ValueError, match="algorithm.kl_estimator"):
        estimate_kl(lp, ref, "k4")


def test_truncated_importance_weights():
    w = truncated_importance_weights(np.log([0.5, 0.9]), np.log([0.25, 0.9]), cap=1.5)
    np.testing.assert_allclose(w, [1.5, 1.0])


def test_group_estimators_subtract_the_centred_kl():
    """grpo / dr_grpo / rloo: A_t = score - kl_coef * (kl_t - mean kl over the batch's tokens)."""
    rewards, lengths = [[1.0, 0.0]], [[2, 1]]
    kl = [[np.array([0.1, 0.3]), np.array([0.2])]]
    got = compute_advantages("dr_grpo", rewards, lengths, EstimatorSettings(kl_coef=0.5), kl)
    np.testing.assert_allclose(np.concatenate(got[0]), [0.5 + 0.05, 0.5 - 0.05, -0.5], atol=1e-15)


def reinforce_pp_reference(rewards, kl, gamma, coef, eps=1e-6):
    """Published REINFORCE++ in float64, written independently of the module: token rewards
    -coef * kl_t with the outcome reward added on the last token, returns as a matrix product
    G = U r with U[t, k] = gamma^(k - t) for k >= t, then whitening over all tokens of the batch
    with the population std."""
    returns = []
    for s, k in zip(rewards, kl, strict=True):
        n = len(k)
        r = -coef * np.asarray(k, dtype=np.float64)
        r[n - 1] = r[n - 1] + s
        t = np.arange(n)
        U = np.where(t[None, :] >= t[:, None], gamma ** (t[None, :] - t[:, None]), 0.0)
        returns.append(U @ r)
    flat = np.concatenate(returns)
    mean = flat.sum() / flat.size
    std = np.sqrt(((flat - mean) ** 2).sum() / flat.size)
    return [(g - mean) / (std + eps) for g in returns]


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
@pytest.mark.parametrize("coef", [0.0, 0.05, 1.0])
def test_reinforce_pp_matches_the_published_definition(gamma, coef):
    """KL goes into the token rewards and through the discounted return BEFORE whitening (the
    old code whitened the outcome-only return and subtracted a centred KL afterwards)."""
    rng = np.random.default_rng(int(gamma * 10 + coef * 100))
    rewards_GN = [[1.0, 0.0, 0.5], [0.0, 2.0]]
    lengths_GN = [[4, 1, 6], [3, 5]]
    kl_GN = [[rng.normal(0.0, 0.3, n) for n in ls] for ls in lengths_GN]
    settings = EstimatorSettings(gamma=gamma, kl_coef=coef)
    got = compute_advantages("reinforce++", rewards_GN, lengths_GN, settings, kl_GN)
    want = reinforce_pp_reference(
        [s for g in rewards_GN for s in g], [k for g in kl_GN for k in g], gamma, coef
    )
    for a, b in zip([x for g in got for x in g], want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    flat = np.concatenate(want)
    assert abs(flat.mean()) < 1e-12 and flat.std() == pytest.approx(1.0, abs=1e-5)
