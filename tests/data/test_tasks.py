from __future__ import annotations

import pytest

from skyrl_trainer.data import (
    TASK_FORMATS,
    Problem,
    TaskConfig,
    build_problems,
    generate_arithmetic_rows,
    last_boxed_answer,
    load_rows,
    register_task_format,
)
from skyrl_trainer.data.tasks import GSM8K_INSTRUCTION
from tests.data.helpers import SMALL_ROWS

SKYRL_GSM8K_SUFFIX = ' Let\'s think step by step and output the final answer after "####".'


def test_gsm8k_messages_and_sample():
    (problem,) = build_problems(SMALL_ROWS[:1], TaskConfig(format="gsm8k"))
    assert problem.prompt_messages == [
        {"role": "user", "content": "What is 1 + 1?" + SKYRL_GSM8K_SUFFIX}
    ]
    assert problem.sample == {
        "question": "What is 1 + 1?",
        "answer": "2",
        "solution": "1 + 1 = 2\n#### 2",
    }


def test_gsm8k_ground_truth_on_real_rows(gsm8k_dir):
    for split in ("test", "train"):
        rows = load_rows(str(gsm8k_dir), split)
        problems = build_problems(rows, TaskConfig(format="gsm8k"))
        assert len(problems) == len(rows)
        for problem in problems:
            assert "," not in problem.sample["answer"]
            float(problem.sample["answer"])  # every GSM8K ground truth is a plain number
        answers = {p.sample["solution"].rsplit("####", 1)[1].strip(): p for p in problems}
        if split == "test":
            assert len(problems) == 1319
            assert problems[0].sample["answer"] == "18"
            assert answers["1,450,000"].sample["answer"] == "1450000"
        else:
            assert answers["1,080"].sample["answer"] == "1080"
            assert answers["1,080"].prompt_messages == [
                {
                    "role": "user",
                    "content": answers["1,080"].sample["question"] + SKYRL_GSM8K_SUFFIX,
                }
            ]


def test_instruction_override_and_columns():
    rows = [{"q": "What is 2 + 2?", "a": "#### 4"}]
    config = TaskConfig(
        format="gsm8k", instruction="Answer briefly.", question_key="q", answer_key="a"
    )
    (problem,) = build_problems(rows, config)
    assert problem.prompt_messages[0]["content"] == "What is 2 + 2? Answer briefly."
    assert problem.sample["answer"] == "4"
    (problem,) = build_problems(
        rows, TaskConfig(instruction="\nAnswer.", question_key="q", answer_key="a")
    )
    assert problem.prompt_messages[0]["content"] == "What is 2 + 2?\nAnswer."
    (problem,) = build_problems(rows, TaskConfig(instruction="", question_key="q", answer_key="a"))
    assert problem.prompt_messages[0]["content"] == "What is 2 + 2?"


def test_gsm8k_row_errors_name_the_row_and_column():
    with pytest.raises(ValueError, match=r"row 1: .*'####'"):
        build_problems([SMALL_ROWS[0], {"question": "x", "answer": "42"}], TaskConfig())
    with pytest.raises(ValueError, match=r"row 0: no 'question' column .*question_key"):
        build_problems([{"problem": "x", "answer": "#### 1"}], TaskConfig())


def test_unknown_format_names_the_field():
    with pytest.raises(ValueError, match=r"^data.format: unknown task format 'nope'"):
        build_problems(SMALL_ROWS, TaskConfig(format="nope"))


def test_math_answer_column_or_boxed_solution():
    rows = [
        {"problem": "Compute $1+1$.", "answer": "2"},
        {"problem": "Simplify.", "solution": "So $x = \\boxed{3}$, not \\boxed{\\frac{1}{2}}."},
        {"question": "Area?", "solution": "It is \\boxed{\\pi r^{2}}"},
    ]
    problems = build_problems(rows, TaskConfig(format="math"))
    assert problems[0].prompt_messages[0]["content"].startswith("Compute $1+1$. ")
    assert (
        problems[0]
        .prompt_messages[0]["content"]
        .endswith("Put your final answer within \\boxed{}.")
    )
    assert [p.sample["answer"] for p in problems] == ["2", "\\frac{1}{2}", "\\pi r^{2}"]
    assert problems[1].sample["solution"] == rows[1]["solution"]
    assert "solution" not in problems[0].sample
    with pytest.raises(ValueError, match=r"row 0: no 'answer' column and no \\boxed"):
        build_problems([{"problem": "x", "solution": "no box"}], TaskConfig(format="math"))


def test_last_boxed_answer():
    assert last_boxed_answer("a \\boxed{1} b \\boxed{{2}+{3}}") == "{2}+{3}"
    assert last_boxed_answer("no box") is None
    assert last_boxed_answer("\\boxed{unclosed") is None


def test_arithmetic_rows_and_format():
    rows = generate_arithmetic_rows(50, seed=3)
    assert rows == generate_arithmetic_rows(50, seed=3)
    assert rows != generate_arithmetic_rows(50, seed=4)
    for row in rows:
        a, op, b = row["question"].removeprefix("What is ").removesuffix("?").split()
        assert op in "+-" and 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert row["answer"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
    problems = build_problems(rows, TaskConfig(format="arithmetic"))
    content = problems[0].prompt_messages[0]["content"]
    assert content.startswith(rows[0]["question"] + " ") and "just the number" in content
    assert problems[0].sample == rows[0]


def test_arithmetic_generator_options():
    rows = generate_arithmetic_rows(20, seed=0, max_operand=5, ops=("*",))
    assert all(" * " in row["question"] for row in rows)
    assert generate_arithmetic_rows(0, seed=0) == []
    with pytest.raises(ValueError, match="ops"):
        generate_arithmetic_rows(3, seed=0, ops=("/",))


def test_register_task_format():
    @register_task_format("test_echo")
    def echo(row: dict, config: TaskConfig) -> Problem:
        return Problem([{"role": "user", "content": row["q"]}], {"answer": row["a"]})

    try:
        (problem,) = build_problems([{"q": "hi", "a": "1"}], TaskConfig(format="test_echo"))
        assert problem.sample == {"answer": "1"}
        with pytest.raises(ValueError, match="already registered"):
            register_task_format("test_echo")(echo)
    finally:
        del TASK_FORMATS["test_echo"]


def test_default_gsm8k_instruction_is_skyrls():
    assert " " + GSM8K_INSTRUCTION == SKYRL_GSM8K_SUFFIX
