"""The gsm8k reward on tricky model outputs (ALGORITHMS.md section 6)."""

from __future__ import annotations

import time

import pytest

from skyrl_trainer.rewards.gsm8k import gsm8k_reward

SAMPLE = {
    "question": "Weng earns $12 an hour for babysitting. How much does she earn in 90 hours?",
    "answer": "Weng earns 12 * 90 = $<<12*90=1080>>1,080.\n#### 1,080",
}


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("She earns 12 * 90 = 1080.\n#### 1080", 1.0),
        ("#### 1,080", 1.0),
        ("####1080", 1.0),
        ("#### $1,080", 1.0),
        ("#### 1080.00", 1.0),
        ("#### 1080.", 1.0),
        ("#### 1080 dollars", 1.0),
        ("#### 1080\nI hope this helps! 42", 1.0),
        ("The answer is \\boxed{1080}.", 1.0),
        ("\\boxed{1,080}", 1.0),
        ("\\boxed{\\$1{,}080.0}", 1.0),
        ("\\boxed{1080 \\text{ dollars}}", 1.0),
        ("\\boxed{1080}}} }{", 1.0),  # stray braces after a closed box
        ("#### 1081", 0.0),
        ("#### -1080", 0.0),
        ("#### 108", 0.0),
        ("1080", 0.0),  # no answer marker
        ("The answer is 1080.", 0.0),
        ("#### The answer is 1080", 0.0),
        ("#### 1080 #### 7", 0.0),  # the last #### wins
        ("#### 1080\n####", 0.0),
        ("\\boxed{100} no wait \\boxed{1080}", 1.0),  # the last box wins
        ("\\boxed{1080} no wait \\boxed{100}", 0.0),
        ("\\boxed{1080}\n#### 5", 1.0),  # a box beats ####
        ("\\boxed{5}\n#### 1080", 0.0),
        ("\\boxed{1080", 0.0),  # unbalanced
        ("\\boxed{}", 0.0),
        ("\\boxed{\\boxed{1080}}", 1.0),
        ("", 0.0),
        ("}}}{{{####", 0.0),
        ("\x00\ufffd garbage \\boxed{\\frac{", 0.0),
        ("x" * 1_000_000 + "\n#### 1,080", 1.0),
        ("{" * 1_000_000, 0.0),
        ("\\boxed{" * 100_000 + "1080", 0.0),
    ],
)
def test_gsm8k_reward(response, expected):
    start = time.perf_counter()
    assert gsm8k_reward(response, SAMPLE) == expected
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    ("answer", "response", "expected"),
    [
        ("#### 2.5", "\\boxed{2.50}", 1.0),
        ("#### 2.5", "#### 2.51", 0.0),
        ("#### -3", "#### -3", 1.0),
        ("#### -3", "#### 3", 0.0),
        ("#### 18", "#### 18.0", 1.0),
        ("18", "\\boxed{$18}", 1.0),  # no #### in the ground truth: all of it
        ("1,800", "#### 1800", 1.0),
        (18, "#### 18", 1.0),
    ],
)
def test_gsm8k_ground_truth_forms(answer, response, expected):
    assert gsm8k_reward(response, {"answer": answer}) == expected


def test_gsm8k_never_raises_on_non_string_response():
    assert gsm8k_reward(None, SAMPLE) == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize("sample", [{}, {"answer": "#### many"}, {"question": "q"}])
def test_gsm8k_bad_ground_truth_is_a_clear_error(sample):
    with pytest.raises(ValueError, match="gsm8k reward"):
        gsm8k_reward("#### 1", sample)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("So she pays 18 dollars in total.", 1.0),  # no format: the last number
        ("18 apples, then 3 more: 21", 0.0),
        ("#### 21\nthough really 18", 0.0),  # a format answer is taken as given
        ("\\boxed{18}", 1.0),
        ("no numbers at all", 0.0),
    ],
)
def test_gsm8k_flexible_reads_the_last_number_without_a_format(response, expected):
    from skyrl_trainer.rewards.gsm8k import gsm8k_flexible_reward

    assert gsm8k_flexible_reward(response, {"answer": "She pays 18.\n#### 18"}) == expected
