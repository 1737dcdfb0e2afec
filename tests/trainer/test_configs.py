"""The Hydra config tree and its validation: every field overridable, errors name the field."""

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from skyrl_trainer.trainer.config import ConfigError, TrainerConfig, build_config, validate_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def composed(*overrides: str) -> dict:
    """The config main.py would build (missing `???` values refused as main.py does)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    data.pop("hydra", None)
    return data


def field_paths(cls, prefix=""):
    paths = set()
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(f.type) or (
            isinstance(f.type, str) and f.type.endswith("Settings")
        ):
            paths |= field_paths(getattr(cls(), f.name).__class__, path + ".")
        else:
            paths.add(path)
    return paths


def dict_paths(data, prefix=""):
    paths = set()
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("local", "loss_fn_config", "config"):
            paths |= dict_paths(value, f"{prefix}{key}.")
        else:
            paths.add(f"{prefix}{key}")
    return paths


def test_base_config_has_every_field():
    assert dict_paths(composed()) == field_paths(TrainerConfig)
    cfg = build_config(composed(), TrainerConfig)
    validate_config(cfg)


RECIPES = sorted(p.stem for p in (Path(__file__).parents[2] / "configs" / "recipe").glob("*.yaml"))


def test_every_recipe_is_tested():
    assert {"gsm8k_grpo", "arithmetic_grpo", "guess_number_grpo", "python_tool_grpo"} <= set(
        RECIPES
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_compose_and_validate(recipe):
    cfg = build_config(composed(f"+recipe={recipe}"), TrainerConfig)
    validate_config(cfg)
    assert cfg.output_dir == f"outputs/{recipe}"


def test_overrides_reach_the_config():
    cfg = build_config(
        composed(
            "+recipe=arithmetic_grpo",
            "algorithm.advantage_estimator=rloo",
            "algorithm.learning_rate=3e-4",
            "steps=3",
        ),
        TrainerConfig,
    )
    assert (cfg.algorithm.advantage_estimator, cfg.algorithm.learning_rate, cfg.steps) == (
        "rloo",
        3e-4,
        3,
    )
    remote = build_config(composed("backend=remote", "backend.base_url=http://x:1"), TrainerConfig)
    assert remote.backend.kind == "remote" and remote.backend.base_url == "http://x:1"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.loss_fn=sft", "algorithm.loss_fn: 'sft' is not one of"),
        ("algorithm.advantage_estimator=gae", "algorithm.advantage_estimator: 'gae'"),
        ("algorithm.loss_reduction=mean", "algorithm.loss_reduction"),
        ("algorithm.group_size=0", "algorithm.group_size: 0 must be >= 1"),
        ("sampling.temperature=-1", "sampling.temperature"),
        ("checkpoint.resume=maybe", "checkpoint.resume"),
        ("backend.kind=cloud", "backend.kind"),
        ("data.format=poetry", "data.format: 'poetry' is not one of"),
        ("algorithm.num_mini_batches=1000", "algorithm.num_mini_batches"),
    ],
)
def test_bad_values_name_the_field(override, message):
    cfg = build_config(composed(override), TrainerConfig)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate_config(cfg)


def test_bad_types_and_unknown_fields():
    with pytest.raises(ConfigError, match="algorithm.group_size: expected an integer"):
        build_config(composed("algorithm.group_size=four"), TrainerConfig)
    with pytest.raises(ConfigError, match="algorithm.learning_rat: unknown field"):
        build_config(composed("+algorithm.learning_rat=1e-4"), TrainerConfig)
    with pytest.raises(ConfigError, match="eval.at_start: expected true or false"):
        build_config(composed("eval.at_start=3"), TrainerConfig)


def test_remote_needs_url_and_lora():
    cfg = build_config(
        composed("backend=remote", "backend.base_url=http://x:1", "model.lora_rank=0"),
        TrainerConfig,
    )
    with pytest.raises(ConfigError, match="model.lora_rank"):
        validate_config(cfg)
    with pytest.raises(MissingMandatoryValue, match="base_url"):
        composed("backend=remote")


def test_main_refuses_a_bad_config_before_connecting(monkeypatch):
    """`python -m skyrl_trainer.main`: a value validate_config refuses stops the run before the
    service client is made (no model loads, no connection to a remote service)."""
    from skyrl_trainer import connect, main

    def must_not_connect(*args, **kwargs):
        raise AssertionError("the service client was made before the config was checked")

    monkeypatch.setattr(connect, "make_service_client", must_not_connect)
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "backend=remote",
                "backend.base_url=http://127.0.0.1:9",
                "+algorithm.loss_fn_config={clip_low_threshold: 2.0}",
            ],
        )
    with pytest.raises(ConfigError, match="algorithm.loss_fn_config.clip_low_threshold"):
        main.run(cfg)
