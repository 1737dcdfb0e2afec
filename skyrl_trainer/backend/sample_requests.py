"""Tinker `sample` requests in, `SampleResponse`s out: validation and conversion at the boundary."""

from __future__ import annotations

import math

import numpy as np
from tinker import types
from tinker.types.topk_logprobs import TopkLogprobs

from skyrl_trainer.backend.config import SamplingConfig
from skyrl_trainer.backend.datums import check_token_ids, model_input_tokens, tensor_data_to_numpy
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.sampling.engine import (
    MAX_TOPK,
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
    topk_sample_logprobs: int = 0,
    prompt_logprobs_last_n: int | None = None,
    target_prompt_logprobs=None,
    prompt_alt_tokens_k: int = 0,
) -> GenerationRequest:
    """Validate a Tinker sample request (errors name the field) and convert it.

    The options are the SDK's `SamplingClient.sample` arguments (`compute_logprobs` sends
    `prompt_logprobs_last_n` too): `topk_sample_logprobs` (<= 20), `prompt_logprobs_last_n`
    (needs `include_prompt_logprobs`; 1 <= N <= len(prompt) - 1), `target_prompt_logprobs`
    (a `TensorData`, the SDK's dataclass or its wire model: int64 [len(prompt) - 1, K],
    K <= 20, -1 = no id, dense or sparse CSR with -1 in unlisted cells, at least one id) and
    `prompt_alt_tokens_k` (<= 20).
    """
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
    for name, value in (
        ("topk_prompt_logprobs", topk_prompt_logprobs),
        ("topk_sample_logprobs", topk_sample_logprobs),
        ("prompt_alt_tokens_k", prompt_alt_tokens_k),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOPK:
            raise InvalidRequestError(name, f"is {value!r}; must be an integer in [0, {MAX_TOPK}]")
    if prompt_logprobs_last_n is not None:
        last_n = prompt_logprobs_last_n
        if not include_prompt_logprobs:
            raise InvalidRequestError(
                "prompt_logprobs_last_n",
                "applies to prompt logprobs; set include_prompt_logprobs (prompt_logprobs)",
            )
        if isinstance(last_n, bool) or not isinstance(last_n, int):
            raise InvalidRequestError("prompt_logprobs_last_n", f"is {last_n!r}; not an integer")
        if not 1 <= last_n <= len(prompt_ids) - 1:
            raise InvalidRequestError(
                "prompt_logprobs_last_n",
                f"is {last_n}; must be in [1, {len(prompt_ids) - 1}] (len(prompt) - 1)",
            )
    target_ids = None
    if target_prompt_logprobs is not None:
        target_ids = _target_ids(target_prompt_logprobs, len(prompt_ids), vocab_size)
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
        topk_sample_logprobs=topk_sample_logprobs,
        prompt_logprobs_last_n=prompt_logprobs_last_n,
        target_prompt_logprobs=target_ids,
        prompt_alt_tokens_k=prompt_alt_tokens_k,
    )


def _target_ids(td, prompt_len: int, vocab_size: int) -> np.ndarray:
    """`target_prompt_logprobs` as a dense int64 (len(prompt) - 1, K) array (-1 = no id)."""
    field = "target_prompt_logprobs"
    if getattr(td, "dtype", None) != "int64":
        raise InvalidRequestError(
            field, f"must be an int64 tensor of token ids, got {getattr(td, 'dtype', td)!r}"
        )
    rows = prompt_len - 1

    def check_shape(shape: list[int]) -> None:
        if len(shape) != 2 or shape[0] != rows or not 1 <= shape[1] <= MAX_TOPK:
            raise InvalidRequestError(
                field,
                f"has shape {shape}; must be [{rows}, K] (len(prompt) - 1 rows; row i "
                f"scores prompt position i + 1) with 1 <= K <= {MAX_TOPK}",
            )

    if getattr(td, "shape", None) is not None:  # before densifying a (maybe huge) CSR shape
        check_shape(list(td.shape))
    ids = tensor_data_to_numpy(td, field, pad_value=-1)
    check_shape(list(ids.shape))
    ids = ids.astype(np.int64)
    bad = np.argwhere((ids < -1) | (ids >= vocab_size))
    if bad.size:
        i, j = (int(x) for x in bad[0])
        raise InvalidRequestError(
            f"{field}[{i}][{j}]",
            f"is {int(ids[i, j])}; must be a token id in [0, {vocab_size}) or -1 (no id)",
        )
    if not (ids >= 0).any():
        raise InvalidRequestError(field, "names no token id (every cell is -1)")
    return ids


def to_sample_response(
    result: GenerationResult,
    sequence_id_prefix: str,
    topk_prompt_logprobs: int,
    *,
    topk_sample_logprobs: int = 0,
    target_prompt_logprobs=None,
    prompt_alt_tokens_k: int = 0,
) -> types.SampleResponse:
    """The engine's result as the SDK's `SampleResponse` (numpy fields, NaN = no log-prob).

    Pass the request's options: `topk_sample_logprobs` fills each sequence's `topk_logprobs_np`;
    `target_prompt_logprobs` (the request's tensor) gives the response tensor its layout, dense
    or the same sparse CSR cells; `prompt_alt_tokens_k` fills `prompt_alt_tokens`.
    """
    sequences = [
        types.SampledSequence(
            stop_reason=seq.stop_reason,
            sequence_id=f"{sequence_id_prefix}:{i}",
            tokens_np=np.asarray(seq.tokens, dtype=np.int32),
            logprobs_np=np.asarray(seq.logprobs, dtype=np.float32),
            topk_logprobs_np=(
                _topk_matrices(seq.topk_logprobs or [], topk_sample_logprobs)
                if topk_sample_logprobs > 0
                else None
            ),
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
        topk = _topk_matrices(result.topk_prompt_logprobs, topk_prompt_logprobs)
    target = None
    if target_prompt_logprobs is not None and result.target_prompt_logprobs is not None:
        target = _target_response(target_prompt_logprobs, result.target_prompt_logprobs)
    alt = None
    if prompt_alt_tokens_k > 0 and result.prompt_alt_tokens is not None:
        tokens, logprobs = result.prompt_alt_tokens
        alt = types.PromptAltTokens(
            tokens=types.TensorData.from_numpy(np.asarray(tokens, dtype=np.int64)),
            logprobs=types.TensorData.from_numpy(np.asarray(logprobs, dtype=np.float32)),
        )
    return types.SampleResponse(
        sequences=sequences,
        prompt_logprobs_np=prompt_logprobs,
        topk_prompt_logprobs_np=topk,
        target_prompt_logprobs=target,
        prompt_alt_tokens=alt,
    )


def _topk_matrices(cells, k: int) -> TopkLogprobs:
    """Per-position (token, logprob) lists (None = nothing) as dense (n, k) matrices, empty
    cells holding the SDK's sentinel (0, -99999)."""
    n = len(cells)
    token_ids = np.full((n, k), TOPK_EMPTY[0], dtype=np.int32)
    logprobs = np.full((n, k), TOPK_EMPTY[1], dtype=np.float32)
    for pos, cell in enumerate(cells):
        for j, (token, lp) in enumerate((cell or [])[:k]):
            token_ids[pos, j], logprobs[pos, j] = token, lp
    return TopkLogprobs(token_ids=token_ids, logprobs=logprobs)


def _target_response(request_td, scored: np.ndarray) -> types.TensorData:
    """The scored target log-probs in the request tensor's layout: dense float32 of its shape
    (0.0 at -1 cells), or, for a sparse request, its own CSR cells."""
    scored = np.asarray(scored, dtype=np.float32)
    crow = request_td.sparse_crow_indices
    if crow is None:
        return types.TensorData.from_numpy(scored)
    crow_a = np.asarray(crow, dtype=np.int64)
    col = np.asarray(request_td.sparse_col_indices, dtype=np.int64)
    rows = np.repeat(np.arange(len(crow_a) - 1), np.diff(crow_a))
    return types.TensorData(
        data=scored[rows, col],
        dtype="float32",
        shape=list(scored.shape),
        sparse_crow_indices=list(crow),
        sparse_col_indices=list(request_td.sparse_col_indices),
    )
