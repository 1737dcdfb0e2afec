"""Training scaling: 1 in-process worker vs `num_workers` Ray workers on fixed work (SmolLM2).

The same batch, `forward_backward(cross_entropy)` + `optim_step` per step, through the
in-process `ServiceClient`; only `training.num_workers` changes. With 1 worker torch uses
every core in one process; with N workers each Ray actor gets `cores / N` CPUs. Reported
per step: forward_backward seconds (each rank computes its share, no communication for LoRA;
FSDP2 all-gathers / reduce-scatters for full fine-tuning) and optim_step seconds (the LoRA
gradient all-reduce happens here), so the communication cost is visible.

Usage:  python benchmarks/training_scaling.py [--mode lora|full] [--workers 2] [--steps 3]
Writes JSON (default benchmarks/results/training_scaling_<mode>.json) and prints a table.
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
from tinker import types

from skyrl_trainer.backend.clients import ServiceClient
from skyrl_trainer.backend.config import BackendConfig, TrainingConfig

MODEL = "SmolLM2-135M-Instruct"
ADAM = types.AdamParams(learning_rate=1e-5)


def make_batch(rows: int, length: int, seed: int = 0) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    batch = []
    for _ in range(rows):
        n = int(rng.integers(length // 2, length + 1))
        tokens = rng.integers(10, 40000, n + 1).tolist()
        batch.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},
            )
        )
    return batch


def measure(num_workers: int, args, storage: str) -> dict:
    cores = os.cpu_count() or 1
    config = TrainingConfig(
        num_workers=num_workers, num_cpus_per_worker=max(1.0, cores / max(num_workers, 1))
    )
    service = ServiceClient(BackendConfig(storage_dir=storage, training=config))
    if args.mode == "lora":
        tc = service.create_lora_training_client(MODEL, rank=32, seed=0).result()
    else:
        tc = service.create_full_training_client(MODEL).result()
    batch = make_batch(args.rows, args.length)
    fb_s, optim_s, losses = [], [], []
    try:
        for step in range(args.steps + 1):  # step 0 warms up: not counted
            t = time.perf_counter()
            out = tc.forward_backward(batch, "cross_entropy").result()
            t_fb = time.perf_counter() - t
            t = time.perf_counter()
            tc.optim_step(ADAM).result()
            t_opt = time.perf_counter() - t
            print(
                f"workers={num_workers} step {step}: fb {t_fb:.2f} s, optim {t_opt:.2f} s",
                flush=True,
            )
            if step > 0:
                fb_s.append(t_fb)
                optim_s.append(t_opt)
                losses.append(out.metrics["loss:sum"])
    finally:
        service.core.shutdown()
    return {
        "num_workers": num_workers,
        "forward_backward_s": fb_s,
        "optim_step_s": optim_s,
        "loss_sum": losses,
        "median_step_s": statistics.median(a + b for a, b in zip(fb_s, optim_s, strict=True)),
        "median_forward_backward_s": statistics.median(fb_s),
        "median_optim_step_s": statistics.median(optim_s),
        "tokens_per_s": sum(len(d.model_input.to_ints()) for d in batch)
        / statistics.median(a + b for a, b in zip(fb_s, optim_s, strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["lora", "full"], default="lora")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--out")
    args = parser.parse_args()
    out = Path(args.out or f"benchmarks/results/training_scaling_{args.mode}.json")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(n, args, f"{tmp}/{n}") for n in (1, args.workers)]
    base = rows[0]["median_step_s"]
    for row in rows:
        row["speedup_vs_1"] = base / row["median_step_s"]
    # Same data and seeds: the summed loss must agree whatever the worker count.
    loss_gap = abs(rows[0]["loss_sum"][0] - rows[1]["loss_sum"][0]) / abs(rows[0]["loss_sum"][0])
    results = {
        "benchmark": "training_scaling",
        "date": str(date.today()),
        "machine": machine_info(ours=resolve_dtype(TrainingConfig.dtype)),
        "model": MODEL,
        "settings": vars(args),
        "rows": rows,
        "first_step_loss_relative_gap": loss_gap,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(
        f"\n{'workers':<8}{'step s':>10}{'fwd_bwd s':>11}{'optim s':>10}{'tok/s':>9}{'speedup':>9}"
    )
    for r in rows:
        print(
            f"{r['num_workers']:<8}{r['median_step_s']:>10.2f}{r['median_forward_backward_s']:>11.2f}"
            f"{r['median_optim_step_s']:>10.2f}{r['tokens_per_s']:>9.0f}{r['speedup_vs_1']:>8.2f}x"
        )
    print(f"first-step loss relative gap: {loss_gap:.1e}  (written to {out})")


if __name__ == "__main__":
    main()
