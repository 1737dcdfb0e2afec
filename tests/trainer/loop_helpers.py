"""Helpers for tests that run the RL loop on the tiny model through the in-process backend."""

from __future__ import annotations

import textwrap

from skyrl_trainer.backend.clients import ServiceClient
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig
from skyrl_trainer.trainer.config import TrainerConfig, build_config

# Dense, trivially learnable rewards from a user module (loaded by "module:function"):
# - vowel_share: the share of the response's characters that are vowels (about 0.25 for the
#   random model's tokens);
# - odd_vowel_share: the same for prompts with an odd answer and 0 for the others, so about half
#   the groups have zero reward variance (what dynamic sampling drops and refills).
REWARD_MODULE = textwrap.dedent(
    """
    def vowel_share(response, sample):
        text = response.replace(" ", "")
        return {"vowels": sum(c in "aeiou" for c in text) / max(len(text), 1)}

    def odd_vowel_share(response, sample):
        if int(sample["answer"]) % 2 == 0:
            return 0.0
        text = response.replace(" ", "")
        return sum(c in "aeiou" for c in text) / max(len(text), 1)
    """
)


def write_reward_module(folder, monkeypatch) -> str:
    """Write the reward module into `folder`, put it on sys.path; returns its module name."""
    (folder / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    return "my_rewards"


def make_service(tmp_path) -> ServiceClient:
    return ServiceClient(
        BackendConfig(
            storage_dir=str(tmp_path / "storage"),
            training=TrainingConfig(dtype="float32", device="cpu"),
            sampling=SamplingConfig(engine="torch", dtype="float32", device="cpu"),
        )
    )


def make_config(tmp_path, tiny_model_dir, reward, **overrides) -> TrainerConfig:
    """A small run on the tiny model; `overrides` are dotted paths ("algorithm.loss_fn")."""
    data = {
        "steps": 4,
        "seed": 3,
        "output_dir": str(tmp_path / "run"),
        "model": {"base_model": str(tiny_model_dir), "lora_rank": 8},
        "data": {"format": "arithmetic", "generated_rows": 64},
        "reward": {"fn": reward},
        "sampling": {"max_tokens": 8},
        "algorithm": {
            "group_size": 4,
            "batch_size": 4,
            "learning_rate": 2e-2,
            "loss_fn": "importance_sampling",
            "num_mini_batches": 2,
        },
        "eval": {"every": 2, "num_prompts": 4},
        "checkpoint": {"every": 2},
    }
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        (data.setdefault(section, {}) if section else data)[name] = value
    return build_config(data, TrainerConfig)


class RecordingTrainingClient:
    """The trainer's real TrainingClient, recording each forward_backward call as
    (datums, loss_fn, loss_fn_config, output future)."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: list[tuple] = []

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        future = self._inner.forward_backward(data, loss_fn, loss_fn_config)
        self.calls.append((data, loss_fn, loss_fn_config, future))
        return future

    def __getattr__(self, name):
        return getattr(self._inner, name)


def record(trainer) -> RecordingTrainingClient:
    trainer.training = RecordingTrainingClient(trainer.training)
    return trainer.training


def spy_on_batches(monkeypatch) -> list:
    """Record every batch the loop collects (`collect.Batch`: trained and sampled groups)."""
    from skyrl_trainer.trainer import pipeline

    batches, collect = [], pipeline.collect_batch

    def spy(*args, **kwargs):
        batches.append(collect(*args, **kwargs))
        return batches[-1]

    monkeypatch.setattr(pipeline, "collect_batch", spy)
    return batches
