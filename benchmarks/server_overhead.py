"""The HTTP server's overhead: one RL step through the official SDK -> `skyrl_trainer.server`
vs the same step through the in-process clients, side by side, same data and seeds.

One RL step (as the trainer does it): weight sync (`save_weights_and_get_sampling_client`),
`sample` for every prompt (all in flight at once), datums from the samples,
`forward_backward(importance_sampling)` + `optim_step` submitted together. Steps alternate
between the two sides, after one warm-up step each, so drift hits both alike.

Usage:  python benchmarks/server_overhead.py [--steps 3] [--prompts 8] [--group 4] [--max-tokens 32]
Writes JSON (default benchmarks/results/server_overhead.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
from _machine import machine_info, resolve_dtype
from _server import start_server
from tinker import types

from skyrl_trainer.backend.clients import ServiceClient
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "tml-benchmark"
QUESTIONS = [
    "What is 17 + 25?", "Name a prime number above 50.", "What is 9 times 7?",
    "Spell 'cat' backwards.", "What is 100 minus 37?", "Give a word that rhymes with 'tree'.",
    "What is half of 86?", "Count from 1 to 5.", "What is 12 squared?", "What is 3 + 4 * 2?",
]  # fmt: skip


def rl_step(tc, tokenizer, args, step: int) -> dict:
    """One synchronous RL step; returns the seconds spent in each phase."""
    times = {}
    start = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client().result()
    times["weight_sync_s"] = time.perf_counter() - start

    t = time.perf_counter()
    prompts = []
    for i in range(args.prompts):
        question = QUESTIONS[(step * args.prompts + i) % len(QUESTIONS)]
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(p),
            args.group,
            types.SamplingParams(**params.model_dump(exclude={"seed"}), seed=1000 * step + i),
        )
        for i, p in enumerate(prompts)
    ]
    responses = [f.result() for f in futures]
    times["sample_s"] = time.perf_counter() - t

    datums = []
    for prompt, response in zip(prompts, responses, strict=True):
        rewards = np.array([len(set(s.tokens)) / len(s.tokens) for s in response.sequences])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for seq, adv in zip(response.sequences, advantages, strict=True):
            tokens = prompt + seq.tokens
            n = len(tokens) - 1
            logprobs = [0.0] * (len(prompt) - 1) + list(seq.logprobs)
            mask = [0.0] * (len(prompt) - 1) + [1.0] * len(seq.tokens)
            datums.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": logprobs,
                        "advantages": [float(adv) * m / n for m in mask],
                    },
                )
            )
    t = time.perf_counter()
    fb = tc.forward_backward(datums, "importance_sampling")
    optim = tc.optim_step(types.AdamParams(learning_rate=1e-5))
    fb.result()
    optim.result()
    times["train_s"] = time.perf_counter() - t
    times["step_s"] = time.perf_counter() - start
    times["sampled_tokens"] = sum(len(s.tokens) for r in responses for s in r.sequences)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--port", type=int, default=8787)
    parser.add_argument("--out", default="benchmarks/results/server_overhead.json")
    args = parser.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    import tinker

    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(MODEL, args.port, f"{tmp}/server")
        try:
            remote = tinker.ServiceClient(base_url=f"http://127.0.0.1:{args.port}", api_key=API_KEY)
            local = ServiceClient(
                BackendConfig(
                    storage_dir=f"{tmp}/local",
                    training=TrainingConfig(),
                    sampling=SamplingConfig(engine="torch"),
                )
            )
            clients = {
                name: service.create_lora_training_client(
                    MODEL, rank=args.lora_rank, seed=0
                ).result()
                for name, service in (("in_process", local), ("sdk_server", remote))
            }
            tokenizer = clients["in_process"].get_tokenizer()
            samples: dict[str, list[dict]] = {name: [] for name in clients}
            for step in range(args.steps + 1):  # step 0 warms up (engines start): not counted
                for name, tc in clients.items():
                    result = rl_step(tc, tokenizer, args, step)
                    print(f"step {step} {name:>10}: {result['step_s']:.2f} s", flush=True)
                    if step > 0:
                        samples[name].append(result)
            local.core.shutdown()
        finally:
            server.terminate()
            server.wait(60)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in samples[name])

    phases = ["step_s", "weight_sync_s", "sample_s", "train_s"]
    summary = {name: {key: median(name, key) for key in phases} for name in samples}
    ratio = summary["sdk_server"]["step_s"] / summary["in_process"]["step_s"]
    results = {
        "benchmark": "server_overhead",
        "date": str(date.today()),
        # Both sides run the backend's default dtype policy.
        "machine": machine_info(
            sdk_server=resolve_dtype(TrainingConfig.dtype),
            in_process=resolve_dtype(TrainingConfig.dtype),
        ),
        "model": MODEL,
        "settings": vars(args),
        "steps": samples,
        "median": summary,
        "overhead_ratio": ratio,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\n{'median seconds':<16}" + "".join(f"{p:>15}" for p in phases))
    for name, row in summary.items():
        print(f"{name:<16}" + "".join(f"{row[p]:>15.2f}" for p in phases))
    print(f"\nSDK -> server / in-process, whole step: {ratio:.3f}x  (written to {args.out})")


if __name__ == "__main__":
    main()
