"""Sampling endpoints: sampling sessions (samplers) and `asample`."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from tinker import types

from skyrl_trainer.backend.core import check_record_stability_info
from skyrl_trainer.server.auth import authenticate
from skyrl_trainer.server.codec import encode_sample_response
from skyrl_trainer.server.future_tracker import PROTOBUF
from skyrl_trainer.server.http_errors import ApiError
from skyrl_trainer.server.state import ServerState, future_response

router = APIRouter(prefix="/api/v1")


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def _new_sampler(
    state: ServerState, owner: str, session_id: str | None, model_path: str | None,
    base_model: str | None,
) -> str:  # fmt: skip
    if model_path is not None:
        state.checkpoint(owner, model_path, field="model_path")
    elif base_model is None:
        raise ApiError(400, "base_model", "give model_path or base_model")
    # Building a sampler may start an engine: off the event loop.
    sampler_id = await asyncio.to_thread(
        state.core.create_sampling_session, model_path=model_path, base_model=base_model
    )
    base = state.core.sampler_base_model(sampler_id)
    state.db.add_sampler(sampler_id, owner, session_id, base, model_path)
    return sampler_id


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    body = await state.parse(request, types.CreateSamplingSessionRequest)
    state.session(owner, body.session_id)
    sampler_id = await _new_sampler(state, owner, body.session_id, body.model_path, body.base_model)
    return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id).model_dump()


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request, owner: str = Depends(authenticate)):
    row = _state(request).sampler(owner, sampler_id)
    return types.GetSamplerResponse(
        sampler_id=sampler_id, base_model=row["base_model"], model_path=row["model_path"]
    ).model_dump()


@router.post("/asample")
async def asample(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    body = await state.parse(request, types.SampleRequest)
    check_record_stability_info(body.record_stability_info)
    limits = state.config.limits
    if not 1 <= body.num_samples <= limits.max_num_samples:
        raise ApiError(400, "num_samples", f"must be between 1 and {limits.max_num_samples}")
    max_tokens = body.sampling_params.max_tokens
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise ApiError(
            400,
            "sampling_params.max_tokens",
            f"{max_tokens} is over the limit of {limits.max_tokens}",
        )
    session_id = None  # a request made without a sampling session expires with nothing
    if body.sampling_session_id is not None:
        session_id = state.sampler(owner, body.sampling_session_id)["session_id"]
        sampler_id = body.sampling_session_id
    else:
        sampler_id = await _new_sampler(state, owner, None, body.model_path, body.base_model)

    def respond() -> dict:
        request_id = state.start(
            owner,
            "Sample",
            lambda: state.core.sample(
                sampler_id,
                body.prompt,
                body.num_samples,
                body.sampling_params,
                include_prompt_logprobs=bool(body.prompt_logprobs),
                topk_prompt_logprobs=body.topk_prompt_logprobs,
                # The backend validates these (naming the field) and the engine produces them;
                # the vLLM engine refuses target_prompt_logprobs / prompt_alt_tokens_k by name.
                topk_sample_logprobs=body.topk_sample_logprobs,
                target_prompt_logprobs=body.target_prompt_logprobs,
                prompt_alt_tokens_k=body.prompt_alt_tokens_k,
                prompt_logprobs_last_n=body.prompt_logprobs_last_n,
            ),
            lambda response: (PROTOBUF, encode_sample_response(response)),
            session_id=session_id,
        )
        ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
        return future_response(request_id, sample_sequence_ids=ids)

    # core.sample may build the sampler's engine on first use: off the event loop.
    return await asyncio.to_thread(state.idempotent, request, owner, respond)
