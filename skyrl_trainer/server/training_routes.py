"""Training endpoints: create/load models, forward_backward, optim_step, save weights.

Each starts a backend request and answers at once with a future (`{request_id}`); the SDK
collects the result through `retrieve_future`. Requests carrying a model's `seq_id` run in
that order (see `sequencer`).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from tinker import types

from skyrl_trainer.server.auth import authenticate
from skyrl_trainer.server.codec import (
    decode_forward_backward_request,
    encode_forward_backward_output,
)
from skyrl_trainer.server.future_tracker import PROTOBUF, json_result
from skyrl_trainer.server.http_errors import ApiError
from skyrl_trainer.server.state import ServerState

router = APIRouter(prefix="/api/v1")


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _check_optimizer(config: types.OptimizerConfig | None) -> None:
    if config is not None and getattr(config, "type", "adamw") != "adamw":
        raise ApiError(
            400, "optimizer_config", f"{config.type!r} is not supported; this server uses AdamW"
        )


def _register_checkpoint(
    state: ServerState, owner: str, model_id: str, path: str, kind: str,
    ttl_seconds: int | None, user_metadata: dict | None,
) -> None:  # fmt: skip
    expires_at = time.time() + ttl_seconds if ttl_seconds else None
    name = path.rsplit("/", 1)[1]
    state.db.add_checkpoint(
        path,
        model_id,
        owner,
        kind,
        name,
        expires_at,
        state.core.checkpoint_size(path),
        user_metadata,
    )


def _register_model(state: ServerState, owner: str, session_id: str, model_id: str) -> None:
    record = state.core.model(model_id)
    rank = record.lora.rank if record.lora else None
    state.db.add_model(model_id, session_id, owner, record.base_model, rank, record.user_metadata)


@router.post("/create_model")
async def create_model(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    body = await state.parse(request, types.CreateModelRequest)
    state.session(owner, body.session_id)
    _check_optimizer(body.optimizer_config)
    model_id = f"{body.session_id}:train:{body.model_seq_id}"

    def encode(created_id: str):
        _register_model(state, owner, body.session_id, created_id)
        state.sequencer.start_model(created_id)
        return json_result(types.CreateModelResponse(model_id=created_id))

    return state.respond_with_future(
        request,
        owner,
        "CreateModel",
        lambda: state.core.create_model(
            body.session_id,
            body.base_model,
            body.lora_config,
            body.user_metadata,
            model_seq_id=body.model_seq_id,
        ),
        encode,
        future_model_id=model_id,
    )


@router.post("/get_info")
async def get_info(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    body = await state.parse(request, types.GetInfoRequest)
    state.model(owner, body.model_id)
    return state.core.get_info(body.model_id).model_dump(mode="json")


@router.post("/forward_backward")
@router.post("/forward")
async def forward_backward(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    call = decode_forward_backward_request(await state.body(request))
    state.model(owner, call.model_id, request, call.seq_id)
    cap = state.config.limits.max_batch_datums
    if len(call.data) > cap:
        raise ApiError(400, "data", f"{len(call.data)} datums is over the limit of {cap}")

    return state.respond_with_future(
        request,
        owner,
        "Forward" if call.forward_only else "ForwardBackward",
        lambda: state.core.forward_backward(
            call.model_id, call.data, call.loss_fn, call.loss_fn_config, call.forward_only
        ),
        lambda out: (PROTOBUF, encode_forward_backward_output(out)),
        model_id=call.model_id,
        seq_id=call.seq_id,
    )


@router.post("/optim_step")
async def optim_step(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    body = await state.parse(request, types.OptimStepRequest)
    state.model(owner, body.model_id, request, body.seq_id)
    if not isinstance(body.optim_params, types.AdamParams):
        raise ApiError(
            400, "optimizer_params", "this optimizer is not supported; the server trains with AdamW"
        )

    return state.respond_with_future(
        request,
        owner,
        "OptimStep",
        lambda: state.core.optim_step(body.model_id, body.optim_params),
        json_result,
        model_id=body.model_id,
        seq_id=body.seq_id,
    )


@router.post("/save_weights")
async def save_weights(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    body = await state.parse(request, types.SaveWeightsRequest)
    state.model(owner, body.model_id, request, body.seq_id)
    if not body.path:
        raise ApiError(400, "path", "a checkpoint name is required")

    def encode(saved: types.SaveWeightsResponse):
        _register_checkpoint(
            state, owner, body.model_id, saved.path, "training", body.ttl_seconds,
            body.user_metadata,
        )  # fmt: skip
        return json_result(saved)

    return state.respond_with_future(
        request,
        owner,
        "SaveWeights",
        lambda: state.core.save_state(
            body.model_id,
            body.path,
            overwrite=body.overwrite,
            ttl_seconds=body.ttl_seconds,
            user_metadata=body.user_metadata,
        ),
        encode,
        model_id=body.model_id,
        seq_id=body.seq_id,
    )


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    body = await state.parse(request, types.SaveWeightsForSamplerRequest)
    model = state.model(owner, body.model_id, request, body.seq_id)
    if body.kind != "snapshot":
        raise ApiError(
            400, "kind", f"{body.kind!r} sampling clients are not supported; use 'snapshot'"
        )
    if body.path is None and body.sampling_session_seq_id is None:
        raise ApiError(400, "path", "give a checkpoint name, or sampling_session_seq_id")

    def encode(result: tuple[str | None, str]):
        path, sampler_id = result
        if path is not None:
            _register_checkpoint(
                state, owner, body.model_id, path, "sampler", body.ttl_seconds,
                body.user_metadata,
            )  # fmt: skip
        state.db.add_sampler(sampler_id, owner, model["session_id"], model["base_model"], path)
        return json_result(
            types.SaveWeightsForSamplerResponseInternal(path=path, sampling_session_id=sampler_id)
        )

    return state.respond_with_future(
        request,
        owner,
        "SaveWeightsForSampler",
        lambda: state.core.save_weights_for_sampler(
            body.model_id, body.path, body.ttl_seconds, body.user_metadata
        ),
        encode,
        model_id=body.model_id,
        seq_id=body.seq_id,
    )


@router.post("/load_weights")
async def load_weights(request: Request, owner: str = Depends(authenticate)):
    """Legacy form (`model_id`): load into an existing model. Create-via-load form
    (`session_id` + `model_seq_id`): a new model that starts from the checkpoint."""
    state = _state(request)
    body = await state.parse(request, types.LoadWeightsRequest)
    if body.model_id is not None:  # first: a refusal below gives its seq_id back
        state.model(owner, body.model_id, request, body.seq_id)
    state.checkpoint(owner, body.path)
    if body.path.split("/")[-2:-1] != ["weights"]:
        raise ApiError(400, "path", "load_weights needs a training checkpoint (.../weights/<name>)")

    if body.model_id is not None:
        model_id = body.model_id

        def run():
            return state.core.load_state(model_id, body.path, with_optimizer=body.optimizer)

        encode = json_result
    else:
        if body.session_id is None or body.model_seq_id is None:
            raise ApiError(400, "session_id", "give model_id, or session_id and model_seq_id")
        _check_optimizer(body.optimizer_config)
        state.session(owner, body.session_id)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"

        def run():
            return state.core.create_model_from_state(
                body.session_id, body.path, body.optimizer, body.base_model, body.user_metadata,
                model_seq_id=body.model_seq_id,
            )  # fmt: skip

        def encode(created_id: str):
            _register_model(state, owner, body.session_id, created_id)
            state.sequencer.start_model(created_id)
            return json_result(types.LoadWeightsResponse(path=body.path, model_id=created_id))

    return state.respond_with_future(
        request,
        owner,
        "LoadWeights",
        run,
        encode,
        model_id=body.model_id,
        seq_id=body.seq_id if body.model_id is not None else None,
        future_model_id=model_id,
    )
