"""Python tool use: the model may run code in the sandbox, read its output, then answer.

For arithmetic or GSM8K questions. A turn holding a complete `<python>...</python>` block (and no
final answer before it) runs the code with `sandbox.run_python` and returns its output as
`<output>...</output>`; a turn holding `<answer>NUMBER</answer>` (or GSM8K's `#### NUMBER`) ends
the episode with reward 1.0 when the number equals the ground truth, else 0.0; a turn with
neither ends it with 0.0. Each step's metadata is `{"tool_call": bool, "tool_error": str | None}`.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from fractions import Fraction
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_trainer.envs.registry import register_env
from skyrl_trainer.envs.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = ["SYSTEM_PROMPT", "PythonToolEnv", "parse_answer"]

SYSTEM_PROMPT = (
    "You can run Python code. Write it between <python> and </python> and you will get its "
    "output back. Use print() to show results.\n"
    "When you know the answer, reply with <answer>NUMBER</answer>."
)
_LIMIT_KEYS = sorted(f.name for f in dataclasses.fields(SandboxLimits))
_PYTHON = re.compile(r"<python>(.*?)</python>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>|####[ \t]*([^\n]*)", re.DOTALL)
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_STDOUT_CHARS = 800  # what the model sees of the output (a small model has little context)
_STDERR_LINES = 3


def _number(text: str) -> Fraction | None:
    """The first number in `text` (commas, `$` and spaces ignored), exactly; None if none."""
    match = _NUMBER.search(re.sub(r"(?<=\d),(?=\d)", "", text).replace("$", ""))
    try:
        return Fraction(match.group()) if match else None
    except (ValueError, ZeroDivisionError):
        return None


def parse_answer(action: str) -> tuple[int, str] | None:
    """(position, text) of the first final answer in `action`: `<answer>X</answer>` or `#### X`."""
    match = _ANSWER.search(action)
    if match is None:
        return None
    return match.start(), (match.group(1) if match.group(1) is not None else match.group(2))


def _correct(answer: str, truth: str) -> bool:
    a, t = _number(answer), _number(truth)
    if t is None:  # a non-numeric ground truth: compare the text
        return answer.strip().casefold() == truth.strip().casefold()
    return a == t


def _code(block: str) -> str:
    """The code in a `<python>` block: a ``` fence around it dropped, common indentation removed."""
    lines = block.strip("\n").splitlines()
    if lines and lines[0].lstrip().startswith("```"):
        lines = lines[1:]
    if lines and lines[-1].strip() == "```":
        lines = lines[:-1]
    return textwrap.dedent("\n".join(lines))


def _observation(result: SandboxResult) -> str:
    out = result.stdout
    if len(out) > _STDOUT_CHARS:
        out = out[:_STDOUT_CHARS] + "\n...(output cut)"
    parts = [out.rstrip("\n")] if out.strip() else []
    err = result.stderr.strip().splitlines()[-_STDERR_LINES:]
    parts += [line[:200] for line in err]
    if result.error and not (err and err[-1] in result.error):
        parts.append(f"Error: {result.error}")
    if not parts:
        parts.append("(no output: use print() to show values)")
    return "<output>\n" + "\n".join(parts) + "\n</output>"


def _tool_error(result: SandboxResult) -> str | None:
    if result.error:
        return result.error
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit code {result.returncode}"
    return None


@register_env("python_tool")
class PythonToolEnv(BaseTextEnv):
    """env_config: any `SandboxLimits` field (e.g. `{"cpu_s": 2, "wall_s": 5}`); extras:
    `reward_spec.ground_truth` (the answer) and optional `max_turns` (default 4).
    Metrics: `tool_calls`, `tool_errors` (calls that raised, were killed or refused), `turns`."""

    def __init__(self, env_config: dict | None = None, extras: dict | None = None):
        super().__init__()
        config, extras = dict(env_config or {}), extras or {}
        for key in config:
            if key not in _LIMIT_KEYS:
                raise ValueError(
                    f"python_tool: unknown env_config key {key!r}; known (SandboxLimits "
                    f"fields): {_LIMIT_KEYS}"
                )
        self.limits = SandboxLimits(**config)
        truth = (extras.get("reward_spec") or {}).get("ground_truth")
        if truth is None:
            raise ValueError("python_tool: extras['reward_spec']['ground_truth'] is required")
        self.ground_truth = str(truth)
        max_turns = extras.get("max_turns")
        self.max_turns = 4 if max_turns is None else int(max_turns)
        if self.max_turns < 1:
            raise ValueError(f"python_tool: max_turns must be >= 1, got {max_turns!r}")
        self.tool_calls = 0
        self.tool_errors = 0

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict]:
        messages = [dict(m) for m in prompt]
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = (
                f"{messages[0].get('content') or ''}\n\n{SYSTEM_PROMPT}".lstrip()
            )
        else:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        return messages, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        answer = parse_answer(action)
        code = _PYTHON.search(action)
        if code is not None and (answer is None or code.start() < answer[0]):
            result = run_python(_code(code.group(1)), self.limits)
            error = _tool_error(result)
            self.tool_calls += 1
            self.tool_errors += error is not None
            return BaseTextEnvStepOutput(
                observations=[{"role": "user", "content": _observation(result)}],
                reward=0.0,
                done=self.turns >= self.max_turns,
                metadata={"tool_call": True, "tool_error": error},
            )
        reward = 1.0 if answer is not None and _correct(answer[1], self.ground_truth) else 0.0
        return BaseTextEnvStepOutput(
            observations=[],
            reward=reward,
            done=True,
            metadata={"tool_call": False, "tool_error": None},
        )

    def get_metrics(self) -> dict[str, Any]:
        return {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "turns": self.turns}
