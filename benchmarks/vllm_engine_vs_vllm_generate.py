"""Sampling throughput: our SamplingClient on the vLLM engine vs raw `vllm.LLM.generate`.

Both sides run vLLM in this process with the same settings (SmolLM2-135M-Instruct, `--dtype`,
eager mode, the "uni" executor, the same KV-cache size and batch limit, per-token log-probs of the
sampled tokens) and sample the same chat-templated GSM8K questions at temperature 1.0, one seed
per prompt, exactly `--max-new-tokens` tokens each (no stop condition):
- ours: every prompt sent at once through `SamplingClient.sample` (Tinker types in and out,
  the backend's futures, the engine thread's continuous batching);
- raw: one `LLM.generate` call over all prompts.

Each side is warmed up, then the two alternate for `--rounds` rounds; the table reports medians.
Usage:  python benchmarks/vllm_engine_vs_vllm_generate.py [--dataset test.jsonl] [--num-prompts 64]
Writes JSON (default benchmarks/results/vllm_engine_vs_vllm_generate.json) and prints a table.
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

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # both sides in this process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from _machine import DTYPE_CHOICES, DTYPE_HELP, machine_info, resolve_dtype  # noqa: E402
from tinker import types  # noqa: E402

from skyrl_trainer.backend.clients import ServiceClient  # noqa: E402
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig  # noqa: E402
from skyrl_trainer.backend.model_loading import resolve_model_dir  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
DEFAULT_DATASET = Path(__file__).resolve().parents[2] / "shared/datasets/gsm8k/test.jsonl"
DEFAULT_OUT = Path(__file__).parent / "results" / "vllm_engine_vs_vllm_generate.json"
KV_CACHE_GIB = 2.0
MAX_BATCH = 128


def load_prompts(tokenizer, dataset: Path, n: int) -> list[list[int]]:
    prompts = []
    with open(dataset) as f:
        for line in f:
            if len(prompts) == n:
                break
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": json.loads(line)["question"]}],
                add_generation_prompt=True,
                tokenize=False,
            )
            prompts.append(tokenizer.encode(text))
    return prompts


def run_ours(sampler, prompts, max_new) -> tuple[float, int]:
    start = time.perf_counter()
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(p),
            1,
            types.SamplingParams(max_tokens=max_new, temperature=1.0, seed=i, stop=[]),
        )
        for i, p in enumerate(prompts)
    ]
    tokens = sum(len(f.result().sequences[0].tokens) for f in futures)
    return time.perf_counter() - start, tokens


def run_raw(llm, prompts, max_new) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(max_tokens=max_new, temperature=1.0, seed=i, ignore_eos=True, logprobs=0)
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", type=Path, default=DEFAULT_DATASET)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype)  # both sides

    from vllm import LLM

    model_dir = resolve_model_dir(MODEL)
    service = ServiceClient(
        BackendConfig(
            storage_dir=tempfile.mkdtemp(prefix="bench-storage-"),
            sampling=SamplingConfig(
                engine="vllm", dtype=dtype, kv_cache_gib=KV_CACHE_GIB, max_batch_size=MAX_BATCH
            ),
        )
    )
    sampler = service.create_sampling_client(base_model=MODEL).result()
    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        enforce_eager=not torch.cuda.is_available(),
        distributed_executor_backend="uni",
        generation_config="vllm",
        max_num_seqs=MAX_BATCH,
        enable_chunked_prefill=torch.cuda.is_available(),  # as our engine (seeded prompts on CPU)
        kv_cache_memory_bytes=int(KV_CACHE_GIB * 2**30),
        seed=0,
    )
    prompts = load_prompts(sampler.get_tokenizer(), args.dataset, args.num_prompts)

    run_ours(sampler, prompts[:8], 8)  # warm-up
    run_raw(llm, prompts[:8], 8)
    runs: dict[str, list[float]] = {"ours": [], "raw": []}
    for round_ in range(args.rounds):
        for name, run in (("raw", run_raw), ("ours", run_ours)):
            seconds, tokens = run(llm if name == "raw" else sampler, prompts, args.max_new_tokens)
            assert tokens == len(prompts) * args.max_new_tokens, tokens
            runs[name].append(tokens / seconds)
            print(f"round {round_ + 1} {name:5s} {seconds:6.2f} s  {tokens / seconds:7.1f} tok/s")
    service.core.shutdown()

    ours, raw = statistics.median(runs["ours"]), statistics.median(runs["raw"])
    print(f"\n{'engine':34s}{'tok/s (median)':>16s}")
    print(f"{'raw vllm.LLM.generate':34s}{raw:16.1f}")
    print(f"{'SamplingClient on the vLLM engine':34s}{ours:16.1f}")
    print(f"{'ratio (ours / raw)':34s}{ours / raw:16.2f}")
    import vllm

    record = {
        "benchmark": "vllm_engine_vs_vllm_generate",
        "date": date.today().isoformat(),
        "machine": machine_info(ours=dtype, raw=dtype),
        "vllm": vllm.__version__,
        "settings": {
            "model": MODEL,
            "dtype": dtype,
            "num_prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0,
            "kv_cache_gib": KV_CACHE_GIB,
            "max_num_seqs": MAX_BATCH,
            "rounds": args.rounds,
        },
        "tokens_per_s": runs,
        "median_tokens_per_s": {"ours": ours, "raw": raw},
        "ratio": ours / raw,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
