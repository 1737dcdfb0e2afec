"""Turning dataset rows into RL problems: the prompt's chat messages and the sample given to the reward.

A task format is a function `(row, TaskConfig) -> Problem`, registered by name in `TASK_FORMATS` with
`@register_task_format(name)`. Built in:

- `gsm8k`: `question` and `answer` columns; the ground truth is the text after the last "####" of the
  answer, commas removed ("#### 1,080" -> "1080"). Default instruction: SkyRL's GSM8K prompt suffix.
- `math`: the question in `problem` (or `question`); the ground truth from `answer`, or else the last
  \\boxed{} of `solution`. Default instruction asks for the answer in \\boxed{}.
- `arithmetic`: rows from `generate_arithmetic_rows` ("What is 23 + 45?", answer "68").

A format's `Problem.sample` holds exactly the normalised fields it documents (always `question` and
`answer`, the latter a string); other columns of the row are not carried over.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One RL prompt and what its reward needs."""

    prompt_messages: list[
        dict
    ]  # chat messages (the user turn; the system prompt is added at render)
    sample: dict  # the row, passed to the reward (must contain "answer")


@dataclass(frozen=True)
class TaskConfig:
    """How rows become problems.

    `system_prompt` is not put into `Problem.prompt_messages`: it is given to `render_prompt`.
    `instruction` replaces the format's default suffix; it is joined to the question with a space, unless
    it starts with whitespace (then appended as is); "" means no suffix.
    `question_key` / `answer_key` name the columns to read instead of the format's defaults.
    """

    format: str = "gsm8k"
    system_prompt: str | None = None
    instruction: str | None = None
    question_key: str | None = None
    answer_key: str | None = None


TaskFormat = Callable[[dict, TaskConfig], Problem]

#: Task formats by name; add one with `@register_task_format(name)`.
TASK_FORMATS: dict[str, TaskFormat] = {}

# SkyRL's (and veRL's) GSM8K prompt suffix, so rewards and results compare with theirs.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step. Put your final answer within \\boxed{}."
ARITHMETIC_INSTRUCTION = "Answer with just the number, nothing else."

ARITHMETIC_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


#: Formats whose rows are generated, not read: name -> `generate(n, seed) -> rows`.
GENERATED_ROWS: dict[str, Callable[[int, int], list[dict]]] = {}


def register_generated_rows(name: str):
    """Decorator: rows of format `name` come from this `generate(n, seed)` function, so
    `data.path` is not read for it (`data.generated_rows` rows for training, `eval.num_prompts`
    more with seed + 1 for evaluation)."""

    def decorator(function):
        GENERATED_ROWS[name] = function
        return function

    return decorator


def register_task_format(name: str) -> Callable[[TaskFormat], TaskFormat]:
    """Decorator registering a task format under `name`; raises ValueError if the name is taken."""

    def decorator(function: TaskFormat) -> TaskFormat:
        if name in TASK_FORMATS:
            raise ValueError(f"task format {name!r} is already registered")
        TASK_FORMATS[name] = function
        return function

    return decorator


def build_problems(
    rows: Iterable[dict], config: TaskConfig, field: str = "data.format"
) -> list[Problem]:
    """Turn every row into a Problem with the format `config.format`.

    Raises ValueError naming `field` for an unknown format, and naming the row index for a bad row.
    """
    task_format = TASK_FORMATS.get(config.format)
    if task_format is None:
        raise ValueError(
            f"{field}: unknown task format {config.format!r}; known: {sorted(TASK_FORMATS)}"
        )
    problems = []
    for index, row in enumerate(rows):
        try:
            problems.append(task_format(row, config))
        except ValueError as error:
            raise ValueError(f"{field}={config.format!r}: row {index}: {error}") from error
    return problems


def last_boxed_answer(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (nested braces balanced), or None if none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    begin = start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index].strip()
            depth -= 1
    return None  # unbalanced: no closing brace


def gsm8k_ground_truth(solution: str) -> str:
    """The final answer of a GSM8K solution: the text after the last "####", commas removed."""
    if "####" not in solution:
        raise ValueError(f"the answer has no '####' final answer: {solution[-80:]!r}")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise ValueError(f"the answer is empty after '####': {solution[-80:]!r}")
    return answer


@register_generated_rows("arithmetic")
def generate_arithmetic_rows(
    n: int, seed: int, max_operand: int = 99, ops: tuple[str, ...] = ("+", "-")
) -> list[dict]:
    """`n` rows {"question": "What is a op b?", "answer": str(result)} with operands in
    [0, max_operand]; the same arguments always give the same rows."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    unknown = [op for op in ops if op not in ARITHMETIC_OPS]
    if not ops or unknown:
        raise ValueError(f"ops must be a non-empty subset of {list(ARITHMETIC_OPS)}, got {ops}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.randint(0, max_operand)
        b = rng.randint(0, max_operand)
        op = ops[rng.randrange(len(ops))]
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(ARITHMETIC_OPS[op](a, b))})
    return rows


def _column(row: dict, key: str, setting: str) -> Any:
    value = row.get(key)
    if value is None:
        raise ValueError(
            f"no {key!r} column (columns: {sorted(row)}); set {setting} to the column to use"
        )
    return value


def _user_message(question: str, instruction: str | None, default: str) -> list[dict]:
    suffix = default if instruction is None else instruction
    if not suffix:
        content = question
    elif suffix[0].isspace():
        content = question + suffix
    else:
        content = f"{question} {suffix}"
    return [{"role": "user", "content": content}]


@register_task_format("gsm8k")
def gsm8k_format(row: dict, config: TaskConfig) -> Problem:
    """GSM8K: sample = {"question", "answer": final number, "solution": the full answer text}."""
    question = str(_column(row, config.question_key or "question", "question_key"))
    solution = str(_column(row, config.answer_key or "answer", "answer_key"))
    return Problem(
        prompt_messages=_user_message(question, config.instruction, GSM8K_INSTRUCTION),
        sample={
            "question": question,
            "answer": gsm8k_ground_truth(solution),
            "solution": solution,
        },
    )


@register_task_format("math")
def math_format(row: dict, config: TaskConfig) -> Problem:
    """MATH-style: sample = {"question", "answer"}, plus "solution" when the row has one."""
    question_key = config.question_key or ("problem" if "problem" in row else "question")
    question = str(_column(row, question_key, "question_key"))
    solution = row.get("solution")
    if config.answer_key is not None:
        answer = str(_column(row, config.answer_key, "answer_key"))
    elif row.get("answer") is not None and str(row["answer"]).strip():
        answer = str(row["answer"]).strip()
    else:
        answer = last_boxed_answer(str(solution)) if solution is not None else None
        if answer is None:
            raise ValueError(
                "no 'answer' column and no \\boxed{} in a 'solution' column; set answer_key"
            )
    sample = {"question": question, "answer": answer}
    if solution is not None:
        sample["solution"] = str(solution)
    return Problem(
        prompt_messages=_user_message(question, config.instruction, MATH_INSTRUCTION),
        sample=sample,
    )


@register_task_format("arithmetic")
def arithmetic_format(row: dict, config: TaskConfig) -> Problem:
    """Rows of `generate_arithmetic_rows`: sample = {"question", "answer"}."""
    question = str(_column(row, config.question_key or "question", "question_key"))
    answer = str(_column(row, config.answer_key or "answer", "answer_key")).strip()
    return Problem(
        prompt_messages=_user_message(question, config.instruction, ARITHMETIC_INSTRUCTION),
        sample={"question": question, "answer": answer},
    )
