"""The in-process `ServiceClient`: creates training clients on the in-process backend.

Mirrors the Tinker SDK's `ServiceClient`: creators return a future of the client (which, as
in the SDK, can still be used as the client directly, with a deprecation warning), and the
`*_async` creators return the client itself.

Extension beyond Tinker: `create_full_training_client` trains all weights instead of a
LoRA adapter. A remote Tinker service has no such call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture
from tinker.lib.public_interfaces.custom_loss import LossHandle, encode_graph, trace_loss

from skyrl_trainer.backend.clients.futures import (
    ClientFuture,
    api_future,
    done,
    failed,
    mapped,
    run_now,
)
from skyrl_trainer.backend.clients.sampling_client import SamplingClient
from skyrl_trainer.backend.clients.training_client import TrainingClient
from skyrl_trainer.backend.config import BackendConfig
from skyrl_trainer.backend.core import BackendCore, check_record_stability_info
from skyrl_trainer.backend.errors import InvalidRequestError


def _check_optimizer(optimizer: Any) -> None:
    if optimizer is not None and getattr(optimizer, "type", None) != "adamw":
        raise InvalidRequestError(
            "optimizer", f"{optimizer!r} is not supported; this backend trains with AdamW"
        )


class ServiceClient:
    """Entry point to the in-process backend: one session on a `BackendCore`.

    `ServiceClient()` starts its own backend from `config`; pass `core=` to share one
    backend (and its loaded models) between several clients.
    """

    def __init__(
        self,
        config: BackendConfig | None = None,
        *,
        core: BackendCore | None = None,
        user_metadata: dict[str, str] | None = None,
    ):
        self.core = core if core is not None else BackendCore(config)
        self.session_id = self.core.create_session(user_metadata)
        self._custom_loss_keys: dict[str, str] = {}  # LossHandle.key -> name, as the SDK

    def _training_client(self, future) -> ClientFuture[TrainingClient]:
        return ClientFuture(mapped(future, lambda model_id: TrainingClient(self.core, model_id)))

    # ----- training clients ---------------------------------------------------------------

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        optimizer: types.AdamOptimizerConfig | None = None,
    ) -> ClientFuture[TrainingClient]:
        """A new LoRA adapter on `base_model`; adapters on one base share its weights."""
        try:
            _check_optimizer(optimizer)
            lora = types.LoraConfig(
                rank=rank,
                seed=seed,
                train_mlp=train_mlp,
                train_attn=train_attn,
                train_unembed=train_unembed,
            )
        except (InvalidRequestError, ValueError) as exc:
            return ClientFuture(failed(exc))
        return self._training_client(
            self.core.create_model(self.session_id, base_model, lora, user_metadata)
        )

    async def create_lora_training_client_async(self, *args, **kwargs) -> TrainingClient:
        return await self.create_lora_training_client(*args, **kwargs)

    def create_full_training_client(
        self, base_model: str, user_metadata: dict[str, str] | None = None
    ) -> ClientFuture[TrainingClient]:
        """Extension: full fine-tuning of all of `base_model`'s weights (float32 master copy)."""
        return self._training_client(
            self.core.create_model(self.session_id, base_model, None, user_metadata)
        )

    async def create_full_training_client_async(self, *args, **kwargs) -> TrainingClient:
        return await self.create_full_training_client(*args, **kwargs)

    def create_training_client_from_state(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
        optimizer: types.AdamOptimizerConfig | None = None,
    ) -> ClientFuture[TrainingClient]:
        """A new model with the weights of a training checkpoint; a fresh optimizer."""
        return self._from_state(path, base_model, user_metadata, optimizer, False)

    async def create_training_client_from_state_async(self, *args, **kwargs) -> TrainingClient:
        return await self.create_training_client_from_state(*args, **kwargs)

    def create_training_client_from_state_with_optimizer(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ) -> ClientFuture[TrainingClient]:
        """A new model with the weights and optimizer state of a training checkpoint."""
        return self._from_state(path, base_model, user_metadata, None, True)

    async def create_training_client_from_state_with_optimizer_async(
        self, *args, **kwargs
    ) -> TrainingClient:
        return await self.create_training_client_from_state_with_optimizer(*args, **kwargs)

    def _from_state(self, path, base_model, user_metadata, optimizer, with_optimizer):
        try:
            _check_optimizer(optimizer)
        except InvalidRequestError as exc:
            return ClientFuture(failed(exc))
        return self._training_client(
            self.core.create_model_from_state(
                self.session_id, path, with_optimizer, base_model, user_metadata
            )
        )

    # ----- sampling clients ---------------------------------------------------------------

    def create_sampling_client(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
    ) -> ClientFuture[SamplingClient]:
        """A sampling client on a saved checkpoint (`model_path`, tinker://...) or on the
        base weights of `base_model` (both: the checkpoint, which must be of that base).
        `record_stability_info=True` is refused (no stable_reinforce here)."""

        def create() -> SamplingClient:
            check_record_stability_info(record_stability_info)
            sampler_id = self.core.create_sampling_session(
                model_path=model_path, base_model=base_model
            )
            return SamplingClient(self.core, sampler_id, model_path)

        return ClientFuture(run_now(create))

    async def create_sampling_client_async(self, *args, **kwargs) -> SamplingClient:
        return await self.create_sampling_client(*args, **kwargs)

    # ----- custom losses ------------------------------------------------------------------

    def create_custom_loss(
        self, fn: Callable[..., Any], input_ranks: Mapping[str, types.CustomLossInputRank]
    ) -> APIFuture[LossHandle]:
        """A per-datum loss `fn(logprobs, *inputs) -> (scalar loss, metrics)` traced with the
        SDK's own tracer (`trace_loss`) and stored in the backend, as a server with
        `custom_loss_server_side` does: `forward_backward_custom(data, handle)` then runs it
        in one pass. Tracing problems raise ValueError here; a graph the backend refuses
        fails the future, naming what was refused."""
        handle = trace_loss(fn, input_ranks, self.session_id)
        existing = self._custom_loss_keys.get(handle.key)
        if existing is not None:
            raise ValueError(
                f"create_custom_loss: this session already created {existing!r} with the same "
                "traced loss; reuse its LossHandle"
            )
        self._custom_loss_keys[handle.key] = handle.name

        def create() -> LossHandle:
            loss_id = self.core.create_custom_loss(
                self.session_id, handle.name, list(handle.inputs), encode_graph(handle)
            )
            return dataclasses.replace(handle, loss_id=loss_id)

        return api_future(run_now(create))

    # ----- service ------------------------------------------------------------------------

    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        return self.core.get_server_capabilities()

    async def get_server_capabilities_async(self) -> types.GetServerCapabilitiesResponse:
        return self.core.get_server_capabilities()

    def close(self, status: str = "success", detail: str | None = None) -> APIFuture[None]:
        """End this session: it accepts no new models. The backend keeps serving others."""
        self.core.close_session(self.session_id, status, detail)
        return api_future(done(None))

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
