"""The in-process `TrainingClient`: the Tinker SDK's training surface over `BackendCore`.

Methods take and return `tinker.types` objects and return `APIFuture`s at once; requests of
one client run in the order they were made. The `*_async` forms are coroutines that return
the future, exactly like the SDK's (`await (await tc.forward_backward_async(...))`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture
from tinker.lib.public_interfaces.custom_loss import LossHandle, check_loss_inputs, run_loss_handle

from skyrl_trainer.backend.clients.futures import ClientFuture, api_future, failed, mapped, run_now
from skyrl_trainer.backend.clients.sampling_client import SamplingClient
from skyrl_trainer.backend.core import CustomLossFn, check_record_stability_info
from skyrl_trainer.backend.errors import InvalidRequestError

if TYPE_CHECKING:
    from skyrl_trainer.backend.core import BackendCore


def _warn_deprecated(method: str, replacement: str) -> None:
    warnings.warn(
        f"TrainingClient.{method} is deprecated; use ServiceClient.{replacement}",
        FutureWarning,
        stacklevel=3,
    )


class TrainingClient:
    """Trains one model (a LoRA adapter or a full fine-tune) held by the in-process backend."""

    def __init__(self, core: BackendCore, model_id: str):
        self._core = core
        self.model_id = model_id
        self._info = core.get_info(model_id)

    # ----- forward / backward -------------------------------------------------------------

    def forward(
        self,
        data: list[types.Datum],
        loss_fn: types.LossFnType,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """Log-probs and loss without gradients."""
        return api_future(
            self._core.forward_backward(self.model_id, data, loss_fn, loss_fn_config, True)
        )

    async def forward_async(self, data, loss_fn, loss_fn_config=None):
        return self.forward(data, loss_fn, loss_fn_config)

    def forward_backward(
        self,
        data: list[types.Datum],
        loss_fn: types.LossFnType,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """Log-probs and loss (summed over tokens and datums); gradients accumulate until
        `optim_step`."""
        return api_future(
            self._core.forward_backward(self.model_id, data, loss_fn, loss_fn_config, False)
        )

    async def forward_backward_async(self, data, loss_fn, loss_fn_config=None):
        return self.forward_backward(data, loss_fn, loss_fn_config)

    def forward_backward_custom(
        self,
        data: list[types.Datum],
        loss_fn: CustomLossFn | LossHandle,
        *,
        loss_type_input: str | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """`loss_fn(data, logprobs_list) -> (loss, metrics)` computed in torch on the learner's
        log-probs; its gradient is applied through a cross_entropy surrogate, as in the SDK.

        A `LossHandle` from `ServiceClient.create_custom_loss` (which always uploads here) runs
        as `forward_backward(data, "custom", {"loss_id": ...})`: one pass, the rebuilt graph
        on the learner's log-probs, autograd through both. A handle without a loss id runs
        its traced graph like a callable."""
        if loss_type_input not in (None, "logprobs"):
            return api_future(
                failed(
                    InvalidRequestError(
                        "loss_type_input", f"{loss_type_input!r} is not supported; use 'logprobs'"
                    )
                )
            )
        if isinstance(loss_fn, LossHandle):
            session_id = self._core.model(self.model_id).session_id
            try:
                if loss_fn.session_id != session_id:
                    raise InvalidRequestError(
                        "loss_fn",
                        f"LossHandle {loss_fn.name!r} was created in session "
                        f"{loss_fn.session_id}; it can only be used by clients of that session",
                    )
                check_loss_inputs(loss_fn, data)
            except ValueError as exc:
                return api_future(failed(exc))
            if loss_fn.loss_id is not None:
                return self.forward_backward(data, "custom", {"loss_id": loss_fn.loss_id})
            handle = loss_fn
            loss_fn = lambda data, logprobs: run_loss_handle(handle, data, logprobs)  # noqa: E731
        if not callable(loss_fn):
            return api_future(failed(InvalidRequestError("loss_fn", "must be a callable")))
        return api_future(self._core.forward_backward_custom(self.model_id, data, loss_fn))

    async def forward_backward_custom_async(self, data, loss_fn, *, loss_type_input=None):
        return self.forward_backward_custom(data, loss_fn, loss_type_input=loss_type_input)

    # ----- optimizer ----------------------------------------------------------------------

    def optim_step(
        self,
        optim_params: types.AdamParams | None = None,
        *,
        adam_params: types.AdamParams | None = None,
    ) -> APIFuture[types.OptimStepResponse]:
        """One AdamW step with these hyper-parameters on the gradients accumulated so far."""
        if optim_params is not None and adam_params is not None:
            raise ValueError("Specify optim_params or legacy adam_params, not both")
        params = optim_params if optim_params is not None else adam_params
        if params is None:
            raise TypeError("optim_step() needs optim_params=types.AdamParams(...)")
        if not isinstance(params, types.AdamParams):
            return api_future(
                failed(
                    InvalidRequestError(
                        "optim_params",
                        f"{type(params).__name__} is not supported; this backend trains with "
                        "AdamW (types.AdamParams)",
                    )
                )
            )
        return api_future(self._core.optim_step(self.model_id, params))

    async def optim_step_async(self, optim_params=None, *, adam_params=None):
        return self.optim_step(optim_params, adam_params=adam_params)

    # ----- checkpoints --------------------------------------------------------------------

    def save_state(
        self,
        name: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[types.SaveWeightsResponse]:
        """Save weights and optimizer state as `tinker://<model_id>/weights/<name>`."""
        return api_future(
            self._core.save_state(
                self.model_id,
                name,
                overwrite=overwrite,
                ttl_seconds=ttl_seconds,
                user_metadata=user_metadata,
            )
        )

    async def save_state_async(self, name, ttl_seconds=None, overwrite=False, user_metadata=None):
        return self.save_state(name, ttl_seconds, overwrite, user_metadata)

    def load_state(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[types.LoadWeightsResponse]:
        """Load weights from a training checkpoint; the optimizer state starts fresh.

        Deprecated as in the SDK (prefer `ServiceClient.create_training_client_from_state`).
        Gradients accumulated before the load are discarded.
        """
        _warn_deprecated("load_state", "create_training_client_from_state")
        return api_future(self._core.load_state(self.model_id, path, with_optimizer=False))

    async def load_state_async(self, path, weights_access_token=None):
        return self.load_state(path, weights_access_token)

    def load_state_with_optimizer(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[types.LoadWeightsResponse]:
        """Load weights and optimizer state from a training checkpoint (deprecated, as in the
        SDK; prefer `ServiceClient.create_training_client_from_state_with_optimizer`)."""
        _warn_deprecated(
            "load_state_with_optimizer", "create_training_client_from_state_with_optimizer"
        )
        return api_future(self._core.load_state(self.model_id, path, with_optimizer=True))

    async def load_state_with_optimizer_async(self, path, weights_access_token=None):
        return self.load_state_with_optimizer(path, weights_access_token)

    # ----- sampling -----------------------------------------------------------------------

    def save_weights_for_sampler(
        self,
        name: str,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        """Save the current weights as `tinker://<model_id>/sampler_weights/<name>` (a PEFT
        adapter or a Hugging Face model folder) and load them into the sampling engine."""
        saved = self._core.save_weights_for_sampler(self.model_id, name, ttl_seconds, user_metadata)
        return api_future(mapped(saved, lambda r: types.SaveWeightsForSamplerResponse(path=r[0])))

    async def save_weights_for_sampler_async(self, name, ttl_seconds=None, user_metadata=None):
        return self.save_weights_for_sampler(name, ttl_seconds, user_metadata)

    def save_weights_and_get_sampling_client(
        self,
        name: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
        kind: str = "snapshot",
    ) -> ClientFuture[SamplingClient]:
        """A sampling client on exactly the current weights, synced in memory (no disk unless
        `name` is given, which also saves a sampler checkpoint). Only `kind="snapshot"`;
        `record_stability_info=True` is refused (no stable_reinforce here)."""
        try:
            check_record_stability_info(record_stability_info)
            if kind != "snapshot":
                raise InvalidRequestError(
                    "kind", f"{kind!r} sampling clients are not supported; use 'snapshot'"
                )
        except InvalidRequestError as exc:
            return ClientFuture(failed(exc))
        saved = self._core.save_weights_for_sampler(self.model_id, name)
        return ClientFuture(
            mapped(saved, lambda r: SamplingClient(self._core, sampler_id=r[1], model_path=r[0]))
        )

    async def save_weights_and_get_sampling_client_async(self, *args, **kwargs):
        return await self.save_weights_and_get_sampling_client(*args, **kwargs)

    def create_sampling_client(
        self, model_path: str, retry_config: Any = None, record_stability_info: bool = False
    ) -> ClientFuture:
        """A sampling client on a saved checkpoint (same as `ServiceClient`'s)."""

        def create() -> SamplingClient:
            check_record_stability_info(record_stability_info)
            sampler_id = self._core.create_sampling_session(model_path=model_path)
            return SamplingClient(self._core, sampler_id, model_path)

        return ClientFuture(run_now(create))

    async def create_sampling_client_async(self, *args, **kwargs):
        return await self.create_sampling_client(*args, **kwargs)

    # ----- info ---------------------------------------------------------------------------

    def get_info(self) -> types.GetInfoResponse:
        return self._info

    async def get_info_async(self) -> types.GetInfoResponse:
        return self._info

    def get_tokenizer(self) -> Any:
        return self._core.tokenizer(self._info.model_data.model_name or "")

    def __repr__(self) -> str:
        return f"TrainingClient(model_id={self.model_id!r})"
