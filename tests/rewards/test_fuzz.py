"""Every built-in reward returns 0.0 or 1.0, quickly and without raising, on random garbage."""

from __future__ import annotations

import random
import time

import pytest

from skyrl_trainer.rewards import REWARD_FNS

PIECES = [*"0123456789+-*/^_(){}[],.$%#= xyab\\\n"] + [
    "\\boxed{",
    "\\frac",
    "\\dfrac",
    "\\sqrt",
    "\\pi",
    "\\left(",
    "\\right)",
    "####",
    "\\text{",
    "\\cdot",
    "\\infty",
    "\\{",
    "^{",
    "10^{",
    "\\circ",
    "\\$",
    "1,000",
]
SAMPLES = {"gsm8k": {"answer": "#### 12"}, "arithmetic": {"answer": "12"}, "math": {"answer": "12"}}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_random_outputs(name):
    fn = REWARD_FNS[name]
    rng = random.Random(name)
    start = time.perf_counter()
    for _ in range(500):
        response = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40)))
        assert fn(response, SAMPLES[name]) in (0.0, 1.0)
    assert time.perf_counter() - start < 5.0
