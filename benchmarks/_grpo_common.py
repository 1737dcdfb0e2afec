"""Shared parts of `grpo_vs_trl.py`: the run settings, our side of the run (the in-process backend
driven by `RLTrainer`), the per-step records both sides produce, the summary and the plot.

A per-step record (both frameworks) holds: step, step_s (wall time of the step), sample_s
(generation), train_s (forward/backward + optimizer), other_s (step_s - sample_s - train_s: rewards,
weight sync, tokenisation, bookkeeping), tokens_generated, tokens_trained (prompt + response tokens
of every trained sequence), reward_mean, elapsed_s (cumulative step time) and side-specific extras.
After the last step each side answers the same held-out problems greedily (`eval_pass1`).
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from queue import Empty

import torch
import yaml

from skyrl_trainer.trainer.config import AlgorithmSettings, ConfigError

# Our default AdamW betas / eps, weight decay and gradient clip; TRL is given the same.
OPTIMIZER = AlgorithmSettings()
# The held-out problems' generator seed: one set for every training seed (the trainer's own eval
# set would be drawn with seed + 1, a different set per seed and another seed's training rows).
EVAL_SEED = 1_000_000
EVAL_BATCH = 64  # prompts per `generate` call in TRL's greedy eval
# Overrides that would change the work both sides share: they have their own options.
SHARED_KEYS = {
    "steps": "--steps",
    "seed": "--seeds",
    "algorithm.batch_size": "--prompts",
    "algorithm.group_size": "--group",
}


@dataclass
class Settings:
    """One framework-independent description of the work; both sides are configured from it."""

    mode: str  # lora | full
    seed: int
    steps: int
    prompts: int  # prompts per step
    group: int  # samples per prompt
    max_tokens: int
    temperature: float
    learning_rate: float
    lora_rank: int
    data_path: str
    data_format: str
    reward: str
    system_prompt: str | None
    max_train_rows: int | None
    our_engine: str  # torch | vllm
    dtype: str  # bfloat16 | float32, resolved from --dtype (training autocast and sampling dtype)
    trl_micro_batch: int  # TRL per_device_train_batch_size (sequences per forward/backward)
    trl_lora_base_dtype: str  # the frozen base's dtype on TRL's side (ours: `dtype`)
    eval_problems: int = 64  # held-out problems answered greedily after training (0: none)
    eval_seed: int = EVAL_SEED
    our_overrides: dict = field(default_factory=dict)  # dotted TrainerConfig keys, ours only
    model: str = "SmolLM2-135M-Instruct"


def isolated(fn, *args):
    """`fn(*args)` in a fresh interpreter (spawn): neither side inherits the other's memory, thread
    count or thread pinning (vLLM's CPU worker pins threads and lowers torch's thread count)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue, fn, args))
    child.start()
    try:
        while True:
            try:
                ok, value = queue.get(timeout=5)
                break
            except Empty:
                if not child.is_alive() and queue.empty():  # killed (out of memory, signal)
                    raise RuntimeError(
                        f"{fn.__name__}: its subprocess died (exit code {child.exitcode})"
                    ) from None
    except KeyboardInterrupt:
        child.terminate()
        raise
    finally:
        child.join()
    if not ok:
        raise RuntimeError(f"{fn.__name__} failed in its subprocess:\n{value}")
    return value


def _child(queue, fn, args) -> None:
    try:
        queue.put((True, fn(*args)))
    except BaseException:
        queue.put((False, traceback.format_exc()))


# ----- ours -----------------------------------------------------------------------------------


def our_config(s: Settings, workdir: Path):
    """The `TrainerConfig` of our side: the gsm8k_grpo recipe's algorithm with `s`'s sizes."""
    from skyrl_trainer.trainer.config import TrainerConfig, build_config

    data = {
        "steps": s.steps,
        "seed": s.seed,
        "output_dir": str(workdir / "ours"),
        "backend": {
            "kind": "local",
            "local": {
                "storage_dir": str(workdir / "storage"),
                "training": {"dtype": s.dtype},
                "sampling": {"engine": s.our_engine, "dtype": s.dtype},
            },
        },
        # TRL refuses a LoRA adapter on lm_head (it computes log-probs from lm_head.weight), so
        # both sides adapt the attention and MLP projections only.
        "model": {
            "base_model": s.model,
            "lora_rank": s.lora_rank if s.mode == "lora" else 0,
            "train_unembed": False,
        },
        "data": {
            "path": s.data_path,
            "split": "train",
            "format": s.data_format,
            "system_prompt": s.system_prompt,
            "max_train_rows": s.max_train_rows,
        },
        "reward": {"fn": s.reward},
        "sampling": {"max_tokens": s.max_tokens, "temperature": s.temperature},
        "algorithm": {
            "advantage_estimator": "grpo",
            "loss_fn": "ppo",  # ratio clipped to [0.8, 1.2]
            "loss_reduction": "token_mean",
            "group_size": s.group,
            "batch_size": s.prompts,
            "num_mini_batches": 1,
            "epochs_per_batch": 1,
            "learning_rate": s.learning_rate,
            "kl_coef": 0.0,
            "max_refill_rounds": 0,
        },
        "eval": {"every": 0, "at_start": False},
        "checkpoint": {"every": 0, "resume": "never"},
    }
    for key, value in s.our_overrides.items():
        *parents, leaf = key.split(".")
        node = data
        for depth, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {'.'.join(parents[: depth + 1])} is not a section")
        node[leaf] = value
    return build_config(data, TrainerConfig)  # refuses unknown keys and wrong types by name


def parse_override(text: str) -> tuple[str, object]:
    """`algorithm.kl_coef=0.01` -> ("algorithm.kl_coef", 0.01). The value is read as YAML, as on
    the trainer's command line (numbers, true/false, null, [lists]); raises ValueError."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not raw.strip() or not all(p.isidentifier() for p in key.split(".")):
        raise ValueError(
            f"--our-override {text!r}: expected key=value with a dotted TrainerConfig key, "
            "e.g. algorithm.kl_coef=0.01 (null for None)"
        )
    if key in SHARED_KEYS:
        raise ValueError(f"--our-override {text!r}: both sides share it; use {SHARED_KEYS[key]}")
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ValueError(f"--our-override {text!r}: the value is not valid YAML ({exc})") from None


def served_batches(s: Settings) -> list:
    """The problems of every step in the order our trainer serves them (`build_run`'s prompt
    stream), without loading a model: TRL's work when ours does not run."""
    from skyrl_trainer.data.stream import PromptStream
    from skyrl_trainer.trainer.setup import load_problems

    cfg = our_config(s, Path("unused"))
    problems, _ = load_problems(cfg)
    stream = PromptStream(problems, cfg.algorithm.batch_size, seed=cfg.seed)
    return [stream.next_batch() for _ in range(s.steps)]


def heldout_problems(s: Settings, batches: list) -> list:
    """`s.eval_problems` problems from the training data's generator with the fixed seed
    `s.eval_seed`, made by the same task format, without repeats and without any prompt trained on
    (`batches`). So every seed gets the same set, except that a problem its training served is
    replaced by the next one. [] for data read from a file (no generator) or `s.eval_problems` 0."""
    from skyrl_trainer.data.tasks import GENERATED_ROWS, TaskConfig, build_problems

    d = our_config(s, Path("unused")).data
    if not s.eval_problems or d.format not in GENERATED_ROWS:
        return []
    seen = {str(p.prompt_messages) for batch in batches for p in batch}
    rows = GENERATED_ROWS[d.format](len(seen) + 4 * s.eval_problems, s.eval_seed)
    problems = []
    for problem in build_problems(rows, TaskConfig(format=d.format, instruction=d.instruction)):
        if str(problem.prompt_messages) not in seen:
            seen.add(str(problem.prompt_messages))
            problems.append(problem)
            if len(problems) == s.eval_problems:
                return problems
    raise SystemExit(f"only {len(problems)} held-out problems outside the training prompts")


def run_ours(s: Settings, workdir: Path, eval_problems: list) -> tuple[dict, list]:
    """Train our side, then answer `eval_problems` greedily; returns (run record, the problems of
    every step in the order served)."""
    from skyrl_trainer.connect import make_service_client
    from skyrl_trainer.data import render_prompt
    from skyrl_trainer.trainer.loop import RLTrainer

    class Trainer(RLTrainer):
        def save_checkpoint(self, steps_done):  # the end-of-run checkpoint is not part of the work
            return None

    started = time.monotonic()
    cfg = our_config(s, workdir)
    service = make_service_client(cfg.backend)
    trainer = Trainer(cfg, service)
    run_state = trainer.run_state
    stream = copy.deepcopy(run_state.stream)  # the exact prompts of every step, handed to TRL
    batches = [stream.next_batch() for _ in range(s.steps)]
    prompt_ids = [
        render_prompt(run_state.tokenizer, p.prompt_messages, cfg.data.system_prompt)
        for batch in batches
        for p in batch
    ]
    startup = time.monotonic() - started
    history = trainer.run()
    records, elapsed = [], 0.0
    for step, m in enumerate(history, start=1):
        elapsed += m["time/step_s"]
        sequences = m.get("train/sequences", 0)
        records.append(
            {
                "step": step,
                "step_s": m["time/step_s"],
                "sample_s": m["time/rollouts_s"],
                "train_s": m["time/train_s"],
                "other_s": m["time/step_s"] - m["time/rollouts_s"] - m["time/train_s"],
                "tokens_generated": round(m["response/mean_tokens"] * sequences),
                "tokens_trained": int(m.get("train/tokens", 0)),
                "reward_mean": m["reward/mean"],
                "elapsed_s": elapsed,
                "extra": {
                    k: m[k]
                    for k in (
                        "time/weight_sync_s",
                        "time/env_s",
                        "pass_rate",
                        "train/clip_frac",
                        "train/grad_norm",
                        "groups/zero_variance_frac",
                        "response/truncated_frac",
                        "sampler_learner_logprob_gap/mean",
                        "sampler_learner_logprob_gap/max",
                        "tis/weight_mean",
                    )
                    if k in m
                },
            }
        )
    run = {"framework": "ours", "seed": s.seed, "startup_s": startup, "steps": records}
    if eval_problems:
        run.update(_our_greedy_eval(trainer, eval_problems, s.max_tokens))
    if s.mode == "lora":
        run["adapter"] = _our_adapter(trainer, service)
    service.core.shutdown()
    run["torch_threads_after"] = torch.get_num_threads()
    run["prompt_ids"] = prompt_ids  # TRL's tokenisation is checked against it (then dropped)
    return run, batches


def _our_adapter(trainer, service) -> dict:
    """The LoRA target modules and trainable parameter count of our trained adapter, read from
    the adapter files the backend saves (what was really trained, not what was asked for)."""
    from safetensors.torch import load_file

    path = trainer.run_state.training.save_state("adapter-check").result().path
    folder, _ = service.core.store.resolve(path)
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    return {
        "lora_targets": sorted(config["target_modules"]),
        "trainable_params": sum(t.numel() for t in tensors.values()),
    }


def _our_greedy_eval(trainer, problems: list, max_tokens: int) -> dict:
    """Greedy pass@1 by the trainer's own `evaluate` with the final sampler; a recording wrapper
    around its rollouts keeps each problem's prompt ids (checked against TRL's), answer and score."""
    from skyrl_trainer.trainer.evaluation import evaluate

    class Recorder:
        def __init__(self, rollouts):
            self.rollouts, self.groups = rollouts, []

        def run(self, *args, **kwargs):
            groups = self.rollouts.run(*args, **kwargs)
            self.groups += groups
            return groups

    rollouts = trainer.run_state.rollouts
    rollouts.stop.clear()  # set by an asynchronous batch source (an override) when the run closed
    recorder, started = Recorder(rollouts), time.monotonic()
    metrics = evaluate(trainer.sampler(), problems, recorder, max_tokens)
    answers = [g.rollouts[0] for g in recorder.groups]
    return {
        "eval_pass1": metrics["eval/pass@1"],
        "eval": {
            "s": time.monotonic() - started,
            "metrics": metrics,
            "correct": [r.correct for r in answers],
            "completions": [r.turns[0].action for r in answers],
        },
        "eval_prompt_ids": [list(g.prompt_tokens) for g in recorder.groups],  # for TRL (dropped)
    }


# ----- TRL helpers ------------------------------------------------------------------------


def trl_reward(name: str, timer: dict):
    """Our registered reward `name` as a TRL reward function (same text, same sample dict)."""
    from skyrl_trainer.rewards import get_reward_fn, normalize_reward

    fn = get_reward_fn(name)

    def reward(prompts, completions, sample, **_):
        start = time.perf_counter()
        scores = []
        for completion, sample_json in zip(completions, sample, strict=True):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            try:
                scores.append(normalize_reward(fn(text, json.loads(sample_json)))[0])
            except Exception:  # as our environments: a failing reward scores 0
                scores.append(0.0)
        timer["reward_s"] += time.perf_counter() - start
        return scores

    reward.__name__ = f"skyrl_{name}"
    return reward


def trl_greedy_eval(trainer, generate, prompt_ids: list, problems: list, s: Settings) -> dict:
    """TRL's trained policy answering each held-out prompt greedily: `generate` (the policy's own,
    untimed) with TRL's generation config but `do_sample=False`, on exactly `prompt_ids`,
    left-padded as TRL pads; then TRL's completion handling (cut after the first EOS, decoded
    without special tokens) and our reward, correct at `reward.correct_threshold` as ours."""
    from transformers import GenerationConfig

    from skyrl_trainer.trainer.config import RewardSettings

    tok, policy, started = trainer.processing_class, trainer.model, time.monotonic()
    greedy = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None, "min_p": None}
    config = GenerationConfig(**{**trainer.generation_kwargs, **greedy}, disable_compile=True)
    eos = set(trainer.eos_token_ids)
    policy.eval()
    texts = []
    for i in range(0, len(prompt_ids), EVAL_BATCH):
        chunk = prompt_ids[i : i + EVAL_BATCH]
        width = max(map(len, chunk))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = generate(
                input_ids=ids.to(policy.device),
                attention_mask=mask.to(policy.device),
                generation_config=config,
            )
        for row in out[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            texts.append(tok.decode(row[:cut], skip_special_tokens=True))
    samples = [json.dumps(p.sample) for p in problems]
    rewards = trl_reward(s.reward, {"reward_s": 0.0})(None, texts, samples)
    correct = [r >= RewardSettings().correct_threshold for r in rewards]
    pass1 = sum(correct) / len(correct)
    return {
        "eval_pass1": pass1,
        "eval": {
            "s": time.monotonic() - started,
            "metrics": {"eval/pass@1": pass1, "eval/reward_mean": statistics.fmean(rewards)},
            "correct": correct,
            "completions": texts,
        },
    }


def timed(fn, timer: dict, key: str, on_call=None):
    """`fn` that adds its wall time to `timer[key]` (and calls `on_call()` before returning)."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timer[key] += time.perf_counter() - start
            if on_call:
                on_call()

    return wrapper


def same_lora_init(policy, model_dir, s: Settings) -> bool:
    """Whether TRL's fresh adapter equals the one our backend creates with the same seed
    (`add_lora_adapter` on a freshly loaded base)."""
    from tinker import types

    from skyrl_trainer.backend.lora import add_lora_adapter, classify_linear_layers
    from skyrl_trainer.backend.model_loading import load_causal_lm

    base = load_causal_lm(model_dir, s.dtype)
    lora = types.LoraConfig(rank=s.lora_rank, seed=s.seed, train_unembed=False)
    ref = add_lora_adapter(base, classify_linear_layers(base), "default", lora)
    ours = {n: p for n, p in ref.named_parameters() if ".default." in n}
    theirs = {n: p for n, p in policy.named_parameters() if ".default." in n}
    return ours.keys() == theirs.keys() and all(
        torch.equal(ours[n].float(), theirs[n].float()) for n in ours
    )


# ----- summary, table, plot -----------------------------------------------------------------------


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for run in runs for r in run["steps"])


def summarise(runs: list[dict], last_k: int) -> dict:
    """Medians over every (seed, step) of each framework, the mean reward of the last `last_k`
    steps (averaged over seeds), and the ours / TRL ratio of the median step time."""
    summary = {}
    for framework in ("ours", "trl"):
        mine = [run for run in runs if run["framework"] == framework]
        if not mine:
            continue
        gen_rate = statistics.median(
            r["tokens_generated"] / r["sample_s"] for run in mine for r in run["steps"]
        )
        train_rate = statistics.median(
            r["tokens_trained"] / r["train_s"] for run in mine for r in run["steps"]
        )
        last = [statistics.fmean(r["reward_mean"] for r in run["steps"][-last_k:]) for run in mine]
        summary[framework] = {
            **{
                f"median_{k}": _median(mine, k)
                for k in ("step_s", "sample_s", "train_s", "other_s")
            },
            "median_step_s_without_step_1": statistics.median(
                r["step_s"] for run in mine for r in run["steps"][1:] or run["steps"]
            ),
            "median_generated_tok_per_s": gen_rate,
            "median_trained_tok_per_s": train_rate,
            "mean_reward_all_steps": statistics.fmean(
                r["reward_mean"] for run in mine for r in run["steps"]
            ),
            f"mean_reward_last_{last_k}": statistics.fmean(last),
            "mean_reward_last_k_per_seed": last,
            "median_startup_s": statistics.median(run["startup_s"] for run in mine),
        }
        evals = [run["eval_pass1"] for run in mine if run.get("eval_pass1") is not None]
        if evals:
            summary[framework]["mean_eval_pass1"] = statistics.fmean(evals)
    if "ours" in summary and "trl" in summary:
        o, t = summary["ours"], summary["trl"]
        summary["ratio_ours_over_trl"] = {
            k: o[f"median_{k}"] / t[f"median_{k}"] for k in ("step_s", "sample_s", "train_s")
        }
    return summary


def print_table(summary: dict, last_k: int) -> None:
    cols = [
        ("median_step_s", "step s", "{:8.1f}"),
        ("median_sample_s", "sample s", "{:9.1f}"),
        ("median_train_s", "train s", "{:8.1f}"),
        ("median_other_s", "other s", "{:8.1f}"),
        ("median_generated_tok_per_s", "gen tok/s", "{:10.0f}"),
        ("median_trained_tok_per_s", "train tok/s", "{:12.0f}"),
        (f"mean_reward_last_{last_k}", f"reward(last {last_k})", "{:16.3f}"),
    ]
    print(
        f"{'framework':10s}" + "".join(f"{label:>{len(fmt.format(0))}s}" for _, label, fmt in cols)
    )
    for framework in ("ours", "trl"):
        if framework in summary:
            row = summary[framework]
            print(f"{framework:10s}" + "".join(fmt.format(row[k]) for k, _, fmt in cols))
    if "ratio_ours_over_trl" in summary:
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in summary["ratio_ours_over_trl"].items())
        print(f"ours / TRL median time (< 1: ours faster): {ratios}")


def plot(runs: list[dict], title: str, out: Path) -> None:
    """Reward against step (left) and cumulative step time (right): every seed thin and faint,
    each framework's mean over its seeds thick (on the right, placed at the mean elapsed time of
    each step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    colors = {"ours": "tab:blue", "trl": "tab:orange"}
    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(10, 3.8))
    for framework, color in colors.items():
        mine = [run["steps"] for run in runs if run["framework"] == framework]
        if not mine:
            continue
        for steps in mine:
            rewards = [r["reward_mean"] for r in steps]
            thin = dict(color=color, alpha=0.3, linewidth=0.8)
            ax_step.plot([r["step"] for r in steps], rewards, **thin)
            ax_time.plot([r["elapsed_s"] / 60 for r in steps], rewards, **thin)
        n = min(len(steps) for steps in mine)  # equal unless a run stopped early
        reward = np.mean([[r["reward_mean"] for r in steps[:n]] for steps in mine], axis=0)
        minutes = np.mean([[r["elapsed_s"] / 60 for r in steps[:n]] for steps in mine], axis=0)
        label = f"{'TRL' if framework == 'trl' else 'ours'}, mean of {len(mine)} seeds"
        thick = dict(color=color, linewidth=2.5, label=label)
        ax_step.plot(range(1, n + 1), reward, **thick)
        ax_time.plot(minutes, reward, **thick)
    ax_step.set_xlabel("step")
    ax_time.set_xlabel("cumulative step time (min)")
    for ax in (ax_step, ax_time):
        ax.set_ylabel("mean train reward")
        ax.grid(alpha=0.3)
    ax_step.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))


def settings_dict(s: Settings) -> dict:
    d = asdict(s)
    d.pop("seed")
    return d
