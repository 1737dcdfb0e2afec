"""The math reward: the fallback grader (no math_verify) and the math_verify wiring."""

from __future__ import annotations

import time

import pytest

from skyrl_trainer.rewards import math as math_reward_module
from skyrl_trainer.rewards.math import math_answers_equal, math_reward
from skyrl_trainer.rewards.math_equivalence import (
    _SympyTools,
    latex_to_sympy_source,
    normalize_math_answer,
)


@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [
        # string normalisation
        ("\\dfrac{1}{2}", "\\frac12", True),
        ("\\sqrt 2", "\\sqrt{2}", True),
        ("\\left( 1, 2 \\right]", "(1,2]", True),
        ("5 \\text{ cm}", "5", True),
        ("12\\text{ m}^2", "12", True),
        ("\\text{(C)}", "C", True),
        ("x = 3", "3", True),
        ("90^\\circ", "90", True),
        ("50\\%", "50", True),
        ("\\$5.", "5", True),
        # numbers
        ("\\frac{1}{2}", "0.5", True),
        ("-\\frac{3}{4}", "-0.75", True),
        ("1/2", "\\frac{1}{2}", True),
        ("1,000", "1000", True),
        (".5", "0.5", True),
        ("1/3", "0.333", False),
        ("0.5", "0.6", False),
        # symbolic
        ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True),
        ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt2}{2}", True),
        ("2^{10}", "1024", True),
        ("\\sqrt[3]{8}", "2", True),
        ("2\\pi", "\\pi \\cdot 2", True),
        ("(x+1)^2", "x^2+2x+1", True),
        ("\\lambda+1", "1+\\lambda", True),
        ("\\sin x", "\\sin(x)", True),
        ("\\pi", "3.14", False),
        ("2x", "x", False),
        ("\\sqrt{3}", "\\sqrt{2}", False),
        # tuples, intervals, sets
        ("(1, \\frac12)", "(1,0.5)", True),
        ("(1,2)", "(2,1)", False),
        ("[1,2)", "(1,2)", False),
        ("\\{1,2\\}", "\\{2,1\\}", True),
        ("1, -2", "-2,1", True),
        # garbage
        ("", "", False),
        ("garbage{", "5", False),
        ("\\frac{1}{0}", "1", False),
        ("\\undefinedmacro{3}", "3", False),
    ],
)
def test_fallback_grader(pred, gold, expected):
    assert math_answers_equal(pred, gold, use_math_verify=False) is expected


@pytest.mark.parametrize(
    "pred",
    [
        "10^{10^{10}}",  # would hold the GIL for ever in one C call
        "9^{9^{9}}",
        "(10^{100})^{100}",
        "__import__('os').system('echo pwned')",
        "exit()",
        "x" * 100_000,
        "$" * 100_000 + "x",  # inputs that make careless regexes backtrack
        "^" + " " * 100_000 + "x",
        "\\text{" * 50_000,
    ],
)
def test_fallback_grader_refuses_dangerous_input_quickly(pred):
    start = time.perf_counter()
    assert math_answers_equal(pred, "1", use_math_verify=False) is False
    assert time.perf_counter() - start < 1.0


def test_symbolic_check_is_bounded_in_time(monkeypatch):
    def hang(self, a, b):
        time.sleep(5)
        return True

    monkeypatch.setattr(_SympyTools, "equal", hang)
    start = time.perf_counter()
    assert math_answers_equal("x+1", "1+x", timeout_s=0.2, use_math_verify=False) is False
    assert time.perf_counter() - start < 1.0


def test_normalize_and_convert():
    assert normalize_math_answer("$\\displaystyle \\dfrac{1}{2}$") == "\\frac{1}{2}"
    assert latex_to_sympy_source("\\frac{1}{2}") is not None
    assert latex_to_sympy_source("x_1") is None  # subscripts are outside the subset
    assert latex_to_sympy_source("\\int x") is None


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("So the probability is \\boxed{\\dfrac{1}{2}}.", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{3} then \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("The answer is 1/2.", "\\frac{1}{2}", 0.0),  # no box
        ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # unclosed box
        ("\\boxed{2}", "We get $x = 2$, so the answer is $\\boxed{2}$.", 1.0),  # gold solution
        ("", "2", 0.0),
    ],
)
def test_math_reward(response, answer, expected):
    assert math_reward(response, {"answer": answer}) == expected


def test_math_reward_bad_sample_is_a_clear_error():
    with pytest.raises(ValueError, match="math reward"):
        math_reward("\\boxed{1}", {})


class FakeMathVerify:
    """Stands in for math_verify: records calls, parses only answers it is told to."""

    def __init__(self, verdict: bool, parseable: bool = True):
        self.verdict = verdict
        self.parseable = parseable
        self.calls: list[tuple[str, dict]] = []

    def parse(self, text: str, **kwargs):
        self.calls.append(("parse", kwargs))
        return [text] if self.parseable else []

    def verify(self, gold, pred, **kwargs):
        self.calls.append(("verify", kwargs))
        return self.verdict


def test_math_verify_decides_when_installed(monkeypatch):
    fake = FakeMathVerify(verdict=True)
    monkeypatch.setattr(math_reward_module, "_load_math_verify", lambda: fake)
    assert math_answers_equal("\\frac{2}{4}", "0.7") is True  # the fake says so
    # Its SIGALRM timeouts are disabled: it runs off the main thread, bounded by ours.
    assert ("parse", {"parsing_timeout": None}) in fake.calls
    assert ("verify", {"timeout_seconds": None}) in fake.calls


def test_fallback_when_math_verify_cannot_parse(monkeypatch):
    fake = FakeMathVerify(verdict=True, parseable=False)
    monkeypatch.setattr(math_reward_module, "_load_math_verify", lambda: fake)
    assert math_answers_equal("\\frac{2}{4}", "0.7") is False
    assert math_answers_equal("\\frac{2}{4}", "0.5") is True
