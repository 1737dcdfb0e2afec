"""The trainer's configuration: typed dataclasses, built from the composed Hydra config and checked
at start-up. Every error names the field (`algorithm.loss_fn`) and the allowed values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from skyrl_trainer.typed_config import ConfigError, build_config

__all__ = ["ConfigError", "TrainerConfig", "build_config", "validate_config"]


@dataclass
class BackendSettings:
    kind: str = "local"
    """local: the in-process Tinker backend; remote: a Tinker service at `base_url`."""
    base_url: str | None = None
    api_key_env: str = "TINKER_API_KEY"
    """Environment variable holding the remote service's API key (never put keys in configs)."""
    local: dict[str, Any] = field(default_factory=dict)
    """BackendConfig fields for the local backend: {training: {dtype: ...}, sampling: {...}}."""


@dataclass
class ModelSettings:
    base_model: str = "SmolLM2-135M-Instruct"
    lora_rank: int = 32
    """0 = full fine-tuning (an extension of the in-process backend; refused by remote services)."""
    train_unembed: bool = True
    """LoRA on lm_head too (Tinker's `train_unembed`); attention and MLP are always adapted."""


@dataclass
class DataSettings:
    path: str = "openai/gsm8k:main"
    split: str = "train"
    eval_path: str | None = None
    """Default: `path` with `eval_split`."""
    eval_split: str = "test"
    format: str = "gsm8k"
    system_prompt: str | None = None
    instruction: str | None = None
    """Overrides the format's instruction appended to each question."""
    max_train_rows: int | None = None
    generated_rows: int = 2000
    """Formats that generate their rows (arithmetic, guess_number) make this many for training
    (and `eval.num_prompts` more for evaluation) instead of reading `path`."""


@dataclass
class RewardSettings:
    fn: str = "gsm8k"
    """A registered reward (gsm8k, arithmetic, math) or `my_pkg.module:function`."""
    timeout_s: float = 10.0
    correct_threshold: float = 1.0
    """A sample counts as correct (pass rate, pass@k) when its reward is at least this."""


@dataclass
class EnvSettings:
    name: str = "single_turn"
    """The environment each trajectory runs: `single_turn` (one response scored by `reward.fn`),
    one of ours (guess_number, python_tool), a skyrl-gym id (gsm8k_multi_turn, ...) or
    `my_pkg.module:ClassName` (a skyrl-gym BaseTextEnv)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Passed to the environment as `env_config`."""
    max_turns: int = 8
    """A trajectory ends after this many actions even if the environment is not done."""
    max_context_tokens: int = 4096
    """Prompt + actions + observations; a trajectory that would exceed it ends as truncated
    (stop reason "length", so `algorithm.overlong_filter` removes it)."""
    step_timeout_s: float | None = None
    """Time-out of one environment call (init, step); default `reward.timeout_s`. A call that
    times out or raises ends its trajectory with reward 0 (counted in `reward/errors`)."""
    max_concurrency: int = 32
    """Environment calls (tool runs) in flight at once."""
    reward_discount: float = 1.0
    """Trajectory return = sum over turns of reward_discount^t * reward_t."""


@dataclass
class SamplingSettings:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class AlgorithmSettings:
    advantage_estimator: str = "grpo"
    loss_fn: str = "ppo"
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    loss_reduction: str = "token_mean"
    max_seq_len: int | None = None
    """For seq_mean_token_sum_norm; default sampling.max_tokens."""
    group_size: int = 4
    batch_size: int = 8
    """Prompts per step (each sampled group_size times)."""
    num_mini_batches: int = 1
    """Optimizer steps per batch; several mini-batches make the later ones off-policy."""
    epochs_per_batch: int = 1
    learning_rate: float = 1e-5
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    gamma: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    tis_cap: float | None = None
    """Truncated importance sampling against learner log-probs, capped at this ratio (e.g. 2.0)."""
    dynamic_sampling: bool = False
    """Drop zero-variance groups and refill the batch with new prompts (DAPO)."""
    max_refill_rounds: int = 2
    overlong_filter: bool = False
    """Responses cut by max_tokens get zero advantage."""
    max_steps_off_policy: int = 0
    """Asynchronous RL: sampling goes on while the learner trains, and the learner at step t trains
    on trajectories sampled with weights of step t - k or newer (k = this; older ones are dropped
    and counted). The loss ratio is always taken against the sampler's log-probs. 0: the
    synchronous loop (sample with the current weights, then train)."""
    async_mode: str = "deterministic"
    """With max_steps_off_policy > 0. deterministic: batch t is sampled with the weights of step
    t - k (a fixed schedule: seeded runs reproduce, resume is exact). streaming: groups enter
    training in the order they finish, from whatever finished first within the bound (for
    trajectories of widely varying length)."""


@dataclass
class EvalSettings:
    every: int = 0
    """Evaluate every N steps (and after the last); 0 = never."""
    num_prompts: int = 64
    pass_k: int = 1
    """Also pass@k with k samples at the training temperature when > 1."""
    at_start: bool = False


@dataclass
class CheckpointSettings:
    every: int = 0
    """Save training state (with optimizer) and loop state every N steps; 0 = only at the end."""
    save_sampler_weights: bool = False
    resume: str = "auto"
    """auto: continue from the newest checkpoint in output_dir, if any; never: start fresh."""


@dataclass
class LoggingSettings:
    wandb_project: str | None = None
    wandb_mode: str | None = None
    tensorboard: bool = False
    print_samples: int = 0
    """Print this many trajectories per step, turn by turn."""
    save_trajectories: bool = True
    """Write every trajectory of every step (messages per turn, rewards, stop reasons, token
    counts) to `output_dir/trajectories.jsonl`."""
    progress_every_s: float = 15.0
    """A phase (sampling, training, evaluation, checkpoint) still running after this many seconds
    prints a status line (done, rate, ETA) this often; 0: never."""


@dataclass
class TrainerConfig:
    steps: int = 20
    seed: int = 0
    output_dir: str = "outputs/run"
    backend: BackendSettings = field(default_factory=BackendSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)
    env: EnvSettings = field(default_factory=EnvSettings)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    algorithm: AlgorithmSettings = field(default_factory=AlgorithmSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    plugins: list[str] = field(default_factory=list)
    """Modules imported at start-up, so their @register_* decorators extend the registries."""


LR_SCHEDULES = ("constant", "linear", "cosine")


def _choice(path: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{path}: {value!r} is not one of {sorted(allowed)}")


def _at_least(path: str, value, low) -> None:
    if value is None or value < low:
        raise ConfigError(f"{path}: {value!r} must be >= {low}")


def validate_config(cfg: TrainerConfig) -> None:
    """Refuse values the run cannot use, before anything starts (registries must already hold
    the plugins' entries)."""
    import skyrl_trainer.envs  # noqa: F401  (the built-in environments register their formats)
    from skyrl_trainer.data.tasks import TASK_FORMATS
    from skyrl_trainer.trainer.advantages import ADVANTAGE_ESTIMATORS
    from skyrl_trainer.trainer.kl import KL_ESTIMATORS
    from skyrl_trainer.trainer.policy_losses import POLICY_LOSSES, config_errors
    from skyrl_trainer.trainer.reductions import LOSS_REDUCTIONS

    _choice("backend.kind", cfg.backend.kind, ("local", "remote"))
    if cfg.backend.kind == "remote":
        if not cfg.backend.base_url:
            raise ConfigError("backend.base_url: required with backend.kind=remote")
        if cfg.model.lora_rank == 0:
            raise ConfigError(
                "model.lora_rank: 0 (full fine-tuning) is an extension of the local backend; "
                "Tinker services train LoRA adapters only: set a rank (e.g. 32)"
            )
    _at_least("model.lora_rank", cfg.model.lora_rank, 0)
    _choice("data.format", cfg.data.format, TASK_FORMATS)
    if cfg.env.name == "single_turn":
        from skyrl_trainer.rewards import get_reward_fn

        try:
            get_reward_fn(cfg.reward.fn)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    _at_least("steps", cfg.steps, 1)
    a = cfg.algorithm
    _choice("algorithm.advantage_estimator", a.advantage_estimator, ADVANTAGE_ESTIMATORS)
    _choice("algorithm.loss_fn", a.loss_fn, POLICY_LOSSES)
    if not isinstance(a.loss_fn_config, dict):
        raise ConfigError(f"algorithm.loss_fn_config: expected a mapping, got {a.loss_fn_config!r}")
    errors = config_errors(a.loss_fn, a.loss_fn_config)
    if errors:
        raise ConfigError("; ".join(errors))
    _choice("algorithm.loss_reduction", a.loss_reduction, LOSS_REDUCTIONS)
    _choice("algorithm.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
    _choice("algorithm.lr_schedule", a.lr_schedule, LR_SCHEDULES)
    _at_least("algorithm.group_size", a.group_size, 1)
    _at_least("algorithm.batch_size", a.batch_size, 1)
    _at_least("algorithm.num_mini_batches", a.num_mini_batches, 1)
    if a.num_mini_batches > a.batch_size * a.group_size:
        raise ConfigError(
            f"algorithm.num_mini_batches: {a.num_mini_batches} is more than the "
            f"{a.batch_size * a.group_size} sequences of a batch"
        )
    _at_least("algorithm.epochs_per_batch", a.epochs_per_batch, 1)
    _at_least("algorithm.learning_rate", a.learning_rate, 0.0)
    _at_least("algorithm.kl_coef", a.kl_coef, 0.0)
    if not 0.0 < a.gamma <= 1.0:
        raise ConfigError(f"algorithm.gamma: {a.gamma!r} must be in (0, 1]")
    if a.max_seq_len is not None:
        _at_least("algorithm.max_seq_len", a.max_seq_len, 1)
    _at_least("algorithm.max_refill_rounds", a.max_refill_rounds, 0)
    if a.dynamic_sampling and a.group_size < 2:
        raise ConfigError(
            "algorithm.dynamic_sampling: needs algorithm.group_size >= 2 (a group of one sample "
            "always has zero reward variance, so every group would be dropped)"
        )
    if a.tis_cap is not None:
        _at_least("algorithm.tis_cap", a.tis_cap, 1.0)
    _validate_async(cfg)
    _at_least("sampling.max_tokens", cfg.sampling.max_tokens, 1)
    _at_least("sampling.temperature", cfg.sampling.temperature, 0.0)
    _at_least("eval.every", cfg.eval.every, 0)
    _at_least("eval.pass_k", cfg.eval.pass_k, 1)
    _at_least("eval.num_prompts", cfg.eval.num_prompts, 1)
    _at_least("checkpoint.every", cfg.checkpoint.every, 0)
    _choice("checkpoint.resume", cfg.checkpoint.resume, ("auto", "never"))
    _at_least("reward.timeout_s", cfg.reward.timeout_s, 0.001)
    _validate_env(cfg.env)


ASYNC_MODES = ("deterministic", "streaming")


def _validate_async(cfg: TrainerConfig) -> None:
    a = cfg.algorithm
    _at_least("algorithm.max_steps_off_policy", a.max_steps_off_policy, 0)
    _choice("algorithm.async_mode", a.async_mode, ASYNC_MODES)
    if a.max_steps_off_policy == 0:
        return
    if cfg.model.lora_rank == 0:
        raise ConfigError(
            "algorithm.max_steps_off_policy: asynchronous RL needs LoRA (model.lora_rank > 0); "
            "full fine-tuning's sampler weights are replaced in place, so older versions cannot "
            "keep sampling: set max_steps_off_policy=0 or a LoRA rank"
        )
    if cfg.backend.kind == "local":
        live = (cfg.backend.local.get("sampling") or {}).get("max_lora_snapshots", 8)
        if a.max_steps_off_policy + 2 > live:
            raise ConfigError(
                f"algorithm.max_steps_off_policy: {a.max_steps_off_policy} needs "
                f"{a.max_steps_off_policy + 2} sampler snapshots live, but "
                f"backend.local.sampling.max_lora_snapshots is {live}: raise it or lower k"
            )


def _validate_env(env: EnvSettings) -> None:
    from skyrl_trainer.envs import get_env_class

    try:
        get_env_class(env.name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not isinstance(env.config, dict):
        raise ConfigError(f"env.config: expected a mapping, got {env.config!r}")
    _at_least("env.max_turns", env.max_turns, 1)
    _at_least("env.max_context_tokens", env.max_context_tokens, 2)
    if env.step_timeout_s is not None:
        _at_least("env.step_timeout_s", env.step_timeout_s, 0.001)
    _at_least("env.max_concurrency", env.max_concurrency, 1)
    if not 0.0 < env.reward_discount <= 1.0:
        raise ConfigError(f"env.reward_discount: {env.reward_discount!r} must be in (0, 1]")
