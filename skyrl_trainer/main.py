"""`python -m skyrl_trainer.main +recipe=gsm8k_grpo [field=value ...]`: RL training from a Hydra config.

The composed config (configs/config.yaml + groups + the recipe + command-line overrides) becomes a
`TrainerConfig`; a bad field stops the run before anything starts, with the field named.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from skyrl_trainer.allocator import tune_malloc
from skyrl_trainer.trainer.config import ConfigError, TrainerConfig, build_config


def run(cfg: DictConfig) -> list[dict]:
    """Build the trainer config and the service client, then train; returns per-step metrics."""
    from skyrl_trainer.connect import make_service_client
    from skyrl_trainer.trainer.config import validate_config
    from skyrl_trainer.trainer.loop import RLTrainer, load_plugins

    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    container.pop("hydra", None)
    trainer_config = build_config(container, TrainerConfig)
    load_plugins(trainer_config.plugins)
    validate_config(trainer_config)  # before any model loads or any connection is made
    service = make_service_client(trainer_config.backend)
    return RLTrainer(trainer_config, service).run()


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    logging.getLogger("vllm").setLevel(logging.WARNING)
    tune_malloc()  # before the backend's threads start: freed tensors go back to the OS
    try:
        run(cfg)
    except ConfigError as exc:
        sys.exit(f"config error: {exc}")


if __name__ == "__main__":
    main()
