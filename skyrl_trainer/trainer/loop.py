"""The RL loop (GRPO / PPO and relatives), speaking only the Tinker client interface.

One step, as in ARCHITECTURE.md: take the batch (rolled out with the current sampler, or, in
asynchronous runs, by producers sampling ahead with weights at most k steps old: `pipeline`),
compute advantages and train on it (`train_step`), which returns the sampler of the new weights;
publish it to the batch source, evaluate with it, checkpoint, log.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from skyrl_trainer.trainer.checkpointing import LoopState, save_loop_state
from skyrl_trainer.trainer.collect import rollout_metrics
from skyrl_trainer.trainer.config import TrainerConfig
from skyrl_trainer.trainer.evaluation import evaluate
from skyrl_trainer.trainer.metrics_log import MetricsLogger
from skyrl_trainer.trainer.pipeline import ScheduledBatches, SynchronousBatches
from skyrl_trainer.trainer.setup import build_run, load_plugins
from skyrl_trainer.trainer.streaming import StreamingBatches
from skyrl_trainer.trainer.train_step import learning_rate, rl_step
from skyrl_trainer.trainer.trajectory_log import append_trajectories, print_trajectories

__all__ = ["RLTrainer", "learning_rate", "load_plugins"]


class RLTrainer:
    """Runs `cfg.steps` RL steps on a Tinker `ServiceClient` (in-process or remote)."""

    def __init__(self, cfg: TrainerConfig, service):
        self.run_state = build_run(cfg, service)
        self.cfg = cfg
        self.start_step = self.run_state.start_step
        self._sampler = None
        self._source = None

    @property
    def training(self):
        return self.run_state.training

    @training.setter
    def training(self, client) -> None:  # tests wrap the client to record its calls
        self.run_state.training = client

    def sampler(self):
        """The sampler of the current weights (synced once, then handed on by each step)."""
        if self._sampler is None:
            self._sampler = self.training.save_weights_and_get_sampling_client().result()
        return self._sampler

    @property
    def source(self):
        """Where batches come from (`algorithm.max_steps_off_policy`, `async_mode`); made on
        first use, with the current weights published to it."""
        if self._source is None:
            run, a = self.run_state, self.cfg.algorithm
            if a.max_steps_off_policy == 0:
                self._source = SynchronousBatches(run)
            else:
                kind = ScheduledBatches if a.async_mode == "deterministic" else StreamingBatches
                self._source = kind(
                    run, a.max_steps_off_policy, self.start_step, run.pending_pipeline
                )
            self._source.publish(self.start_step, self.sampler())
        return self._source

    def step(self, step: int) -> dict[str, float]:
        """Run (0-based) step `step`; returns its metrics."""
        run, start = self.run_state, time.monotonic()
        batch = self.source.next_batch(step)
        metrics = rollout_metrics(batch)
        metrics.update(self.source.metrics(batch, step))
        if self.cfg.logging.save_trajectories:
            append_trajectories(run.output_dir, step + 1, batch.sampled, batch.dropped)
        print_trajectories(batch.sampled, self.cfg.logging.print_samples)
        self._sampler, train_metrics = rl_step(run, batch, step, self._sampler)
        self.source.publish(step + 1, self._sampler)
        metrics.update(train_metrics)
        if self._eval_due(step + 1):
            t0 = time.monotonic()
            with self.source.exclusive():
                metrics.update(self.evaluate())
            metrics["time/eval_s"] = time.monotonic() - t0
        metrics["time/step_s"] = elapsed = time.monotonic() - start
        if "train/tokens" in metrics:
            metrics["throughput/tokens_per_s"] = metrics["train/tokens"] / elapsed
        return metrics

    def _eval_due(self, steps_done: int) -> bool:
        every = self.cfg.eval.every
        return (
            bool(self.run_state.eval_problems)
            and every > 0
            and (steps_done % every == 0 or steps_done == self.cfg.steps)
        )

    def evaluate(self) -> dict[str, float]:
        run, cfg = self.run_state, self.cfg
        return evaluate(
            self.sampler(),
            run.eval_problems,
            run.rollouts,
            cfg.sampling.max_tokens,
            pass_k=cfg.eval.pass_k,
            temperature=cfg.sampling.temperature,
            seed=cfg.seed,
            progress=run.progress,
        )

    def save_checkpoint(self, steps_done: int) -> LoopState:
        run, name = self.run_state, f"step-{steps_done:06d}"
        futures = [run.training.save_state(name)]
        if self.cfg.checkpoint.save_sampler_weights:
            futures.append(run.training.save_weights_for_sampler(name))
        stream, pending = self.source.checkpoint_state(steps_done)
        paths = [r.path for r in run.progress.results(futures, f"checkpoint {name}", "saves")]
        training_path, sampler_path = paths[0], (paths[1] if len(paths) > 1 else None)
        state = LoopState(steps_done, stream, training_path, sampler_path)
        save_loop_state(run.output_dir, state, pending)
        return state

    def run(self, stop_after: int | None = None) -> list[dict[str, float]]:
        """Train from the current step to `cfg.steps` (or stop after `stop_after` steps, as an
        interruption would); returns every step's metrics."""
        cfg = self.cfg
        logger = MetricsLogger(
            self.run_state.output_dir,
            cfg.steps,
            self.start_step,
            wandb_project=cfg.logging.wandb_project,
            wandb_mode=cfg.logging.wandb_mode,
            tensorboard=cfg.logging.tensorboard,
            run_config=asdict(cfg),
        )
        history = []
        try:
            if cfg.eval.at_start and self.start_step == 0 and self.run_state.eval_problems:
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
            self.close()
            logger.close()
        return history

    def close(self) -> None:
        """Stop the batch source's producers (bounded time; nothing in flight is trained)."""
        if self._source is not None:
            self._source.close()
            self._source = None
