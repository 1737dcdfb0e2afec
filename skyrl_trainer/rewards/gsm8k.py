"""The GSM8K reward: 1.0 when the response's final answer equals the ground-truth number."""

from __future__ import annotations

from skyrl_trainer.rewards.math_answers import (
    extract_boxed,
    extract_hash_answer,
    last_number_in_text,
    numbers_equal,
    parse_number,
)
from skyrl_trainer.rewards.registry import register_reward


@register_reward("gsm8k")
def gsm8k_reward(response: str, sample: dict) -> float:
    """1.0 if the response's answer equals the ground truth as a number, else 0.0.

    Ground truth: the text after the last `####` in `sample["answer"]` (all of it when there is
    no `####`), commas removed. The response's answer: the content of its last closed
    `\\boxed{}` if it has one, else the first line after its last `####`, read with
    `parse_number` (`18`, `18.00`, `$18`, `1,800`, `18 dollars` all read as numbers). No answer,
    or one that is not a number, scores 0.0. Never raises on any response; raises ValueError
    only for a sample whose ground truth is missing or not a number (a dataset error).
    """
    truth = _ground_truth(sample)
    if not isinstance(response, str):
        return 0.0
    answer = extract_boxed(response)
    if answer is None:
        hashed = extract_hash_answer(response)
        if hashed is None:
            return 0.0
        answer = hashed.split("\n", 1)[0]
    return 1.0 if numbers_equal(parse_number(answer), truth) else 0.0


@register_reward("gsm8k_flexible")
def gsm8k_flexible_reward(response: str, sample: dict) -> float:
    """Like `gsm8k`, but a response with neither `\\boxed{}` nor `####` is read by its last
    number (lm-eval's "flexible extract"): a learning signal for small models that do not yet
    follow the answer format. Use the strict `gsm8k` to report accuracy comparable to SkyRL's."""
    if gsm8k_reward(response, sample) == 1.0:
        return 1.0
    if not isinstance(response, str) or extract_boxed(response) or extract_hash_answer(response):
        return 0.0
    return 1.0 if numbers_equal(last_number_in_text(response), _ground_truth(sample)) else 0.0


def _ground_truth(sample: dict) -> float:
    if not isinstance(sample, dict) or "answer" not in sample:
        keys = sorted(sample) if isinstance(sample, dict) else type(sample).__name__
        raise ValueError(f"gsm8k reward: the sample has no 'answer' field (got {keys})")
    raw = str(sample["answer"])
    text = extract_hash_answer(raw)
    if text is None:
        text = raw
    value = parse_number(text.replace(",", ""))
    if value is None:
        raise ValueError(f"gsm8k reward: ground truth {text[:80]!r} is not a number")
    return value
