"""Training and evaluation data: loading rows, turning them into RL problems, rendering prompts, and
streaming resumable batches."""

from skyrl_trainer.data.prompts import render_prompt
from skyrl_trainer.data.sources import load_rows
from skyrl_trainer.data.stream import PromptStream
from skyrl_trainer.data.tasks import (
    TASK_FORMATS,
    Problem,
    TaskConfig,
    build_problems,
    generate_arithmetic_rows,
    gsm8k_ground_truth,
    last_boxed_answer,
    register_task_format,
)

__all__ = [
    "TASK_FORMATS",
    "Problem",
    "PromptStream",
    "TaskConfig",
    "build_problems",
    "generate_arithmetic_rows",
    "gsm8k_ground_truth",
    "last_boxed_answer",
    "load_rows",
    "register_task_format",
    "render_prompt",
]
