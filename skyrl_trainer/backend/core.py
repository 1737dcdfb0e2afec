"""The backend core: sessions, models, ordered request execution and checkpoints.

Both faces of the backend (the in-process clients and the HTTP server) call this class and
nothing below it, so every Tinker semantic lives here once:
- requests for models on one base model run one at a time, in submission order, on that
  base's executor thread (so a model's requests never overtake each other);
- gradients accumulate over `forward_backward` calls until `optim_step` (worker-side);
- a request that fails (bad input, a mismatched checkpoint) changes nothing;
- checkpoints live at `tinker://<model_id>/weights/<name>` in the checkpoint store.
Every request method returns a `concurrent.futures.Future` at once; errors arrive through it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from tinker import types

from skyrl_trainer.backend import custom_loss_graph, model_loading
from skyrl_trainer.backend.base_models import BaseModelCatalog
from skyrl_trainer.backend.checkpoints import CheckpointMetadata, CheckpointStore
from skyrl_trainer.backend.config import BackendConfig
from skyrl_trainer.backend.datums import to_training_examples
from skyrl_trainer.backend.errors import InvalidRequestError, NotFoundError
from skyrl_trainer.backend.futures import failed
from skyrl_trainer.backend.losses import get_loss, resolve_loss_config
from skyrl_trainer.backend.optimizer import validate_adam_params
from skyrl_trainer.backend.sample_requests import to_generation_request, to_sample_response
from skyrl_trainer.backend.sampler_registry import SamplerRegistry
from skyrl_trainer.backend.worker_group import TrainingWorkerGroup, make_worker_group

T = TypeVar("T")

CustomLossFn = Callable[
    [list[types.Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]
]


@dataclass
class ModelRecord:
    model_id: str
    session_id: str
    base_model: str
    lora: types.LoraConfig | None
    user_metadata: dict[str, str] | None = None


@dataclass
class _BaseModelSlot:
    """One base model: its executor (the ordering guarantee) and, once loaded, its workers."""

    name: str
    executor: ThreadPoolExecutor
    group: TrainingWorkerGroup | None = None


@dataclass
class _Session:
    session_id: str
    user_metadata: dict[str, str] | None
    model_seq: itertools.count = field(default_factory=itertools.count)
    end_status: str | None = None  # set by close_session
    custom_losses: dict[str, custom_loss_graph.CustomLossProgram] = field(default_factory=dict)
    custom_loss_seq: itertools.count = field(default_factory=itertools.count)


RECORD_STABILITY_INFO_REFUSAL = (
    "is not supported by this backend: stability records exist only for the stable_reinforce "
    "loss, which it does not implement; create the sampling client with "
    "record_stability_info=False (the default)"
)


def check_record_stability_info(record_stability_info: bool | None) -> None:
    """Refuse `record_stability_info=True`: nothing here would ever read the records."""
    if record_stability_info:
        raise InvalidRequestError("record_stability_info", RECORD_STABILITY_INFO_REFUSAL)


def check_provenance(data: Sequence[types.Datum]) -> None:
    """Refuse malformed provenance spans (`Datum.with_provenance`), naming the field.

    Provenance says which sampled sequence or prompt each token came from. Only the
    stable_reinforce loss reads it (and that loss is refused by name); every other loss is
    defined on the tokens alone, so well-formed spans change nothing, as on the Tinker service.
    The tinker-cookbook's RL framework attaches them to every datum it builds."""
    for i, datum in enumerate(data):
        inputs, targets = datum.model_input_spans, datum.loss_fn_input_spans
        if (inputs is None) != (targets is None):
            missing = "model_input_spans" if inputs is None else "loss_fn_input_spans"
            raise InvalidRequestError(
                f"data[{i}].{missing}", "provenance comes as a pair: set both span lists or neither"
            )
        if inputs is None:
            continue
        tiled = [("model_input_spans", inputs, datum.model_input.length)]
        if "target_tokens" in datum.loss_fn_inputs:
            tiled.append(
                ("loss_fn_input_spans", targets, _positions(datum.loss_fn_inputs["target_tokens"]))
            )
        for name, spans, length in tiled:
            covered = sum(span.length for span in spans)
            if covered != length:
                raise InvalidRequestError(
                    f"data[{i}].{name}",
                    f"the spans cover {covered} positions but the field has {length}; "
                    "the runs must tile it exactly (see Datum.with_provenance)",
                )


def _positions(tensor: Any) -> int:
    """Length of the first dimension of a loss_fn_inputs value (TensorData or a list)."""
    shape = getattr(tensor, "shape", None)
    return int(shape[0]) if shape else len(getattr(tensor, "data", tensor))


def _output(logprobs: list[torch.Tensor], metrics: dict[str, float]) -> types.ForwardBackwardOutput:
    return types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[{"logprobs": types.TensorData.from_torch(lp)} for lp in logprobs],
        metrics=metrics,
    )


class BackendCore:
    """One in-process Tinker backend. Thread-safe; share one per process."""

    def __init__(self, config: BackendConfig | None = None, served_only: bool = False):
        """`served_only` (the HTTP server): only `config.base_models` can be used, under their
        public names (`base_models`); else any loadable name or folder."""
        self.config = config or BackendConfig()
        self.base_models = BaseModelCatalog(self.config.base_models, served_only)
        self.store = CheckpointStore(self.config.resolved_storage_dir())
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._models: dict[str, ModelRecord] = {}
        self._bases: dict[str, _BaseModelSlot] = {}
        self._tokenizers: dict[str, Any] = {}
        self.samplers = SamplerRegistry(
            self.config.sampling, self._model_dir, ray_config=self.config.training.ray
        )
        self._sample_seq = itertools.count()

    # ----- sessions and lookup ------------------------------------------------------------

    def create_session(
        self, user_metadata: dict[str, str] | None = None, session_id: str | None = None
    ) -> str:
        """A new session; with `session_id`, that id (kept if it exists: the HTTP server
        re-attaches sessions it persisted)."""
        session_id = session_id or uuid.uuid4().hex[:16]
        with self._lock:
            self._sessions.setdefault(session_id, _Session(session_id, user_metadata))
        return session_id

    def close_session(self, session_id: str, status: str, detail: str | None = None) -> None:
        """Mark a session ended: it can create no more models; its models stay usable."""
        self._session(session_id).end_status = status

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFoundError("session_id", f"unknown session '{session_id}'")
        return session

    def model(self, model_id: str) -> ModelRecord:
        record = self._models.get(model_id)
        if record is None:
            raise NotFoundError("model_id", f"unknown model '{model_id}'")
        return record

    def model_dir(self, base_model: str) -> Path:
        """The local folder `base_model` loads from (for the server's tokenizer files route;
        never sent to a client)."""
        return self._model_dir(self.base_models.resolve(base_model))

    def _model_dir(self, base_model: str) -> Path:
        """The folder of a known base model (a name from `base_models.resolve`)."""
        source = self.base_models.source(base_model)
        return model_loading.resolve_model_dir(source, self.config.resolved_cache_dir())

    def _base_slot(self, base_model: str) -> _BaseModelSlot:
        key = self.base_models.resolve(base_model)
        with self._lock:
            slot = self._bases.get(key)
            if slot is None:
                executor = ThreadPoolExecutor(1, thread_name_prefix=f"skyrl-train-{key[-24:]}")
                slot = self._bases[key] = _BaseModelSlot(key, executor)
            return slot

    def _group(self, slot: _BaseModelSlot) -> TrainingWorkerGroup:
        """The base model's worker group, loaded on first use (runs on the slot's thread)."""
        if slot.group is None:
            try:
                slot.group = make_worker_group(self._model_dir(slot.name), self.config.training)
            except BaseException:
                # A name that does not load keeps no executor thread behind.
                with self._lock:
                    if self._bases.get(slot.name) is slot:
                        del self._bases[slot.name]
                slot.executor.shutdown(wait=False)
                raise
        return slot.group

    def _submit(self, slot: _BaseModelSlot, job: Callable[[], T]) -> Future[T]:
        return slot.executor.submit(job)

    def _submit_for_model(
        self, model_id: str, job: Callable[[ModelRecord, TrainingWorkerGroup], T]
    ) -> Future[T]:
        """Queue `job` behind every earlier request on the model's base model."""
        try:
            record = self.model(model_id)
        except InvalidRequestError as exc:
            return failed(exc)
        slot = self._base_slot(record.base_model)
        return self._submit(slot, lambda: job(record, self._group(slot)))

    # ----- models -------------------------------------------------------------------------

    def create_model(
        self,
        session_id: str,
        base_model: str,
        lora: types.LoraConfig | None,
        user_metadata: dict[str, str] | None = None,
        model_seq_id: int | None = None,
        initial_state: tuple[str, bool] | None = None,
    ) -> Future[str]:
        """Create a trainable model (LoRA adapter, or full fine-tuning when `lora` is None).

        With `initial_state=(path, with_optimizer)` the model starts from that checkpoint; if
        loading fails, the model is removed again and the error returned.
        """
        try:
            session = self._session(session_id)
            if session.end_status is not None:
                raise InvalidRequestError("session_id", f"session '{session_id}' was closed")
            # Known by one name from here on: a relative path must mean the same folder later.
            base_model = self.base_models.resolve(base_model)
            seq = next(session.model_seq) if model_seq_id is None else model_seq_id
            model_id = f"{session_id}:train:{seq}"
            if model_id in self._models:
                raise InvalidRequestError("model_seq_id", f"model '{model_id}' already exists")
            slot = self._base_slot(base_model)
        except InvalidRequestError as exc:
            return failed(exc)

        def job() -> str:
            group = self._group(slot)
            group.create_model(model_id, lora)
            record = ModelRecord(model_id, session_id, base_model, lora, user_metadata)
            if initial_state is not None:
                path, with_optimizer = initial_state
                try:
                    folder, metadata = self.store.resolve(path)
                    self._check_compatible(record, metadata)
                    group.load_state(model_id, folder, with_optimizer=with_optimizer)
                except BaseException:
                    group.remove_model(model_id)
                    raise
            with self._lock:
                self._models[model_id] = record
            return model_id

        return self._submit(slot, job)

    def get_info(self, model_id: str) -> types.GetInfoResponse:
        record = self.model(model_id)
        slot = self._base_slot(record.base_model)
        assert slot.group is not None  # the model exists, so its base is loaded
        description = slot.group.description
        return types.GetInfoResponse(
            model_id=model_id,
            model_data=types.ModelData(
                arch=description.arch,
                model_name=record.base_model,
                tokenizer_id=self.base_models.tokenizer_id(
                    record.base_model, description.model_dir
                ),
            ),
            is_lora=record.lora is not None,
            lora_rank=record.lora.rank if record.lora else None,
            model_name=record.base_model,
        )

    def tokenizer(self, base_model: str) -> Any:
        """The base model's tokenizer (loaded once)."""
        key = self.base_models.resolve(base_model)
        if key not in self._tokenizers:
            self._tokenizers[key] = model_loading.load_tokenizer(self._model_dir(key))
        return self._tokenizers[key]

    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        return types.GetServerCapabilitiesResponse(
            supported_models=[
                types.SupportedModel(model_name=name, trainable=True, sampleable=True)
                for name in self.base_models.names or self.config.base_models
            ]
        )

    # ----- custom losses ------------------------------------------------------------------

    def create_custom_loss(
        self,
        session_id: str,
        name: str,
        inputs: Sequence[Any],
        graph: Any,
        custom_loss_seq_id: int | None = None,
    ) -> str:
        """Store a traced custom loss (`tinker.types.CreateCustomLossRequest`'s name, inputs
        and graph) for the session's models; returns its loss id,
        `<session_id>:loss:<seq>`. The graph is rebuilt from `custom_loss_graph`'s allowlist
        or refused (InvalidRequestError naming what). The same upload again under the same
        seq id (an SDK retry) returns the same id."""
        session = self._session(session_id)
        program = custom_loss_graph.rebuild(name, inputs, graph)
        with self._lock:
            seq = (
                next(session.custom_loss_seq) if custom_loss_seq_id is None else custom_loss_seq_id
            )
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
                raise InvalidRequestError("custom_loss_seq_id", f"must be an int >= 0, got {seq!r}")
            loss_id = f"{session_id}:loss:{seq}"
            existing = session.custom_losses.get(loss_id)
            if existing is not None:
                if existing != program:
                    raise InvalidRequestError(
                        "custom_loss_seq_id", f"loss '{loss_id}' already exists with another graph"
                    )
                return loss_id
            if len(session.custom_losses) >= custom_loss_graph.MAX_LOSSES_PER_SESSION:
                raise InvalidRequestError(
                    "custom_loss_seq_id",
                    f"a session may hold at most {custom_loss_graph.MAX_LOSSES_PER_SESSION} "
                    "custom losses",
                )
            session.custom_losses[loss_id] = program
        return loss_id

    def _custom_loss(
        self, record: ModelRecord, loss_fn_config: Mapping[str, Any] | None
    ) -> custom_loss_graph.CustomLossProgram:
        """The uploaded loss `loss_fn_config` names (`{"loss_id": ...}`), of the model's
        session."""
        config = dict(loss_fn_config or {})
        loss_id = config.pop("loss_id", None)
        if config:
            raise InvalidRequestError(
                f"loss_fn_config.{sorted(config)[0]}",
                "unknown key for loss 'custom'; it takes only loss_id",
            )
        if not isinstance(loss_id, str):
            raise InvalidRequestError(
                "loss_fn_config.loss_id",
                "loss 'custom' runs a loss uploaded with create_custom_loss: pass "
                "{'loss_id': <its id>} (forward_backward_custom with its LossHandle does)",
            )
        session = self._sessions.get(record.session_id)
        program = session.custom_losses.get(loss_id) if session is not None else None
        if program is None:
            raise InvalidRequestError(
                "loss_fn_config.loss_id",
                f"unknown custom loss {loss_id!r} for model '{record.model_id}' (a loss is "
                "usable by the models of the session that created it, and lives in memory "
                "with it: after a server restart, upload it again with create_custom_loss)",
            )
        return program

    def _forward_backward_graph(
        self,
        model_id: str,
        data: Sequence[types.Datum],
        loss_fn_config: Mapping[str, Any] | None,
        forward_only: bool,
    ) -> Future[types.ForwardBackwardOutput]:
        """`forward_backward(data, "custom", {"loss_id": ...})`: the uploaded loss in one
        pass. The learner's log-probs go through the rebuilt graph with each datum's inputs
        and autograd backpropagates through both; metrics: the loss's own (`:sum` summed,
        `:mean` averaged over datums, as the SDK does) and `loss:sum`."""

        def job(record: ModelRecord, group: TrainingWorkerGroup) -> types.ForwardBackwardOutput:
            self.samplers.before_training(record.base_model)  # colocated engines sleep
            program = self._custom_loss(record, loss_fn_config)
            desc = group.description
            examples = custom_loss_graph.to_examples(
                data, program, desc.vocab_size, desc.max_length
            )
            spec = custom_loss_graph.loss_spec(program)
            result = group.forward_backward(model_id, examples, spec, {}, backward=not forward_only)
            metrics = custom_loss_graph.metrics(program, result.logprobs, examples)
            return _output(result.logprobs, {**metrics, "loss:sum": result.loss_sum})

        return self._submit_for_model(model_id, job)

    # ----- training -----------------------------------------------------------------------

    def forward_backward(
        self,
        model_id: str,
        data: Sequence[types.Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        forward_only: bool = False,
    ) -> Future[types.ForwardBackwardOutput]:
        """Per-token log-probs and the summed loss (`loss:sum`); unless `forward_only`,
        the loss's gradients are added to the model's accumulated gradients.

        `loss_fn="custom"` with `{"loss_id": ...}` runs a loss uploaded with
        `create_custom_loss` (`_forward_backward_graph`)."""
        try:
            check_provenance(data)
        except InvalidRequestError as exc:
            return failed(exc)
        if loss_fn == "custom":
            return self._forward_backward_graph(model_id, data, loss_fn_config, forward_only)

        def job(record: ModelRecord, group: TrainingWorkerGroup) -> types.ForwardBackwardOutput:
            self.samplers.before_training(record.base_model)  # colocated engines sleep
            spec = get_loss(loss_fn)
            config = resolve_loss_config(spec, loss_fn_config)
            desc = group.description
            examples = to_training_examples(data, spec, desc.vocab_size, desc.max_length)
            result = group.forward_backward(
                model_id, examples, spec, config, backward=not forward_only
            )
            return _output(result.logprobs, {"loss:sum": result.loss_sum})

        return self._submit_for_model(model_id, job)

    def forward_backward_custom(
        self, model_id: str, data: Sequence[types.Datum], loss_fn: CustomLossFn
    ) -> Future[types.ForwardBackwardOutput]:
        """A user loss on the learner's log-probs, as the Tinker SDK computes it.

        One queued job: a forward pass for log-probs, `loss_fn(data, logprobs)` in torch,
        then a cross_entropy backward with `weights = -dloss/dlogprobs` (its gradient is the
        custom loss's gradient). Metrics: the user's plus `loss:sum` (the custom loss) and
        `surrogate_loss:sum`.
        """
        try:
            check_provenance(data)
        except InvalidRequestError as exc:
            return failed(exc)

        def job(record: ModelRecord, group: TrainingWorkerGroup) -> types.ForwardBackwardOutput:
            self.samplers.before_training(record.base_model)  # colocated engines sleep
            spec = get_loss("cross_entropy")
            desc = group.description
            ce_data = [_cross_entropy_view(d, f"data[{i}]") for i, d in enumerate(data)]
            examples = to_training_examples(ce_data, spec, desc.vocab_size, desc.max_length)
            forward = group.forward_backward(model_id, examples, spec, {}, backward=False)
            logprobs = [lp.clone().requires_grad_(True) for lp in forward.logprobs]
            loss, user_metrics = loss_fn(list(data), logprobs)
            loss.backward()
            for i, (lp, example) in enumerate(zip(logprobs, examples, strict=True)):
                if lp.grad is None:
                    raise InvalidRequestError(
                        f"loss_fn (datum {i})", "the custom loss does not depend on its logprobs"
                    )
                example.loss_inputs["weights"] = -lp.grad.float()
            backward = group.forward_backward(model_id, examples, spec, {}, backward=True)
            metrics = {**user_metrics, "loss:sum": float(loss.detach().sum())}
            metrics["surrogate_loss:sum"] = backward.loss_sum
            return _output(backward.logprobs, metrics)

        return self._submit_for_model(model_id, job)

    def optim_step(self, model_id: str, adam: types.AdamParams) -> Future[types.OptimStepResponse]:
        """One AdamW step on the accumulated gradients with `adam`'s hyper-parameters."""

        def job(record: ModelRecord, group: TrainingWorkerGroup) -> types.OptimStepResponse:
            if not isinstance(adam, types.AdamParams):
                raise InvalidRequestError(
                    "adam_params", f"expected tinker.types.AdamParams, got {type(adam).__name__}"
                )
            validate_adam_params(adam)
            return types.OptimStepResponse(metrics=group.optim_step(model_id, adam))

        return self._submit_for_model(model_id, job)

    # ----- checkpoints --------------------------------------------------------------------

    def save_state(
        self,
        model_id: str,
        name: str,
        *,
        overwrite: bool = False,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> Future[types.SaveWeightsResponse]:
        """Save weights and optimizer state to `tinker://<model_id>/weights/<name>`."""

        def job(record: ModelRecord, group: TrainingWorkerGroup) -> types.SaveWeightsResponse:
            metadata = _checkpoint_metadata(record, True, ttl_seconds, user_metadata)
            path = self.store.write(
                model_id,
                "training",
                name,
                metadata,
                lambda folder: group.save_state(model_id, folder, with_optimizer=True),
                overwrite=overwrite,
            )
            return types.SaveWeightsResponse(path=path, type="save_weights")

        return self._submit_for_model(model_id, job)

    def _check_compatible(self, record: ModelRecord, metadata: CheckpointMetadata) -> None:
        ours = self.base_models.resolve(record.base_model)
        theirs = self.base_models.resolve(metadata.base_model, field="path")
        if ours != theirs:
            raise InvalidRequestError(
                "path",
                f"checkpoint was trained on base model '{theirs}', but model "
                f"'{record.model_id}' is on '{record.base_model}'",
            )
        if metadata.is_lora != (record.lora is not None):
            kinds = {True: "a LoRA", False: "a full fine-tuning"}
            raise InvalidRequestError(
                "path",
                f"checkpoint is {kinds[metadata.is_lora]} checkpoint but model "
                f"'{record.model_id}' is {kinds[record.lora is not None]} model",
            )
        if record.lora and metadata.lora_rank != record.lora.rank:
            raise InvalidRequestError(
                "path",
                f"checkpoint has LoRA rank {metadata.lora_rank}, model '{record.model_id}' "
                f"has rank {record.lora.rank}",
            )

    def load_state(
        self, model_id: str, path: str, with_optimizer: bool
    ) -> Future[types.LoadWeightsResponse]:
        """Load a training checkpoint into an existing model (optimizer reset unless asked)."""

        def job(record: ModelRecord, group: TrainingWorkerGroup) -> types.LoadWeightsResponse:
            folder, metadata = self.store.resolve(path)
            self._check_compatible(record, metadata)
            group.load_state(model_id, folder, with_optimizer=with_optimizer)
            return types.LoadWeightsResponse(path=path)

        return self._submit_for_model(model_id, job)

    def create_model_from_state(
        self,
        session_id: str,
        path: str,
        with_optimizer: bool,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        model_seq_id: int | None = None,
    ) -> Future[str]:
        """A new model initialised from a training checkpoint (same base and LoRA config)."""
        try:
            _, metadata = self.store.resolve(path)
            trained_on = self.base_models.resolve(metadata.base_model, field="path")
            if base_model is not None and self.base_models.resolve(base_model) != trained_on:
                raise InvalidRequestError(
                    "base_model",
                    f"is '{base_model}' but the checkpoint was trained on '{trained_on}'",
                )
        except InvalidRequestError as exc:
            return failed(exc)
        return self.create_model(
            session_id,
            trained_on,
            metadata.lora(),
            user_metadata,
            model_seq_id,
            initial_state=(path, with_optimizer),
        )

    def checkpoint_metadata(self, path: str, field: str = "path") -> CheckpointMetadata:
        """What the checkpoint at `path` was made from (its base model by the name this
        backend knows it by)."""
        _, metadata = self.store.resolve(path, field=field)
        base = self.base_models.resolve(metadata.base_model, field=field)
        return replace(metadata, base_model=base)

    def checkpoint_size(self, path: str) -> int:
        """Bytes the checkpoint at `path` takes on disk."""
        folder, _ = self.store.resolve(path)
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())

    def check_checkpoint_path(self, path: str, field: str = "path") -> None:
        """Refuse a path that is not of the form tinker://<run>/<kind>/<name> or would leave
        the checkpoint storage; the checkpoint need not exist."""
        self.store.folder_of(path, field=field)

    def set_checkpoint_expiry(self, path: str, expires_at: float | None) -> None:
        self.store.set_expiry(path, expires_at)

    def delete_checkpoint(self, path: str) -> bool:
        """Remove the checkpoint's folder; False if there was none."""
        return self.store.delete(path)

    # ----- sampling -----------------------------------------------------------------------

    def save_weights_for_sampler(
        self,
        model_id: str,
        name: str | None = None,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> Future[tuple[str | None, str]]:
        """Make a sampler serve the model's current weights; returns (path, sampler_id).

        Queued behind the model's earlier requests, so the snapshot holds every preceding
        `optim_step`. The weights reach the engine in memory (LoRA: an adapter; full
        fine-tuning: an in-place update). With `name`, they are also saved as the checkpoint
        `tinker://<model_id>/sampler_weights/<name>` (PEFT adapter or HF model folder).
        """

        def job(record: ModelRecord, group: TrainingWorkerGroup) -> tuple[str | None, str]:
            path = None
            if name is not None:
                metadata = _checkpoint_metadata(record, False, ttl_seconds, user_metadata)
                path = self.store.write(
                    model_id,
                    "sampler",
                    name,
                    metadata,
                    lambda folder: group.save_sampler_weights(model_id, folder),
                    overwrite=True,
                )
            if record.lora is None:
                weights = group.full_weights(model_id)
                return path, self.samplers.bind_full_weights(model_id, record.base_model, weights)
            if path is not None:
                folder, _ = self.store.resolve(path)
                return path, self.samplers.bind_lora(model_id, record.base_model, folder, path)
            sampler_id = self.samplers.bind_lora_tensors(
                model_id,
                record.base_model,
                lambda folder: group.save_sampler_weights(model_id, folder),
            )
            return None, sampler_id

        return self._submit_for_model(model_id, job)

    def create_sampling_session(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> str:
        """A sampler on a saved checkpoint (`model_path`) or on a base model's weights.

        Both may be given (the Tinker SDK sends both when the caller names both): the
        checkpoint is sampled, and `base_model` must be the base model it was trained on."""
        if model_path is None and base_model is None:
            raise InvalidRequestError("model_path", "pass model_path or base_model")
        if model_path is None:
            return self.samplers.bind_base(self.base_models.resolve(base_model))
        folder, metadata = self.store.resolve(model_path, field="model_path")
        base = self.base_models.resolve(metadata.base_model, field="model_path")
        if base_model is not None and self.base_models.resolve(base_model) != base:
            raise InvalidRequestError(
                "base_model",
                f"is {base_model!r}, but the checkpoint at model_path {model_path!r} was trained "
                f"on {base!r}; give model_path alone, or with base_model={base!r}",
            )
        if metadata.is_lora:
            return self.samplers.bind_lora(model_path, base, folder, model_path)
        return self.samplers.bind_full_folder(model_path, base, folder, metadata.created_at)

    def sampler_base_model(self, sampler_id: str) -> str:
        return self.samplers.binding(sampler_id).base_model

    def sampler_tokenizer(self, sampler_id: str) -> Any:
        """The tokenizer of the engine serving the sampler."""
        return self.samplers.tokenizer(sampler_id)

    def sample(
        self,
        sampler_id: str,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: Any = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> Future[types.SampleResponse]:
        """Sample `num_samples` continuations of `prompt` from the sampler's weights.

        The arguments are the SDK's `SamplingClient.sample` ones (`target_prompt_logprobs` is a
        `TensorData`, the SDK's dataclass or its pydantic wire model, dense or sparse CSR);
        `to_generation_request` validates them, naming the field."""
        try:
            engine = self.samplers.engine(sampler_id)
            request = to_generation_request(
                prompt,
                num_samples,
                sampling_params,
                include_prompt_logprobs=include_prompt_logprobs,
                topk_prompt_logprobs=topk_prompt_logprobs,
                vocab_size=engine.vocab_size,
                context_length=engine.max_model_len,
                eos_token_id=engine.tokenizer.eos_token_id,
                config=self.config.sampling,
                topk_sample_logprobs=topk_sample_logprobs,
                prompt_logprobs_last_n=prompt_logprobs_last_n,
                target_prompt_logprobs=target_prompt_logprobs,
                prompt_alt_tokens_k=prompt_alt_tokens_k,
            )
            result = self.samplers.generate(sampler_id, request)
        except InvalidRequestError as exc:
            return failed(exc)
        prefix = f"{sampler_id}:{next(self._sample_seq)}"
        stop = getattr(engine, "cancel", None)  # an engine that can stop running requests
        return _SampleFuture(
            result,
            lambda r: to_sample_response(
                r,
                prefix,
                topk_prompt_logprobs,
                topk_sample_logprobs=topk_sample_logprobs,
                target_prompt_logprobs=target_prompt_logprobs,
                prompt_alt_tokens_k=prompt_alt_tokens_k,
            ),
            (lambda: stop(result)) if stop is not None else result.cancel,
        )

    def shutdown(self) -> None:
        for slot in list(self._bases.values()):
            slot.executor.shutdown(wait=True, cancel_futures=True)
            if slot.group is not None:
                slot.group.shutdown()  # a Ray group kills its actors
        self.samplers.shutdown()


class _SampleFuture(Future):
    """The future `BackendCore.sample` returns: `convert` of the engine's result. `cancel()`
    (while unfinished) also calls `stop`, which frees the request's place in the engine: a
    queued request is dropped, and an engine with a `cancel` method drops running rows too."""

    def __init__(self, engine_future: Future, convert: Callable[[Any], Any], stop: Callable):
        super().__init__()
        self._stop = stop
        engine_future.add_done_callback(lambda done: self._engine_done(done, convert))

    def _engine_done(self, done: Future, convert: Callable[[Any], Any]) -> None:
        if self.done():
            return  # cancelled first
        try:
            value, error = convert(done.result()), None
        except BaseException as exc:
            value, error = None, exc
        with contextlib.suppress(InvalidStateError):  # a cancel() raced us
            if error is None:
                self.set_result(value)
            else:
                self.set_exception(error)

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self._stop()
        return True


def _checkpoint_metadata(
    record: ModelRecord,
    has_optimizer: bool,
    ttl_seconds: int | None,
    user_metadata: dict[str, str] | None,
) -> CheckpointMetadata:
    now = time.time()
    return CheckpointMetadata(
        base_model=record.base_model,
        is_lora=record.lora is not None,
        lora_rank=record.lora.rank if record.lora else None,
        lora_config=record.lora.model_dump() if record.lora else None,
        model_id=record.model_id,
        has_optimizer=has_optimizer,
        created_at=now,
        expires_at=now + ttl_seconds if ttl_seconds else None,
        user_metadata=user_metadata,
    )


def _cross_entropy_view(datum: types.Datum, field_name: str) -> types.Datum:
    """The datum with only cross_entropy's inputs (zero weights where none are given)."""
    targets = datum.loss_fn_inputs.get("target_tokens") if isinstance(datum, types.Datum) else None
    if targets is None:
        raise InvalidRequestError(f"{field_name}.loss_fn_inputs.target_tokens", "is missing")
    weights = datum.loss_fn_inputs.get("weights")
    if weights is None:
        # np.zeros of the shape, not of len(targets.data): a sparse CSR `data` lists only
        # some cells of a 2-D target_tokens.
        shape = targets.shape if targets.shape is not None else np.shape(targets.to_numpy())
        weights = types.TensorData.from_numpy(np.zeros(shape, dtype=np.float32))
    return types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )
