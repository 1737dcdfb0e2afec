"""What the trainer knows about each Tinker policy loss it calls (ALGORITHMS.md section 1).

The losses run on the server side of the client interface; the trainer needs, per loss: the
`loss_fn_config` keys it accepts and their ranges (checked at start-up), the extra per-token
`loss_fn_inputs` it needs beyond `target_tokens` / `logprobs` / `advantages`, and which tokens its
clipping made inactive (`train/clip_frac`; losses that never clip report nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

CLIP_LOW, CLIP_HIGH = "clip_low_threshold", "clip_high_threshold"


@dataclass(frozen=True)
class ConfigRange:
    default: float
    low: float
    high: float = math.inf


ExtraInputs = Callable[[np.ndarray], dict[str, np.ndarray]]
"""Response-token loss weights -> extra per-response-token inputs (prompt positions get 0)."""
ClippedTokens = Callable[[np.ndarray, np.ndarray, np.ndarray, float, float], np.ndarray]
"""(learner lp, reference lp, advantages, low, high) of one response -> bool per token."""


@dataclass(frozen=True)
class PolicyLoss:
    config: dict[str, ConfigRange] = field(default_factory=dict)
    extra_inputs: ExtraInputs | None = None
    clipped: ClippedTokens | None = None
    weighted_penalty: bool = False
    """The loss has a term on every weighted token whatever its advantage (dro's penalty), so a
    datum with all-zero advantages still has a gradient."""

    def has_gradient(self, advantages: np.ndarray, weights: np.ndarray) -> bool:
        """Whether a datum with these response-token advantages and loss weights adds anything
        to the gradient (the loss is a sum over datums: one that adds nothing can be left out)."""
        return bool(np.any(advantages != 0) or (self.weighted_penalty and np.any(weights != 0)))


def _ppo_clipped(lp, ref, adv, low, high) -> np.ndarray:
    """min(r*A, clip(r)*A) took the clipped (constant) term: A > 0 and r > high, or A < 0 and
    r < low."""
    r = np.exp(lp - ref)
    return ((adv > 0) & (r > high)) | ((adv < 0) & (r < low))


def _gspo_clipped(lp, ref, adv, low, high) -> np.ndarray:
    """ppo's rule with the one sequence ratio exp(mean(lp - ref)) for every token."""
    log_s = float(np.mean(lp - ref)) if len(lp) else 0.0
    return _ppo_clipped(np.full(len(lp), log_s), np.zeros(len(lp)), adv, low, high)


def _cispo_clipped(lp, ref, adv, low, high) -> np.ndarray:
    """The clamped importance weight differs from the ratio (on tokens that carry gradient)."""
    r = np.exp(lp - ref)
    return (adv != 0) & ((r < low) | (r > high))


_CLIP = {CLIP_LOW: ConfigRange(0.8, 0.0, 1.0), CLIP_HIGH: ConfigRange(1.2, 1.0)}

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "importance_sampling": PolicyLoss(),
    "ppo": PolicyLoss(config=_CLIP, clipped=_ppo_clipped),
    "cispo": PolicyLoss(config=_CLIP, clipped=_cispo_clipped),
    # GSPO's sequence ratio is the mean log-ratio over the response tokens.
    "gspo": PolicyLoss(
        config=_CLIP,
        extra_inputs=lambda w: {"sequence_ratio_mask": np.ones_like(w)},
        clipped=_gspo_clipped,
    ),
    # dro's penalty is weighted per token like the policy term (0 on prompt positions).
    "dro": PolicyLoss(
        config={"beta": ConfigRange(0.05, 0.0)},
        extra_inputs=lambda w: {"weights": w},
        weighted_penalty=True,
    ),
}


def config_errors(loss_fn: str, loss_fn_config: dict) -> list[str]:
    """What is wrong with `algorithm.loss_fn_config` for `loss_fn` (empty: nothing)."""
    allowed = POLICY_LOSSES[loss_fn].config
    errors = []
    for key, value in (loss_fn_config or {}).items():
        path = f"algorithm.loss_fn_config.{key}"
        if key not in allowed:
            errors.append(f"{path}: unknown key for loss {loss_fn!r}; accepted: {sorted(allowed)}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{path}: must be a number, got {value!r}")
        elif not (math.isfinite(value) and allowed[key].low <= value <= allowed[key].high):
            errors.append(f"{path}: {value!r} is outside [{allowed[key].low}, {allowed[key].high}]")
    return errors


def clip_bounds(loss_fn: str, loss_fn_config: dict) -> tuple[float, float]:
    cfg = POLICY_LOSSES[loss_fn].config
    merged = {k: r.default for k, r in cfg.items()} | dict(loss_fn_config or {})
    return float(merged[CLIP_LOW]), float(merged[CLIP_HIGH])
