"""Tests for skyrl_trainer.backend.losses.

Values are checked against independent numpy float64 references written from the Tinker formulas
(not from the module's code); gradients against finite differences (torch.autograd.gradcheck) where
the loss's gradient is the derivative of its value, and against hand-derived gradients for the
clipped and stop-gradient losses (cispo's and gspo's gradients are surrogate gradients by design,
so finite differences of their values do not apply).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.losses import (
    LOSS_FNS,
    LossSpec,
    check_loss_inputs,
    get_loss,
    register_loss,
    resolve_loss_config,
)

N = 64
LO, HI = 0.8, 1.2
BUILTINS = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
TOKEN_SEPARABLE = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")


# ---------------------------------------------------------------------------------------------
# Data


def _away_from(values: np.ndarray, kinks: tuple[float, ...], margin: float) -> bool:
    return all(np.all(np.abs(values - k) > margin) for k in kinks)


def make_datum(seed: int = 0, n: int = N) -> dict[str, np.ndarray]:
    """Random float64 datum; ratios well inside and well outside [LO, HI], advantages of both
    signs and away from 0, so that no token sits on a kink of the clipped losses."""
    rng = np.random.default_rng(seed)
    lp = -rng.exponential(1.0, size=n) - 0.01
    log_ratio = rng.uniform(-0.6, 0.6, size=n)
    while not _away_from(np.exp(log_ratio), (LO, HI), 0.02):
        bad = ~np.all([np.abs(np.exp(log_ratio) - k) > 0.02 for k in (LO, HI)], axis=0)
        log_ratio[bad] = rng.uniform(-0.6, 0.6, size=int(bad.sum()))
    adv = rng.normal(0.0, 1.0, size=n)
    adv = np.where(np.abs(adv) < 0.05, 0.5 * np.sign(adv) + 0.05, adv)
    ratio = np.exp(log_ratio)
    # The sample must exercise every branch of the clipped objective.
    assert (adv > 0).any() and (adv < 0).any()
    assert ((ratio > LO) & (ratio < HI)).any() and (ratio > HI).any() and (ratio < LO).any()
    return {
        "lp": lp,
        "logprobs": lp - log_ratio,
        "advantages": adv,
        "weights": rng.uniform(0.0, 1.0, size=n),
        "sequence_ratio_mask": (rng.uniform(size=n) < 0.7).astype(np.float64),
        "target_tokens": rng.integers(0, 1000, size=n),
    }


def to_inputs(d: dict[str, np.ndarray], dtype=torch.float32) -> dict[str, torch.Tensor]:
    out = {k: torch.tensor(v, dtype=dtype) for k, v in d.items() if k not in ("lp",)}
    out["target_tokens"] = torch.tensor(d["target_tokens"], dtype=torch.int64)
    return out


def lp_tensor(d: dict[str, np.ndarray], dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(d["lp"], dtype=dtype, requires_grad=True)


def run(name: str, d, config=None, *, inputs_dtype=torch.float64, lp_dtype=torch.float64):
    """Loss value (float) and gradient wrt lp (numpy) of the registered loss `name`."""
    spec = get_loss(name)
    lp = lp_tensor(d, lp_dtype)
    inputs = to_inputs(d, inputs_dtype)
    loss = spec.fn(lp, inputs, resolve_loss_config(spec, config))
    assert loss.dim() == 0
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad.numpy()


# ---------------------------------------------------------------------------------------------
# Independent numpy references (float64)


def ref_ce(d):
    return -np.sum(d["lp"] * d["weights"])


def ref_is(d):
    return -np.sum(np.exp(d["lp"] - d["logprobs"]) * d["advantages"])


def ref_ppo(d, lo=LO, hi=HI):
    r = np.exp(d["lp"] - d["logprobs"])
    a = d["advantages"]
    return -np.sum(np.minimum(r * a, np.clip(r, lo, hi) * a))


def ref_ppo_grad(d, lo=LO, hi=HI):
    # min(rA, clip(r)A) picks the clipped (constant) term iff A > 0 and r > hi, or A < 0 and r < lo.
    r = np.exp(d["lp"] - d["logprobs"])
    a = d["advantages"]
    clipped = ((a > 0) & (r > hi)) | ((a < 0) & (r < lo))
    return np.where(clipped, 0.0, -a * r)


def ref_cispo(d, lo=LO, hi=HI):
    r = np.exp(d["lp"] - d["logprobs"])
    return -np.sum(np.clip(r, lo, hi) * d["lp"] * d["advantages"])


def ref_cispo_grad(d, lo=LO, hi=HI):
    return -np.clip(np.exp(d["lp"] - d["logprobs"]), lo, hi) * d["advantages"]


def ref_dro(d, beta):
    """Tinker's dro with our per-token penalty weights (w = 1 without `weights`)."""
    lp, slp, a = d["lp"], d["logprobs"], d["advantages"]
    w = d.get("weights", np.ones_like(lp))
    return -np.sum(lp * a - 0.5 * beta * w * (lp - slp) ** 2)


def ref_gspo_seq_ratio(d):
    m = d["sequence_ratio_mask"] != 0
    if not m.any():
        return 1.0
    return float(np.exp(np.mean(d["lp"][m] - d["logprobs"][m])))


def ref_gspo(d, lo=LO, hi=HI):
    s = ref_gspo_seq_ratio(d)
    a = d["advantages"]
    return -np.sum(np.minimum(s * a, np.clip(s, lo, hi) * a))


def ref_gspo_grad(d, lo=LO, hi=HI):
    s = ref_gspo_seq_ratio(d)
    a = d["advantages"]
    clipped = ((a > 0) & (s > hi)) | ((a < 0) & (s < lo))
    return np.where(clipped, 0.0, -a * s)


# ---------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_values_match_numpy_references(seed):
    d = make_datum(seed)
    expected = {
        "cross_entropy": ref_ce(d),
        "importance_sampling": ref_is(d),
        "ppo": ref_ppo(d),
        "cispo": ref_cispo(d),
        "dro": ref_dro(d, 0.05),
        "gspo": ref_gspo(d),
    }
    for name, want in expected.items():
        got, _ = run(name, d)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12), name


def test_values_with_custom_config():
    d = make_datum(3)
    got, _ = run("ppo", d, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05})
    assert got == pytest.approx(ref_ppo(d, 0.9, 1.05), rel=1e-12)
    got, _ = run("cispo", d, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.1})
    assert got == pytest.approx(ref_cispo(d, 0.5, 1.1), rel=1e-12)
    got, _ = run("dro", d, {"beta": 0.7})
    assert got == pytest.approx(ref_dro(d, 0.7), rel=1e-12)
    got, _ = run("gspo", d, {"clip_low_threshold": 0.95, "clip_high_threshold": 1.01})
    assert got == pytest.approx(ref_gspo(d, 0.95, 1.01), rel=1e-12)


def test_ppo_clipping_changes_the_value():
    """Guard against a ppo that silently degenerates to importance_sampling."""
    d = make_datum(0)
    assert abs(ref_ppo(d) - ref_is(d)) > 1e-3
    assert run("ppo", d)[0] != pytest.approx(run("importance_sampling", d)[0], rel=1e-6)


@pytest.mark.parametrize("name", BUILTINS)
def test_float32_learner_logprobs(name):
    d = make_datum(4)
    spec = get_loss(name)
    lp = lp_tensor(d, torch.float32)
    loss = spec.fn(lp, to_inputs(d, torch.float32), resolve_loss_config(spec, None))
    assert loss.dtype == torch.float32 and loss.dim() == 0
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    want, _ = run(name, d)
    assert loss.item() == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_float64_logprobs_with_float32_inputs_stay_float64():
    d = make_datum(5)
    spec = get_loss("ppo")
    loss = spec.fn(lp_tensor(d), to_inputs(d, torch.float32), resolve_loss_config(spec, None))
    assert loss.dtype == torch.float64
    # float32 inputs: compare with the reference on the rounded inputs.
    d32 = {k: (v.astype(np.float32).astype(np.float64) if k != "lp" else v) for k, v in d.items()}
    assert loss.item() == pytest.approx(ref_ppo(d32), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "dro"])
def test_gradcheck_against_finite_differences(name):
    """For these losses the gradient is the true derivative of the value; the sample points are
    at least 0.02 away from ppo's kinks in the ratio, far beyond gradcheck's step."""
    d = make_datum(6, n=24)
    spec = get_loss(name)
    inputs = to_inputs(d, torch.float64)
    config = resolve_loss_config(spec, None)
    assert torch.autograd.gradcheck(lambda lp: spec.fn(lp, inputs, config), (lp_tensor(d),))


def test_ppo_gradient_matches_hand_derivation():
    d = make_datum(7)
    _, grad = run("ppo", d)
    want = ref_ppo_grad(d)
    np.testing.assert_allclose(grad, want, rtol=1e-12, atol=1e-15)
    # Some tokens are clipped (zero gradient) and some are not.
    assert (want == 0).any() and (want != 0).any()


def test_simple_losses_gradients_match_hand_derivation():
    d = make_datum(8)
    np.testing.assert_allclose(run("cross_entropy", d)[1], -d["weights"], rtol=1e-15)
    r = np.exp(d["lp"] - d["logprobs"])
    np.testing.assert_allclose(run("importance_sampling", d)[1], -d["advantages"] * r, rtol=1e-12)
    beta = 0.3
    want = -(d["advantages"] - beta * d["weights"] * (d["lp"] - d["logprobs"]))
    np.testing.assert_allclose(run("dro", d, {"beta": beta})[1], want, rtol=1e-12, atol=1e-15)


def test_dro_without_weights_is_tinkers_formula():
    d = make_datum(8)
    del d["weights"]
    value, grad = run("dro", d, {"beta": 0.3})
    lp, slp, a = d["lp"], d["logprobs"], d["advantages"]
    assert value == pytest.approx(-np.sum(lp * a - 0.15 * (lp - slp) ** 2), rel=1e-12)
    np.testing.assert_allclose(grad, -(a - 0.3 * (lp - slp)), rtol=1e-12, atol=1e-15)


def test_dro_penalty_skips_zero_weight_positions():
    """Prompt positions (advantage 0, weight 0) get no gradient whatever their placeholder
    sampler log-prob; the penalty elsewhere is scaled by the token's weight, like its advantage
    (the reduction folded into both)."""
    d = make_datum(26)
    d["advantages"][:10] = 0.0
    d["weights"][:10] = 0.0
    d["logprobs"][:10] = 0.0  # the trainer's placeholder
    base_value, base_grad = run("dro", d, {"beta": 0.5})
    assert np.all(base_grad[:10] == 0)
    d["logprobs"][:10] = -1e4  # any placeholder: nothing changes
    value, grad = run("dro", d, {"beta": 0.5})
    assert value == base_value and np.array_equal(grad, base_grad)
    assert value == pytest.approx(ref_dro(d, 0.5), rel=1e-12)
    # Scaling every weight and advantage by c (a reduction) scales the loss and gradient by c.
    scaled = {**d, "advantages": d["advantages"] / 7, "weights": d["weights"] / 7}
    value7, grad7 = run("dro", scaled, {"beta": 0.5})
    assert value7 == pytest.approx(value / 7, rel=1e-12)
    np.testing.assert_allclose(grad7, grad / 7, rtol=1e-12, atol=1e-15)


def test_dro_negative_weights_refused():
    inputs = to_inputs(make_datum(27))
    inputs["weights"][3] = -0.5
    with pytest.raises(InvalidRequestError) as err:
        check_loss_inputs(get_loss("dro"), inputs)
    assert err.value.field == "loss_fn_inputs.weights"


def test_cispo_gradient_stops_at_the_clipped_ratio():
    """d/dlp of -sum(sg(clip(r)) * lp * A) is exactly -clip(r) * A: no term through the ratio."""
    d = make_datum(9)
    _, grad = run("cispo", d)
    want = ref_cispo_grad(d)
    np.testing.assert_allclose(grad, want, rtol=1e-14, atol=0)
    # Without the stop-gradient, unclipped tokens would get an extra -r * lp * A term.
    r = np.exp(d["lp"] - d["logprobs"])
    inside = (r > LO) & (r < HI)
    no_sg = want - np.where(inside, r * d["lp"] * d["advantages"], 0.0)
    assert np.max(np.abs(grad - no_sg)) > 1e-3


def test_gspo_gradient_shares_the_sequence_ratio():
    d = make_datum(10)
    s = ref_gspo_seq_ratio(d)
    assert LO < s < HI  # unclipped: every token's gradient is -A_t * s
    _, grad = run("gspo", d)
    np.testing.assert_allclose(grad, ref_gspo_grad(d), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(grad / -d["advantages"], np.full(N, s), rtol=1e-12)
    # Unmasked tokens are trained too (only the ratio's definition uses the mask).
    unmasked = d["sequence_ratio_mask"] == 0
    assert unmasked.any() and np.all(grad[unmasked] != 0)


@pytest.mark.parametrize("shift, clipped_sign", [(0.4, 1), (-0.4, -1)])
def test_gspo_clips_the_shared_ratio_by_advantage_sign(shift, clipped_sign):
    """Shifting the sampler log-probs moves s outside [LO, HI]: then every token whose advantage
    has the clipped sign gets zero gradient and the others get -A_t * s."""
    d = make_datum(11)
    d["logprobs"] = d["logprobs"] - shift
    s = ref_gspo_seq_ratio(d)
    assert s > HI if clipped_sign > 0 else s < LO
    value, grad = run("gspo", d)
    assert value == pytest.approx(ref_gspo(d), rel=1e-12)
    a = d["advantages"]
    clipped = np.sign(a) == clipped_sign
    assert np.all(grad[clipped] == 0)
    np.testing.assert_allclose(grad[~clipped], -a[~clipped] * s, rtol=1e-12)


def test_gspo_equals_importance_sampling_when_all_ratios_are_one():
    d = make_datum(12)
    d["logprobs"] = d["lp"].copy()
    v_gspo, g_gspo = run("gspo", d)
    v_is, g_is = run("importance_sampling", d)
    assert v_gspo == pytest.approx(v_is, rel=1e-14)
    assert v_gspo == pytest.approx(-np.sum(d["advantages"]), rel=1e-12)
    np.testing.assert_allclose(g_gspo, g_is, rtol=1e-14)


def test_gspo_ignores_sampler_logprobs_outside_the_mask():
    d = make_datum(13)
    base = run("gspo", d)
    unmasked = d["sequence_ratio_mask"] == 0
    d["logprobs"] = np.where(unmasked, d["logprobs"] - 50.0, d["logprobs"])
    value, grad = run("gspo", d)
    assert value == pytest.approx(base[0], rel=1e-14)
    np.testing.assert_allclose(grad, base[1], rtol=1e-14)


def test_gspo_all_zero_mask_is_on_policy_not_nan():
    d = make_datum(14)
    d["sequence_ratio_mask"] = np.zeros(N)
    value, grad = run("gspo", d)
    assert math.isfinite(value) and np.all(np.isfinite(grad))
    assert value == pytest.approx(-np.sum(d["advantages"]), rel=1e-12)
    np.testing.assert_allclose(grad, -d["advantages"], rtol=1e-14)


@pytest.mark.parametrize("name", BUILTINS)
def test_empty_datum_gives_zero(name):
    d = make_datum(15)
    d = {k: v[:0] for k, v in d.items()}
    value, grad = run(name, d)
    assert value == 0.0 and grad.shape == (0,)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "gspo"])
def test_overflowing_ratio_on_zero_advantage_tokens_is_harmless(name):
    """Prompt positions carry A = 0 and sometimes a placeholder sampler log-prob; exp overflows
    there, and inf * 0 must not poison the loss or its gradient."""
    d = make_datum(16)
    d["advantages"][:8] = 0.0
    d["logprobs"][:8] = -1000.0
    d["sequence_ratio_mask"][:8] = 0.0
    value, grad = run(name, d)
    assert math.isfinite(value) and np.all(np.isfinite(grad))
    assert np.all(grad[:8] == 0)
    ref = {"importance_sampling": ref_is, "ppo": ref_ppo, "cispo": ref_cispo, "gspo": ref_gspo}
    rest = {k: v[8:] for k, v in d.items()}
    assert value == pytest.approx(ref[name](rest), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Sum contract


@pytest.mark.parametrize("name", TOKEN_SEPARABLE)
def test_loss_is_the_sum_over_tokens(name):
    d = make_datum(17)
    d["clip_low_threshold"] = np.full(N, 0.85)  # exercised by ppo/cispo, ignored by the rest
    spec = get_loss(name)
    config = resolve_loss_config(spec, None)
    inputs = to_inputs(d, torch.float64)
    lp = lp_tensor(d)
    whole = spec.fn(lp, inputs, config)
    k = 23
    first = spec.fn(lp[:k], {key: v[:k] for key, v in inputs.items()}, config)
    second = spec.fn(lp[k:], {key: v[k:] for key, v in inputs.items()}, config)
    assert whole.item() == pytest.approx((first + second).item(), rel=1e-13, abs=1e-13)


def test_gspo_is_not_token_separable():
    """The sequence ratio couples tokens: the halves' sum differs (documents the exclusion)."""
    d = make_datum(18)
    d["logprobs"] = d["logprobs"] - 0.3
    whole = ref_gspo(d)
    halves = ref_gspo({k: v[:20] for k, v in d.items()}) + ref_gspo(
        {k: v[20:] for k, v in d.items()}
    )
    assert run("gspo", d)[0] == pytest.approx(whole, rel=1e-12)
    assert abs(whole - halves) > 1e-6


# ---------------------------------------------------------------------------------------------
# Per-token clip thresholds


@pytest.mark.parametrize("name, ref", [("ppo", ref_ppo), ("cispo", ref_cispo), ("gspo", ref_gspo)])
def test_per_token_thresholds_override_config(name, ref):
    d = make_datum(19)
    rng = np.random.default_rng(190)
    lo = rng.choice([0.5, 0.8, 0.95], size=N)
    hi = rng.choice([1.05, 1.2, 2.0], size=N)
    config = {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}  # overridden per token
    d_both = {**d, "clip_low_threshold": lo, "clip_high_threshold": hi}
    assert run(name, d_both, config)[0] == pytest.approx(ref(d, lo, hi), rel=1e-12)
    # Only one per-token key: the other bound comes from the config.
    d_low = {**d, "clip_low_threshold": lo}
    assert run(name, d_low, config)[0] == pytest.approx(ref(d, lo, 1.01), rel=1e-12)
    d_high = {**d, "clip_high_threshold": hi}
    assert run(name, d_high, config)[0] == pytest.approx(ref(d, 0.99, hi), rel=1e-12)


def test_per_token_thresholds_gradient():
    d = make_datum(20)
    lo = np.where(np.arange(N) % 2 == 0, 0.0, 0.9)
    hi = np.where(np.arange(N) % 3 == 0, 10.0, 1.1)
    d_tok = {**d, "clip_low_threshold": lo, "clip_high_threshold": hi}
    r = np.exp(d["lp"] - d["logprobs"])
    assert _away_from(r, (0.9, 1.1), 1e-3)
    np.testing.assert_allclose(run("ppo", d_tok)[1], ref_ppo_grad(d, lo, hi), rtol=1e-12)
    np.testing.assert_allclose(run("cispo", d_tok)[1], ref_cispo_grad(d, lo, hi), rtol=1e-14)


def test_wide_per_token_thresholds_make_ppo_importance_sampling():
    d = make_datum(21)
    d_wide = {**d, "clip_low_threshold": np.zeros(N), "clip_high_threshold": np.full(N, 1e6)}
    assert run("ppo", d_wide)[0] == pytest.approx(ref_is(d), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Registry and config


def test_builtins_registered_with_their_inputs_and_defaults():
    assert set(BUILTINS) <= set(LOSS_FNS)
    assert get_loss("cross_entropy").required_inputs == ("weights",)
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        assert get_loss(name).required_inputs == ("logprobs", "advantages")
    assert get_loss("gspo").required_inputs == ("logprobs", "advantages", "sequence_ratio_mask")
    for name in ("ppo", "cispo", "gspo"):
        spec = get_loss(name)
        assert spec.config_defaults == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
        assert spec.optional_inputs == ("clip_low_threshold", "clip_high_threshold")
    assert get_loss("dro").config_defaults == {"beta": 0.05}
    assert get_loss("cross_entropy").config_defaults == {}
    assert get_loss("importance_sampling").config_defaults == {}


def test_unknown_loss_names_loss_fn_and_lists_choices():
    with pytest.raises(InvalidRequestError) as err:
        get_loss("reinforce")
    assert err.value.field == "loss_fn"
    assert "'reinforce'" in err.value.problem
    for name in BUILTINS:
        assert name in err.value.problem


def test_resolve_config_merges_defaults_without_mutating_them():
    spec = get_loss("ppo")
    assert resolve_loss_config(spec, None) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
    }
    got = resolve_loss_config(spec, {"clip_high_threshold": 2})
    assert got == {"clip_low_threshold": 0.8, "clip_high_threshold": 2.0}
    assert isinstance(got["clip_high_threshold"], float)
    got["clip_low_threshold"] = 0.1
    assert spec.config_defaults["clip_low_threshold"] == 0.8
    assert resolve_loss_config(get_loss("cross_entropy"), {}) == {}


def test_unknown_config_key_is_named_with_accepted_keys():
    with pytest.raises(InvalidRequestError) as err:
        resolve_loss_config(get_loss("ppo"), {"clip_ratio": 0.2})
    assert err.value.field == "loss_fn_config.clip_ratio"
    assert "clip_low_threshold" in err.value.problem and "clip_high_threshold" in err.value.problem
    with pytest.raises(InvalidRequestError) as err:
        resolve_loss_config(get_loss("cross_entropy"), {"beta": 0.1})
    assert err.value.field == "loss_fn_config.beta"


@pytest.mark.parametrize("value", ["0.9", "high", True, None, float("nan"), float("inf")])
def test_non_numeric_or_non_finite_config_value_is_named(value):
    with pytest.raises(InvalidRequestError) as err:
        resolve_loss_config(get_loss("cispo"), {"clip_low_threshold": value})
    assert err.value.field == "loss_fn_config.clip_low_threshold"


@pytest.mark.parametrize(
    "config, key",
    [
        ({"clip_low_threshold": 1.2}, "clip_low_threshold"),
        ({"clip_low_threshold": -0.1}, "clip_low_threshold"),
        ({"clip_high_threshold": 0.9}, "clip_high_threshold"),
        ({"clip_low_threshold": 0.2, "clip_high_threshold": 0.8}, "clip_high_threshold"),
    ],
)
@pytest.mark.parametrize("name", ["ppo", "cispo", "gspo"])
def test_clip_threshold_ranges(name, config, key):
    with pytest.raises(InvalidRequestError) as err:
        resolve_loss_config(get_loss(name), config)
    assert err.value.field == f"loss_fn_config.{key}"
    assert "epsilon" in err.value.problem  # tells the user these are ratio bounds


def test_clip_threshold_boundaries_accepted():
    got = resolve_loss_config(
        get_loss("ppo"), {"clip_low_threshold": 1, "clip_high_threshold": 1.0}
    )
    assert got == {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0}
    resolve_loss_config(get_loss("ppo"), {"clip_low_threshold": 0.0, "clip_high_threshold": 10})


def test_dro_beta_must_be_non_negative():
    assert resolve_loss_config(get_loss("dro"), {"beta": 0})["beta"] == 0.0
    with pytest.raises(InvalidRequestError) as err:
        resolve_loss_config(get_loss("dro"), {"beta": -0.1})
    assert err.value.field == "loss_fn_config.beta"


@pytest.fixture
def scratch_loss_names():
    names: list[str] = []
    yield names
    for name in names:
        LOSS_FNS.pop(name, None)


def test_register_loss_adds_a_user_loss(scratch_loss_names):
    scratch_loss_names.append("test_squared_logprob")

    @register_loss(
        "test_squared_logprob", required_inputs=("weights",), config_defaults={"scale": 2}
    )
    def squared(lp, inputs, config):
        return config["scale"] * (lp * lp * inputs["weights"]).sum()

    spec = get_loss("test_squared_logprob")
    assert isinstance(spec, LossSpec) and spec.fn is squared
    assert spec.required_inputs == ("weights",) and spec.optional_inputs == ()
    assert spec.config_defaults == {"scale": 2.0}
    config = resolve_loss_config(spec, {"scale": 3})
    d = make_datum(22)
    value = spec.fn(lp_tensor(d), to_inputs(d, torch.float64), config)
    assert value.item() == pytest.approx(3 * np.sum(d["lp"] ** 2 * d["weights"]), rel=1e-12)
    with pytest.raises(InvalidRequestError):
        get_loss("test_squared_logprob_typo")
    # A name is registered once unless replaced explicitly.
    with pytest.raises(ValueError):
        register_loss("test_squared_logprob", required_inputs=())(squared)
    register_loss("test_squared_logprob", required_inputs=(), replace=True)(squared)
    assert get_loss("test_squared_logprob").required_inputs == ()


# ---------------------------------------------------------------------------------------------
# Input validation


def test_check_loss_inputs_accepts_a_good_datum():
    d = make_datum(23)
    for name in BUILTINS:
        check_loss_inputs(get_loss(name), to_inputs(d))
    check_loss_inputs(
        get_loss("ppo"),
        to_inputs({**d, "clip_low_threshold": np.zeros(N), "clip_high_threshold": np.ones(N)}),
    )


def test_check_loss_inputs_names_the_bad_key():
    d = make_datum(24)
    inputs = to_inputs(d)

    def field_of(spec_name, bad_inputs, **kwargs):
        with pytest.raises(InvalidRequestError) as err:
            check_loss_inputs(get_loss(spec_name), bad_inputs, **kwargs)
        return err.value.field

    missing = {k: v for k, v in inputs.items() if k != "sequence_ratio_mask"}
    assert field_of("gspo", missing) == "loss_fn_inputs.sequence_ratio_mask"
    no_targets = {k: v for k, v in inputs.items() if k != "target_tokens"}
    assert field_of("cross_entropy", no_targets, prefix="data[2].loss_fn_inputs") == (
        "data[2].loss_fn_inputs.target_tokens"
    )
    short = {**inputs, "advantages": inputs["advantages"][:-1]}
    assert field_of("ppo", short) == "loss_fn_inputs.advantages"
    nan = {**inputs, "logprobs": inputs["logprobs"].clone()}
    nan["logprobs"][3] = float("nan")
    assert field_of("importance_sampling", nan) == "loss_fn_inputs.logprobs"
    bad_low = {**inputs, "clip_low_threshold": torch.full((N,), 1.5)}
    assert field_of("cispo", bad_low) == "loss_fn_inputs.clip_low_threshold"
    bad_high = {**inputs, "clip_high_threshold": torch.full((N,), 0.5)}
    assert field_of("ppo", bad_high) == "loss_fn_inputs.clip_high_threshold"
    # Keys a loss does not read are not its business.
    check_loss_inputs(get_loss("cross_entropy"), {**inputs, "clip_low_threshold": torch.ones(3)})


@pytest.mark.parametrize("name", BUILTINS)
def test_forward_only_under_no_grad(name):
    """`forward` evaluates the loss without autograd; the value must be the same."""
    d = make_datum(25)
    spec = get_loss(name)
    with torch.no_grad():
        lp = torch.tensor(d["lp"], dtype=torch.float64)
        loss = spec.fn(lp, to_inputs(d, torch.float64), resolve_loss_config(spec, None))
    assert not loss.requires_grad
    assert loss.item() == pytest.approx(run(name, d)[0], rel=1e-14)
