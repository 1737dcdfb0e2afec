"""One RL update on a batch: advantages (with the KL penalty and off-policy correction), then
mini-batches x epochs of forward_backward + optim_step, all submitted before any is awaited, then
the train metrics; returns the sampler of the updated weights.

Only action tokens (what the policy sampled) carry loss, KL, importance weights and metrics;
estimators see each trajectory's action tokens as its response, and their per-token values are
scattered back to the trajectory's positions with 0 on observation tokens.
"""

from __future__ import annotations

import math
import time

import numpy as np
from tinker import types

from skyrl_trainer.trainer.advantages import EstimatorSettings, compute_advantages
from skyrl_trainer.trainer.collect import Batch
from skyrl_trainer.trainer.datums import (
    Rollout,
    build_rl_datum,
    build_scoring_datum,
    response_logprobs,
)
from skyrl_trainer.trainer.kl import estimate_kl
from skyrl_trainer.trainer.off_policy import truncated_importance_weights
from skyrl_trainer.trainer.policy_losses import POLICY_LOSSES, clip_bounds
from skyrl_trainer.trainer.reductions import loss_weights
from skyrl_trainer.trainer.rollouts import sample_seed


def learning_rate(cfg, step: int) -> float:
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


def rl_step(run, batch: Batch, step: int, sampler):
    """Train on `batch`; returns (the sampler of the new weights, metrics). With no trajectory
    to train on, the weights do not change and `sampler` is returned as it is."""
    metrics: dict[str, float] = {}
    rollouts = batch.rollouts
    metrics["train/sequences"] = len(rollouts)
    start, trained = time.monotonic(), False
    if rollouts:
        advantages, masks = compute_token_advantages(run, batch, metrics)
        trained = train_on(run, rollouts, advantages, masks, step, metrics)
        metrics["train/tokens"] = sum(len(r.prompt_tokens) + len(r.tokens) for r in rollouts)
    metrics["time/train_s"] = time.monotonic() - start
    if trained:
        start = time.monotonic()
        sampler = run.training.save_weights_and_get_sampling_client().result()
        metrics["time/weight_sync_s"] = time.monotonic() - start
    return sampler, metrics


def compute_token_advantages(run, batch: Batch, metrics: dict):
    """Per-token advantages and loss masks of every trajectory. The mask is 0 on observation
    tokens and on every token of a trajectory the overlong filter removes (applied after all else,
    so no term, KL included, reaches it)."""
    a = run.cfg.algorithm
    groups = batch.groups
    rollouts = batch.rollouts
    actions = [r.mask() > 0 for r in rollouts]
    kl_GN = None
    if run.reference is not None:
        kl = iter(k[m] for k, m in zip(token_kl(run, rollouts, metrics), actions, strict=True))
        kl_GN = [[next(kl) for _ in g.rollouts] for g in groups]
    per_group = compute_advantages(
        a.advantage_estimator,
        [g.rewards for g in groups],
        [[int(r.mask().sum()) for r in g.rollouts] for g in groups],
        EstimatorSettings(gamma=a.gamma, kl_coef=a.kl_coef),
        kl_GN,
    )
    advantages = []
    for values, is_action in zip((v for g in per_group for v in g), actions, strict=True):
        full = np.zeros(len(is_action))
        full[is_action] = values
        advantages.append(full)
    masks = [
        r.mask() * (0.0 if a.overlong_filter and r.stop_reason == "length" else 1.0)
        for r in rollouts
    ]
    return advantages, masks


def token_kl(run, rollouts: list[Rollout], metrics: dict) -> list[np.ndarray]:
    """Per-token KL estimates of each trajectory to the reference (base) policy (0 on
    observation tokens; `kl/mean` over action tokens)."""
    futures = [
        run.reference.compute_logprobs(
            types.ModelInput.from_ints(list(r.prompt_tokens) + list(r.tokens))
        )
        for r in rollouts
    ]
    kl = []
    for r, f in zip(rollouts, futures, strict=True):
        ref = np.asarray(f.result()[len(r.prompt_tokens) :], dtype=np.float64)
        kl.append(estimate_kl(np.asarray(r.sampler_logprobs), ref, run.cfg.algorithm.kl_estimator))
        kl[-1] = kl[-1] * r.mask()
    action_kl = [k[r.mask() > 0] for k, r in zip(kl, rollouts, strict=True)]
    metrics["kl/mean"] = float(np.concatenate(action_kl).mean()) if action_kl else 0.0
    return kl


def train_on(run, rollouts, advantages, masks, step: int, metrics: dict) -> bool:
    """Mini-batches x epochs of forward_backward + optim_step, all submitted up front. Datums
    without a gradient are not sent (they add exactly nothing); every mini-batch still takes its
    optimizer step. Returns whether any step was taken."""
    cfg, a = run.cfg, run.cfg.algorithm
    reference_logprobs = [None] * len(rollouts)
    if a.tis_cap is not None:
        out = run.training.forward([build_scoring_datum(r) for r in rollouts], "cross_entropy")
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
        reference_logprobs = [
            np.where(r.mask() > 0, lp, r.sampler_logprobs)  # ppo clips against the learner
            for lp, r in zip(learner, rollouts, strict=True)
        ]
        on_actions = [w[r.mask() > 0] for w, r in zip(weights, rollouts, strict=True)]
        metrics["tis/weight_mean"] = float(np.mean(np.concatenate(on_actions)))
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
            datums = [
                build_rl_datum(
                    rollouts[i], advantages[i] * w, reference_logprobs[i], extra_inputs(w)
                )
                for i, w in live
            ]
            # A mini-batch with no gradient sends no forward_backward but still takes its AdamW
            # step (momentum and weight decay move the weights, as after a zero loss).
            fb = (
                run.training.forward_backward(datums, a.loss_fn, a.loss_fn_config or None)
                if datums
                else None
            )
            opt = run.training.optim_step(adam)
            submitted.append((live, datums, fb, opt))
    metrics["train/learning_rate"] = adam.learning_rate
    metrics["train/datums_without_gradient"] = skipped
    train_metrics(run, rollouts, submitted, metrics, step)
    return bool(submitted)


def train_metrics(run, rollouts, submitted, metrics: dict, step: int) -> None:
    """Loss, grad norm, clip fraction and the sampler-learner log-prob gap (action tokens; in
    asynchronous runs also per staleness, the learner being `staleness` steps newer)."""
    a = run.cfg.algorithm
    # Wait for the whole step's updates with a status line (each optim_step follows its
    # forward_backward), so the loop below finds every result ready.
    run.progress.results([s[-1] for s in submitted], "training", "mini-batches")
    clipped_tokens = POLICY_LOSSES[a.loss_fn].clipped
    bounds = clip_bounds(a.loss_fn, a.loss_fn_config) if clipped_tokens else None
    clipped = total = 0
    grad_norms, losses, gaps, gaps_by_age = [], [], [], {}
    for n, (live, datums, fb, opt) in enumerate(submitted):
        opt_out = opt.result()
        if "grad_norm:mean" in (opt_out.metrics or {}):
            grad_norms.append(opt_out.metrics["grad_norm:mean"])
        if fb is None:  # no datum had a gradient: an optimizer step on momentum alone
            continue
        out = fb.result()
        losses.append(out.metrics.get("loss:sum", float("nan")))
        for (i, w), datum, o in zip(live, datums, out.loss_fn_outputs, strict=True):
            rollout = rollouts[i]
            lp = response_logprobs(rollout, o["logprobs"].tolist())
            if clipped_tokens is not None:
                inputs = datum.loss_fn_inputs
                ref = response_logprobs(rollout, inputs["logprobs"].tolist())
                adv = response_logprobs(rollout, inputs["advantages"].tolist())
                trained = w > 0
                clipped += int(clipped_tokens(lp, ref, adv, *bounds)[trained].sum())
                total += int(trained.sum())
            if n == 0:
                # The first mini-batch ran on the weights of this step (those that sampled,
                # unless the trajectory is stale): the sampler vs the learner.
                is_action = rollout.mask() > 0
                gaps.append(np.abs(lp - np.asarray(rollout.sampler_logprobs))[is_action])
                if rollout.sampler_version is not None:
                    age = step - rollout.sampler_version
                    gaps_by_age.setdefault(age, []).append(gaps[-1])
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
    for age, parts in sorted(gaps_by_age.items()):
        metrics[f"sampler_learner_logprob_gap/staleness_{age}"] = float(
            np.concatenate(parts).mean()
        )
