"""Multi-turn environment rollouts, token in and token out, on the tiny model through the real
in-process backend: what the sampler was asked, what the datum holds, and every way a trajectory
ends (done, max_turns, context budget, environment exception, time-out)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from tinker import types

from skyrl_trainer.backend.model_loading import load_tokenizer
from skyrl_trainer.data.prompts import render_prompt
from skyrl_trainer.data.tasks import Problem
from skyrl_trainer.envs.guarded import GuardedEnvCalls
from skyrl_trainer.trainer.datums import build_scoring_datum, response_logprobs
from skyrl_trainer.trainer.rollouts import EnvRollouts, EnvSpec
from tests.trainer.loop_helpers import make_service

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A user environment in a module outside the package (loaded as "scripted_envs:Scripted").
SCRIPTED_ENVS = textwrap.dedent(
    '''
    import time
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    class Scripted(BaseTextEnv):
        """Ends after `turns` actions (reward 0.1 per turn, 0.5 on the last); replies
        "Turn k done." meanwhile. Faults on request: raise or hang at a given turn."""

        def __init__(self, env_config=None, extras=None):
            super().__init__()
            self.cfg = env_config or {}
            self.answer = (extras or {})["reward_spec"]["ground_truth"]

        def step(self, action):
            self.turns += 1
            if self.cfg.get("raise_at_turn") == self.turns:
                raise RuntimeError("tool crashed")
            if self.cfg.get("hang_at_turn") == self.turns:
                time.sleep(3)
            done = self.turns >= self.cfg.get("turns", 3)
            reply = [] if done else [{"role": "user", "content": f"Turn {self.turns} done."}]
            reward = 0.5 if done else 0.1
            if done and self.cfg.get("vowel_reward"):  # varies, so groups carry a gradient
                reward = sum(c in "aeiou" for c in action) / max(len(action), 1)
            return {
                "observations": reply,
                "reward": reward,
                "done": done,
                "metadata": {"tool_call": True, "tool_error": "bad" if self.turns == 2 else None},
            }

        def get_metrics(self):
            return {"steps_taken": self.turns}
    '''
)


@pytest.fixture
def scripted(tmp_path, monkeypatch) -> str:
    (tmp_path / "scripted_envs.py").write_text(SCRIPTED_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "scripted_envs:Scripted"


@pytest.fixture(scope="module")
def backend(tmp_path_factory, tiny_model_dir):
    service = make_service(tmp_path_factory.mktemp("rollouts"))
    training = service.create_lora_training_client(str(tiny_model_dir), rank=8, seed=0).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    yield service, training, sampler
    service.core.shutdown()


class RecordingSampler:
    def __init__(self, inner):
        self.inner, self.prompts = inner, []

    def sample(self, prompt, num_samples, params):
        self.prompts.append((prompt.to_ints(), num_samples, params.max_tokens))
        return self.inner.sample(prompt, num_samples, params)


PROBLEM = Problem([{"role": "user", "content": "Play."}], {"question": "Play.", "answer": "7"})


def rollouts(tiny_model_dir, name, config=None, timeout_s=10.0, **spec):
    tokenizer = load_tokenizer(tiny_model_dir)
    env = EnvSpec(name=name, config=config or {}, **spec)
    return EnvRollouts(env, tokenizer, GuardedEnvCalls(8, timeout_s)), tokenizer


def params(max_tokens=6):
    from tinker import types

    return types.SamplingParams(max_tokens=max_tokens, temperature=1.0)


def action_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s in the mask."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_three_turn_trajectory_is_token_in_token_out(backend, tiny_model_dir, scripted):
    _, training, sampler = backend
    recorder = RecordingSampler(sampler)
    engine, tokenizer = rollouts(tiny_model_dir, scripted, max_turns=5)
    (group,) = engine.run(recorder, [PROBLEM], 2, params(), seeds=[11])
    for rollout in group.rollouts:
        assert len(rollout.turns) == 3 and rollout.end_reason == "done"
        assert rollout.reward == pytest.approx(0.1 + 0.1 + 0.5)
        assert rollout.env_metrics == {"steps_taken": 3}
        mask = rollout.mask()
        runs = action_runs(mask)
        assert [e - s for s, e in runs] == [t.action_tokens for t in rollout.turns]
        assert runs[0][0] == 0 and runs[-1][1] == len(rollout.tokens)  # ends on an action
        # Observation tokens carry no sampler log-prob and no loss.
        assert all(rollout.sampler_logprobs[i] == 0.0 for i in np.flatnonzero(mask == 0))
        # Each later turn was sampled from exactly the tokens so far (nothing re-tokenised).
        context = rollout.prompt_tokens + rollout.tokens
        for start, _ in runs[1:]:
            asked = [
                p
                for p, n, _ in recorder.prompts
                if n == 1 and p == context[: len(rollout.prompt_tokens) + start]
            ]
            assert asked, "the turn's request is the trajectory so far"
        # The text equals the chat template's rendering of the conversation.
        messages = [{"role": "user", "content": "Play."}]
        for (start, end), turn in zip(runs, rollout.turns, strict=True):
            action = rollout.tokens[start:end]
            if action[-1] == tokenizer.eos_token_id:
                action = action[:-1]
            messages.append({"role": "assistant", "content": tokenizer.decode(action)})
            messages += turn.observation
        expected = tokenizer.apply_chat_template(
            messages[:-1], tokenize=False, add_generation_prompt=True
        )
        last_start, last_end = runs[-1]
        expected += tokenizer.decode(rollout.tokens[last_start:last_end])
        assert tokenizer.decode(context) == expected
        # The learner's log-probs at action positions agree with the sampler's.
        out = training.forward([build_scoring_datum(rollout)], "cross_entropy").result()
        learner = response_logprobs(rollout, out.loss_fn_outputs[0]["logprobs"].tolist())
        gap = np.abs(learner - np.asarray(rollout.sampler_logprobs))[mask > 0]
        assert gap.max() < 2e-3, gap.max()
    # The first turn of the group was one request for both samples; each later turn one each.
    assert sum(n == 2 for _, n, _ in recorder.prompts) == 1
    assert sum(n == 1 for _, n, _ in recorder.prompts) == 4


def test_skyrl_gym_environment_runs_unchanged(backend, tiny_model_dir):
    _, _, sampler = backend
    engine, _ = rollouts(tiny_model_dir, "gsm8k_multi_turn", max_turns=3)
    problem = Problem(
        [{"role": "user", "content": "What is 2+2?"}], {"question": "q", "answer": "4"}
    )
    (group,) = engine.run(sampler, [problem], 2, params(), seeds=[3])
    for rollout in group.rollouts:
        # The random model never writes "#### 4": the environment ends at its max_turns (3),
        # after its own reply asking for the answer in between.
        assert rollout.reward_error is None
        assert len(rollout.turns) == 3
        assert "#### ANSWER" in rollout.turns[0].observation[0]["content"]
        assert rollout.env_metrics == {"steps": 3}


def test_max_turns_ends_a_trajectory_the_env_did_not_end(backend, tiny_model_dir, scripted):
    engine, _ = rollouts(tiny_model_dir, scripted, {"turns": 10}, max_turns=2)
    (group,) = engine.run(backend[2], [PROBLEM], 2, params(), seeds=[5])
    for rollout in group.rollouts:
        assert len(rollout.turns) == 2 and rollout.end_reason == "max_turns"
        assert rollout.reward == pytest.approx(0.2)


def test_context_budget_truncates(backend, tiny_model_dir, scripted):
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt_len = len(render_prompt(tokenizer, PROBLEM.prompt_messages))
    budget = prompt_len + 14  # room for about one action and one observation
    engine, _ = rollouts(
        tiny_model_dir, scripted, {"turns": 10}, max_turns=10, max_context_tokens=budget
    )
    (group,) = engine.run(backend[2], [PROBLEM], 2, params(), seeds=[5])
    for rollout in group.rollouts:
        assert rollout.end_reason == "context"
        assert rollout.stop_reason == "length"  # what the overlong filter removes
        assert len(rollout.prompt_tokens) + len(rollout.tokens) <= budget


def test_env_exception_ends_only_its_trajectory_with_reward_zero(backend, tiny_model_dir, scripted):
    engine, _ = rollouts(tiny_model_dir, scripted, {"raise_at_turn": 2}, max_turns=5)
    healthy, _ = rollouts(tiny_model_dir, scripted, {}, max_turns=5)
    groups = engine.run(backend[2], [PROBLEM], 2, params(), seeds=[5])
    groups += healthy.run(backend[2], [PROBLEM], 2, params(), seeds=[5])
    crashed, fine = groups
    for rollout in crashed.rollouts:
        assert rollout.reward == 0.0 and rollout.end_reason == "env_error"
        assert "RuntimeError: tool crashed" in rollout.reward_error
        assert len(rollout.turns) == 2
    assert all(r.reward_error is None and len(r.turns) == 3 for r in fine.rollouts)


def test_env_timeout_ends_the_trajectory(backend, tiny_model_dir, scripted):
    engine, _ = rollouts(tiny_model_dir, scripted, {"hang_at_turn": 1}, timeout_s=0.3, max_turns=5)
    (group,) = engine.run(backend[2], [PROBLEM], 2, params(), seeds=[5])
    for rollout in group.rollouts:
        assert rollout.reward == 0.0 and rollout.reward_error == "timed out after 0.3 s"


def test_unknown_or_broken_env_names_are_refused_with_the_field():
    from skyrl_trainer.envs import get_env_class

    with pytest.raises(ValueError, match="env.name='nope' is not a known environment"):
        get_env_class("nope")
    with pytest.raises(ValueError, match="env.name='no_such_module:X'"):
        get_env_class("no_such_module:X")


def test_single_turn_env_reproduces_sampling_then_scoring(backend, tiny_model_dir):
    """The single-turn path samples and scores exactly as the loop did before environments: one
    `sample(prompt, group_size, seed)` per problem, each response scored by the reward fn."""
    from skyrl_trainer.data import render_prompt
    from skyrl_trainer.rewards import get_reward_fn

    _, _, sampler = backend
    tokenizer = load_tokenizer(tiny_model_dir)
    problems = [
        Problem([{"role": "user", "content": f"What is {a} + 1?"}], {"question": "", "answer": "7"})
        for a in (3, 6)
    ]
    engine = EnvRollouts(
        EnvSpec(config={"reward_fn": "tests.trainer.test_rollouts:count_sevens"}),
        tokenizer,
        GuardedEnvCalls(),
    )
    groups = engine.run(sampler, problems, 3, params(8), seeds=[21, 22])
    reward = get_reward_fn("tests.trainer.test_rollouts:count_sevens")
    for problem, group, seed in zip(problems, groups, (21, 22), strict=True):
        prompt = render_prompt(tokenizer, problem.prompt_messages)
        direct = sampler.sample(
            types.ModelInput.from_ints(prompt), 3, params(8).model_copy(update={"seed": seed})
        ).result()
        assert group.prompt_tokens == prompt
        for rollout, seq in zip(group.rollouts, direct.sequences, strict=True):
            assert rollout.tokens == list(seq.tokens)
            assert rollout.sampler_logprobs == pytest.approx(list(seq.logprobs), abs=1e-5)
            text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
            assert rollout.reward == reward(text, problem.sample)
            assert rollout.action_mask is None and len(rollout.turns) == 1


def count_sevens(response: str, sample: dict) -> float:
    return float(response.count("7") + len(response) % 3)
