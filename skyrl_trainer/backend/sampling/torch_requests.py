"""Requests and rows of the PyTorch sampling engine: per-row state, stop conditions.

A `Pending` is one queued `GenerationRequest` with its future; once admitted it owns
`num_samples` `Row`s, one per sample, each generating its own tokens until a stop condition:
a stop token or stop string ("stop"), `max_tokens` or the model's context length ("length").
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Literal

from transformers import PreTrainedTokenizerBase

from skyrl_trainer.backend.sampling.engine import (
    GeneratedSequence,
    GenerationRequest,
    GenerationResult,
)
from skyrl_trainer.backend.sampling.prefix_cache import PrefixEntry
from skyrl_trainer.backend.sampling.row_sampling import StopStrings, row_rng


def plan_prefill(lengths: list[int], max_tokens: int, overhead: int = 128) -> list[list[int]]:
    """Group prompts (by index) into prefill forwards of right-padded prompts.

    Minimises padded tokens plus `overhead` token-equivalents per forward (the cost of a separate,
    smaller forward), each forward holding at most `max_tokens` padded tokens (or one prompt): with
    prompts sorted by length, an exact split into runs by dynamic programming.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sizes = [lengths[i] for i in order]
    best = [0.0] + [math.inf] * len(sizes)
    start = [0] * (len(sizes) + 1)
    for end in range(1, len(sizes) + 1):
        for begin in range(end - 1, -1, -1):
            padded = (end - begin) * sizes[end - 1]
            if padded > max_tokens and end - begin > 1:
                break
            cost = best[begin] + padded + overhead
            if cost < best[end]:
                best[end], start[end] = cost, begin
    chunks, end = [], len(sizes)
    while end > 0:
        chunks.append(order[start[end] : end])
        end = start[end]
    return chunks[::-1]


class Pending:
    """A request waiting for, or being served by, the engine loop."""

    def __init__(
        self,
        request: GenerationRequest,
        future: Future[GenerationResult],
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
    ):
        params = request.params
        self.request = request
        self.future = future
        self.prompt_len = len(request.prompt_ids)
        self.num_rows = request.num_samples if params.max_tokens > 0 else 0
        # Prompt log-probs, their top-k, target ids or alternative draws: a scoring prefill.
        self.wants_prompt_logprobs = request.scores_prompt
        self.topk_sample = request.topk_sample_logprobs
        self.limit = min(params.max_tokens, max_model_len - self.prompt_len)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.stop_strings = StopStrings(tokenizer, params.stop_strings)
        self.sequences: list[GeneratedSequence | None] = [None] * request.num_samples
        self.remaining = self.num_rows
        self.prompt_logprobs: list[float | None] | None = None
        self.topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
        self.target_prompt_logprobs = None  # np.ndarray float32 (len(prompt) - 1, K)
        self.prompt_alt_tokens = None  # (tokens, logprobs) np.ndarrays (len(prompt) - 1, k)

    def record(self, row: Row) -> bool:
        """Note that `row` left the batch; True when it was the request's last row."""
        if row.stop_reason is not None:
            self.sequences[row.index] = GeneratedSequence(
                row.tokens, row.logprobs, row.stop_reason, row.topk
            )
        self.remaining -= 1
        return self.remaining == 0

    def finish_empty(self) -> None:
        """max_tokens == 0: every sample is empty."""
        self.sequences = [
            GeneratedSequence([], [], "length", [] if self.topk_sample else None)
            for _ in range(self.request.num_samples)
        ]

    def result(self) -> GenerationResult:
        assert all(s is not None for s in self.sequences)
        return GenerationResult(
            sequences=list(self.sequences),
            prompt_logprobs=self.prompt_logprobs,
            topk_prompt_logprobs=self.topk_prompt_logprobs,
            target_prompt_logprobs=self.target_prompt_logprobs,
            prompt_alt_tokens=self.prompt_alt_tokens,
        )


class Row:
    """One sample of a request: its tokens so far, their log-probs and its random stream."""

    __slots__ = (
        "pending",
        "index",
        "params",
        "rng",
        "tokens",
        "logprobs",
        "stop_reason",
        "prefix",
        "topk",
    )

    def __init__(self, pending: Pending, index: int):
        self.pending = pending
        self.index = index
        self.params = pending.request.params
        self.rng = row_rng(self.params.seed, index)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.stop_reason: Literal["stop", "length"] | None = None
        self.prefix: PrefixEntry | None = None  # the stored KV the row started from, if any
        # The top-k (token, logprob) at each generated position, when the request asks.
        self.topk: list[list[tuple[int, float]]] | None = [] if pending.topk_sample else None

    def append(
        self, token: int, logprob: float, topk: list[tuple[int, float]] | None = None
    ) -> bool:
        """Add a sampled token (and its position's top-k); True when the row is finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.topk is not None:
            self.topk.append(topk or [])
        pending = self.pending
        if token in pending.stop_ids or (
            pending.stop_strings and pending.stop_strings.hit(self.tokens)
        ):
            self.stop_reason = "stop"
        elif len(self.tokens) >= pending.limit:
            self.stop_reason = "length"
        return self.stop_reason is not None
