"""Rolling out environments through a Tinker SamplingClient: one trajectory, one group, a batch.

Token in, token out: a trajectory is the prompt followed by each turn's sampled action tokens
(kept verbatim with their sampler log-probs) and the rendered observation tokens that continue
them; nothing is ever re-tokenised. All trajectories of a batch are in flight at once: each group's
first turn is one `sample(prompt, group_size)` request (the prompt is shared, and single-turn runs
sample exactly as before), then every trajectory goes on by itself, so the engine batches the
pending turns of all trajectories while environments step concurrently (`GuardedEnvCalls`).
"""

from __future__ import annotations

import math
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from skyrl_trainer.data.prompts import render_observation, render_prompt
from skyrl_trainer.envs import make_env
from skyrl_trainer.envs.guarded import GuardedEnvCalls
from skyrl_trainer.trainer.datums import Rollout
from skyrl_trainer.trainer.progress import PhaseTimer

_POLL_S = 0.25


class RolloutsStopped(Exception):
    """The rollouts were told to stop (`EnvRollouts.stop`) while waiting for the sampler."""


def sample_seed(*parts: Any) -> int:
    """A deterministic 31-bit seed for (run seed, step, round, prompt index, ...)."""
    return zlib.crc32(",".join(map(str, parts)).encode()) & 0x7FFFFFFF


@dataclass
class Turn:
    """One action and what the environment made of it (for logs and metrics)."""

    action: str
    action_tokens: int
    stop_reason: str  # the sampler's: stop | length
    reward: float = 0.0
    observation: list[dict] = field(default_factory=list)
    observation_tokens: int = 0
    env_seconds: float = 0.0
    tool_call: bool = False
    tool_error: str | None = None


@dataclass
class Group:
    """The `group_size` trajectories of one problem."""

    problem: Any  # skyrl_trainer.data.Problem
    prompt_tokens: list[int]
    rollouts: list[Rollout]
    index: int | None = None  # streaming mode: the group's place in the order groups started

    @property
    def version(self) -> int | None:
        """The weights version that sampled the group (None: the synchronous loop's current)."""
        return self.rollouts[0].sampler_version if self.rollouts else None

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]


@dataclass(frozen=True)
class EnvSpec:
    """Which environment and the limits of a trajectory (config section `env`)."""

    name: str = "single_turn"
    config: dict = field(default_factory=dict)
    max_turns: int = 8
    max_context_tokens: int = 4096
    reward_discount: float = 1.0  # return = sum_t discount^t * reward_t


def env_extras(sample: dict, max_turns: int) -> dict:
    """What an environment is constructed with besides its config: the row, skyrl-gym's
    `reward_spec` / `extra_info`, and the turn limit."""
    return {
        "sample": sample,
        "reward_spec": {"method": "rule", "ground_truth": sample.get("answer")},
        "extra_info": sample.get("extra_info", {}),
        "max_turns": max_turns,
    }


class EnvRollouts:
    """Runs groups of trajectories of `spec`'s environment on a sampler."""

    def __init__(
        self,
        spec: EnvSpec,
        tokenizer,
        calls: GuardedEnvCalls,
        system_prompt: str | None = None,
        correct_threshold: float = 1.0,
    ):
        self.spec = spec
        self.tokenizer = tokenizer
        self.calls = calls
        self.system_prompt = system_prompt
        self.correct_threshold = correct_threshold
        self.stop_token_ids = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t}
        # Set by whoever shuts the run down: every trajectory waiting for the sampler gives up
        # within `_POLL_S` with RolloutsStopped, so no thread outlives the run by more than that
        # (an environment call in progress ends within its own time-out).
        self.stop = threading.Event()

    def _result(self, future):
        while True:
            if self.stop.is_set():
                raise RolloutsStopped("rollouts stopped")
            try:
                return future.result(timeout=_POLL_S)
            except TimeoutError:
                continue

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def run(
        self,
        sampler,
        problems: list,
        group_size: int,
        params: types.SamplingParams,
        seeds: list[int | None],
        progress: PhaseTimer | None = None,
        label: str = "rollouts",
    ) -> list[Group]:
        """`group_size` trajectories per problem, all in flight at once; returns one Group per
        problem with every trajectory finished (an environment fault ends its trajectory with
        reward 0 and `reward_error` set; it never raises out of here)."""
        starts = [self._start_group(p, group_size) for p in problems]
        firsts = [
            _Shared(sampler.sample(types.ModelInput.from_ints(prompt), group_size, first_params))
            for prompt, first_params in (
                (prompt, self._turn_params(params, seed, len(prompt)))
                for (prompt, _), seed in zip(starts, seeds, strict=True)
            )
        ]
        jobs = [
            (first, prompt, env, error, j, seed)
            for (prompt, envs), first, seed in zip(starts, firsts, seeds, strict=True)
            for j, (env, error) in enumerate(envs)
        ]
        progress = progress or PhaseTimer(every_s=0)
        with ThreadPoolExecutor(max(len(jobs), 1), thread_name_prefix="trajectory") as pool:
            futures = [pool.submit(self._trajectory, sampler, params, *job) for job in jobs]
            rollouts = progress.results(futures, label, "trajectories")
        groups, it = [], iter(rollouts)
        for problem, (prompt, _) in zip(problems, starts, strict=True):
            groups.append(Group(problem, prompt, [next(it) for _ in range(group_size)]))
        return groups

    # ----- one group, one trajectory -----------------------------------------------------

    def _start_group(self, problem, group_size: int):
        """The group's environments (initialised) and its prompt tokens."""
        spec = self.spec
        extras = env_extras(problem.sample, spec.max_turns)
        config = dict(spec.config)
        envs, messages = [], None
        for _ in range(group_size):
            made = self.calls.call(make_env, spec.name, config, extras)
            env, error = made.value, made.error
            if env is not None:
                init = self.calls.call(env.init, list(problem.prompt_messages))
                if init.error is None:
                    first = list(init.value[0])
                    if messages is None:
                        messages = first
                    elif first != messages:
                        error = "init returned another prompt than its group's first environment"
                error = error or init.error
            envs.append((env, error))
        if messages is None:
            messages = list(problem.prompt_messages)
        return render_prompt(self.tokenizer, messages, self.system_prompt), envs

    def _turn_params(self, params, seed, context_len: int) -> types.SamplingParams:
        room = self.spec.max_context_tokens - context_len
        return params.model_copy(
            update={"seed": seed, "max_tokens": max(1, min(params.max_tokens, room))}
        )

    def _trajectory(self, sampler, params, first, prompt, env, error, j, seed) -> Rollout:
        try:
            return self._play(sampler, params, first, prompt, env, error, j, seed)
        except RolloutsStopped:
            if env is not None:
                self.calls.call(env.close)
            raise

    def _play(self, sampler, params, first, prompt, env, error, j, seed) -> Rollout:
        spec = self.spec
        response = first.get(self._result).sequences[j]
        tokens: list[int] = []
        logprobs: list[float] = []
        mask: list[float] = []
        turns: list[Turn] = []
        total, end, components = 0.0, "max_turns", {}
        while True:
            action = list(response.tokens)
            tokens += action
            logprobs += [float(x) for x in (response.logprobs or [0.0] * len(action))]
            mask += [1.0] * len(action)
            turn = Turn(self.decode(action), len(action), response.stop_reason)
            turns.append(turn)
            if error is not None:
                total, end = 0.0, "env_error"
                break
            result = self.calls.call(env.step, turn.action)
            turn.env_seconds = result.seconds
            if result.error is not None:
                error, total, end = result.error, 0.0, "env_error"
                break
            out = result.value
            reward = out.get("reward") if isinstance(out, dict) else None
            if not isinstance(reward, (int, float)) or not math.isfinite(reward):
                error, total, end = (
                    f"step returned no finite reward: {out!r:.200}",
                    0.0,
                    "env_error",
                )
                break
            metadata = out.get("metadata") or {}
            turn.reward = float(reward)
            turn.tool_call = bool(metadata.get("tool_call", False))
            turn.tool_error = metadata.get("tool_error")
            for key, value in (metadata.get("reward_components") or {}).items():
                components[key] = components.get(key, 0.0) + value
            total += spec.reward_discount ** (len(turns) - 1) * turn.reward
            if out.get("done"):
                end = "done"
                break
            if len(turns) >= spec.max_turns:
                break
            turn.observation = list(out.get("observations") or [])
            observation = render_observation(
                self.tokenizer, turn.observation, action, self.stop_token_ids
            )
            context = len(prompt) + len(tokens) + len(observation)
            if context >= spec.max_context_tokens:  # no room for another action
                end = "context"
                break
            turn.observation_tokens = len(observation)
            tokens += observation
            logprobs += [0.0] * len(observation)
            mask += [0.0] * len(observation)
            turn_seed = None if seed is None else sample_seed(seed, j, len(turns))
            future = sampler.sample(
                types.ModelInput.from_ints(prompt + tokens),
                1,
                self._turn_params(params, turn_seed, context),
            )
            response = self._result(future).sequences[0]
        env_metrics = {}
        if env is not None:
            metrics = self.calls.call(env.get_metrics).value
            env_metrics = dict(metrics) if isinstance(metrics, dict) else {}
            self.calls.call(env.close)
        cut = end == "context" or turns[-1].stop_reason == "length"
        return Rollout(
            prompt_tokens=list(prompt),
            tokens=tokens,
            sampler_logprobs=logprobs,
            stop_reason="length" if cut else "stop",
            reward=total,
            reward_components=components if error is None else {},
            reward_error=error,
            correct=error is None and total >= self.correct_threshold,
            action_mask=None if len(turns) == 1 else mask,
            turns=turns,
            end_reason=end,
            env_metrics=env_metrics,
        )


class _Shared:
    """A sampling future whose result several trajectory threads read (fetched once)."""

    def __init__(self, future):
        self._future, self._lock, self._value = future, threading.Lock(), None

    def get(self, wait):
        with self._lock:
            if self._value is None:
                self._value = wait(self._future)
            return self._value
