"""The interface between the backend core and whatever runs training compute.

The core talks to a `TrainingWorkerGroup` per base model: one in-process `TrainingWorker`
(`training.num_workers == 1`), or a Ray group of workers (`distributed.ray_group`) that
implements the same methods by splitting examples across ranks and summing, so the core and
the clients never change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from tinker import types

from skyrl_trainer.backend.config import TrainingConfig
from skyrl_trainer.backend.datums import TrainingExample
from skyrl_trainer.backend.losses import LossSpec
from skyrl_trainer.backend.training_worker import ForwardResult, ModelDescription, TrainingWorker
from skyrl_trainer.typed_config import ConfigError


class TrainingWorkerGroup(Protocol):
    """Training compute for the models on one base model. Calls arrive one at a time."""

    description: ModelDescription

    def create_model(self, model_id: str, lora: types.LoraConfig | None) -> None: ...

    def remove_model(self, model_id: str) -> None: ...

    def forward_backward(
        self,
        model_id: str,
        examples: list[TrainingExample],
        spec: LossSpec,
        loss_config: dict[str, float],
        backward: bool,
    ) -> ForwardResult: ...

    def optim_step(self, model_id: str, adam: types.AdamParams) -> dict[str, float]: ...

    def save_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None: ...

    def load_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None: ...

    def save_sampler_weights(self, model_id: str, directory: Path) -> None: ...

    def full_weights(self, model_id: str) -> dict[str, torch.Tensor]: ...

    def shutdown(self) -> None:
        """Stop what the group started (the Ray group kills its actors)."""
        ...


def make_worker_group(model_dir: Path, config: TrainingConfig) -> TrainingWorkerGroup:
    """The worker group for one base model: a single in-process worker when
    `config.num_workers == 1`, else `num_workers` Ray actors (`distributed.ray_group`)."""
    if isinstance(config.num_workers, bool) or config.num_workers < 1:
        raise ConfigError(f"training.num_workers: must be >= 1, got {config.num_workers!r}")
    if config.num_workers == 1:
        return TrainingWorker(model_dir, config)
    from skyrl_trainer.backend.distributed.ray_group import RayTrainingWorkerGroup

    return RayTrainingWorkerGroup(model_dir, config)
