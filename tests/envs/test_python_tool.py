"""The python_tool environment: scripted episodes through the sandboxed Python tool."""

from __future__ import annotations

import sys

import pytest

import skyrl_trainer.envs.python_tool  # noqa: F401  (registers "python_tool")
from skyrl_trainer.envs import ENVS, make_env
from skyrl_trainer.envs.python_tool import SYSTEM_PROMPT, PythonToolEnv, parse_answer
from skyrl_trainer.envs.sandbox import SandboxLimits

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox targets Linux")

QUESTION = "A shop sells 45 boxes of 24 pencils. How many pencils is that?"


def _extras(answer: str = "1080", max_turns: int | None = 4) -> dict:
    extras = {
        "reward_spec": {"method": "rule", "ground_truth": answer},
        "sample": {"question": QUESTION, "answer": answer},
    }
    if max_turns is not None:
        extras["max_turns"] = max_turns
    return extras


def _env(answer: str = "1080", max_turns: int | None = 4, **config) -> PythonToolEnv:
    return PythonToolEnv(env_config={"wall_s": 5, **config}, extras=_extras(answer, max_turns))


def _content(out: dict) -> str:
    assert len(out["observations"]) == 1 and out["observations"][0]["role"] == "user"
    return out["observations"][0]["content"]


def test_scripted_episode_tool_then_right_answer():
    assert ENVS["python_tool"] is PythonToolEnv
    env = make_env("python_tool", {"cpu_s": 2}, _extras())
    assert isinstance(env, PythonToolEnv) and env.limits.cpu_s == 2
    messages, _ = env.init([{"role": "user", "content": QUESTION}])
    assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert messages[1] == {"role": "user", "content": QUESTION}

    out = env.step("Let me compute.\n<python>\nprint(45 * 24)\n</python>")
    assert out["reward"] == 0.0 and not out["done"]
    assert out["metadata"] == {"tool_call": True, "tool_error": None}
    assert _content(out) == "<output>\n1080\n</output>"

    out = env.step("The shop has <answer>1080</answer> pencils.")
    assert out["reward"] == 1.0 and out["done"] and out["observations"] == []
    assert out["metadata"] == {"tool_call": False, "tool_error": None}
    assert env.get_metrics() == {"tool_calls": 1, "tool_errors": 0, "turns": 2}


def test_wrong_answer_scores_zero():
    env = _env()
    out = env.step("<answer>1008</answer>")
    assert out["reward"] == 0.0 and out["done"]
    assert env.get_metrics() == {"tool_calls": 0, "tool_errors": 0, "turns": 1}


def test_no_tool_call_and_no_answer_ends_with_zero():
    out = _env().step("I think it is about a thousand.")
    assert out["reward"] == 0.0 and out["done"]
    assert out["metadata"] == {"tool_call": False, "tool_error": None}


@pytest.mark.parametrize(
    "action",
    [
        "<answer>1,080</answer>",
        "#### 1080",
        "so the total is\n#### 1,080",
        "<answer>$1080</answer>",
        "<answer>1080.0</answer>",
        "<answer> 1080 pencils </answer>",
    ],
)
def test_answer_forms_accepted(action):
    out = _env().step(action)
    assert out["reward"] == 1.0 and out["done"], action


def test_decimal_and_negative_ground_truths():
    assert _env("2.5").step("<answer>2.50</answer>")["reward"] == 1.0
    assert _env("-3").step("#### -3")["reward"] == 1.0
    assert _env("-3").step("#### 3")["reward"] == 0.0
    assert _env("0.75").step("<answer>3/4</answer>")["reward"] == 1.0


def test_tool_error_is_reported_and_the_episode_goes_on():
    env = _env()
    out = env.step("<python>\nx = 45 * 24\nprint(x / 0)\n</python>")
    assert not out["done"] and out["reward"] == 0.0
    assert out["metadata"]["tool_call"] is True
    assert out["metadata"]["tool_error"] == "ZeroDivisionError: division by zero"
    assert "ZeroDivisionError" in _content(out)

    out = env.step("<python>\nprint(45 * 24)\n</python>")
    assert out["metadata"] == {"tool_call": True, "tool_error": None}
    assert env.step("<answer>1080</answer>")["reward"] == 1.0
    assert env.get_metrics() == {"tool_calls": 2, "tool_errors": 1, "turns": 3}


def test_killed_program_is_a_tool_error():
    env = _env(wall_s=1)
    out = env.step("<python>\nimport time\ntime.sleep(10)\n</python>")
    assert not out["done"]
    assert "wall-clock" in out["metadata"]["tool_error"]
    assert "wall-clock" in _content(out)


def test_the_sandbox_refuses_reads_for_the_tool():
    out = _env().step("<python>\nprint(open('/etc/passwd').read())\n</python>")
    assert out["metadata"]["tool_error"] is not None and "root:" not in _content(out)


def test_max_turns_ends_the_episode():
    env = _env(max_turns=2)
    assert not env.step("<python>print(1)</python>")["done"]
    out = env.step("<python>print(2)</python>")
    assert out["done"] and out["reward"] == 0.0 and out["metadata"]["tool_call"]
    assert env.get_metrics() == {"tool_calls": 2, "tool_errors": 0, "turns": 2}


def test_default_max_turns_is_four():
    assert _env(max_turns=None).max_turns == 4


def test_answer_before_code_wins_and_code_before_answer_runs():
    env = _env()
    out = env.step("<answer>1080</answer> <python>print(1)</python>")
    assert out["done"] and out["reward"] == 1.0 and env.tool_calls == 0

    env = _env()
    out = env.step("<python>print(45 * 24)</python> so <answer>1080</answer>")
    assert not out["done"] and out["metadata"]["tool_call"] and "1080" in _content(out)


def test_code_in_a_fence_or_indented_runs():
    out = _env().step("<python>\n```python\n    x = 2\n    print(x * 3)\n```\n</python>")
    assert _content(out) == "<output>\n6\n</output>"


def test_no_output_hint():
    out = _env().step("<python>x = 45 * 24</python>")
    assert "print()" in _content(out) and out["metadata"]["tool_error"] is None


def test_init_merges_into_an_existing_system_message():
    env = _env()
    messages, _ = env.init(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    )
    assert len(messages) == 2 and messages[0]["role"] == "system"
    assert (
        messages[0]["content"].startswith("Be brief.") and SYSTEM_PROMPT in messages[0]["content"]
    )


def test_bad_env_config_key_names_it():
    with pytest.raises(ValueError, match="'cpu_seconds'"):
        make_env("python_tool", {"cpu_seconds": 2}, _extras())
    with pytest.raises(ValueError, match="cpu_s"):
        _env(cpu_s=-1)
    with pytest.raises(ValueError, match="ground_truth"):
        PythonToolEnv(env_config={}, extras={})


def test_parse_answer():
    assert parse_answer("x <answer> 12 </answer>") == (2, " 12 ")
    assert parse_answer("#### 7\nmore") == (0, "7")
    assert parse_answer("no answer here") is None


def test_env_limits_reach_the_sandbox():
    env = _env(output_bytes=100)
    assert env.limits == SandboxLimits(wall_s=5, output_bytes=100)
    out = env.step("<python>print('y' * 1000)</python>")
    assert "output limit" in out["metadata"]["tool_error"]
    assert "y" * 100 in _content(out) and "y" * 101 not in _content(out)
