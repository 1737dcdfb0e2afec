"""The interface every sampling engine implements, and the records it exchanges.

The backend core turns Tinker `sample` requests into `GenerationRequest`s and engine results
into `tinker.types.SampleResponse`s; engines never see Tinker types. Engines batch all requests
in flight together (continuous batching in vLLM, dynamic batching in the PyTorch engine).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy (argmax)
    top_k: int = -1  # -1 = no top-k filtering
    top_p: float = 1.0
    seed: int | None = None  # same seed, same prompt, same weights -> same tokens
    stop_token_ids: tuple[int, ...] = ()  # a sampled id in here ends the sequence ("stop")
    stop_strings: tuple[str, ...] = ()  # decoded text containing one ends the sequence ("stop")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    num_samples: int
    params: GenerationParams
    prompt_logprobs: bool = False  # log p(prompt[i] | prompt[:i]); position 0 is None
    topk_prompt_logprobs: int = 0  # also the top-k (token, logprob) at each prompt position
    adapter: str | None = None  # a LoRA adapter loaded with add_lora; None = the engine's weights


@dataclass
class GeneratedSequence:
    tokens: list[int]  # includes the stop token / the token that completed a stop string
    logprobs: list[float]  # log p(token) under the model's raw distribution (temperature 1)
    stop_reason: Literal["stop", "length"]


@dataclass
class GenerationResult:
    sequences: list[GeneratedSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    extra: dict = field(default_factory=dict)


class SamplingEngine(Protocol):
    """A batched generator over one base model, with swappable weights and LoRA adapters."""

    tokenizer: Any  # the model's tokenizer (decoding stop strings, client get_tokenizer)
    vocab_size: int  # token ids must be in [0, vocab_size)
    max_model_len: int  # context length: prompt + generated tokens

    def generate(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Queue a request (thread-safe); it is batched with every other request in flight."""
        ...

    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Replace the base weights in place (Hugging Face parameter names). Requests queued
        after this call see the new weights; requests in flight finish on the old ones."""
        ...

    def add_lora(self, name: str, adapter_dir: str) -> None:
        """Load a PEFT adapter folder under `name`; several can be live at once."""
        ...

    def remove_lora(self, name: str) -> None: ...

    def shutdown(self) -> None: ...
