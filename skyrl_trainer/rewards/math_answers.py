"""Helpers shared by the math graders: pull the final answer out of a response, read it as a number.

Every helper is total on arbitrary model output: it returns None (or False) instead of raising,
and runs in time linear in the length of the text (no backtracking-prone regular expressions),
so a 1 MB response costs milliseconds.
"""

from __future__ import annotations

import math
import re

_BOXED_OPEN_RE = re.compile(r"\\boxed\s*\{")
_BRACE_RE = re.compile(r"[{}]")
_DIGIT_RE = re.compile(r"\d")

# A plain decimal: digits with optional inner thousands commas ("1,234", also the lax "1,80"),
# optional fractional part; or a bare fractional part (".5").
_DECIMAL = r"(?:\d(?:[\d,]*\d)?(?:\.\d+)?|\.\d+)"
_SIGNED = rf"(?:[-+]\s*)?{_DECIMAL}"
_NUMBER_RE = re.compile(
    rf"""
    (?P<sign1>[-+]?)
    (?:\s*\\?\$)?                          # currency: $ or \$
    (?:\s*(?P<sign2>[-+]))?
    \s*
    (?:
        \\[dt]?frac\s*\{{\s*(?P<frac_num>{_SIGNED})\s*\}}\s*\{{\s*(?P<frac_den>{_SIGNED})\s*\}}
      | (?P<num>{_DECIMAL})(?:\s*/\s*(?P<den>{_DECIMAL}))?
    )
    (?P<rest>.*)
    """,
    re.DOTALL | re.VERBOSE,
)
# Spellings of the same digits: LaTeX grouping "1{,}234", thin spaces "1\,234", negative space
# "\!", and the Unicode minus sign models sometimes emit.
_NUMBER_NOISE = (("{,}", ","), ("\\,", ""), ("\\!", ""), ("\u2212", "-"))


def extract_hash_answer(text: str) -> str | None:
    """The text after the last `####` in `text`, stripped; None when there is no `####`."""
    position = text.rfind("####")
    if position < 0:
        return None
    return text[position + 4 :].strip()


def extract_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` in `text`, stripped; None when there is none.

    Braces nest (`\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`). A `\\boxed{` whose brace is never
    closed (a truncated response) is not an answer: the last *closed* one wins.
    """
    first = text.find("\\boxed")
    if first < 0:
        return None
    opens = {m.end() - 1: m.end() for m in _BOXED_OPEN_RE.finditer(text, first)}
    if not opens:
        return None
    # One pass over the braces (from the first \boxed on: earlier braces cannot pair with later
    # ones) pairs every boxed "{" with its "}", so pathological inputs stay linear.
    stack: list[int] = []
    closes: dict[int, int] = {}
    for match in _BRACE_RE.finditer(text, first):
        if match.group() == "{":
            stack.append(match.start())
        elif stack:
            opened = stack.pop()
            if opened in opens:
                closes[opened] = match.start()
    if not closes:
        return None
    last_open = max(closes)
    return text[opens[last_open] : closes[last_open]].strip()


def parse_number(s: str, *, strict: bool = False) -> float | None:
    """`s` read as a number, or None when it does not start with one.

    Accepts `18`, `-3`, `+3`, `18.00`, `.5`, `1,234` (commas between digits are dropped, so
    `1,80` reads as 180), `1{,}234` and `1\\,234` (LaTeX grouping), `$18`, `\\$18`, `-$18`,
    `1/2`, `\\frac{1}{2}` / `\\dfrac{-1}{2}`. After the number, anything without a digit is
    ignored as units or punctuation (`18 dollars`, `18.`, `18 \\text{ cm}`); a percent sign is
    such a unit too, so `50%` reads as 50 (GSM8K ground truths give the number of percent).
    Text with more digits after the number (`18 - 3`, `1e3`, `3 1/2`) is refused as ambiguous.
    With `strict=True` only a trailing `.` and whitespace may follow the number.
    Returns None too for division by zero and for values that overflow a float.
    """
    if not isinstance(s, str):
        return None
    for noisy, clean in _NUMBER_NOISE:
        s = s.replace(noisy, clean)
    # No two optional-whitespace runs are adjacent in the pattern, so matching stays linear.
    match = _NUMBER_RE.match(s.strip())
    if match is None:
        return None
    rest = match.group("rest")
    if strict:
        if rest.strip().rstrip(".").strip():
            return None
    elif _DIGIT_RE.search(rest):
        return None
    negative = (match.group("sign1") == "-") != (match.group("sign2") == "-")
    if match.group("frac_num") is not None:
        numerator, denominator = match.group("frac_num"), match.group("frac_den")
    else:
        numerator, denominator = match.group("num"), match.group("den")
    try:
        value = _decimal(numerator)
        if denominator is not None:
            value /= _decimal(denominator)
    except ZeroDivisionError:
        return None
    if not math.isfinite(value):
        return None
    return -value if negative else value


def numbers_equal(a: float | None, b: float | None) -> bool:
    """True when both are numbers equal within 1e-6, relative or absolute; False for None/NaN."""
    if a is None or b is None:
        return False
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def _decimal(text: str) -> float:
    return float(text.replace(",", "").replace(" ", ""))


# A number in running text. Commas count only as thousands separators ("1,234"), so a list
# "1,2,3" is three numbers. A "-" is a sign only where it cannot be a binary minus (not right
# after a word character or a closing bracket), so "45-23" ends in 23, not -23.
_NUMBER_IN_TEXT_RE = re.compile(r"(?:(?<![\w)\]])-)?\d+(?:,\d{3}(?!\d))*(?:\.\d+)?")


def last_number_in_text(text: str) -> float | None:
    """The last number written in `text` (`-7`, `1,234`, `2.5`), or None."""
    numbers = _NUMBER_IN_TEXT_RE.findall(text)
    return parse_number(numbers[-1]) if numbers else None
