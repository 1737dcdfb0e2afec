"""Between the engine's records and vLLM's: sampling parameters, finished outputs, and the split of
a prompt-log-prob request into one request per sample (see `VLLMSamplingEngine._runs_alone`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import replace

from skyrl_trainer.backend.sampling.engine import (
    GeneratedSequence,
    GenerationRequest,
    GenerationResult,
)


def to_vllm_sampling_params(request: GenerationRequest):
    """vLLM `SamplingParams` for `request`: Tinker stop semantics (only the given stop tokens
    and strings end a sequence; EOS is one only when listed), the sampled tokens' log-probs, and
    prompt log-probs when asked."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    p = request.params
    prompt_logprobs = None
    if request.topk_prompt_logprobs:
        prompt_logprobs = request.topk_prompt_logprobs
    elif request.prompt_logprobs:
        prompt_logprobs = 0
    greedy = p.temperature == 0
    return SamplingParams(
        n=1 if greedy else request.num_samples,  # vLLM refuses n > 1 with greedy: see below
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=max(p.top_k, 0),  # 0 = off in vLLM
        top_p=p.top_p,
        seed=p.seed,
        ignore_eos=True,
        stop_token_ids=list(p.stop_token_ids),
        stop=list(p.stop_strings),
        include_stop_str_in_output=True,
        detokenize=bool(p.stop_strings),
        logprobs=0,  # the sampled token's log-prob, under the raw (temperature 1) distribution
        prompt_logprobs=prompt_logprobs,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def to_generation_result(request: GenerationRequest, output) -> GenerationResult:
    """A finished vLLM `RequestOutput` as a `GenerationResult`."""
    sequences = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a sequence with {completion.finish_reason!r}")
        tokens = list(completion.token_ids)
        logprobs = [float(step[t].logprob) for step, t in zip(completion.logprobs, tokens)]
        sequences.append(GeneratedSequence(tokens, logprobs, completion.finish_reason))
    if request.params.temperature == 0:
        # Greedy decoding is deterministic: the samples are copies of the one computed.
        one = sequences[0]
        sequences = [
            GeneratedSequence(list(one.tokens), list(one.logprobs), one.stop_reason)
            for _ in range(request.num_samples)
        ]
    result = GenerationResult(sequences=sequences)
    if request.prompt_logprobs or request.topk_prompt_logprobs:
        prompt = request.prompt_ids
        steps = output.prompt_logprobs
        result.prompt_logprobs = [None] + [
            float(steps[i][prompt[i]].logprob) for i in range(1, len(prompt))
        ]
        if request.topk_prompt_logprobs:
            k = request.topk_prompt_logprobs
            result.topk_prompt_logprobs = [None] + [
                [
                    (int(t), float(lp.logprob))
                    for t, lp in sorted(steps[i].items(), key=lambda kv: kv[1].rank)
                    if lp.rank <= k
                ][:k]
                for i in range(1, len(prompt))
            ]
    return result


def wants_prompt_logprobs(request: GenerationRequest) -> bool:
    return request.prompt_logprobs or request.topk_prompt_logprobs > 0


def child_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else seed + index  # as vLLM seeds the samples of one request


def combined_result(
    parts: list[Future[GenerationResult]], num_samples: int
) -> Future[GenerationResult]:
    """One future for the results of `parts` (a request split by samples), in order."""
    future: Future[GenerationResult] = Future()
    future.set_running_or_notify_cancel()
    remaining = [len(parts)]
    lock = threading.Lock()

    def on_done(_):
        with lock:
            remaining[0] -= 1
            if remaining[0] or future.done():
                return
        try:
            results = [part.result() for part in parts]
        except Exception as exc:
            future.set_exception(exc)
            return
        combined = results[0]
        combined.sequences = [seq for result in results for seq in result.sequences]
        while len(combined.sequences) < num_samples:  # greedy: copies of the one sequence
            one = combined.sequences[0]
            combined.sequences.append(
                GeneratedSequence(list(one.tokens), list(one.logprobs), one.stop_reason)
            )
        future.set_result(combined)

    for part in parts:
        part.add_done_callback(on_done)
    return future


def split_by_sample(request: GenerationRequest) -> list[GenerationRequest]:
    """One request per sample, seeded as vLLM seeds the samples of one request (seed + index);
    only the first asks for prompt log-probs. Greedy: one request (its samples are copies)."""
    p = request.params
    parts = [
        replace(
            request,
            num_samples=1,
            params=replace(p, seed=child_seed(p.seed, i)),
            prompt_logprobs=request.prompt_logprobs and i == 0,
            topk_prompt_logprobs=request.topk_prompt_logprobs if i == 0 else 0,
        )
        for i in range(request.num_samples)
    ]
    return parts[:1] if p.temperature == 0 else parts
