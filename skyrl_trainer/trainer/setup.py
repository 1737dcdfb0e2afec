"""Building a run from config: plugins, problems, the training client (fresh or resumed), the
prompt stream, the reference sampler for the KL penalty, and the environment rollouts."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_trainer.connect import training_tokenizer
from skyrl_trainer.data import PromptStream, TaskConfig, load_rows
from skyrl_trainer.data.tasks import GENERATED_ROWS, build_problems
from skyrl_trainer.envs import make_env
from skyrl_trainer.envs.guarded import GuardedEnvCalls
from skyrl_trainer.trainer.checkpointing import LoopState, latest_loop_state, load_pipeline
from skyrl_trainer.trainer.config import ConfigError, TrainerConfig, validate_config
from skyrl_trainer.trainer.progress import PhaseTimer
from skyrl_trainer.trainer.rollouts import EnvRollouts, EnvSpec, env_extras


@dataclass
class Run:
    """Everything a step needs; built once by `build_run`."""

    cfg: TrainerConfig
    service: Any
    training: Any  # tinker TrainingClient
    tokenizer: Any
    stream: PromptStream
    start_step: int
    reference: Any  # tinker SamplingClient of the base model, or None (no KL penalty)
    rollouts: EnvRollouts
    eval_problems: list
    progress: PhaseTimer
    output_dir: Path
    pending_pipeline: dict | None = None  # resumed async run: what was sampled, not trained


def load_plugins(modules: list[str]) -> None:
    """Import the user's modules so their @register_* decorators run."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(
                f"plugins: cannot import {name!r} ({exc}); is it on PYTHONPATH?"
            ) from exc


def pick_data_source(spec: str) -> str:
    """`"a|b|hub/id"`: the first alternative that exists on disk, else the last one (a hub id), so
    one config serves offline machines with a local copy and online ones without."""
    options = [s.strip() for s in spec.split("|") if s.strip()]
    for option in options[:-1]:
        if Path(option).expanduser().exists():
            return option
    return options[-1]


def build_run(cfg: TrainerConfig, service) -> Run:
    load_plugins(cfg.plugins)
    validate_config(cfg)
    output_dir = Path(cfg.output_dir)
    problems, eval_problems = load_problems(cfg)
    env = cfg.env
    env_config = dict(env.config)
    if env.name == "single_turn":
        env_config.setdefault("reward_fn", cfg.reward.fn)
    spec = EnvSpec(env.name, env_config, env.max_turns, env.max_context_tokens, env.reward_discount)
    check_env_builds(spec, problems[0])  # before any model loads
    resume = latest_loop_state(output_dir) if cfg.checkpoint.resume == "auto" else None
    training = training_client(cfg, service, resume)
    tokenizer = training_tokenizer(training, cfg.model.base_model)
    stream = PromptStream(problems, cfg.algorithm.batch_size, seed=cfg.seed)
    pending = None
    if resume is not None:
        stream.load_state_dict(resume.stream)
        pending = resumable_pipeline(cfg, load_pipeline(output_dir, resume))
    reference = None
    if cfg.algorithm.kl_coef > 0:
        reference = service.create_sampling_client(base_model=cfg.model.base_model).result()
    calls = GuardedEnvCalls(env.max_concurrency, env.step_timeout_s or cfg.reward.timeout_s)
    rollouts = EnvRollouts(
        spec, tokenizer, calls, cfg.data.system_prompt, cfg.reward.correct_threshold
    )
    print(
        f"environment: {env.name} (max {env.max_turns} turns, {env.max_context_tokens} "
        f"context tokens)",
        flush=True,
    )
    return Run(
        cfg=cfg,
        service=service,
        training=training,
        tokenizer=tokenizer,
        stream=stream,
        start_step=resume.step if resume is not None else 0,
        reference=reference,
        rollouts=rollouts,
        eval_problems=eval_problems,
        progress=PhaseTimer(cfg.logging.progress_every_s),
        output_dir=output_dir,
        pending_pipeline=pending,
    )


def resumable_pipeline(cfg: TrainerConfig, pending: dict | None) -> dict | None:
    """The checkpoint's pending payload, refused when this run's async settings cannot continue
    it (its sampled-but-untrained groups would be lost or trained on the wrong schedule)."""
    a = cfg.algorithm
    saved = (pending or {}).get("mode"), (pending or {}).get("k")
    wanted = (a.async_mode, a.max_steps_off_policy) if a.max_steps_off_policy else (None, None)
    if saved != wanted:
        raise ConfigError(
            f"algorithm.async_mode / max_steps_off_policy: the checkpoint in {cfg.output_dir} "
            f"was written with async_mode={saved[0]}, max_steps_off_policy={saved[1] or 0}; "
            f"resume with those settings, or start afresh (checkpoint.resume=never or a new "
            f"output_dir)"
        )
    return pending


def check_env_builds(spec: EnvSpec, problem) -> None:
    """Construct and init one environment before anything trains, so that a bad `env.config`
    stops the run with its message instead of failing every trajectory."""
    try:
        env = make_env(spec.name, dict(spec.config), env_extras(problem.sample, spec.max_turns))
        env.init(list(problem.prompt_messages))
        env.close()
    except Exception as exc:
        raise ConfigError(
            f"env: {spec.name!r} with env.config={spec.config!r} cannot start on the first "
            f"problem: {type(exc).__name__}: {exc}"
        ) from exc


def load_problems(cfg: TrainerConfig):
    """Training and evaluation problems (generated for formats in `GENERATED_ROWS`)."""
    d = cfg.data
    task = TaskConfig(format=d.format, system_prompt=d.system_prompt, instruction=d.instruction)
    if d.format in GENERATED_ROWS:
        generate = GENERATED_ROWS[d.format]
        train_rows = generate(d.generated_rows, cfg.seed)
        eval_rows = generate(cfg.eval.num_prompts, cfg.seed + 1)
        source = eval_source = f"generated {d.format}"
    else:
        path = pick_data_source(d.path)
        train_rows = load_rows(path, d.split, field="data.path")
        source, eval_rows, eval_source = f"{path} [{d.split}]", [], "none"
        if cfg.eval.every or cfg.eval.at_start:
            eval_path = pick_data_source(d.eval_path or d.path)
            eval_rows = load_rows(eval_path, d.eval_split, field="data.eval_path")
            eval_source = f"{eval_path} [{d.eval_split}]"
    if d.max_train_rows:
        train_rows = train_rows[: d.max_train_rows]
    problems = build_problems(train_rows, task)
    eval_problems = build_problems(eval_rows[: cfg.eval.num_prompts], task)
    print(
        f"data: train {source}, {len(problems)} problems; eval {eval_source}, "
        f"{len(eval_problems)} problems",
        flush=True,
    )
    return problems, eval_problems


def training_client(cfg: TrainerConfig, service, resume: LoopState | None):
    m = cfg.model
    if resume is not None:
        return service.create_training_client_from_state_with_optimizer(
            resume.training_path
        ).result()
    if m.lora_rank == 0:
        if not hasattr(service, "create_full_training_client"):
            raise ConfigError("model.lora_rank: 0 (full fine-tuning) needs backend.kind=local")
        return service.create_full_training_client(m.base_model).result()
    return service.create_lora_training_client(
        m.base_model, rank=m.lora_rank, seed=cfg.seed, train_unembed=m.train_unembed
    ).result()
