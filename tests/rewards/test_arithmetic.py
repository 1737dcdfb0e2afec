"""The arithmetic reward for generated "What is 23 + 45?" tasks."""

from __future__ import annotations

import pytest

from skyrl_trainer.rewards.arithmetic import arithmetic_reward

SAMPLE = {"question": "What is 23 + 45?", "answer": "68"}


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("68", 1.0),
        ("23 + 45 = 68", 1.0),
        ("The answer is 68.", 1.0),
        ("68.0", 1.0),
        ("\\boxed{68}", 1.0),
        ("\\boxed{68}, not 70", 1.0),  # a box beats the last number
        ("I think 70... no: \\boxed{69}", 0.0),
        ("23 + 45 = 67", 0.0),
        ("68, or maybe 69", 0.0),
        ("-68", 0.0),
        ("sixty-eight", 0.0),
        ("", 0.0),
        ("\\boxed{68", 1.0),  # unclosed box: falls back to the last number
        ("x" * 1_000_000 + " 68", 1.0),
    ],
)
def test_arithmetic_reward(response, expected):
    assert arithmetic_reward(response, SAMPLE) == expected


@pytest.mark.parametrize(
    ("answer", "response", "expected"),
    [
        ("22", "45-23=22", 1.0),
        ("-22", "23 - 45 = -22", 1.0),
        ("-23", "45-23", 0.0),  # a binary minus is not a sign
        ("1234", "That makes 1,234 apples.", 1.0),
        ("3", "1,2,3", 1.0),
        ("2.5", "5 / 2 = 2.50", 1.0),
        (68, "68", 1.0),
    ],
)
def test_arithmetic_number_forms(answer, response, expected):
    assert arithmetic_reward(response, {"answer": answer}) == expected


def test_arithmetic_bad_sample_is_a_clear_error():
    with pytest.raises(ValueError, match="arithmetic reward"):
        arithmetic_reward("68", {"question": "What is 23 + 45?"})
    with pytest.raises(ValueError, match="not a number"):
        arithmetic_reward("68", {"answer": "sixty-eight"})
