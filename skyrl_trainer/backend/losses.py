"""Registry of the server-side Tinker loss functions (`forward_backward(data, loss_fn=...)`).

Every loss is computed for ONE datum on 1-D tensors and returns that datum's loss as a 0-d tensor
equal to the SUM over its tokens. The caller sums over datums; there is never a mean (Tinker
contract, TINKER_PROTOCOL.md section 4): normalisation is the client's job, through `weights` or
`advantages`.

Notation (ALGORITHMS.md section 1): `lp` = the learner's log-probs of the target tokens (the tensor
gradients flow into), `slp` = `loss_fn_inputs["logprobs"]` (the sampler's log-probs), `A` =
`loss_fn_inputs["advantages"]`, `r = exp(lp - slp)`, `sg` = stop-gradient (`detach`).

| loss                | loss_fn_inputs besides target_tokens | per-datum loss                     |
|---------------------|--------------------------------------|------------------------------------|
| cross_entropy       | weights                              | sum(-lp * w)                       |
| importance_sampling | logprobs, advantages                 | -sum(r * A)                        |
| ppo                 | logprobs, advantages                 | -sum(min(r*A, clip(r)*A))          |
| cispo               | logprobs, advantages                 | -sum(sg(clip(r)) * lp * A)         |
| dro                 | logprobs, advantages (+ weights)     | -sum(lp*A - w*beta/2 * (lp-slp)^2) |
| gspo                | + sequence_ratio_mask                | ppo's, with one sequence ratio     |

cross_entropy also takes several candidate targets per position: `target_tokens` and `weights`
of shape (N, K), `lp` then (N, K) and the loss the sum over every cell (the SDK's 2-D
`target_tokens`, sent e.g. by the tinker-cookbook's off-policy distillation). The other losses
take one target per position and refuse 2-D inputs.

`loss_fn_inputs` / `loss_fn_config` keys a loss does not read are refused (naming the key, the
loss and the keys it accepts), never silently dropped: `resolve_loss_config` for the config,
`datums.to_training_example` for the inputs.

`clip(r)` = `clamp(r, clip_low_threshold, clip_high_threshold)`: the thresholds bound the RATIO
itself (defaults 0.8 / 1.2, i.e. epsilon = 0.2), they are not epsilons. They come from
`loss_fn_config`, and the Datum may override them per token with `loss_fn_inputs` keys of the same
names (the SDK knows these keys: `tinker/types/datum.py` `_KEY_TO_TYPE`).

Sources: tinker-cookbook `docs/losses.mdx` and tinker-docs.thinkingmachines.ai/tinker/losses/*
(the formulas and implementation snippets; the gspo page gives the GSPO-token formula used here).

Numerical note: wherever `A == 0` the importance-ratio losses use a log-ratio of 0 instead of
`lp - slp`. A zero-advantage token contributes exactly 0 to the value and to the gradient either
way, so this changes nothing mathematically, but it keeps an overflowing ratio (a placeholder
sampler log-prob on a prompt position, say) from turning `inf * 0` into NaN.

The loss functions do not validate their inputs (no host sync per datum); `check_loss_inputs`
does, and the worker should call it before the forward pass.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from skyrl_trainer.backend.errors import InvalidRequestError

__all__ = [
    "CLIP_HIGH",
    "CLIP_LOW",
    "LOSS_FNS",
    "TARGET_TOKENS",
    "LossFn",
    "LossSpec",
    "check_loss_inputs",
    "get_loss",
    "register_loss",
    "resolve_loss_config",
]

TARGET_TOKENS = "target_tokens"
CLIP_LOW = "clip_low_threshold"
CLIP_HIGH = "clip_high_threshold"

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its function and what it accepts.

    `fn(target_logprobs_N, inputs, config)` returns the datum's loss (0-d tensor, sum over tokens).
    `inputs` holds the datum's `loss_fn_inputs` as (N,) tensors (`target_tokens` included);
    `config` is the output of `resolve_loss_config`.
    """

    name: str
    fn: LossFn
    required_inputs: tuple[str, ...]  # loss_fn_inputs keys needed besides "target_tokens"
    optional_inputs: tuple[str, ...] = ()  # keys accepted but not needed
    config_defaults: dict[str, float] = field(default_factory=dict)  # allowed config keys
    gradient_weight_input: str | None = None
    """An input the loss's gradient is proportional to, token by token (advantages, weights): a
    datum where it is all zero adds exactly nothing to the gradient, so the workers run only its
    forward. None: no such input (dro's penalty has a gradient whatever the advantages)."""
    multi_target: bool = False
    """The loss accepts 2-D `target_tokens` of shape (N, K), K candidate targets per position,
    with every other input of the same shape; `lp` is then (N, K) too."""

    @property
    def accepted_inputs(self) -> tuple[str, ...]:
        """Every `loss_fn_inputs` key the loss reads (`target_tokens` first)."""
        return (TARGET_TOKENS, *self.required_inputs, *self.optional_inputs)


LOSS_FNS: dict[str, LossSpec] = {}


def register_loss(
    name: str,
    *,
    required_inputs: tuple[str, ...] | list[str],
    optional_inputs: tuple[str, ...] | list[str] = (),
    config_defaults: Mapping[str, float] | None = None,
    gradient_weight_input: str | None = None,
    multi_target: bool = False,
    replace: bool = False,
) -> Callable[[LossFn], LossFn]:
    """Decorator: register `fn` as the loss `name` in `LOSS_FNS` and return `fn` unchanged.

    Registering a name twice is a programming error (ValueError) unless `replace=True`.
    """

    def decorator(fn: LossFn) -> LossFn:
        if name in LOSS_FNS and not replace:
            raise ValueError(f"loss {name!r} is already registered (pass replace=True)")
        LOSS_FNS[name] = LossSpec(
            name=name,
            fn=fn,
            required_inputs=tuple(required_inputs),
            optional_inputs=tuple(optional_inputs),
            config_defaults={k: float(v) for k, v in (config_defaults or {}).items()},
            gradient_weight_input=gradient_weight_input,
            multi_target=multi_target,
        )
        return fn

    return decorator


def get_loss(name: str) -> LossSpec:
    """The registered loss `name`; an unknown name is the caller's error."""
    spec = LOSS_FNS.get(name)
    if spec is None and name == "stable_reinforce":
        raise InvalidRequestError(
            "loss_fn",
            "'stable_reinforce' is not supported by this backend: its objective and the "
            "server-side stability records it reads (record_stability_info, provenance spans) "
            "are not published. Pass loss_fn='importance_sampling' instead (the same "
            "importance-weighted policy gradient on the sampler's logprobs, and the "
            "tinker-cookbook rl_loop's default), or 'ppo' for a clipped ratio; fold a KL "
            "penalty (stable_reinforce's kl_coeff) into the advantages",
        )
    if spec is None:
        choices = ", ".join(sorted(LOSS_FNS))
        raise InvalidRequestError("loss_fn", f"unknown loss {name!r}; choose one of: {choices}")
    return spec


def resolve_loss_config(
    spec: LossSpec, loss_fn_config: Mapping[str, float | str] | None
) -> dict[str, float]:
    """The loss's defaults overridden by `loss_fn_config`, validated.

    Values must be real numbers (int/float; bools and strings, even numeric-looking ones, are
    refused: the wire distinguishes numbers from text) and finite. When the loss takes clip
    thresholds, `0 <= clip_low_threshold <= 1 <= clip_high_threshold` must hold. dro's `beta`
    must be >= 0 (a negative beta would reward moving away from the sampler).
    """
    config = dict(spec.config_defaults)
    for key, value in (loss_fn_config or {}).items():
        field_name = f"loss_fn_config.{key}"
        if key not in spec.config_defaults:
            accepted = ", ".join(sorted(spec.config_defaults)) or "(none)"
            raise InvalidRequestError(
                field_name,
                f"unknown key for loss {spec.name!r}; accepted keys: {accepted}",
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InvalidRequestError(
                field_name, f"must be a number, got {type(value).__name__} {value!r}"
            )
        number = float(value)
        if not math.isfinite(number):
            raise InvalidRequestError(field_name, f"must be finite, got {number!r}")
        config[key] = number

    if CLIP_LOW in config and not 0.0 <= config[CLIP_LOW] <= 1.0:
        raise InvalidRequestError(
            f"loss_fn_config.{CLIP_LOW}",
            f"must be in [0, 1] (a bound on the ratio, not an epsilon), got {config[CLIP_LOW]!r}",
        )
    if CLIP_HIGH in config and not config[CLIP_HIGH] >= 1.0:
        raise InvalidRequestError(
            f"loss_fn_config.{CLIP_HIGH}",
            f"must be >= 1 (a bound on the ratio, not an epsilon), got {config[CLIP_HIGH]!r}",
        )
    if "beta" in config and spec.name == "dro" and config["beta"] < 0.0:
        raise InvalidRequestError("loss_fn_config.beta", f"must be >= 0, got {config['beta']!r}")
    return config


def check_loss_inputs(
    spec: LossSpec, inputs: Mapping[str, torch.Tensor], *, prefix: str = "loss_fn_inputs"
) -> None:
    """Validate one datum's `loss_fn_inputs` for `spec`; raise InvalidRequestError naming the key.

    Checks: `target_tokens` and every required key present; `target_tokens` is 1-D (N,), or 2-D
    (N, K) with K >= 1 for a `multi_target` loss; every other key the loss reads has the shape of
    `target_tokens`; float inputs finite; per-token clip thresholds in range
    (`0 <= low <= 1 <= high`). Keys the loss does not read are not checked here (the datum
    boundary, `datums.to_training_example`, refuses them). `prefix` starts the error fields,
    e.g. `data[3].loss_fn_inputs`.
    """
    for key in (TARGET_TOKENS, *spec.required_inputs):
        if key not in inputs:
            raise InvalidRequestError(f"{prefix}.{key}", f"required by loss {spec.name!r}")
    targets = inputs[TARGET_TOKENS]
    shape = tuple(targets.shape)
    if spec.multi_target:
        if targets.dim() not in (1, 2) or (targets.dim() == 2 and shape[1] < 1):
            raise InvalidRequestError(
                f"{prefix}.{TARGET_TOKENS}",
                f"must be 1-D (N,) or 2-D (N, K) with K >= 1, got shape {shape}",
            )
    elif targets.dim() != 1:
        raise InvalidRequestError(
            f"{prefix}.{TARGET_TOKENS}",
            f"must be 1-D, got shape {shape}"
            + (
                f" (several targets per position, 2-D (N, K), only work with "
                f"{_multi_target_losses()})"
                if targets.dim() == 2
                else ""
            ),
        )
    for key in (*spec.required_inputs, *spec.optional_inputs):
        if key not in inputs:
            continue
        value = inputs[key]
        if tuple(value.shape) != shape:
            raise InvalidRequestError(
                f"{prefix}.{key}",
                f"must have shape {shape} like target_tokens, got {tuple(value.shape)}",
            )
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise InvalidRequestError(f"{prefix}.{key}", "contains NaN or infinite values")
    if CLIP_LOW in spec.optional_inputs and CLIP_LOW in inputs:
        low = inputs[CLIP_LOW]
        if not bool(((low >= 0) & (low <= 1)).all()):
            raise InvalidRequestError(f"{prefix}.{CLIP_LOW}", "every value must be in [0, 1]")
    if spec.name == "dro" and "weights" in inputs and not bool((inputs["weights"] >= 0).all()):
        raise InvalidRequestError(f"{prefix}.weights", "dro's penalty weights must be >= 0")
    if (
        CLIP_HIGH in spec.optional_inputs
        and CLIP_HIGH in inputs
        and not bool((inputs[CLIP_HIGH] >= 1).all())
    ):
        raise InvalidRequestError(f"{prefix}.{CLIP_HIGH}", "every value must be >= 1")


# ---------------------------------------------------------------------------------------------
# Helpers


def _multi_target_losses() -> str:
    return ", ".join(sorted(name for name, spec in LOSS_FNS.items() if spec.multi_target))


def _input(inputs: Mapping[str, torch.Tensor], key: str, like: torch.Tensor) -> torch.Tensor:
    """`inputs[key]` in `like`'s dtype and device (float32 inputs may meet float64 log-probs)."""
    return inputs[key].to(dtype=like.dtype, device=like.device)


def _guarded_log_ratio(log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """`log_ratio`, with 0 where the advantage is 0 (see the module's numerical note)."""
    return torch.where(advantages != 0, log_ratio, torch.zeros_like(log_ratio))


def _clip_bounds(
    inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) ratio bounds: per-token inputs where given, else the config's scalars."""
    bounds = []
    for key in (CLIP_LOW, CLIP_HIGH):
        if key in inputs:
            bounds.append(_input(inputs, key, like))
        else:
            bounds.append(torch.tensor(config[key], dtype=like.dtype, device=like.device))
    return bounds[0], bounds[1]


def _clipped_objective_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> torch.Tensor:
    """PPO's pessimistic clipped surrogate: -sum(min(r*A, clamp(r, low, high)*A))."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, min=low, max=high) * advantages
    return -torch.minimum(unclipped, clipped).sum()


_CLIP_DEFAULTS = {CLIP_LOW: 0.8, CLIP_HIGH: 1.2}  # Tinker docs: epsilon_low = epsilon_high = 0.2
_RL_INPUTS = ("logprobs", "advantages")
_CLIP_INPUTS = (CLIP_LOW, CLIP_HIGH)


# ---------------------------------------------------------------------------------------------
# The built-in losses


@register_loss(
    "cross_entropy",
    required_inputs=("weights",),
    gradient_weight_input="weights",
    multi_target=True,
)
def cross_entropy(
    lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """Weighted negative log-likelihood: sum(-lp * weights).

    With 2-D `target_tokens` (N, K) (K candidate targets per position, e.g. a teacher's top-K
    for distillation), `lp[t, k] = log p(target_tokens[t, k] | input[:t+1])` and `weights` is
    (N, K): the loss is the sum over every cell, sum_t sum_k -w[t, k] * lp[t, k].
    """
    return -(lp * _input(inputs, "weights", lp)).sum()


@register_loss(
    "importance_sampling", required_inputs=_RL_INPUTS, gradient_weight_input="advantages"
)
def importance_sampling(
    lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """Importance-weighted policy gradient: -sum(exp(lp - slp) * A)."""
    slp = _input(inputs, "logprobs", lp)
    adv = _input(inputs, "advantages", lp)
    ratio = torch.exp(_guarded_log_ratio(lp - slp, adv))
    return -(ratio * adv).sum()


@register_loss(
    "ppo",
    required_inputs=_RL_INPUTS,
    optional_inputs=_CLIP_INPUTS,
    config_defaults=_CLIP_DEFAULTS,
    gradient_weight_input="advantages",
)
def ppo(
    lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """Token-level PPO clipped objective: -sum(min(r*A, clamp(r, lo, hi)*A))."""
    slp = _input(inputs, "logprobs", lp)
    adv = _input(inputs, "advantages", lp)
    ratio = torch.exp(_guarded_log_ratio(lp - slp, adv))
    low, high = _clip_bounds(inputs, config, lp)
    return _clipped_objective_loss(ratio, adv, low, high)


@register_loss(
    "cispo",
    required_inputs=_RL_INPUTS,
    optional_inputs=_CLIP_INPUTS,
    config_defaults=_CLIP_DEFAULTS,
    gradient_weight_input="advantages",
)
def cispo(
    lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """CISPO: -sum(sg(clamp(r, lo, hi)) * lp * A); the clipped ratio is a constant weight."""
    slp = _input(inputs, "logprobs", lp)
    adv = _input(inputs, "advantages", lp)
    low, high = _clip_bounds(inputs, config, lp)
    weight = torch.clamp(torch.exp(lp.detach() - slp), min=low, max=high)
    return -(weight * lp * adv).sum()


# Tinker documents `beta` as a dro config key (its example passes 0.05) but not its default.
# 0.05 is OUR choice: the only value the docs show, and a mild penalty.
_DRO_DEFAULT_BETA = 0.05


@register_loss(
    "dro",
    required_inputs=_RL_INPUTS,
    optional_inputs=("weights",),
    config_defaults={"beta": _DRO_DEFAULT_BETA},
)
def dro(
    lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """DRO: -sum(lp*A - 0.5*beta*w*(lp - slp)^2), w = `weights` (>= 0) where given, else 1.

    Tinker's formula has no mask (w = 1): the penalty then pulls EVERY position, prompt positions
    with their placeholder sampler log-prob included, towards `slp`. `weights` (our extension) is
    each token's share of the loss: 0 on prompt positions and on masked tokens, and the loss
    reduction's scale (1 / tokens for a token mean) elsewhere, the same factor the client folded
    into that token's advantage, so the penalty is reduced exactly like the policy term.
    """
    slp = _input(inputs, "logprobs", lp)
    adv = _input(inputs, "advantages", lp)
    log_ratio = lp - slp
    penalty = 0.5 * config["beta"] * log_ratio * log_ratio
    if "weights" in inputs:
        # torch.where, not a product: a weight of 0 must give 0 even where slp is a placeholder
        # far from lp (no 0 * inf).
        weights = _input(inputs, "weights", lp)
        penalty = torch.where(weights != 0, weights * penalty, torch.zeros_like(penalty))
    return -(lp * adv - penalty).sum()


# The Tinker gspo page gives the formula (1 - eps_low, 1 + eps_high) but, as far as we could
# find, no gspo-specific defaults; we use ppo's 0.8 / 1.2. (The GSPO paper clips its sequence
# ratio much tighter, eps ~ 3e-4 / 4e-4: pass those through loss_fn_config if wanted.)
@register_loss(
    "gspo",
    required_inputs=(*_RL_INPUTS, "sequence_ratio_mask"),
    optional_inputs=_CLIP_INPUTS,
    config_defaults=_CLIP_DEFAULTS,
    gradient_weight_input="advantages",
)
def gspo(
    lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """GSPO-token: ppo's clipped objective with one sequence-level ratio per datum.

    log_s = mean over tokens with sequence_ratio_mask != 0 of (sg(lp) - slp); each token's ratio
    is exp(log_s + lp - sg(lp)): its value is the shared sequence ratio s, its gradient wrt its own
    lp is s (d ratio_t / d lp_t = ratio_t). So the gradient at token t is -A_t * s where that
    token is not clipped and 0 where it is; the mask only selects the tokens that define s, every
    token with a nonzero advantage is trained.

    An all-zero mask (no token defines the ratio) is read as log_s = 0, i.e. s = 1, the on-policy
    ratio: the loss is then -sum(A) with gradient -A, importance_sampling at r = 1, rather than
    NaN (the mean of an empty set, which Tinker's reference snippet would produce).
    """
    slp = _input(inputs, "logprobs", lp)
    adv = _input(inputs, "advantages", lp)
    in_ratio = inputs["sequence_ratio_mask"].to(device=lp.device) != 0
    lp_sg = lp.detach()
    token_log_ratio = torch.where(in_ratio, lp_sg - slp, torch.zeros_like(lp_sg))
    count = in_ratio.sum().clamp(min=1).to(lp.dtype)
    log_seq_ratio = token_log_ratio.sum() / count  # 0 when the mask is empty
    ratio = torch.exp(_guarded_log_ratio(log_seq_ratio + lp - lp_sg, adv))
    low, high = _clip_bounds(inputs, config, lp)
    return _clipped_objective_loss(ratio, adv, low, high)
