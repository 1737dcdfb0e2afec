"""The competition-math reward: the response's last `\\boxed{}` graded against the ground truth."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from skyrl_trainer.rewards.math_answers import extract_boxed
from skyrl_trainer.rewards.math_equivalence import math_answers_equivalent, normalize_math_answer
from skyrl_trainer.rewards.registry import register_reward
from skyrl_trainer.rewards.timeouts import CallTimedOut, call_with_timeout

CHECK_TIMEOUT_S = 3.0


# Cached: a failed import is not cached by Python and would cost a path scan per call; and
# lazy, because math_verify takes a second to import.
@functools.cache
def _load_math_verify() -> ModuleType | None:
    try:
        return importlib.import_module("math_verify")
    except ImportError:
        return None


@register_reward("math")
def math_reward(response: str, sample: dict) -> float:
    """1.0 if the response's last closed `\\boxed{}` is equivalent to the ground truth, else 0.0.

    The ground truth is `sample["answer"]`: a bare answer (`\\frac{1}{2}`) or a whole solution,
    whose last `\\boxed{}` is then used. No `\\boxed{}` in the response scores 0.0. Grading is
    `math_answers_equal`. Never raises on any response; raises ValueError for a sample without
    an `answer`.
    """
    if not isinstance(sample, dict) or "answer" not in sample:
        raise ValueError("math reward: the sample has no 'answer' field")
    gold = str(sample["answer"])
    gold = extract_boxed(gold) or gold
    if not isinstance(response, str):
        return 0.0
    pred = extract_boxed(response)
    if pred is None:
        return 0.0
    return 1.0 if math_answers_equal(pred, gold) else 0.0


def math_answers_equal(
    pred: str,
    gold: str,
    *,
    timeout_s: float = CHECK_TIMEOUT_S,
    use_math_verify: bool | None = None,
) -> bool:
    """True when answer `pred` is equivalent to answer `gold` (both LaTeX without `\\boxed`).

    Answers equal after `normalize_math_answer` match at once. Otherwise math_verify's verdict
    decides, when it is installed and `use_math_verify` is not False, unless it cannot parse
    one of the answers; then, or without math_verify, `math_answers_equivalent` decides
    (numbers, then sympy). Each check is bounded by `timeout_s`; a check that times out counts
    as not equal. Never raises.
    """
    normalized = normalize_math_answer(pred)
    if normalized and normalized == normalize_math_answer(gold):
        return True
    math_verify = _load_math_verify() if use_math_verify is not False else None
    if math_verify is not None:
        verdict = _math_verify_equal(math_verify, pred, gold, timeout_s)
        if verdict is not None:
            return verdict
    return math_answers_equivalent(pred, gold, timeout_s=timeout_s)


def _math_verify_equal(
    math_verify: ModuleType, pred: str, gold: str, timeout_s: float
) -> bool | None:
    """math_verify's verdict; None when it cannot parse an answer (or fails)."""

    def check() -> bool | None:
        # Its own timeouts use SIGALRM, which fails off the main thread: ours bounds the call.
        gold_parsed = math_verify.parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
        pred_parsed = math_verify.parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
        if not gold_parsed or not pred_parsed:
            return None
        return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None))

    try:
        return call_with_timeout(check, timeout_s)
    except CallTimedOut:
        return False
    except Exception:
        return None
