"""Synchronous vs asynchronous RL on identical work: the multi-turn guess-the-number game
(`+recipe=guess_number_grpo`: trajectories of 1 to 5 turns, SmolLM2-135M-Instruct, LoRA r32).

Arms (each a `python -m skyrl_trainer.main` run, the way a user starts one, same seed and work):
- sync:          the default placement: one process, the engine and the learner share all cores
                 (torch threads = cores) and take turns.
- sync_split:    the engine in a Ray actor with 1 core (`sampling.engines_as_actors`), the learner
                 on 1 thread: the async arms' placement without the overlap.
- one_step_off:  sync_split + `algorithm.max_steps_off_policy=1` (deterministic: batch t sampled
                 with the weights of step t-1 while step t-1 trains).
- streaming:     sync_split + k=1, `async_mode=streaming` (groups train in the order they finish).
- one_step_off_learner_2t: one_step_off with the learner on as many threads as cores (the engine
                 actor keeps its one): oversubscribed while both run.

Per arm: step time, train tokens/s, the share of wall time the learner waits for batches and the
share the sampler has nothing in flight, reward (and games won) per step and per wall-clock
second. Then a projection for disaggregated GPUs from the measured phase times (see
`gpu_projection`). Writes JSON (benchmarks/results/async_rl.json) and prints a table.

Usage:  python benchmarks/async_rl.py [--steps 8] [--seeds 0] [--arms sync,one_step_off,...]
        python benchmarks/async_rl.py --learning-rate 0 --out benchmarks/results/async_rl_lr0.json \
            --work-dir outputs/bench_async_rl_lr0      # identical work in every arm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _machine import describe, machine_info

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"

SPLIT = [
    "backend.local.sampling.engines_as_actors=true",
    "backend.local.sampling.num_cpus_per_engine=1",
]
ARMS = {
    "sync": ([], {}),
    "sync_split": (SPLIT, {"OMP_NUM_THREADS": "1"}),
    "one_step_off": (
        SPLIT + ["algorithm.max_steps_off_policy=1", "algorithm.async_mode=deterministic"],
        {"OMP_NUM_THREADS": "1"},
    ),
    "streaming": (
        SPLIT + ["algorithm.max_steps_off_policy=1", "algorithm.async_mode=streaming"],
        {"OMP_NUM_THREADS": "1"},
    ),
    # The learner keeps both cores' threads and the engine actor its one: they overlap where
    # the sampler runs, and the learner has the machine to itself while the sampler idles.
    "one_step_off_learner_2t": (
        SPLIT + ["algorithm.max_steps_off_policy=1", "algorithm.async_mode=deterministic"],
        {},
    ),
}


def run_arm(name: str, seed: int, steps: int, out_dir: Path, extra: list[str]) -> dict:
    overrides, env = ARMS[name]
    folder = out_dir / f"{name}-seed{seed}"
    args = [
        sys.executable,
        "-m",
        "skyrl_trainer.main",
        "+recipe=guess_number_grpo",
        f"steps={steps}",
        f"seed={seed}",
        f"output_dir={folder}",
        "checkpoint.resume=never",
        "checkpoint.every=0",
        f"eval.every={steps}",  # greedy games after the last step: the same held-out secrets
        "eval.num_prompts=32",
        "eval.at_start=false",
        "logging.print_samples=0",
        "logging.progress_every_s=0",
        *overrides,
        *extra,
    ]
    started = time.monotonic()
    with open(out_dir / f"{name}-seed{seed}.log", "w") as log:
        subprocess.run(
            args, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=log, check=True
        )
    return summarize(read_metrics(folder), time.monotonic() - started)


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def summarize(steps: list[dict], wall_s: float) -> dict:
    final_eval = {k: v for k, v in steps[-1].items() if k.startswith("eval/")}
    step_s = [m["time/step_s"] - m.get("time/eval_s", 0.0) for m in steps]
    total = sum(step_s)
    if "async/learner_wait_s" in steps[0]:
        learner_wait = sum(m["async/learner_wait_s"] for m in steps)
        sampler_idle = sum(m["async/sampler_idle_s"] for m in steps)
    else:  # synchronous: the learner waits while rollouts run, the sampler while training runs
        learner_wait = sum(m["time/rollouts_s"] for m in steps)
        sampler_idle = total - learner_wait
    rewards = [m["reward/mean"] for m in steps]
    won = [m.get("env/won", float("nan")) for m in steps]
    return {
        "steps": len(steps),
        "wall_s": wall_s,
        "train_s": total,
        "step_s_mean": total / len(steps),
        # the first step has nothing to overlap with (asynchronous arms sample ahead from step 2)
        "step_s_mean_after_first": sum(step_s[1:]) / max(len(step_s) - 1, 1),
        "train_tokens_per_s": sum(m.get("train/tokens", 0) for m in steps) / total,
        "learner_wait_share": learner_wait / total,
        "sampler_idle_share": sampler_idle / total,
        "rollouts_s_mean": statistics.mean(m["time/rollouts_s"] for m in steps),
        # Steps differ in how many datums carry a gradient (zero-variance groups are not sent),
        # so the learner's cost is also given per datum trained.
        "datums_trained": sum(
            m.get("train/sequences", 0) - m.get("train/datums_without_gradient", 0) for m in steps
        ),
        "step_s_per_datum_trained": total
        / max(
            sum(
                m.get("train/sequences", 0) - m.get("train/datums_without_gradient", 0)
                for m in steps
            ),
            1,
        ),
        "train_phase_s_mean": statistics.mean(
            m.get("time/train_s", 0) + m.get("time/weight_sync_s", 0) for m in steps
        ),
        "reward_per_step": rewards,
        "won_per_step": won,
        "reward_mean": statistics.mean(rewards),
        "reward_last_half": statistics.mean(rewards[len(rewards) // 2 :]),
        "reward_per_s": sum(rewards) / total,  # area under the reward curve per second of steps
        # Streaming trains the groups that finish first (here: games won in fewer guesses), so
        # its training reward is biased upward; the greedy evaluation at the end is not.
        "final_eval": final_eval,
        "staleness_mean": statistics.mean(m.get("async/staleness_mean", 0.0) for m in steps),
        "dropped_groups": sum(m.get("async/dropped_groups", 0) for m in steps),
    }


def gpu_projection(sync: dict) -> dict:
    """Disaggregated GPUs (sampler and learner on GPUs of their own), from the synchronous arm's
    phases: S = sampling per step, T = training + weight sync per step. Assumptions: both phases
    speed up on GPUs by factors s and t; one-step-off overlaps them perfectly, so a step takes
    max(S/s, T/t) instead of S/s + T/t; weight sync stays inside T. The speed-up is then
    (rho + 1) / max(rho, 1) with rho = (S/s) / (T/t): 2x at best (rho = 1), less the more one side
    dominates. vLLM on a GPU typically speeds sampling more than training (s > t), so rho is shown
    for several s/t."""
    S, T = sync["rollouts_s_mean"], sync["train_phase_s_mean"]
    rows = []
    for relative in (0.5, 1.0, 2.0, 4.0, 8.0):  # s / t
        rho = (S / T) / relative
        rows.append(
            {
                "sampling_speedup_over_training_speedup": relative,
                "rho": rho,
                "one_step_off_speedup": (rho + 1) / max(rho, 1),
            }
        )
    return {"S_s": S, "T_s": T, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", type=Path, default=RESULTS / "async_rl.json")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="0: the weights never change, so every arm samples and trains the same work "
        "(a pure throughput comparison); default: the recipe's",
    )
    parser.add_argument(
        "--add", action="store_true", help="keep the arms already in --out, add these to them"
    )
    parser.add_argument("--work-dir", type=Path, default=ROOT / "outputs" / "bench_async_rl")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = args.arms.split(",")
    runs: dict[str, list[dict]] = {}
    if args.add and args.out.exists():  # summarised again from their metrics (same wall times)
        for arm, results in json.loads(args.out.read_text())["arms"].items():
            runs[arm] = [
                summarize(read_metrics(args.work_dir / f"{arm}-seed{seed}"), r["wall_s"])
                for seed, r in zip(seeds, results, strict=True)
            ]
    for seed in seeds:
        for arm in arms:  # interleaved, so a drift of the machine hits every arm alike
            print(f"{arm} seed {seed} ...", flush=True)
            extra = (
                []
                if args.learning_rate is None
                else [f"algorithm.learning_rate={args.learning_rate}"]
            )
            runs.setdefault(arm, []).append(run_arm(arm, seed, args.steps, args.work_dir, extra))
    result = {
        "benchmark": "async_rl",
        "recipe": "guess_number_grpo",
        "learning_rate": args.learning_rate,
        "steps": args.steps,
        "seeds": seeds,
        "arms": runs,
        "machine": machine_info(ours="auto"),
    }
    if "sync" in runs:
        result["gpu_projection"] = gpu_projection(runs["sync"][0])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    head = (
        f"{'arm':13} {'step s':>7} {'step s>1':>8} {'tok/s':>7} {'learner waits':>13} "
        f"{'sampler idle':>12} {'reward':>7} {'reward/s':>8} {'stale':>6} {'dropped':>7} "
        f"{'eval won':>8}"
    )
    print(head)
    for arm, results in runs.items():

        def mean(key, results=results):
            return statistics.mean(r[key] for r in results)

        print(
            f"{arm:13} {mean('step_s_mean'):7.1f} {mean('step_s_mean_after_first'):8.1f} "
            f"{mean('train_tokens_per_s'):7.1f} {mean('learner_wait_share'):13.0%} "
            f"{mean('sampler_idle_share'):12.0%} {mean('reward_mean'):7.3f} "
            f"{mean('reward_per_s'):8.4f} {mean('staleness_mean'):6.2f} {mean('dropped_groups'):7.0f} "
            f"{statistics.mean(r['final_eval'].get('eval/pass@1', float('nan')) for r in results):8.3f}"
        )
    if "gpu_projection" in result:
        p = result["gpu_projection"]
        print(f"GPU projection from sync phases S={p['S_s']:.1f}s T={p['T_s']:.1f}s:")
        for row in p["rows"]:
            print(
                f"  s/t={row['sampling_speedup_over_training_speedup']:<4} rho={row['rho']:.2f}"
                f"  one-step-off speed-up {row['one_step_off_speedup']:.2f}x"
            )
    print(f"-> {args.out}\n{describe(result['machine'])}")


if __name__ == "__main__":
    main()
