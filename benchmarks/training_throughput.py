"""Training throughput: our in-process backend vs a plain PyTorch/transformers training step.

Both sides train the same model on identical data with the same dtype, optimizer and
micro-batch size in tokens, one `forward_backward` + `optim_step` per step:
- ours: `TrainingClient.forward_backward(datums, "cross_entropy")` + `optim_step` (length-
  bucketed micro-batches under a token budget);
- plain: a hand-written loop (`model(input_ids, attention_mask)`, log-softmax, sum of
  target log-probs, `backward`, AdamW) that pads every sequence to the batch's longest, the
  floor a user gets from transformers without a framework.

Batches: `equal` (32 x 256 tokens) and `variable` (32 lengths uniform in 32..512).
Usage:  python benchmarks/training_throughput.py [--mode lora|full] [--steps 3] [--out FILE]
Writes JSON (default benchmarks/results/training_throughput.json) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from contextlib import nullcontext
from datetime import date
from pathlib import Path

import numpy as np
import torch
from _machine import DTYPE_CHOICES, DTYPE_HELP, machine_info, resolve_dtype
from tinker import types

from skyrl_trainer.backend.clients import ServiceClient
from skyrl_trainer.backend.compute_dtype import parse_dtype
from skyrl_trainer.backend.config import BackendConfig, TrainingConfig
from skyrl_trainer.backend.lora import LORA_ALPHA
from skyrl_trainer.backend.model_loading import load_causal_lm, resolve_model_dir

MODEL = "SmolLM2-135M-Instruct"
ADAM = types.AdamParams(learning_rate=1e-5)


def make_batch(kind: str, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = [256] * 32 if kind == "equal" else rng.integers(32, 513, size=32).tolist()
    # +1: a sequence of n+1 tokens gives n (input, target) pairs.
    return [rng.integers(0, vocab, size=n + 1) for n in lengths]


def to_datums(sequences: list[np.ndarray]) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
            loss_fn_inputs={
                "target_tokens": seq[1:].astype(np.int64),
                "weights": np.ones(len(seq) - 1, np.float32),
            },
        )
        for seq in sequences
    ]


def time_interleaved(steps_by_side: dict, steps: int, warmup: int) -> dict[str, list[float]]:
    """Alternate the sides step by step, so background load hits both alike."""
    for step in steps_by_side.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {side: [] for side in steps_by_side}
    for _ in range(steps):
        for side, step in steps_by_side.items():
            start = time.perf_counter()
            step()
            times[side].append(time.perf_counter() - start)
    return times


# ----- ours ---------------------------------------------------------------------------------


def ours_step_fn(mode: str, dtype: str, budget: int, sequences):
    storage = tempfile.mkdtemp(prefix="bench-storage-")
    # micro_batch_tokens counts bf16-sized activations: this runs `budget` tokens, as the plain loop.
    tokens = budget * parse_dtype(dtype).itemsize // 2
    config = BackendConfig(
        storage_dir=storage, training=TrainingConfig(dtype=dtype, micro_batch_tokens=tokens)
    )
    service = ServiceClient(config)
    if mode == "lora":
        client = service.create_lora_training_client(MODEL, rank=32, seed=0).result()
    else:
        client = service.create_full_training_client(MODEL).result()
    datums = to_datums(sequences)

    def step():
        fwd_bwd = client.forward_backward(datums, "cross_entropy")
        optim = client.optim_step(ADAM)
        fwd_bwd.result()
        optim.result()

    return step


# ----- plain loop ---------------------------------------------------------------------------


def plain_step_fn(mode: str, dtype: str, budget: int, sequences):
    compute_dtype = parse_dtype(dtype)
    model_dir = resolve_model_dir(MODEL)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = load_causal_lm(model_dir, compute_dtype)
        torch.manual_seed(0)
        model = get_peft_model(
            model,
            LoraConfig(
                r=32,
                lora_alpha=LORA_ALPHA,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
                + ["down_proj", "lm_head"],
            ),
        )
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in model.modules():  # as in ours: no float32 input copies under autocast
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = False
    else:
        model = load_causal_lm(model_dir, torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(0.9, 0.95), eps=1e-12)
    autocast = (
        torch.autocast("cpu", dtype=compute_dtype)
        if compute_dtype != torch.float32
        else nullcontext()
    )
    longest = max(len(s) - 1 for s in sequences)
    rows_per_micro_batch = max(1, budget // longest)
    input_ids = torch.zeros((len(sequences), longest), dtype=torch.long)
    targets = torch.zeros_like(input_ids)
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        n = len(seq) - 1
        input_ids[row, :n] = torch.from_numpy(seq[:-1])
        targets[row, :n] = torch.from_numpy(seq[1:])
        mask[row, :n] = True

    def step():
        for start in range(0, len(sequences), rows_per_micro_batch):
            rows = slice(start, start + rows_per_micro_batch)
            with autocast:
                logits = model(input_ids=input_ids[rows], attention_mask=mask[rows].long()).logits
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            target_lp = logprobs.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
            loss = -(target_lp * mask[rows]).sum()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["lora", "full"], default="lora")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    parser.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batches", default="equal,variable")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)  # both sides

    vocab = 49152
    rows = []
    for kind in args.batches.split(","):
        sequences = make_batch(kind, vocab)
        tokens = sum(len(s) - 1 for s in sequences)
        result = {"batch": kind, "tokens_per_step": tokens}
        step_fns = {
            "plain": plain_step_fn(args.mode, args.dtype, args.budget, sequences),
            "ours": ours_step_fn(args.mode, args.dtype, args.budget, sequences),
        }
        times = time_interleaved(step_fns, args.steps, args.warmup)
        for side, side_times in times.items():
            median = statistics.median(side_times)
            result[side] = {
                "step_s": side_times,
                "median_step_s": median,
                "tokens_per_s": tokens / median,
            }
            print(f"  {kind:8s} {side:5s} median {median:6.2f} s  {tokens / median:7.0f} tok/s")
        del step_fns
        gc.collect()  # free this batch's models before the next
        result["speedup"] = result["ours"]["tokens_per_s"] / result["plain"]["tokens_per_s"]
        rows.append(result)

    print(f"\nmode={args.mode} dtype={args.dtype} budget={args.budget} steps={args.steps}")
    print(f"{'batch':10s}{'tokens':>8s}{'plain tok/s':>13s}{'ours tok/s':>12s}{'ours/plain':>12s}")
    for r in rows:
        print(
            f"{r['batch']:10s}{r['tokens_per_step']:8d}{r['plain']['tokens_per_s']:13.0f}"
            f"{r['ours']['tokens_per_s']:12.0f}{r['speedup']:12.2f}"
        )
    out = Path(args.out or f"benchmarks/results/training_throughput_{args.mode}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "training_throughput",
        "date": date.today().isoformat(),
        "machine": machine_info(plain=args.dtype, ours=args.dtype),
        "args": vars(args),
        "results": rows,
    }
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
