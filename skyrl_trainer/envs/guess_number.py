"""Guess-the-number: a multi-turn game without tools, small enough for a 135M chat model.

The model guesses a secret whole number in [low, high]; after each wrong guess the user says
"Higher." or "Lower.". Reward is 1.0 for a win and 0.0 otherwise (the trainer sums turn rewards).
Binary search needs `optimal_turns(1, 16) == 5` guesses, hence the default turn limit of 5.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_trainer.data.tasks import (
    Problem,
    TaskConfig,
    register_generated_rows,
    register_task_format,
)
from skyrl_trainer.envs.registry import register_env

__all__ = ["GuessNumberEnv", "generate_guess_number_rows", "optimal_turns"]

_DEFAULTS = {"low": 1, "high": 16}
_INT = re.compile(r"-?\d+")
_METRICS = ("won", "turns", "invalid_guesses", "repeated_guesses", "inconsistent_guesses")


def optimal_turns(low: int, high: int) -> int:
    """Guesses binary search needs in the worst case for a secret in [low, high]:
    ceil(log2(n + 1)) with n = high - low + 1 (5 for 1..16)."""
    return math.ceil(math.log2(_check_range(low, high) + 1))


def _check_range(low: Any, high: Any) -> int:
    """The number of values in [low, high]; ValueError unless they are ints with low < high."""
    for key, value in (("low", low), ("high", high)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"guess_number: {key} must be an int, got {value!r}")
    if low >= high:
        raise ValueError(f"guess_number: need low < high, got low={low}, high={high}")
    return high - low + 1


def _question(low: int, high: int) -> str:
    # The wording SmolLM2-135M-Instruct most often answers with an in-range number (42% of
    # replies, with the system prompt "You reply with a single number."; 11% for a longer
    # explanation of the rules). The "Higher." / "Lower." replies explain themselves.
    return f"Pick a number from {low} to {high}."


def generate_guess_number_rows(n: int, seed: int, low: int = 1, high: int = 16) -> list[dict]:
    """`n` rows `{"question": opening message, "answer": str(secret)}`, secrets uniform in
    [low, high] drawn by `random.Random(seed)`."""
    _check_range(low, high)
    if n < 0:
        raise ValueError(f"guess_number: n must be >= 0, got {n}")
    rng = random.Random(seed)
    question = _question(low, high)
    return [{"question": question, "answer": str(rng.randint(low, high))} for _ in range(n)]


@register_env("guess_number")
class GuessNumberEnv(BaseTextEnv):
    """env_config: `{"low": 1, "high": 16}` (defaults); extras: `reward_spec.ground_truth` (the
    secret) and optional `max_turns` (default `optimal_turns(low, high)`, 5 for 1..16).

    Every step is a turn, valid or not. Metadata per step: `{"guess": int | None, "valid": bool}`;
    a guess is valid when it is a number inside [low, high]. Among valid wrong guesses, a
    *repeated* one was guessed before and an *inconsistent* one (not a repeat) lies outside the
    interval the earlier feedback still allows.
    """

    def __init__(self, env_config: dict | None = None, extras: dict | None = None):
        super().__init__()
        config, extras = dict(env_config or {}), extras or {}
        unknown = sorted(set(config) - set(_DEFAULTS))
        if unknown:
            raise ValueError(
                f"guess_number: unknown env_config key(s) {unknown}; known: {sorted(_DEFAULTS)}"
            )
        self.low, self.high = config.get("low", 1), config.get("high", 16)
        _check_range(self.low, self.high)
        self.secret = int(extras["reward_spec"]["ground_truth"])
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"guess_number: secret {self.secret} not in [{self.low}, {self.high}]")
        max_turns = extras.get("max_turns")
        self.max_turns = (
            int(max_turns) if max_turns is not None else optimal_turns(self.low, self.high)
        )
        if self.max_turns < 1:
            raise ValueError(f"guess_number: max_turns must be >= 1, got {self.max_turns}")
        self.lo, self.hi = self.low, self.high  # what the feedback so far still allows
        self.guesses: set[int] = set()
        self.won = False
        self.invalid = self.repeated = self.inconsistent = 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        match = _INT.search(action or "")
        guess = int(match.group()) if match else None
        valid = guess is not None and self.low <= guess <= self.high
        metadata = {"guess": guess, "valid": valid}
        if not valid:
            self.invalid += 1
            message = f"Reply with just one number between {self.low} and {self.high}."
            if guess is not None:
                message = f"{guess} is not between {self.low} and {self.high}. {message}"
        elif guess == self.secret:
            self.won = True
            return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata=metadata)
        else:
            if guess in self.guesses:
                self.repeated += 1
            elif not self.lo <= guess <= self.hi:
                self.inconsistent += 1
            self.guesses.add(guess)
            if guess < self.secret:
                message, self.lo = "Higher.", max(self.lo, guess + 1)
            else:
                message, self.hi = "Lower.", min(self.hi, guess - 1)
        done = self.turns >= self.max_turns
        observations = [] if done else [{"role": "user", "content": message}]
        return BaseTextEnvStepOutput(
            observations=observations, reward=0.0, done=done, metadata=metadata
        )

    def get_metrics(self) -> dict[str, Any]:
        return {
            "won": int(self.won),
            "turns": self.turns,
            "invalid_guesses": self.invalid,
            "repeated_guesses": self.repeated,
            "inconsistent_guesses": self.inconsistent,
        }

    @staticmethod
    def aggregate_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
        if not metrics:
            return {}
        return {key: sum(float(m.get(key, 0)) for m in metrics) / len(metrics) for key in _METRICS}


@register_generated_rows("guess_number")
def _generated_rows(n: int, seed: int) -> list[dict]:
    return generate_guess_number_rows(n, seed)


@register_task_format("guess_number")
def guess_number_format(row: dict, config: TaskConfig) -> Problem:
    """`data.format=guess_number`: the opening message as the user turn, the secret as answer."""
    question, answer = str(row["question"]), str(row["answer"]).strip()
    return Problem(
        [{"role": "user", "content": question}], {"question": question, "answer": answer}
    )
