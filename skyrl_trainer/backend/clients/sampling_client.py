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
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[types.SampleResponse]:
        """`num_samples` continuations, each with tokens, per-token log-probs and stop reason
        (and the top `topk_sample_logprobs` log-probs at each generated token). Optionally, of
        the prompt: its log-probs (`include_prompt_logprobs`, only the last
        `prompt_logprobs_last_n` when given), the top `topk_prompt_logprobs` at each position,
        the log-probs of chosen ids at chosen positions (`target_prompt_logprobs`, int64
        [len(prompt) - 1, K], -1 = no id, dense or sparse CSR; the result has the same layout)
        and `prompt_alt_tokens_k` draws per position at the request's temperature. The
        arguments and results are the Tinker SDK's `SamplingClient.sample` ones."""
        return api_future(
            self._core.sample(
                self.sampler_id,
                prompt,
                num_samples,
                sampling_params,
                include_prompt_logprobs,
                topk_prompt_logprobs,
                topk_sample_logprobs=topk_sample_logprobs,
                target_prompt_logprobs=target_prompt_logprobs,
                prompt_alt_tokens_k=prompt_alt_tokens_k,
                prompt_logprobs_last_n=prompt_logprobs_last_n,
            )
        )

    async def sample_async(self, *args: Any, **kwargs: Any) -> types.SampleResponse:
        return await self.sample(*args, **kwargs)

    def compute_logprobs(
        self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None
    ) -> APIFuture[list[float | None]]:
        """log p(token_i | tokens_<i) for every prompt token (None for the first); with
        `prompt_logprobs_last_n=N` (1 <= N <= len(prompt) - 1) only the last N are scored and
        the earlier entries are None."""
        response = self._core.sample(
            self.sampler_id,
            prompt,
            1,
            types.SamplingParams(max_tokens=1, temperature=1.0),
            include_prompt_logprobs=True,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
        )
        return api_future(mapped(response, lambda r: r.prompt_logprobs))

    async def compute_logprobs_async(
        self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None
    ) -> list[float | None]:
        return await self.compute_logprobs(prompt, prompt_logprobs_last_n)

    def get_base_model(self) -> str:
        return self._core.sampler_base_model(self.sampler_id)

    def get_tokenizer(self) -> Any:
        return self._core.sampler_tokenizer(self.sampler_id)

    def __repr__(self) -> str:
        return f"SamplingClient(sampler_id={self.sampler_id!r}, model_path={self.model_path!r})"
