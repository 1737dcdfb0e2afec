"""Prefix reuse in the PyTorch sampling engine: multi-turn continuations with and without it.

The workload is a token-in-token-out multi-turn rollout: `--conversations` chat-templated prompts
(a system message and a user question, ~80 tokens), each run for `--turns` turns; turn k+1's prompt
is turn k's prompt + its `--new-tokens` sampled tokens + an observation (a templated user message,
~20 tokens). All conversations of a turn are submitted at once; turns follow one another. Sampling
at temperature 1 with fixed seeds, no stop tokens, so both sides generate exactly the same count.

Two `TorchSamplingEngine`s on SmolLM2-135M-Instruct, one after the other in this process, each
after a short warm-up: `prefix_cache_tokens=0` (every prompt prefilled in full) and the default
store (each turn starts from the KV the previous turn left). Reported per side: wall time, prompt
tokens prefilled vs taken from the store, tokens/s, and for the store its size and bytes per token;
and whether both sides sampled the same tokens (float32: they should, up to rare near-ties).

Usage:  python benchmarks/prefix_reuse.py [--conversations 32] [--turns 4] [--new-tokens 8]
Writes JSON (default benchmarks/results/prefix_reuse_<cpu capability>.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from datetime import date
from pathlib import Path

import torch
from _machine import DTYPE_CHOICES, DTYPE_HELP, describe, machine_info, resolve_dtype

from skyrl_trainer.backend.model_loading import load_tokenizer, resolve_model_dir
from skyrl_trainer.backend.sampling.engine import GenerationParams, GenerationRequest
from skyrl_trainer.backend.sampling.torch_engine import TorchSamplingEngine

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = (
    "You are playing a number guessing game. The secret number is an integer between 1 and "
    "1000. After each guess you will be told whether the secret is higher or lower. Answer "
    "with a single number and nothing else; use as few guesses as you can."
)
FEEDBACK = ["Higher. Guess again.", "Lower. Guess again.", "Much higher. Try again.", "Lower."]


def chat_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def make_prompts(tokenizer, n: int) -> list[tuple[int, ...]]:
    return [
        tuple(
            chat_ids(
                tokenizer,
                [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Game {i}: make your first guess."},
                ],
                add_generation_prompt=True,
            )
        )
        for i in range(n)
    ]


def observation(tokenizer, turn: int) -> tuple[int, ...]:
    """The tokens an environment appends after a turn: end of the assistant message, a user
    message, the start of the next assistant message (in ChatML, as the chat template has it)."""
    text = (
        "<|im_end|>\n<|im_start|>user\n"
        + FEEDBACK[turn % len(FEEDBACK)]
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def converse(engine, prompts, turns, new_tokens, observations) -> dict:
    """All conversations, turn by turn; returns the per-turn times and everything sampled."""
    current = list(prompts)
    turn_s, sampled = [], []
    store_peak = 0
    for turn in range(turns):
        started = time.perf_counter()
        futures = [
            engine.generate(
                GenerationRequest(
                    p,
                    1,
                    GenerationParams(max_tokens=new_tokens, temperature=1.0, seed=1000 * turn + i),
                )
            )
            for i, p in enumerate(current)
        ]
        seqs = [f.result().sequences[0] for f in futures]
        turn_s.append(time.perf_counter() - started)
        sampled.append([(s.tokens, s.logprobs) for s in seqs])
        current = [p + tuple(s.tokens) + observations[turn] for p, s in zip(current, seqs)]
        if engine.prefix_store is not None:
            store_peak = max(store_peak, engine.prefix_store.nbytes)
    return {
        "turn_s": turn_s,
        "sampled": sampled,
        "final_prompt_tokens": [len(p) for p in current],
        "store_peak_bytes": store_peak,
    }


def run_side(model_dir, dtype, prefix_cache_tokens, prompts, args, observations) -> dict:
    engine = TorchSamplingEngine(model_dir, dtype=dtype, prefix_cache_tokens=prefix_cache_tokens)
    try:
        # Warm-up: two short turns of other conversations (store emptied afterwards).
        converse(engine, [p[:-1] for p in prompts[:4]], 2, 2, observations)
        if engine.prefix_store is not None:
            engine.prefix_store.clear()
        before = dict(vars(engine.stats))
        started = time.perf_counter()
        out = converse(engine, prompts, args.turns, args.new_tokens, observations)
        wall = time.perf_counter() - started
        after = vars(engine.stats)
        delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
        prompt_tokens = delta["prompt_tokens"]
        hit = delta["prefix_hit_tokens"]
        generated = delta["generated_tokens"]
        layers, kv_heads, head_dim = engine.runner.cache_dims
        bytes_per_token = layers * 2 * kv_heads * head_dim * torch.finfo(engine.dtype).bits // 8
        store = engine.prefix_store
        side = {
            "prefix_cache_tokens": prefix_cache_tokens,
            "wall_s": wall,
            "turn_s": out["turn_s"],
            "prompt_tokens": prompt_tokens,
            "prefilled_tokens": prompt_tokens - hit,
            "prefix_hit_tokens": hit,
            "hit_rate": hit / prompt_tokens if prompt_tokens else 0.0,
            "generated_tokens": generated,
            "prefill_forwards": delta["prefill_forwards"],
            "decode_forwards": delta["decode_forwards"],
            "generated_tok_per_s": generated / wall,
            "prompt_and_generated_tok_per_s": (prompt_tokens + generated) / wall,
            "kv_bytes_per_token": bytes_per_token,
            "store_entries": len(store) if store is not None else 0,
            "store_tokens": store.tokens if store is not None else 0,
            "store_bytes": store.nbytes if store is not None else 0,
            "store_peak_bytes": out["store_peak_bytes"],
            "final_prompt_tokens_mean": sum(out["final_prompt_tokens"])
            / len(out["final_prompt_tokens"]),
        }
        return {"side": side, "sampled": out["sampled"]}
    finally:
        engine.shutdown()


def compare(a, b) -> dict:
    """How far the two sides' samples agree (turn by turn, conversation by conversation)."""
    same_convs = 0
    max_diff = 0.0
    convs = len(a[0])
    for c in range(convs):
        identical = True
        for turn_a, turn_b in zip(a, b):
            (tok_a, lp_a), (tok_b, lp_b) = turn_a[c], turn_b[c]
            if tok_a != tok_b:
                identical = False
                break  # the conversations diverge from here
            max_diff = max([max_diff, *(abs(x - y) for x, y in zip(lp_a, lp_b))])
        same_convs += identical
    return {
        "identical_conversations": same_convs,
        "conversations": convs,
        "max_abs_logprob_diff_while_identical": max_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prefix-cache-tokens", type=int, default=65536)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help=DTYPE_HELP)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    model_dir = resolve_model_dir(MODEL)
    tokenizer = load_tokenizer(model_dir)
    dtype = resolve_dtype(args.dtype, "cpu" if not torch.cuda.is_available() else None)
    prompts = make_prompts(tokenizer, args.conversations)
    observations = [observation(tokenizer, t) for t in range(args.turns)]
    machine = machine_info(engine=dtype)

    plain = run_side(model_dir, dtype, 0, prompts, args, observations)
    reuse = run_side(model_dir, dtype, args.prefix_cache_tokens, prompts, args, observations)
    agreement = compare(plain["sampled"], reuse["sampled"])
    sides = {"no_reuse": plain["side"], "reuse": reuse["side"]}
    record = {
        "benchmark": "prefix_reuse",
        "date": date.today().isoformat(),
        "model": MODEL,
        "machine": machine,
        "workload": {
            "conversations": args.conversations,
            "turns": args.turns,
            "new_tokens_per_turn": args.new_tokens,
            "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
            "observation_tokens": [len(o) for o in observations],
            "temperature": 1.0,
        },
        "sides": sides,
        "speedup_wall": plain["side"]["wall_s"] / reuse["side"]["wall_s"],
        "agreement": agreement,
    }
    suffix = machine["cpu_capability"].lower() + ("" if dtype == "float32" else f"_{dtype}")
    out = Path(args.out or Path(__file__).parent / "results" / f"prefix_reuse_{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")

    print(describe(machine))
    w = record["workload"]
    print(
        f"{w['conversations']} conversations x {w['turns']} turns, {w['new_tokens_per_turn']} new "
        f"tokens/turn, prompt {w['prompt_tokens_mean']:.0f} tokens, observations "
        f"{w['observation_tokens'][0]} tokens"
    )
    header = (
        f"{'side':<9} {'wall s':>7} {'prompt':>7} {'prefilled':>9} {'hit %':>6} "
        f"{'gen tok/s':>9} {'all tok/s':>9} {'store MiB':>9}"
    )
    print(header)
    for name, s in sides.items():
        print(
            f"{name:<9} {s['wall_s']:>7.2f} {s['prompt_tokens']:>7} {s['prefilled_tokens']:>9} "
            f"{100 * s['hit_rate']:>6.1f} {s['generated_tok_per_s']:>9.1f} "
            f"{s['prompt_and_generated_tok_per_s']:>9.1f} {s['store_peak_bytes'] / 2**20:>9.1f}"
        )
    print(
        f"speedup {record['speedup_wall']:.2f}x; per-turn s no reuse "
        f"{[round(t, 2) for t in plain['side']['turn_s']]}, reuse "
        f"{[round(t, 2) for t in reuse['side']['turn_s']]}; identical conversations "
        f"{agreement['identical_conversations']}/{agreement['conversations']} (max |d logprob| "
        f"{agreement['max_abs_logprob_diff_while_identical']:.1e}); KV "
        f"{reuse['side']['kv_bytes_per_token'] / 1024:.0f} KiB/token"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
