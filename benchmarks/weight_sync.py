"""Weight-sync latency: trainer weights -> sampling engine, in memory, on SmolLM2.

Measures `TrainingClient.save_weights_and_get_sampling_client()` after a training step, for a
LoRA model (rank 32, all layers: the adapter is written to a memory-backed folder and read
by the shared base engine, which merges it into a weight copy at its first forward) and for full fine-tuning (all 135M parameters copied in place
into the model's own engine), and the first sample on the new weights (proof it serves them).

Usage:  python benchmarks/weight_sync.py [--repeats 3] [--engine torch] [--out FILE]
Writes JSON (default benchmarks/results/weight_sync.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

from _machine import DTYPE_CHOICES, DTYPE_HELP, machine_info, resolve_dtype
from tinker import types

from skyrl_trainer.backend.clients import ServiceClient
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig

MODEL = "SmolLM2-135M-Instruct"


def one_step(client, tokenizer) -> None:
    ids = tokenizer.encode("Weight sync should be fast and exact.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    client.forward_backward([datum], "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=1e-4)).result()


def measure(client, repeats: int) -> dict:
    tokenizer = client.get_tokenizer()
    prompt = types.ModelInput.from_ints(tokenizer.encode("The weights are"))
    sync_s, first_sample_s = [], []
    for _ in range(repeats + 1):  # the first round also starts the engine: not counted
        one_step(client, tokenizer)
        start = time.perf_counter()
        sampler = client.save_weights_and_get_sampling_client().result()
        synced = time.perf_counter()
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, temperature=0)).result()
        sync_s.append(synced - start)
        first_sample_s.append(time.perf_counter() - synced)
    return {
        "sync_s": sync_s[1:],
        "median_sync_s": statistics.median(sync_s[1:]),
        "first_sample_s": first_sample_s[1:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", default="torch")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    parser.add_argument("--out", default="benchmarks/results/weight_sync.json")
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)

    config = BackendConfig(
        storage_dir=tempfile.mkdtemp(prefix="bench-storage-"),
        training=TrainingConfig(dtype=args.dtype),
        sampling=SamplingConfig(engine=args.engine, dtype=args.dtype),
    )
    service = ServiceClient(config)
    results = {}
    lora = service.create_lora_training_client(MODEL, rank=32, seed=0).result()
    results["lora_r32"] = measure(lora, args.repeats)
    full = service.create_full_training_client(MODEL).result()
    results["full"] = measure(full, args.repeats)
    service.core.shutdown()

    print(f"\n{'weights':10s}{'median sync s':>15s}{'first sample s':>16s}")
    for name, r in results.items():
        print(f"{name:10s}{r['median_sync_s']:15.3f}{statistics.median(r['first_sample_s']):16.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "weight_sync",
        "date": date.today().isoformat(),
        "machine": machine_info(ours=args.dtype),
        "engine": args.engine,
        "results": results,
    }
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
