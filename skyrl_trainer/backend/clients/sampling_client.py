"""The in-process `SamplingClient`: the Tinker SDK's sampling surface over `BackendCore`.

A sampling client is bound to one set of weights for its whole life (the base model, a saved
checkpoint, or a snapshot of a training client); see `skyrl_trainer.backend.sampler_registry`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture

from skyrl_trainer.backend.clients.futures import api_future, mapped

if TYPE_CHECKING:
    from skyrl_trainer.backend.core import BackendCore


class SamplingClient:
    """Samples from the weights this client was created for. Requests are batched together."""

    def __init__(self, core: BackendCore, sampler_id: str, model_path: str | None = None):
        self._core = core
        self.sampler_id = sampler_id
        self.model_path = model_path

    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> APIFuture[types.SampleResponse]:
        """`num_samples` continuations, each with tokens, per-token log-probs and stop reason;
        the prompt's log-probs too when asked."""
        return api_future(
            self._core.sample(
                self.sampler_id,
                prompt,
                num_samples,
                sampling_params,
                include_prompt_logprobs,
                topk_prompt_logprobs,
            )
        )

    async def sample_async(self, *args: Any, **kwargs: Any) -> types.SampleResponse:
        return await self.sample(*args, **kwargs)

    def compute_logprobs(self, prompt: types.ModelInput) -> APIFuture[list[float | None]]:
        """log p(token_i | tokens_<i) for every prompt token (None for the first)."""
        response = self._core.sample(
            self.sampler_id,
            prompt,
            1,
            types.SamplingParams(max_tokens=1, temperature=1.0),
            include_prompt_logprobs=True,
        )
        return api_future(mapped(response, lambda r: r.prompt_logprobs))

    async def compute_logprobs_async(self, prompt: types.ModelInput) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    def get_base_model(self) -> str:
        return self._core.sampler_base_model(self.sampler_id)

    def get_tokenizer(self) -> Any:
        return self._core.sampler_tokenizer(self.sampler_id)

    def __repr__(self) -> str:
        return f"SamplingClient(sampler_id={self.sampler_id!r}, model_path={self.model_path!r})"
