"""Guess-the-number environment: scripted games, metrics, row generation, config checks."""

from __future__ import annotations

import re
from collections import Counter

import pytest

import skyrl_trainer.envs.guess_number  # noqa: F401  (registers "guess_number")
from skyrl_trainer.envs import ENVS, make_env
from skyrl_trainer.envs.guess_number import (
    GuessNumberEnv,
    generate_guess_number_rows,
    optimal_turns,
)


def _env(secret: int, max_turns: int | None = 5, **config) -> GuessNumberEnv:
    extras = {"reward_spec": {"method": "rule", "ground_truth": str(secret)}}
    if max_turns is not None:
        extras["max_turns"] = max_turns
    return GuessNumberEnv(env_config=config, extras=extras)


def _play(env: GuessNumberEnv, actions: list[str]) -> list[dict]:
    outs = []
    for action in actions:
        outs.append(env.step(action))
        if outs[-1]["done"]:
            break
    return outs


def _feedback(out: dict) -> str:
    assert len(out["observations"]) == 1 and out["observations"][0]["role"] == "user"
    return out["observations"][0]["content"]


def test_win_on_third_turn_after_feedback():
    env = _env(11)
    prompt = [{"role": "user", "content": "I am thinking of ..."}]
    assert env.init(prompt) == (prompt, {})
    outs = _play(env, ["8", "12", "11"])
    assert [_feedback(o) for o in outs[:2]] == ["Higher.", "Lower."]
    assert [o["reward"] for o in outs] == [0.0, 0.0, 1.0]
    assert [o["done"] for o in outs] == [False, False, True]
    assert outs[2]["observations"] == []
    assert [o["metadata"] for o in outs] == [{"guess": g, "valid": True} for g in (8, 12, 11)]
    assert env.get_metrics() == {
        "won": 1,
        "turns": 3,
        "invalid_guesses": 0,
        "repeated_guesses": 0,
        "inconsistent_guesses": 0,
    }


def test_loss_after_max_turns():
    env = _env(16, max_turns=3)
    outs = _play(env, ["1", "2", "3", "4"])
    assert len(outs) == 3
    assert [o["done"] for o in outs] == [False, False, True]
    assert sum(o["reward"] for o in outs) == 0.0
    assert outs[-1]["observations"] == []  # no feedback after the last turn
    assert env.get_metrics()["won"] == 0 and env.get_metrics()["turns"] == 3


def test_invalid_reply_then_valid():
    env = _env(4)
    out = env.step("I don't know, maybe something small?")
    assert _feedback(out) == "Reply with just one number between 1 and 16."
    assert (out["reward"], out["done"], out["metadata"]) == (
        0.0,
        False,
        {"guess": None, "valid": False},
    )
    out = env.step("4")
    assert (out["reward"], out["done"]) == (1.0, True)
    assert env.get_metrics()["invalid_guesses"] == 1 and env.get_metrics()["turns"] == 2


@pytest.mark.parametrize("action,guess", [("20", 20), ("0", 0), ("-3", -3)])
def test_out_of_range_guess_is_told_so(action, guess):
    out = _env(4).step(action)
    assert _feedback(out) == (
        f"{guess} is not between 1 and 16. Reply with just one number between 1 and 16."
    )
    assert out["metadata"] == {"guess": guess, "valid": False} and out["reward"] == 0.0


@pytest.mark.parametrize(
    "action", ["My guess is 7.", "7", " 7\n", "I think it's 7!", "**7**", "7 (seven)"]
)
def test_words_around_the_number(action):
    out = _env(7).step(action)
    assert out["metadata"] == {"guess": 7, "valid": True} and out["reward"] == 1.0


def test_metrics_count_repeats_and_inconsistent_guesses():
    env = _env(10, max_turns=8)
    actions = ["7", "5", "7", "abc", "12", "13", "8", "8"]
    outs = _play(env, actions)
    # 7: Higher (possible 8..16); 5: inconsistent; 7: repeat; abc: invalid;
    # 12: Lower (8..11); 13: inconsistent; 8: Higher (9..11); 8: repeat, last turn.
    assert [o["metadata"]["guess"] for o in outs] == [7, 5, 7, None, 12, 13, 8, 8]
    assert outs[-1]["done"] and sum(o["reward"] for o in outs) == 0.0
    assert env.get_metrics() == {
        "won": 0,
        "turns": 8,
        "invalid_guesses": 1,
        "repeated_guesses": 2,
        "inconsistent_guesses": 2,
    }


def test_aggregate_metrics_means():
    won, late = _env(3), _env(3, max_turns=2)
    _play(won, ["3"])
    _play(late, ["x", "3 5"])  # "3 5": the first integer counts, so this wins on turn 2
    _play(lost := _env(3, max_turns=2), ["9", "9"])
    agg = GuessNumberEnv.aggregate_metrics([e.get_metrics() for e in (won, late, lost)])
    assert agg == pytest.approx(
        {
            "won": 2 / 3,
            "turns": 5 / 3,
            "invalid_guesses": 1 / 3,
            "repeated_guesses": 1 / 3,
            "inconsistent_guesses": 0.0,
        }
    )
    assert GuessNumberEnv.aggregate_metrics([]) == {}


def test_optimal_turns_justifies_default_max_turns():
    assert optimal_turns(1, 16) == 5
    assert optimal_turns(1, 15) == 4 and optimal_turns(1, 2) == 2 and optimal_turns(1, 100) == 7
    assert _env(5, max_turns=None).max_turns == optimal_turns(1, 16) == 5
    assert _env(5, max_turns=None, low=1, high=100).max_turns == 7


def _binary_search(env: GuessNumberEnv) -> tuple[int, float]:
    lo, hi = env.low, env.high
    while True:
        guess = (lo + hi) // 2
        out = env.step(f"My guess is {guess}.")
        if out["done"]:
            return env.turns, out["reward"]
        if _feedback(out) == "Higher.":
            lo = guess + 1
        else:
            hi = guess - 1


@pytest.mark.parametrize("low,high", [(1, 16), (1, 2), (5, 20), (1, 100)])
def test_binary_search_always_wins_within_optimal_turns(low, high):
    for secret in range(low, high + 1):
        env = _env(secret, max_turns=optimal_turns(low, high), low=low, high=high)
        turns, reward = _binary_search(env)
        assert reward == 1.0 and turns <= optimal_turns(low, high), secret
        assert env.get_metrics()["inconsistent_guesses"] == 0


def test_rows_deterministic_by_seed_and_inside_range():
    rows = generate_guess_number_rows(200, seed=0)
    assert rows == generate_guess_number_rows(200, seed=0)
    assert rows != generate_guess_number_rows(200, seed=1)
    assert all(set(r) == {"question", "answer"} for r in rows)
    assert all(1 <= int(r["answer"]) <= 16 for r in rows)
    question = rows[0]["question"]
    assert "from 1 to 16" in question and len(question) < 200
    narrow = generate_guess_number_rows(50, seed=3, low=5, high=9)
    assert {int(r["answer"]) for r in narrow} <= set(range(5, 10))
    assert "from 5 to 9" in narrow[0]["question"]
    assert generate_guess_number_rows(0, seed=0) == []


def test_rows_cover_range_roughly_uniformly():
    counts = Counter(int(r["answer"]) for r in generate_guess_number_rows(3200, seed=7))
    assert set(counts) == set(range(1, 17))
    assert all(140 <= c <= 260 for c in counts.values()), counts  # expected 200 each


def test_question_plays_with_the_env():
    row = generate_guess_number_rows(1, seed=5)[0]
    env = make_env("guess_number", {}, {"reward_spec": {"ground_truth": row["answer"]}})
    nums = [int(x) for x in re.findall(r"\d+", row["question"])]
    assert nums == [env.low, env.high]
    assert env.step(row["answer"])["reward"] == 1.0


def test_make_env_constructs_registered_class():
    assert ENVS["guess_number"] is GuessNumberEnv
    env = make_env(
        "guess_number",
        {"low": 1, "high": 8},
        {"reward_spec": {"ground_truth": "6"}, "max_turns": 4, "sample": {}},
    )
    assert isinstance(env, GuessNumberEnv)
    assert (env.low, env.high, env.secret, env.max_turns) == (1, 8, 6, 4)


@pytest.mark.parametrize(
    "config,needle",
    [
        ({"lo": 1}, "'lo'"),
        ({"low": 1, "hgih": 9}, "'hgih'"),
        ({"low": 10, "high": 3}, "low < high"),
        ({"low": 4, "high": 4}, "low < high"),
        ({"high": "16"}, "high must be an int"),
        ({"low": 1.5}, "low must be an int"),
    ],
)
def test_bad_env_config_raises(config, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        _env(2, **config)


def test_bad_secret_or_max_turns_raises():
    with pytest.raises(ValueError, match="secret 17"):
        _env(17)
    with pytest.raises(ValueError, match="max_turns"):
        _env(3, max_turns=0)
    with pytest.raises(ValueError, match="low < high"):
        generate_guess_number_rows(3, seed=0, low=5, high=5)
