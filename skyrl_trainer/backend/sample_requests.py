"""Tinker `sample` requests in, `SampleResponse`s out: validation and conversion at the boundary."""

from __future__ import annotations

import math

import numpy as np
from tinker import types
from tinker.types.topk_logprobs import TopkLogprobs

from skyrl_trainer.backend.config import SamplingConfig
from skyrl_trainer.backend.datums import check_token_ids, model_input_tokens
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.sampling.engine import (
    GenerationParams,
    GenerationRequest,
    GenerationResult,
)

TOPK_EMPTY = (0, -99999.0)  # the SDK's sentinel for an empty top-k cell


def _stop_conditions(
    stop: str | list[str] | list[int] | None, eos_token_id: int | None
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Tinker semantics: None stops at EOS; a given list replaces it (`[]` disables EOS)."""
    if stop is None:
        return ((eos_token_id,) if eos_token_id is not None else ()), ()
    if isinstance(stop, str):
        stop = [stop]
    if all(isinstance(s, str) for s in stop):
        if any(s == "" for s in stop):
            raise InvalidRequestError("sampling_params.stop", "stop strings must be non-empty")
        return (), tuple(stop)
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return tuple(stop), ()
    raise InvalidRequestError(
        "sampling_params.stop", "must be a string, a list of strings, or a list of token ids"
    )


def to_generation_request(
    prompt: types.ModelInput,
    num_samples: int,
    params: types.SamplingParams,
    *,
    include_prompt_logprobs: bool,
    topk_prompt_logprobs: int,
    vocab_size: int,
    context_length: int,
    eos_token_id: int | None,
    config: SamplingConfig,
) -> GenerationRequest:
    """Validate a Tinker sample request (errors name the field) and convert it."""
    if not isinstance(prompt, types.ModelInput):
        raise InvalidRequestError("prompt", f"must be a ModelInput, got {type(prompt).__name__}")
    prompt_ids = model_input_tokens(prompt, "prompt")
    if not prompt_ids:
        raise InvalidRequestError("prompt", "is empty; a prompt needs at least one token")
    check_token_ids(np.asarray(prompt_ids), vocab_size, "prompt")
    if not isinstance(num_samples, int) or not 1 <= num_samples <= config.max_num_samples:
        raise InvalidRequestError(
            "num_samples", f"is {num_samples!r}; must be in [1, {config.max_num_samples}]"
        )
    room = context_length - len(prompt_ids)
    if room < 1:
        raise InvalidRequestError(
            "prompt", f"has {len(prompt_ids)} tokens; the context length is {context_length}"
        )
    max_tokens = (
        params.max_tokens if params.max_tokens is not None else min(room, config.max_tokens)
    )
    if not 1 <= max_tokens <= min(room, config.max_tokens):
        raise InvalidRequestError(
            "sampling_params.max_tokens",
            f"is {max_tokens}; must be in [1, {min(room, config.max_tokens)}] (cap "
            f"{config.max_tokens}, and prompt + max_tokens <= context length {context_length})",
        )
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise InvalidRequestError(
            "sampling_params.temperature", f"is {params.temperature}; must be >= 0 (0 = greedy)"
        )
    if not (0 < params.top_p <= 1):
        raise InvalidRequestError("sampling_params.top_p", f"is {params.top_p}; must be in (0, 1]")
    if params.top_k == 0 or params.top_k < -1:
        raise InvalidRequestError(
            "sampling_params.top_k", f"is {params.top_k}; must be -1 (off) or >= 1"
        )
    if not 0 <= topk_prompt_logprobs <= 20:
        raise InvalidRequestError(
            "topk_prompt_logprobs", f"is {topk_prompt_logprobs}; must be in [0, 20]"
        )
    stop_ids, stop_strings = _stop_conditions(params.stop, eos_token_id)
    return GenerationRequest(
        prompt_ids=tuple(prompt_ids),
        num_samples=num_samples,
        params=GenerationParams(
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            stop_token_ids=stop_ids,
            stop_strings=stop_strings,
        ),
        prompt_logprobs=include_prompt_logprobs or topk_prompt_logprobs > 0,
        topk_prompt_logprobs=topk_prompt_logprobs,
    )


def to_sample_response(
    result: GenerationResult, sequence_id_prefix: str, topk_prompt_logprobs: int
) -> types.SampleResponse:
    """The engine's result as the SDK's `SampleResponse` (numpy fields, NaN = no log-prob)."""
    sequences = [
        types.SampledSequence(
            stop_reason=seq.stop_reason,
            sequence_id=f"{sequence_id_prefix}:{i}",
            tokens_np=np.asarray(seq.tokens, dtype=np.int32),
            logprobs_np=np.asarray(seq.logprobs, dtype=np.float32),
        )
        for i, seq in enumerate(result.sequences)
    ]
    prompt_logprobs = None
    if result.prompt_logprobs is not None:
        prompt_logprobs = np.array(
            [np.nan if lp is None else lp for lp in result.prompt_logprobs], dtype=np.float32
        )
    topk = None
    if topk_prompt_logprobs > 0 and result.topk_prompt_logprobs is not None:
        k = topk_prompt_logprobs
        n = len(result.topk_prompt_logprobs)
        token_ids = np.full((n, k), TOPK_EMPTY[0], dtype=np.int32)
        logprobs = np.full((n, k), TOPK_EMPTY[1], dtype=np.float32)
        for pos, cell in enumerate(result.topk_prompt_logprobs):
            for j, (token, lp) in enumerate((cell or [])[:k]):
                token_ids[pos, j], logprobs[pos, j] = token, lp
        topk = TopkLogprobs(token_ids=token_ids, logprobs=logprobs)
    return types.SampleResponse(
        sequences=sequences, prompt_logprobs_np=prompt_logprobs, topk_prompt_logprobs_np=topk
    )
