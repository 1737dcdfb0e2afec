"""The RL loop (GRPO / PPO and relatives), speaking only the Tinker client interface.

One step, as in ARCHITECTURE.md: sync the current weights to a sampler, sample every prompt's group
at once, score, compute advantages (KL penalty, off-policy correction, loss reduction folded in),
then forward_backward + optim_step per mini-batch, all submitted before any is awaited.
"""

from __future__ import annotations

import importlib
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tinker import types

from skyrl_trainer.connect import training_tokenizer
from skyrl_trainer.data import (
    PromptStream,
    TaskConfig,
    generate_arithmetic_rows,
    load_rows,
    render_prompt,
)
from skyrl_trainer.data.tasks import build_problems
from skyrl_trainer.rewards import RewardRunner, get_reward_fn
from skyrl_trainer.trainer.advantages import EstimatorSettings, compute_advantages, is_zero_variance
from skyrl_trainer.trainer.checkpointing import LoopState, latest_loop_state, save_loop_state
from skyrl_trainer.trainer.config import ConfigError, TrainerConfig, validate_config
from skyrl_trainer.trainer.datums import (
    Rollout,
    build_rl_datum,
    build_scoring_datum,
    response_logprobs,
)
from skyrl_trainer.trainer.evaluation import evaluate
from skyrl_trainer.trainer.kl import estimate_kl
from skyrl_trainer.trainer.metrics_log import MetricsLogger
from skyrl_trainer.trainer.off_policy import truncated_importance_weights
from skyrl_trainer.trainer.policy_losses import POLICY_LOSSES, clip_bounds
from skyrl_trainer.trainer.progress import PhaseTimer
from skyrl_trainer.trainer.reductions import loss_weights
from skyrl_trainer.trainer.rollouts import Group, sample_groups, sample_seed, score_groups


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


def learning_rate(cfg: TrainerConfig, step: int) -> float:
    """The learning rate of (0-based) `step`: linear warm-up, then constant / linear / cosine."""
    a = cfg.algorithm
    if step < a.warmup_steps:
        return a.learning_rate * (step + 1) / a.warmup_steps
    progress = (step - a.warmup_steps) / max(cfg.steps - a.warmup_steps, 1)
    if a.lr_schedule == "linear":
        return a.learning_rate * (1.0 - progress)
    if a.lr_schedule == "cosine":
        return a.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))
    return a.learning_rate


class RLTrainer:
    """Runs `cfg.steps` RL steps on a Tinker `ServiceClient` (in-process or remote)."""

    def __init__(self, cfg: TrainerConfig, service):
        load_plugins(cfg.plugins)
        validate_config(cfg)
        self.cfg = cfg
        self.service = service
        self.output_dir = Path(cfg.output_dir)
        self.rewards = RewardRunner(get_reward_fn(cfg.reward.fn), timeout_s=cfg.reward.timeout_s)
        self.problems, self.eval_problems = self._load_problems()
        resume = latest_loop_state(self.output_dir) if cfg.checkpoint.resume == "auto" else None
        self.training = self._training_client(resume)
        self.tokenizer = training_tokenizer(self.training, cfg.model.base_model)
        self.stream = PromptStream(self.problems, cfg.algorithm.batch_size, seed=cfg.seed)
        self.start_step = 0
        if resume is not None:
            self.stream.load_state_dict(resume.stream)
            self.start_step = resume.step
        self.reference = None
        if cfg.algorithm.kl_coef > 0:
            self.reference = service.create_sampling_client(
                base_model=cfg.model.base_model
            ).result()
        self._prompt_cache: dict[int, list[int]] = {}
        self.progress = PhaseTimer(cfg.logging.progress_every_s)

    # ----- setup -------------------------------------------------------------------------

    def _load_problems(self):
        d = self.cfg.data
        task = TaskConfig(format=d.format, system_prompt=d.system_prompt, instruction=d.instruction)
        source = eval_source = "generated arithmetic"
        if d.format == "arithmetic":
            train_rows = generate_arithmetic_rows(d.arithmetic_rows, seed=self.cfg.seed)
            eval_rows = generate_arithmetic_rows(self.cfg.eval.num_prompts, seed=self.cfg.seed + 1)
        else:
            path = pick_data_source(d.path)
            train_rows = load_rows(path, d.split, field="data.path")
            source, eval_rows, eval_source = f"{path} [{d.split}]", [], "none"
            if self.cfg.eval.every or self.cfg.eval.at_start:
                eval_path = pick_data_source(d.eval_path or d.path)
                eval_rows = load_rows(eval_path, d.eval_split, field="data.eval_path")
                eval_source = f"{eval_path} [{d.eval_split}]"
        if d.max_train_rows:
            train_rows = train_rows[: d.max_train_rows]
        problems = build_problems(train_rows, task)
        eval_problems = build_problems(eval_rows[: self.cfg.eval.num_prompts], task)
        print(
            f"data: train {source}, {len(problems)} problems; eval {eval_source}, "
            f"{len(eval_problems)} problems",
            flush=True,
        )
        return problems, eval_problems

    def _training_client(self, resume: LoopState | None):
        m = self.cfg.model
        if resume is not None:
            return self.service.create_training_client_from_state_with_optimizer(
                resume.training_path
            ).result()
        if m.lora_rank == 0:
            if not hasattr(self.service, "create_full_training_client"):
                raise ConfigError("model.lora_rank: 0 (full fine-tuning) needs backend.kind=local")
            return self.service.create_full_training_client(m.base_model).result()
        return self.service.create_lora_training_client(
            m.base_model, rank=m.lora_rank, seed=self.cfg.seed
        ).result()

    def _prompt(self, problem) -> list[int]:
        key = id(problem)
        if key not in self._prompt_cache:
            self._prompt_cache[key] = render_prompt(
                self.tokenizer, problem.prompt_messages, self.cfg.data.system_prompt
            )
        return self._prompt_cache[key]

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ----- one step ----------------------------------------------------------------------

    def _collect_groups(self, sampler, step: int, timings: dict) -> tuple[list[Group], dict]:
        """Sample and score the step's groups; with dynamic sampling, drop zero-variance groups
        and refill with exactly as many next prompts as groups are missing, up to
        `max_refill_rounds` rounds (no prompt is taken from the stream and left unsampled)."""
        cfg, a = self.cfg, self.cfg.algorithm
        params = types.SamplingParams(
            max_tokens=cfg.sampling.max_tokens,
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            top_k=cfg.sampling.top_k,
        )
        kept: list[Group] = []
        stats = {"groups": 0, "zero_variance": 0, "all": []}
        for round_ in range(1 + (a.max_refill_rounds if a.dynamic_sampling else 0)):
            problems = self.stream.next_batch(a.batch_size - len(kept))
            prompts = [self._prompt(p) for p in problems]
            seeds = [sample_seed(cfg.seed, step, round_, i) for i in range(len(prompts))]
            t0 = time.monotonic()
            rollouts = sample_groups(
                sampler,
                prompts,
                a.group_size,
                params,
                seeds,
                self.progress,
                f"sampling step {step + 1}",
            )
            t1 = time.monotonic()
            groups = [Group(p, t, r) for p, t, r in zip(problems, prompts, rollouts, strict=True)]
            score_groups(groups, self.rewards, self._decode, cfg.reward.correct_threshold)
            timings["sample"] += t1 - t0
            timings["reward"] += time.monotonic() - t1
            for group in groups:
                stats["groups"] += 1
                stats["all"].append(group)
                if is_zero_variance(group.rewards):
                    stats["zero_variance"] += 1
                    if a.dynamic_sampling:
                        continue
                kept.append(group)
            if not a.dynamic_sampling or len(kept) >= a.batch_size:
                break
        return kept, stats

    def _advantages(self, groups: list[Group], metrics: dict):
        """Per-token advantages (KL to the reference inside, where the estimator puts it) and
        per-token loss masks: 0 on every token of a response the overlong filter removes, applied
        after everything else so no term (KL included) reaches it."""
        a = self.cfg.algorithm
        rollouts = [r for g in groups for r in g.rollouts]
        kl_GN = None
        if self.reference is not None:
            kl = iter(self._token_kl(rollouts, metrics))
            kl_GN = [[next(kl) for _ in g.rollouts] for g in groups]
        per_group = compute_advantages(
            a.advantage_estimator,
            [g.rewards for g in groups],
            [[len(r.tokens) for r in g.rollouts] for g in groups],
            EstimatorSettings(gamma=a.gamma, kl_coef=a.kl_coef),
            kl_GN,
        )
        advantages = [adv for group in per_group for adv in group]
        filtered = [a.overlong_filter and r.stop_reason == "length" for r in rollouts]
        masks = [np.full(len(r.tokens), 0.0 if f else 1.0) for r, f in zip(rollouts, filtered)]
        return advantages, masks

    def _train(self, rollouts: list[Rollout], advantages, masks, step: int, metrics: dict) -> None:
        """Mini-batches x epochs of forward_backward + optim_step, all submitted up front."""
        cfg, a = self.cfg, self.cfg.algorithm
        reference_logprobs = [None] * len(rollouts)
        if a.tis_cap is not None:
            out = self.training.forward([build_scoring_datum(r) for r in rollouts], "cross_entropy")
            out = out.result()
            learner = [
                response_logprobs(r, o["logprobs"].tolist())
                for r, o in zip(rollouts, out.loss_fn_outputs, strict=True)
            ]
            weights = [
                truncated_importance_weights(lp, r.sampler_logprobs, a.tis_cap)
                for lp, r in zip(learner, rollouts, strict=True)
            ]
            advantages = [adv * w for adv, w in zip(advantages, weights, strict=True)]
            reference_logprobs = learner  # ppo clips against the learner's own log-probs
            metrics["tis/weight_mean"] = float(np.mean(np.concatenate(weights)))
        order = np.random.default_rng(sample_seed(cfg.seed, step, "minibatch")).permutation(
            len(rollouts)
        )
        chunks = [c for c in np.array_split(order, a.num_mini_batches) if len(c)]
        max_len = a.max_seq_len or cfg.sampling.max_tokens
        adam = types.AdamParams(
            learning_rate=learning_rate(cfg, step),
            beta1=a.adam_beta1,
            beta2=a.adam_beta2,
            eps=a.adam_eps,
            weight_decay=a.weight_decay,
            grad_clip_norm=a.grad_clip_norm,
        )
        loss = POLICY_LOSSES[a.loss_fn]
        extra_inputs = loss.extra_inputs or (lambda w: {})
        submitted, skipped = [], 0
        for _ in range(a.epochs_per_batch):
            for chunk in chunks:
                # Normalised over the whole mini-batch; then only the datums with a gradient are
                # sent (GRPO groups whose rewards were all equal add exactly nothing to the sum).
                weights = loss_weights([masks[i] for i in chunk], a.loss_reduction, max_len)
                live = [
                    (i, w)
                    for i, w in zip(chunk, weights, strict=True)
                    if loss.has_gradient(advantages[i] * w, w)
                ]
                skipped += len(chunk) - len(live)
                if not live:  # no gradient at all: forward_backward + optim_step change nothing
                    continue
                chunk, weights = [i for i, _ in live], [w for _, w in live]
                datums = [
                    build_rl_datum(
                        rollouts[i], advantages[i] * w, reference_logprobs[i], extra_inputs(w)
                    )
                    for i, w in zip(chunk, weights, strict=True)
                ]
                fb = self.training.forward_backward(datums, a.loss_fn, a.loss_fn_config or None)
                opt = self.training.optim_step(adam)
                submitted.append((chunk, weights, datums, fb, opt))
        metrics["train/learning_rate"] = adam.learning_rate
        metrics["train/datums_without_gradient"] = skipped
        self._train_metrics(rollouts, submitted, metrics)

    def _train_metrics(self, rollouts, submitted, metrics: dict) -> None:
        a = self.cfg.algorithm
        # Wait for the whole step's updates with a status line (each optim_step follows its
        # forward_backward), so the loop below finds every result ready.
        self.progress.results([s[-1] for s in submitted], "training", "mini-batches")
        clipped_tokens = POLICY_LOSSES[a.loss_fn].clipped
        bounds = clip_bounds(a.loss_fn, a.loss_fn_config) if clipped_tokens else None
        clipped = total = 0
        grad_norms, losses, gaps = [], [], []
        for n, (chunk, weights, datums, fb, opt) in enumerate(submitted):
            out, opt_out = fb.result(), opt.result()
            losses.append(out.metrics.get("loss:sum", float("nan")))
            if "grad_norm:mean" in (opt_out.metrics or {}):
                grad_norms.append(opt_out.metrics["grad_norm:mean"])
            for i, w, datum, o in zip(chunk, weights, datums, out.loss_fn_outputs, strict=True):
                lp = response_logprobs(rollouts[i], o["logprobs"].tolist())
                if clipped_tokens is not None:
                    inputs = datum.loss_fn_inputs
                    ref = response_logprobs(rollouts[i], inputs["logprobs"].tolist())
                    adv = response_logprobs(rollouts[i], inputs["advantages"].tolist())
                    trained = w > 0
                    clipped += int(clipped_tokens(lp, ref, adv, *bounds)[trained].sum())
                    total += int(trained.sum())
                if n == 0:
                    # The first mini-batch ran on the weights that sampled: sampler vs learner.
                    gaps.append(np.abs(lp - np.asarray(rollouts[i].sampler_logprobs)))
        metrics["train/loss_sum"] = float(np.nansum(losses))
        if clipped_tokens is not None:
            # PPO / GSPO: tokens whose clipped term was the active one (zero gradient); CISPO:
            # tokens whose importance weight was clamped; over the tokens with loss weight.
            metrics["train/clip_frac"] = clipped / max(total, 1)
        if grad_norms:
            metrics["train/grad_norm"] = float(np.mean(grad_norms))
        if gaps:
            flat = np.concatenate(gaps)
            metrics["sampler_learner_logprob_gap/mean"] = float(flat.mean())
            metrics["sampler_learner_logprob_gap/max"] = float(flat.max())

    def _token_kl(self, rollouts: list[Rollout], metrics: dict) -> list[np.ndarray]:
        """Per-token KL estimates of each response to the reference (base) policy."""
        a = self.cfg.algorithm
        futures = [
            self.reference.compute_logprobs(
                types.ModelInput.from_ints(list(r.prompt_tokens) + list(r.tokens))
            )
            for r in rollouts
        ]
        kl = []
        for r, f in zip(rollouts, futures, strict=True):
            ref = np.asarray(f.result()[len(r.prompt_tokens) :], dtype=np.float64)
            kl.append(estimate_kl(np.asarray(r.sampler_logprobs), ref, a.kl_estimator))
        metrics["kl/mean"] = float(np.concatenate(kl).mean()) if kl else 0.0
        return kl

    def step(self, step: int) -> dict[str, float]:
        """Run (0-based) step `step`; returns its metrics."""
        timings = dict.fromkeys(("weight_sync", "sample", "reward", "train", "eval"), 0.0)
        start = time.monotonic()
        sampler = self.training.save_weights_and_get_sampling_client().result()
        timings["weight_sync"] = time.monotonic() - start
        groups, stats = self._collect_groups(sampler, step, timings)
        metrics = self._rollout_metrics(stats)
        self._print_samples(stats["all"])
        rollouts = [r for g in groups for r in g.rollouts]
        t0 = time.monotonic()
        if rollouts:
            advantages, masks = self._advantages(groups, metrics)
            self._train(rollouts, advantages, masks, step, metrics)
            tokens = sum(len(r.prompt_tokens) + len(r.tokens) for r in rollouts)
            metrics["train/tokens"] = tokens
        metrics["train/sequences"] = len(rollouts)
        timings["train"] = time.monotonic() - t0
        if self._eval_due(step + 1):
            t0 = time.monotonic()
            metrics.update(self.evaluate())
            timings["eval"] = time.monotonic() - t0
        elapsed = time.monotonic() - start
        metrics.update({f"time/{k}_s": v for k, v in timings.items()})
        metrics["time/step_s"] = elapsed
        if rollouts:
            metrics["throughput/tokens_per_s"] = metrics["train/tokens"] / elapsed
        return metrics

    def _print_samples(self, groups: list[Group]) -> None:
        """`logging.print_samples` decoded responses with their rewards, for a look at the text."""
        rollouts = [(g, r) for g in groups for r in g.rollouts][: self.cfg.logging.print_samples]
        for group, rollout in rollouts:
            text = self._decode(rollout.tokens).replace("\n", "\\n")
            answer = group.problem.sample.get("answer")
            print(f"  [reward {rollout.reward:.2f} | answer {answer}] {text[:400]}", flush=True)

    def _rollout_metrics(self, stats) -> dict[str, float]:
        everything = [r for g in stats["all"] for r in g.rollouts]
        rewards = np.array([r.reward for r in everything])
        metrics = {
            "reward/mean": float(rewards.mean()) if len(rewards) else 0.0,
            "pass_rate": float(np.mean([r.correct for r in everything])) if everything else 0.0,
            "response/mean_tokens": float(np.mean([len(r.tokens) for r in everything])),
            "response/truncated_frac": float(
                np.mean([r.stop_reason == "length" for r in everything])
            ),
            "groups/zero_variance_frac": stats["zero_variance"] / max(stats["groups"], 1),
            "groups/sampled": stats["groups"],
            "reward/errors": sum(r.reward_error is not None for r in everything),
        }
        components = sorted({k for r in everything for k in r.reward_components})
        for key in components:
            metrics[f"reward/{key}"] = float(
                np.mean([r.reward_components.get(key, 0.0) for r in everything])
            )
        return metrics

    # ----- eval, checkpoints, the run ------------------------------------------------------

    def _eval_due(self, steps_done: int) -> bool:
        every = self.cfg.eval.every
        return (
            bool(self.eval_problems)
            and every > 0
            and (steps_done % every == 0 or steps_done == self.cfg.steps)
        )

    def evaluate(self, sampler=None) -> dict[str, float]:
        cfg = self.cfg
        sampler = sampler or self.training.save_weights_and_get_sampling_client().result()
        return evaluate(
            sampler,
            self.eval_problems,
            [self._prompt(p) for p in self.eval_problems],
            self.rewards,
            self._decode,
            cfg.sampling.max_tokens,
            cfg.reward.correct_threshold,
            pass_k=cfg.eval.pass_k,
            temperature=cfg.sampling.temperature,
            seed=cfg.seed,
            progress=self.progress,
        )

    def save_checkpoint(self, steps_done: int) -> LoopState:
        name = f"step-{steps_done:06d}"
        futures = [self.training.save_state(name)]
        if self.cfg.checkpoint.save_sampler_weights:
            futures.append(self.training.save_weights_for_sampler(name))
        paths = [r.path for r in self.progress.results(futures, f"checkpoint {name}", "saves")]
        training_path, sampler_path = paths[0], (paths[1] if len(paths) > 1 else None)
        state = LoopState(steps_done, self.stream.state_dict(), training_path, sampler_path)
        save_loop_state(self.output_dir, state)
        return state

    def run(self, stop_after: int | None = None) -> list[dict[str, float]]:
        """Train from the current step to `cfg.steps` (or stop after `stop_after` steps, as an
        interruption would); returns every step's metrics."""
        cfg = self.cfg
        logger = MetricsLogger(
            self.output_dir,
            cfg.steps,
            self.start_step,
            wandb_project=cfg.logging.wandb_project,
            wandb_mode=cfg.logging.wandb_mode,
            tensorboard=cfg.logging.tensorboard,
            run_config=asdict(cfg),
        )
        history = []
        try:
            if cfg.eval.at_start and self.start_step == 0 and self.eval_problems:
                logger.log(0, self.evaluate())
            for step in range(self.start_step, cfg.steps):
                if stop_after is not None and step - self.start_step >= stop_after:
                    break
                metrics = self.step(step)
                steps_done = step + 1
                every = cfg.checkpoint.every
                if (every and steps_done % every == 0) or steps_done == cfg.steps:
                    t0 = time.monotonic()
                    self.save_checkpoint(steps_done)
                    metrics["time/checkpoint_s"] = time.monotonic() - t0
                logger.log(steps_done, metrics)
                history.append(metrics)
        finally:
            logger.close()
            self.rewards.close()
        return history
