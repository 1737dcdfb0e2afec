"""Between the engine's records and vLLM's: sampling parameters, finished outputs, and the split of
a prompt-log-prob request into one request per sample (see `VLLMSamplingEngine._runs_alone`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import replace

from skyrl_trainer.backend.errors import InvalidRequestError
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
        # The sampled token's log-prob, under the raw (temperature 1) distribution, and the
        # top-k at each generated position when asked.
        logprobs=request.topk_sample_logprobs,
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
        topk = None
        if request.topk_sample_logprobs:
            topk = [_ranked(step, request.topk_sample_logprobs) for step in completion.logprobs]
        sequences.append(GeneratedSequence(tokens, logprobs, completion.finish_reason, topk))
    if request.params.temperature == 0:
        # Greedy decoding is deterministic: the samples are copies of the one computed.
        one = sequences[0]
        sequences = [_copy(one) for _ in range(request.num_samples)]
    result = GenerationResult(sequences=sequences)
    if request.prompt_logprobs or request.topk_prompt_logprobs:
        prompt = request.prompt_ids
        steps = output.prompt_logprobs
        # vLLM scores every prompt position; prompt_logprobs_last_n reports only the last N.
        first = request.first_scored_position()
        result.prompt_logprobs = [None] * first + [
            float(steps[i][prompt[i]].logprob) for i in range(first, len(prompt))
        ]
        if request.topk_prompt_logprobs:
            k = request.topk_prompt_logprobs
            result.topk_prompt_logprobs = [None] * first + [
                _ranked(steps[i], k) for i in range(first, len(prompt))
            ]
    return result


def _ranked(step: dict, k: int) -> list[tuple[int, float]]:
    """The top-k (token, logprob) of one position's vLLM log-prob dict, most likely first (the
    dict also holds the actual token, whatever its rank)."""
    ranked = sorted(step.items(), key=lambda kv: kv[1].rank)
    return [(int(t), float(lp.logprob)) for t, lp in ranked if lp.rank <= k][:k]


def _copy(one: GeneratedSequence) -> GeneratedSequence:
    topk = None if one.topk_logprobs is None else [list(c) for c in one.topk_logprobs]
    return GeneratedSequence(list(one.tokens), list(one.logprobs), one.stop_reason, topk)


def check_vllm_supports(request: GenerationRequest) -> None:
    """Refuse the options vLLM cannot produce (its prompt log-probs are the prompt token's and
    the top-k only; it draws nothing at prompt positions)."""
    if request.target_prompt_logprobs is not None:
        raise InvalidRequestError(
            "target_prompt_logprobs",
            "is not supported by the vLLM sampling engine (vLLM scores only the prompt's own "
            "tokens and the top-k); use topk_prompt_logprobs, or the PyTorch engine "
            "(backend.sampling.engine=torch)",
        )
    if request.prompt_alt_tokens_k:
        raise InvalidRequestError(
            "prompt_alt_tokens_k",
            "is not supported by the vLLM sampling engine (vLLM draws no tokens at prompt "
            "positions); use the PyTorch engine (backend.sampling.engine=torch)",
        )


def wants_prompt_logprobs(request: GenerationRequest) -> bool:
    return request.prompt_logprobs or request.topk_prompt_logprobs > 0


def child_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else seed + index  # as vLLM seeds the samples of one request


def combined_result(
    parts: list[Future[GenerationResult]], num_samples: int
) -> Future[GenerationResult]:
    """One future for the results of `parts` (a request split by samples), in order. It is
    running from the start, so it cannot be cancelled itself: `VLLMSamplingEngine.cancel` cancels
    the parts, and it ends with their `CancelledError` once the last of them has ended."""
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
            combined.sequences.append(_copy(combined.sequences[0]))
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
            prompt_logprobs_last_n=request.prompt_logprobs_last_n if i == 0 else None,
        )
        for i in range(request.num_samples)
    ]
    return parts[:1] if p.temperature == 0 else parts
