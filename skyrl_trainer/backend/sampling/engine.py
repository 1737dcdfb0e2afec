"""The interface every sampling engine implements, and the records it exchanges.

The backend core turns Tinker `sample` requests into `GenerationRequest`s and engine results
into `tinker.types.SampleResponse`s; engines never see Tinker types. Every engine checks a
request with `validate_request` before queueing it; an engine replica that is gone fails its
requests with `EngineDiedError`. Engines batch all requests
in flight together (continuous batching in vLLM, dynamic batching in the PyTorch engine).
"""

from __future__ import annotations

import math
import operator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import torch

from skyrl_trainer.backend.errors import InvalidRequestError


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy (argmax)
    top_k: int = -1  # -1 = no top-k filtering
    top_p: float = 1.0
    seed: int | None = None  # same seed, same prompt, same weights -> same tokens
    stop_token_ids: tuple[int, ...] = ()  # a sampled id in here ends the sequence ("stop")
    stop_strings: tuple[str, ...] = ()  # decoded text containing one ends the sequence ("stop")


MAX_TOPK = 20  # widest top-k (prompt or sampled positions), alternative draws, target columns


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    num_samples: int
    params: GenerationParams
    prompt_logprobs: bool = False  # log p(prompt[i] | prompt[:i]); position 0 is None
    topk_prompt_logprobs: int = 0  # also the top-k (token, logprob) at each prompt position
    adapter: str | None = None  # a LoRA adapter loaded with add_lora; None = the engine's weights
    topk_sample_logprobs: int = 0  # the top-k (token, logprob) at each generated position
    prompt_logprobs_last_n: int | None = None
    """Score only the last N prompt positions (prompt log-probs and their top-k); earlier
    positions are None. None: every position."""
    target_prompt_logprobs: np.ndarray | None = field(default=None, compare=False)
    """int64 (len(prompt) - 1, K): cell [i, j] asks for log p(id | prompt[:i+1]), the log-prob
    of that id at prompt position i + 1; -1 asks for nothing."""
    prompt_alt_tokens_k: int = 0
    """Draw this many tokens, independently, at the request's temperature, from the model's
    next-token distribution at every prompt position after the first."""

    @property
    def scores_prompt(self) -> bool:
        """The prompt's positions need the model's distributions (a prompt-scoring prefill)."""
        return (
            self.prompt_logprobs
            or self.topk_prompt_logprobs > 0
            or self.target_prompt_logprobs is not None
            or self.prompt_alt_tokens_k > 0
        )

    def first_scored_position(self) -> int:
        """The first prompt position whose log-prob / top-k is reported (>= 1)."""
        n = self.prompt_logprobs_last_n
        return 1 if n is None else max(1, len(self.prompt_ids) - n)


@dataclass
class GeneratedSequence:
    tokens: list[int]  # includes the stop token / the token that completed a stop string
    logprobs: list[float]  # log p(token) under the model's raw distribution (temperature 1)
    stop_reason: Literal["stop", "length"]
    # With topk_sample_logprobs: per generated position, the top-k (token, logprob) of the raw
    # distribution, most likely first.
    topk_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class GenerationResult:
    sequences: list[GeneratedSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    extra: dict = field(default_factory=dict)
    # float32 (len(prompt) - 1, K), the request's target_prompt_logprobs scored; 0.0 at -1 cells.
    target_prompt_logprobs: np.ndarray | None = None
    # (tokens int64, logprobs float32), each (len(prompt) - 1, k): prompt_alt_tokens_k draws.
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None


class EngineDiedError(RuntimeError):
    """A sampling engine actor died, failed to start, or was killed after a failed sync."""


def validate_request(request: GenerationRequest, vocab_size: int, max_model_len: int) -> None:
    """Raise InvalidRequestError (naming the field) for a request the engine cannot serve."""
    if not isinstance(request, GenerationRequest):
        raise InvalidRequestError(
            "request", f"is a {type(request).__name__}, not a GenerationRequest"
        )
    prompt = request.prompt_ids
    if len(prompt) == 0:
        raise InvalidRequestError("prompt_ids", "is empty; a prompt needs at least one token")
    for i, token in enumerate(prompt):
        try:
            token = operator.index(token)
        except TypeError:
            raise InvalidRequestError(
                f"prompt_ids[{i}]", f"is {token!r}, not an integer token id"
            ) from None
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"prompt_ids[{i}]", f"token id {token} is outside the vocabulary [0, {vocab_size})"
            )
    if len(prompt) >= max_model_len:
        raise InvalidRequestError(
            "prompt_ids",
            f"has {len(prompt)} tokens; the engine's context length is {max_model_len}, so a "
            f"prompt can have at most {max_model_len - 1}",
        )
    if request.num_samples < 1:
        raise InvalidRequestError("num_samples", f"is {request.num_samples}; must be >= 1")
    k = request.topk_prompt_logprobs
    if not 0 <= k <= vocab_size:
        raise InvalidRequestError("topk_prompt_logprobs", f"is {k}; must be in [0, {vocab_size}]")
    for name in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
        value = getattr(request, name)
        if not 0 <= value <= MAX_TOPK:
            raise InvalidRequestError(name, f"is {value}; must be in [0, {MAX_TOPK}]")
    last_n = request.prompt_logprobs_last_n
    if last_n is not None:
        if not (request.prompt_logprobs or request.topk_prompt_logprobs):
            raise InvalidRequestError(
                "prompt_logprobs_last_n", "applies to prompt log-probs, which were not asked for"
            )
        if not 1 <= last_n <= len(prompt) - 1:
            raise InvalidRequestError(
                "prompt_logprobs_last_n", f"is {last_n}; must be in [1, {len(prompt) - 1}]"
            )
    targets = request.target_prompt_logprobs
    if targets is not None:
        targets = np.asarray(targets)
        if targets.dtype.kind not in "iu" or targets.ndim != 2:
            raise InvalidRequestError(
                "target_prompt_logprobs", "must be a 2-D integer array (len(prompt) - 1, K)"
            )
        if targets.shape[0] != len(prompt) - 1 or not 1 <= targets.shape[1] <= MAX_TOPK:
            raise InvalidRequestError(
                "target_prompt_logprobs",
                f"has shape {list(targets.shape)}; must be [{len(prompt) - 1}, K] with "
                f"1 <= K <= {MAX_TOPK}",
            )
        bad = np.argwhere((targets < -1) | (targets >= vocab_size))
        if bad.size:
            i, j = (int(x) for x in bad[0])
            raise InvalidRequestError(
                f"target_prompt_logprobs[{i}][{j}]",
                f"is {int(targets[i, j])}; must be a token id in [0, {vocab_size}) or -1 (none)",
            )
    params = request.params
    if params.max_tokens < 0:
        raise InvalidRequestError("max_tokens", f"is {params.max_tokens}; must be >= 0")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise InvalidRequestError(
            "temperature", f"is {params.temperature}; must be >= 0 (0 = greedy)"
        )
    if not 0 < params.top_p <= 1:
        raise InvalidRequestError("top_p", f"is {params.top_p}; must be in (0, 1]")
    if params.top_k < -1:
        raise InvalidRequestError("top_k", f"is {params.top_k}; must be -1 (off) or >= 1")
    if not all(isinstance(s, str) for s in params.stop_strings):
        raise InvalidRequestError("stop_strings", "must all be strings")


class SamplingEngine(Protocol):
    """A batched generator over one base model, with swappable weights and LoRA adapters.

    Every engine implements every method (some as no-ops): the registry and the pool's actors
    call them unconditionally, and a missing one is a type error, not a silently skipped step.
    """

    tokenizer: Any  # the model's tokenizer (decoding stop strings, client get_tokenizer)
    vocab_size: int  # token ids must be in [0, vocab_size)
    max_model_len: int  # context length: prompt + generated tokens

    def generate(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Queue a request (thread-safe); it is batched with every other request in flight."""
        ...

    def generate_for_session(
        self, session: str | None, request: GenerationRequest
    ) -> Future[GenerationResult]:
        """`generate` for sampling session `session`: an engine pool routes by session and
        prompt prefix (a replica's prefix cache); a single engine just generates."""
        ...

    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Replace the base weights in place (Hugging Face parameter names). Requests queued
        after this call see the new weights; requests in flight finish on the old ones."""
        ...

    def add_lora(self, name: str, adapter_dir: str) -> None:
        """Load a PEFT adapter folder under `name`; several can be live at once."""
        ...

    def remove_lora(self, name: str) -> None: ...

    def before_training(self) -> None:
        """Training on this engine's base model is about to run: engines colocated with the
        trainer sleep until their next request or sync; others do nothing."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory (after the requests in flight) until `wake_up`; a no-op
        for engines without a sleep mode."""
        ...

    def wake_up(self) -> None: ...

    def shutdown(self) -> None: ...
