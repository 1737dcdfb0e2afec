"""The arithmetic reward, for generated "What is 23 + 45?" tasks whose answer is a number."""

from __future__ import annotations

from skyrl_trainer.rewards.math_answers import (
    extract_boxed,
    last_number_in_text,
    numbers_equal,
    parse_number,
)
from skyrl_trainer.rewards.registry import register_reward


@register_reward("arithmetic")
def arithmetic_reward(response: str, sample: dict) -> float:
    """1.0 if the response's answer equals `sample["answer"]` numerically, else 0.0.

    The response's answer is the content of its last closed `\\boxed{}` (read with
    `parse_number`), else the last number in the text (`-7`, `1,234`, `2.5`). Never raises on
    any response; raises ValueError for a sample whose `answer` is missing or not a number.
    """
    if not isinstance(sample, dict) or "answer" not in sample:
        raise ValueError("arithmetic reward: the sample has no 'answer' field")
    truth = parse_number(str(sample["answer"]))
    if truth is None:
        raise ValueError(f"arithmetic reward: answer {sample['answer']!r} is not a number")
    if not isinstance(response, str):
        return 0.0
    boxed = extract_boxed(response)
    if boxed is not None:
        answer = parse_number(boxed)
    else:
        answer = last_number_in_text(response)
    return 1.0 if numbers_equal(answer, truth) else 0.0
