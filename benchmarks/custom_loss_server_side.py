"""Server-side custom losses vs the SDK's client-side two-pass path, through our server.

A DPO-style loss (one chosen and one rejected completion packed per datum, reference logprobs
from the initial policy as inputs) is created with `ServiceClient.create_custom_loss`. One
LoRA model trains with the uploaded handle (the server rebuilds the graph and runs it in ONE
forward/backward pass); a second LoRA model with the same seed trains with the same handle
without its loss id, which the SDK runs client-side: a forward pass for the logprobs, the loss
and its gradient on the client, then a cross_entropy forward/backward with the gradient as
weights. Steps alternate between the two after one warm-up step each. Reported: the time of
`forward_backward_custom` (and of the whole step with `optim_step`), the losses of both sides
step by step, and how far apart their logprobs are after the last step.

Usage:  python benchmarks/custom_loss_server_side.py [--steps 5] [--pairs 8] [--tokens 48]
Writes JSON (default benchmarks/results/custom_loss_server_side.json) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch.nn.functional as F
from _machine import describe, machine_info, resolve_dtype
from _server import start_server
from tinker import types

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "tml-benchmark"


def dpo_loss(logprobs, ref_logprobs, chosen_mask, rejected_mask, beta):
    delta = logprobs - ref_logprobs
    margin = (delta * chosen_mask).sum() - (delta * rejected_mask).sum()
    loss = -F.logsigmoid(beta * margin)
    return loss, {
        "custom/margin:mean": margin.detach(),
        "custom/accuracy:mean": (margin > 0).float(),
    }


RANKS = {"logprobs": 1, "ref_logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "beta": 0}


def packed_pairs(args) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """(tokens, chosen mask, rejected mask): prompt + chosen + prompt + rejected."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(args.pairs):
        prompt, chosen, rejected = (
            rng.integers(100, 20000, size=args.tokens).tolist() for _ in range(3)
        )
        tokens = prompt + chosen + prompt + rejected
        n, p, c = len(tokens) - 1, len(prompt), len(chosen)
        chosen_mask, rejected_mask = np.zeros(n, np.float32), np.zeros(n, np.float32)
        chosen_mask[p - 1 : p - 1 + c] = 1
        rejected_mask[2 * p + c - 1 :] = 1
        out.append((tokens, chosen_mask, rejected_mask))
    return out


def ce_data(pairs) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)},
        )
        for tokens, _, _ in pairs
    ]


def dpo_data(pairs, reference: types.ForwardBackwardOutput, beta: float) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": tokens[1:],
                "ref_logprobs": ref["logprobs"].to_numpy().astype(np.float32),
                "chosen_mask": chosen_mask,
                "rejected_mask": rejected_mask,
                "beta": np.array(beta, dtype=np.float32),
            },
        )
        for (tokens, chosen_mask, rejected_mask), ref in zip(
            pairs, reference.loss_fn_outputs, strict=True
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48, help="prompt/chosen/rejected length")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--out", default="benchmarks/results/custom_loss_server_side.json")
    args = parser.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    import tinker

    pairs = packed_pairs(args)
    adam = types.AdamParams(learning_rate=args.lr)
    samples: dict[str, list[dict]] = {"server_side": [], "client_side": []}
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(MODEL, args.port, f"{tmp}/server", "--dtype", args.dtype)
        try:
            service = tinker.ServiceClient(
                base_url=f"http://127.0.0.1:{args.port}", api_key=API_KEY
            )
            assert service.holder.get_client_config().custom_loss_server_side
            handle = service.create_custom_loss(dpo_loss, RANKS).result()
            handles = {
                "server_side": handle,
                "client_side": dataclasses.replace(handle, loss_id=None),
            }
            clients = {
                name: service.create_lora_training_client(
                    MODEL, rank=args.lora_rank, seed=0
                ).result()
                for name in handles
            }
            reference = clients["server_side"].forward(ce_data(pairs), "cross_entropy").result()
            data = dpo_data(pairs, reference, args.beta)
            for step in range(args.steps + 1):  # step 0 warms up: not counted
                for name, tc in clients.items():
                    start = time.perf_counter()
                    out = tc.forward_backward_custom(data, handles[name]).result()
                    fb = time.perf_counter() - start
                    tc.optim_step(adam).result()
                    row = {
                        "forward_backward_custom_s": fb,
                        "step_s": time.perf_counter() - start,
                        "loss": out.metrics["loss:sum"],
                        "margin": out.metrics["custom/margin:mean"],
                    }
                    print(
                        f"step {step} {name:>11}: {fb:.3f} s  loss {row['loss']:.6f}  margin {row['margin']:.4f}",
                        flush=True,
                    )
                    if step > 0:
                        samples[name].append(row)
            after = {
                name: [o["logprobs"].to_numpy() for o in tc.forward(ce_data(pairs), "cross_entropy").result().loss_fn_outputs]
                for name, tc in clients.items()
            }  # fmt: skip
        finally:
            server.terminate()
            server.wait(60)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in samples[name])

    keys = ["forward_backward_custom_s", "step_s"]
    summary = {name: {key: median(name, key) for key in keys} for name in samples}
    ratio = (
        summary["client_side"]["forward_backward_custom_s"]
        / summary["server_side"]["forward_backward_custom_s"]
    )
    loss_diff = max(
        abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12)
        for a, b in zip(samples["server_side"], samples["client_side"], strict=True)
    )
    logprob_diff = max(
        float(np.abs(a - b).max())
        for a, b in zip(after["server_side"], after["client_side"], strict=True)
    )
    info = machine_info(
        server_side=resolve_dtype(args.dtype), client_side=resolve_dtype(args.dtype)
    )
    results = {
        "benchmark": "custom_loss_server_side",
        "date": str(date.today()),
        "machine": info,
        "model": MODEL,
        "settings": vars(args),
        "datum_tokens": len(pairs[0][0]) - 1,
        "steps": samples,
        "median": summary,
        "client_side_over_server_side": ratio,
        "max_relative_loss_difference": loss_diff,
        "max_abs_logprob_difference_after": logprob_diff,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\n{describe(info)}")
    print(f"{MODEL}, LoRA r{args.lora_rank}, {args.pairs} pairs x {results['datum_tokens']} tokens")
    print(f"{'median seconds':<16}" + "".join(f"{k:>28}" for k in keys))
    for name, row in summary.items():
        print(f"{name:<16}" + "".join(f"{row[k]:>28.3f}" for k in keys))
    print(f"\nclient-side two-pass / server-side, forward_backward_custom: {ratio:.2f}x")
    print(f"max relative loss difference per step: {loss_diff:.2e}")
    print(f"max |logprob difference| after {args.steps + 1} steps: {logprob_diff:.2e}")
    print(f"(written to {args.out})")


if __name__ == "__main__":
    main()
