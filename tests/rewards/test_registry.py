"""The reward registry and `reward.fn` lookup, and normalize_reward."""

from __future__ import annotations

import sys
import textwrap
import uuid

import numpy as np
import pytest

from skyrl_trainer.rewards import (
    REWARD_FNS,
    get_reward_fn,
    normalize_reward,
    register_reward,
)
from skyrl_trainer.rewards.gsm8k import gsm8k_reward


@pytest.fixture
def clean_registry():
    saved = dict(REWARD_FNS)
    yield
    REWARD_FNS.clear()
    REWARD_FNS.update(saved)


@pytest.fixture
def module_on_path(tmp_path, monkeypatch):
    """Write a uniquely named module to tmp_path, put it on sys.path, return its name."""
    names: list[str] = []

    def write(source: str) -> str:
        name = f"user_rewards_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for name in names:
        sys.modules.pop(name, None)


def test_builtins_are_registered():
    assert {"gsm8k", "arithmetic", "math"} <= set(REWARD_FNS)
    assert get_reward_fn("gsm8k") is gsm8k_reward
    assert get_reward_fn("  gsm8k ") is gsm8k_reward


def test_register_custom_reward(clean_registry):
    @register_reward("length_penalty")
    def length_penalty(response: str, sample: dict) -> float:
        return -len(response) / 100

    assert get_reward_fn("length_penalty") is length_penalty
    assert length_penalty("ab", {}) == -0.02  # the decorator returns the function unchanged


def test_register_duplicate_name_is_refused(clean_registry):
    with pytest.raises(ValueError, match="'gsm8k' is already registered"):

        @register_reward("gsm8k")
        def other(response: str, sample: dict) -> float:
            return 0.0

    assert get_reward_fn("gsm8k") is gsm8k_reward


@pytest.mark.parametrize("name", ["", "a:b"])
def test_register_bad_name_is_refused(name):
    with pytest.raises(ValueError, match="reward name"):
        register_reward(name)


def test_load_from_module_path(module_on_path):
    name = module_on_path(
        """
        def score(response, sample):
            return {"correct": float(response == sample["answer"]), "format": -0.1}

        class Graders:
            @staticmethod
            def strict(response, sample):
                return 1.0
        """
    )
    fn = get_reward_fn(f"{name}:score")
    assert fn("7", {"answer": "7"}) == {"correct": 1.0, "format": -0.1}
    assert get_reward_fn(f"{name}:Graders.strict")("", {}) == 1.0


def _error(spec: str) -> str:
    with pytest.raises(ValueError) as info:
        get_reward_fn(spec)
    message = str(info.value)
    assert "reward.fn" in message
    return message


def test_unknown_name_lists_registered_ones():
    message = _error("gsm9k")
    assert "not a registered reward" in message
    assert "arithmetic, gsm8k, gsm8k_flexible, math" in message
    assert "module.path:function" in message


@pytest.mark.parametrize("spec", ["", "   ", ":score", "some_module:"])
def test_malformed_spec(spec):
    assert "module.path:function" in _error(spec)


def test_missing_module():
    message = _error("no_such_module_for_rewards:score")
    assert "cannot be imported" in message and "PYTHONPATH" in message


def test_module_with_missing_dependency(module_on_path):
    name = module_on_path("import no_such_dependency_xyz\n\ndef score(r, s):\n    return 1.0\n")
    message = _error(f"{name}:score")
    assert "no_such_dependency_xyz" in message and "missing dependency" in message


def test_module_raising_on_import(module_on_path):
    name = module_on_path("raise RuntimeError('broken config')\n")
    message = _error(f"{name}:score")
    assert "RuntimeError: broken config" in message


def test_missing_attribute(module_on_path):
    name = module_on_path("def scor(response, sample):\n    return 1.0\n")
    message = _error(f"{name}:score")
    assert "has no attribute 'score'" in message and "it defines: scor." in message


def test_not_callable(module_on_path):
    name = module_on_path("score = 3\n")
    message = _error(f"{name}:score")
    assert "not a function" in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1.0, (1.0, {})),
        (0, (0.0, {})),
        (True, (1.0, {})),
        (np.float32(0.5), (0.5, {})),
        (np.int64(2), (2.0, {})),
        (np.bool_(True), (1.0, {})),
        (np.array(0.25), (0.25, {})),
        ({"correct": 1.0, "format": -0.1}, (0.9, {"correct": 1.0, "format": -0.1})),
        ({"a": np.float64(1.0), "b": 2}, (3.0, {"a": 1.0, "b": 2.0})),
        ({}, (0.0, {})),
    ],
)
def test_normalize_reward(value, expected):
    total, components = normalize_reward(value)
    assert total == pytest.approx(expected[0])
    assert components == expected[1]
    assert type(total) is float and all(type(v) is float for v in components.values())


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (None, TypeError, "returned value None of type NoneType"),
        ("1.0", TypeError, "of type str"),
        ([1.0], TypeError, "of type list"),
        (np.array([1.0, 2.0]), TypeError, "ndarray"),
        (float("nan"), ValueError, "must be finite"),
        (float("inf"), ValueError, "must be finite"),
        ({"a": None}, TypeError, "component 'a'"),
        ({"a": {"b": 1.0}}, TypeError, "component 'a'"),
        ({"a": float("nan")}, ValueError, "component 'a'"),
        ({1: 1.0}, TypeError, "non-string key"),
    ],
)
def test_normalize_reward_refuses_bad_values(value, error, match):
    with pytest.raises(error, match=match):
        normalize_reward(value)
