"""One AdamW step with Tinker's per-call hyper-parameters (`AdamParams`).

The optimizer state (moments, step counts) lives across calls; the hyper-parameters are
taken fresh from every call, so learning-rate schedules live in the caller.
"""

from __future__ import annotations

import math

import torch
from tinker import types

from skyrl_trainer.backend.errors import InvalidRequestError


def validate_adam_params(adam: types.AdamParams) -> None:
    """Refuse hyper-parameters AdamW cannot use, naming the field."""
    checks = {
        "learning_rate": adam.learning_rate >= 0,
        "beta1": 0 <= adam.beta1 < 1,
        "beta2": 0 <= adam.beta2 < 1,
        "eps": adam.eps > 0,
        "weight_decay": adam.weight_decay >= 0,
        "grad_clip_norm": adam.grad_clip_norm >= 0,
    }
    for name, ok in checks.items():
        value = getattr(adam, name)
        if not ok or not math.isfinite(value):
            raise InvalidRequestError(
                f"adam_params.{name}",
                f"is {value}; need learning_rate >= 0, 0 <= beta1, beta2 < 1, eps > 0, "
                "weight_decay >= 0, grad_clip_norm >= 0 (0 = no clipping)",
            )


def make_adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    # Hyper-parameters are placeholders: adam_step overwrites them on every call.
    return torch.optim.AdamW(params, lr=0.0, foreach=True)


def adam_step(
    optimizer: torch.optim.AdamW, params: list[torch.nn.Parameter], adam: types.AdamParams
) -> dict[str, float]:
    """Clip (if asked), apply one AdamW update with `adam`'s settings, and clear the gradients.

    Every parameter takes the step: one with no accumulated gradient (no forward_backward since
    the last step, or none that reached it) counts as a zero gradient, so its momentum and weight
    decay still move it, exactly as after a backward pass of a zero loss. (torch's AdamW would
    skip it, and a batch whose advantages are all zero would then stall the optimizer that other
    trainers, e.g. TRL's, keep stepping.)

    Returns metrics: the pre-clip global gradient norm and the learning rate. A step whose
    gradients are not finite is skipped (weights untouched) and reported, never applied.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
    metrics = {"grad_norm:mean": float(grad_norm), "learning_rate:mean": adam.learning_rate}
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        metrics["skipped_nonfinite_step:sum"] = 1.0
        return metrics
    if adam.grad_clip_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, grad_norm)
    for group in optimizer.param_groups:
        group.update(
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return metrics
