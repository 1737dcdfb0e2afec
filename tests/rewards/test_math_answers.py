"""The shared answer helpers: extraction, number parsing, comparison."""

from __future__ import annotations

import time

import pytest

from skyrl_trainer.rewards.math_answers import (
    extract_boxed,
    extract_hash_answer,
    numbers_equal,
    parse_number,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", 18.0),
        ("18.0", 18.0),
        ("18.00", 18.0),
        ("-3", -3.0),
        ("+3", 3.0),
        (".5", 0.5),
        ("1,234", 1234.0),
        ("1,234,567.5", 1234567.5),
        ("1{,}080", 1080.0),
        ("1\\,080", 1080.0),
        ("$18", 18.0),
        ("\\$18", 18.0),
        ("-$18", -18.0),
        ("$-18", -18.0),
        ("\u221218", -18.0),
        ("18 dollars", 18.0),
        ("18.", 18.0),
        ("18 \\text{ cm}", 18.0),
        ("50%", 50.0),
        ("50\\%", 50.0),
        ("1/2", 0.5),
        ("-3 / 4", -0.75),
        ("\\frac{1}{2}", 0.5),
        ("\\dfrac{-3}{4}", -0.75),
        ("  42  ", 42.0),
        ("", None),
        ("abc", None),
        ("The answer is 18", None),
        ("18 - 3", None),
        ("1e3", None),
        ("3 1/2", None),
        ("1/0", None),
        ("9" * 400, None),  # overflows a float
        (None, None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


def test_parse_number_strict_refuses_trailing_text():
    assert parse_number("18.", strict=True) == 18.0
    assert parse_number("2x", strict=True) is None
    assert parse_number("2x") == 2.0


def test_numbers_equal():
    assert numbers_equal(18, 18.0000001)
    assert numbers_equal(1e9, 1e9 + 1)  # relative tolerance
    assert numbers_equal(0.0, 1e-7)  # absolute tolerance
    assert not numbers_equal(18, 18.01)
    assert not numbers_equal(None, 18)
    assert not numbers_equal(float("nan"), float("nan"))


def test_extract_hash_answer():
    assert extract_hash_answer("a #### 1 b #### 2 ") == "2"
    assert extract_hash_answer("####") == ""
    assert extract_hash_answer("no marker") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{18}", "18"),
        ("\\boxed{ 18 }", "18"),
        ("\\boxed {18}", "18"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{1} then \\boxed{2", "1"),  # an unclosed box is not an answer
        ("\\boxed{{a}{b}} x}", "{a}{b}"),
        ("\\boxed{}", ""),
        ("\\boxed", None),
        ("\\boxed{", None),
        ("}{", None),
        ("", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "{" * 1_000_000,
        "\\boxed{" * 150_000,
        "1" * 1_000_000 + "x",
        "$" + " " * 1_000_000 + "x",
        "\\frac{" + " " * 1_000_000,
    ],
)
def test_helpers_are_fast_on_pathological_input(text):
    start = time.perf_counter()
    extract_boxed(text)
    extract_hash_answer(text)
    parse_number(text)
    assert time.perf_counter() - start < 1.0
