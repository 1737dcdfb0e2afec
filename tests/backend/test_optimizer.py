"""`adam_step`: one AdamW update per call, checked against the update written out in float64.

A parameter with no accumulated gradient takes the step as a zero gradient (momentum and weight
decay still move it), as TRL's and any trainer's AdamW does after a backward pass of a zero loss;
torch's AdamW alone would leave it, and its moments, untouched.
"""

from __future__ import annotations

import math

import torch
from tinker import types

from skyrl_trainer.backend.optimizer import adam_step, make_adamw

ADAM = types.AdamParams(
    learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.0
)


def reference_adamw(p0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """Decoupled-weight-decay Adam with bias correction, in float64, one update per gradient."""
    p = p0.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    b1, b2, lr = ADAM.beta1, ADAM.beta2, ADAM.learning_rate
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * ADAM.weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        p = p - lr * m_hat / (v_hat.sqrt() + ADAM.eps)
    return p


def test_a_step_without_gradient_is_a_zero_gradient_step():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3))
    start = p.detach().clone()
    optimizer = make_adamw([p])
    g1 = torch.randn(5, 3)
    p.grad = g1.clone()
    adam_step(optimizer, [p], ADAM)
    assert p.grad is None  # cleared after every step
    for _ in range(3):  # no forward_backward in between: no gradient accumulated
        metrics = adam_step(optimizer, [p], ADAM)
        assert metrics["grad_norm:mean"] == 0.0
    zeros = torch.zeros(5, 3)
    expected = reference_adamw(start, [g1, zeros, zeros, zeros])
    torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)
    # and the momentum really moved it beyond the first step
    after_one = reference_adamw(start, [g1])
    assert (expected - after_one).abs().max() > 1e-3


def test_a_parameter_without_gradient_still_steps_beside_one_with():
    torch.manual_seed(1)
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    a0, b0 = a.detach().clone(), b.detach().clone()
    optimizer = make_adamw([a, b])
    ga1, gb1, ga2 = torch.randn(4), torch.randn(4), torch.randn(4)
    a.grad, b.grad = ga1.clone(), gb1.clone()
    adam_step(optimizer, [a, b], ADAM)
    a.grad = ga2.clone()  # b gets nothing this time
    metrics = adam_step(optimizer, [a, b], ADAM)
    assert math.isclose(metrics["grad_norm:mean"], float(ga2.norm()), rel_tol=1e-6)
    torch.testing.assert_close(a.detach().double(), reference_adamw(a0, [ga1, ga2]))
    torch.testing.assert_close(
        b.detach().double(), reference_adamw(b0, [gb1, torch.zeros(4)]), rtol=1e-5, atol=1e-6
    )
