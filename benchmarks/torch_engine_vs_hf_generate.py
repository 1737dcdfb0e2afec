"""Sampling throughput: our TorchSamplingEngine vs transformers `model.generate`.

Both sides sample the same chat-templated GSM8K questions with the same model and dtype,
at temperature 1.0 with no top-k/top-p, up to `--max-new-tokens` new tokens, stopping at eos:
- ours: all prompts submitted at once to `TorchSamplingEngine.generate` (dynamic batching,
  preallocated slot KV cache, finished rows leave the batch);
- HF: one `model.generate(do_sample=True, ...)` over the whole batch, left-padded,
  `pad_token_id=eos` (DynamicCache; finished rows keep computing until all are done).

Generated tokens count each sequence up to and including its eos. Each side is warmed up with a
short run first, then measured once, in the same process, one after the other.
Usage:  python benchmarks/torch_engine_vs_hf_generate.py [--dataset test.jsonl] [--num-prompts 64]
Writes JSON (default benchmarks/results/torch_engine_vs_hf_generate.json) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Mapping
from datetime import date
from pathlib import Path

import torch
from _machine import DTYPE_CHOICES, DTYPE_HELP, describe, machine_info, resolve_dtype

from skyrl_trainer.backend.model_loading import load_causal_lm, load_tokenizer, resolve_model_dir
from skyrl_trainer.backend.sampling.engine import GenerationParams, GenerationRequest
from skyrl_trainer.backend.sampling.torch_engine import TorchSamplingEngine

MODEL = "SmolLM2-135M-Instruct"
DEFAULT_DATASET = "/work/shared/datasets/gsm8k/test.jsonl"
DEFAULT_OUT = Path(__file__).parent / "results" / "torch_engine_vs_hf_generate.json"


def load_prompts(tokenizer, dataset: str, n: int) -> list[list[int]]:
    questions = []
    with open(dataset) as f:
        for line in f:
            if len(questions) == n:
                break
            questions.append(json.loads(line)["question"])
    prompts = []
    for q in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if isinstance(ids, Mapping) else ids))
    return prompts


def run_engine(model_dir, dtype, prompts, max_new, eos) -> dict:
    engine = TorchSamplingEngine(model_dir, dtype=dtype)
    params = GenerationParams(max_tokens=max_new, temperature=1.0, stop_token_ids=(eos,))

    def request(prompt, max_tokens=max_new):
        return GenerationRequest(
            tuple(prompt), 1, dataclasses.replace(params, max_tokens=max_tokens)
        )

    try:
        for f in [engine.generate(request(p, 4)) for p in prompts[:2]]:  # warm-up
            f.result()
        started = time.perf_counter()
        futures = [engine.generate(request(p)) for p in prompts]
        results = [f.result() for f in futures]
        seconds = time.perf_counter() - started
        lengths = [len(r.sequences[0].tokens) for r in results]
        stats = vars(engine.stats).copy()  # cumulative: includes the 2 warm-up requests
    finally:
        engine.shutdown()
    return {"seconds": seconds, "lengths": lengths, "engine_stats": stats}


def run_hf(model_dir, dtype, prompts, max_new, eos) -> dict:
    model = load_causal_lm(model_dir, dtype)
    pad = eos
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad, eos_token_id=eos
    )
    with torch.inference_mode():
        model.generate(
            input_ids=ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kwargs
        )  # warm-up
        started = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, **kwargs)
        seconds = time.perf_counter() - started
    lengths = []
    for row in out[:, width:].tolist():
        lengths.append(row.index(eos) + 1 if eos in row else len(row))
    return {"seconds": seconds, "lengths": lengths, "generated_steps": out.shape[1] - width}


def summarize(run: dict, max_new: int) -> dict:
    tokens = sum(run["lengths"])
    return {
        "generated_tokens": tokens,
        "wall_s": round(run["seconds"], 3),
        "tokens_per_s": round(tokens / run["seconds"], 1),
        "sequences_at_max_tokens": sum(n >= max_new for n in run["lengths"]),
        **{k: v for k, v in run.items() if k not in ("seconds", "lengths")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", default=DEFAULT_DATASET)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for both sides (default: torch's)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype)  # both sides

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)  # the engine's loop thread takes the same count
    model_dir = resolve_model_dir(MODEL)
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    prompts = load_prompts(tokenizer, args.dataset, args.num_prompts)
    load_before = os.getloadavg()

    sides = {}
    for name, fn in (("torch_engine", run_engine), ("hf_generate", run_hf)):
        run = fn(model_dir, dtype, prompts, args.max_new_tokens, eos)
        summary = summarize(run, args.max_new_tokens)
        sides[name] = summary
        print(f"{name}: {summary['generated_tokens']} tokens in {summary['wall_s']} s", flush=True)

    ratio = sides["torch_engine"]["tokens_per_s"] / sides["hf_generate"]["tokens_per_s"]
    result = {
        "date": date.today().isoformat(),
        "model": MODEL,
        "dtype": dtype,
        "num_prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "max_new_tokens": args.max_new_tokens,
        "sampling": "temperature 1.0, no top-k/top-p, stop at eos",
        "sides": sides,
        "speedup_tokens_per_s": round(ratio, 2),
        "machine": {
            **machine_info(torch_engine=dtype, hf_generate=dtype),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n{'side':<14}{'tokens':>8}{'wall s':>9}{'tok/s':>9}")
    for name, s in sides.items():
        print(f"{name:<14}{s['generated_tokens']:>8}{s['wall_s']:>9.2f}{s['tokens_per_s']:>9.1f}")
    print(f"speedup (tok/s): {ratio:.2f}x   -> {args.out}\n{describe(result['machine'])}")


if __name__ == "__main__":
    main()
