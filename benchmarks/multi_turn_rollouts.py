"""Multi-turn rollout throughput: every trajectory's turns in flight at once (the trainer's
`EnvRollouts`) versus one trajectory at a time, on the same engine and the same environments.

Both sides run the same code path; "one at a time" rolls out each trajectory alone (a group of
one, problem after problem), which is what a rollout loop without concurrency does. Reports
trajectories/s, sampled tokens/s, the speedup, and the share of wall time that environment calls
took (they overlap with sampling when all trajectories are in flight).

Usage:  python benchmarks/multi_turn_rollouts.py [--env guess_number] [--trajectories 32]
Writes JSON (default benchmarks/results/multi_turn_rollouts_<env>.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _machine import DTYPE_CHOICES, DTYPE_HELP, describe, machine_info, resolve_dtype
from tinker import types

from skyrl_trainer.backend.clients import ServiceClient
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig
from skyrl_trainer.backend.model_loading import load_tokenizer, resolve_model_dir
from skyrl_trainer.data.tasks import GENERATED_ROWS, TaskConfig, build_problems
from skyrl_trainer.envs.guarded import GuardedEnvCalls
from skyrl_trainer.trainer.rollouts import EnvRollouts, EnvSpec

RESULTS = Path(__file__).parent / "results"
DATA_FORMAT = {"guess_number": "guess_number", "python_tool": "arithmetic"}


def summarize(groups, seconds: float) -> dict:
    rollouts = [r for g in groups for r in g.rollouts]
    turns = [t for r in rollouts for t in r.turns]
    sampled = sum(t.action_tokens for t in turns)
    env_s = sum(t.env_seconds for t in turns)
    return {
        "seconds": seconds,
        "trajectories": len(rollouts),
        "turns": len(turns),
        "sampled_tokens": sampled,
        "trajectories_per_s": len(rollouts) / seconds,
        "tokens_per_s": sampled / seconds,
        "env_seconds": env_s,
        "env_share": env_s / seconds,
        "mean_reward": sum(r.reward for r in rollouts) / len(rollouts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--env", default="guess_number", choices=sorted(DATA_FORMAT))
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype)
    out = args.out or RESULTS / f"multi_turn_rollouts_{args.env}.json"

    service = ServiceClient(
        BackendConfig(
            storage_dir="/tmp/multi_turn_rollouts_storage",
            sampling=SamplingConfig(engine="torch", dtype=dtype),
        )
    )
    sampler = service.create_sampling_client(base_model=args.model).result()
    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    fmt = DATA_FORMAT[args.env]
    problems = build_problems(
        GENERATED_ROWS[fmt](args.trajectories // args.group_size, 0),
        TaskConfig(format=fmt, instruction="" if args.env == "python_tool" else None),
    )
    spec = EnvSpec(args.env, {}, args.max_turns, 2048)
    rollouts = EnvRollouts(spec, tokenizer, GuardedEnvCalls(32, 30.0))
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    seeds = list(range(len(problems)))

    rollouts.run(sampler, problems[:1], 2, params, [99])  # warm-up (engine start, first forward)
    t0 = time.monotonic()
    together = rollouts.run(sampler, problems, args.group_size, params, seeds)
    concurrent = summarize(together, time.monotonic() - t0)
    t0 = time.monotonic()
    alone = [
        rollouts.run(sampler, [problem], 1, params, [seed * 1000 + j])[0]
        for problem, seed in zip(problems, seeds, strict=True)
        for j in range(args.group_size)
    ]
    sequential = summarize(alone, time.monotonic() - t0)
    ratio = concurrent["trajectories_per_s"] / sequential["trajectories_per_s"]

    result = {
        "benchmark": "multi_turn_rollouts",
        "env": args.env,
        "settings": vars(args) | {"out": str(out)},
        "all_in_flight": concurrent,
        "one_at_a_time": sequential,
        "speedup_trajectories_per_s": ratio,
        "machine": machine_info(torch_engine=dtype),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'':16} {'traj/s':>8} {'tok/s':>8} {'turns':>6} {'env share':>10} {'wall s':>8}")
    for name, r in (("all in flight", concurrent), ("one at a time", sequential)):
        print(
            f"{name:16} {r['trajectories_per_s']:8.2f} {r['tokens_per_s']:8.1f} "
            f"{r['turns']:6d} {r['env_share']:10.1%} {r['seconds']:8.1f}"
        )
    print(f"speedup (trajectories/s): {ratio:.2f}x   -> {out}\n{describe(result['machine'])}")
    service.core.shutdown()


if __name__ == "__main__":
    main()
