"""The interface between the backend core and whatever runs training compute.

The core talks to a `TrainingWorkerGroup` per base model. Today that is one in-process
`TrainingWorker`; a Ray group of FSDP workers implements the same methods (splitting
examples across ranks and summing), so the core and the clients never change.
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


def make_worker_group(model_dir: Path, config: TrainingConfig) -> TrainingWorkerGroup:
    """The worker group for one base model: a single in-process worker."""
    return TrainingWorker(model_dir, config)
