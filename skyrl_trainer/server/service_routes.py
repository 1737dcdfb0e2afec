"""Service endpoints: client config, sessions, heartbeats, telemetry, capabilities, and
`retrieve_future` (how the SDK collects every asynchronous result)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel
from tinker import types

from skyrl_trainer.server.auth import authenticate
from skyrl_trainer.server.http_errors import ApiError
from skyrl_trainer.server.state import ServerState

router = APIRouter(prefix="/api/v1")


class _FinishRequest(BaseModel):
    reason: dict | None = None
    detail: str | None = None


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.post("/client/config")
async def client_config(request: Request, owner: str = Depends(authenticate)):
    """Feature flags for the SDK: zstd request bodies, and forward/backward chunks that stay
    under this server's batch and size limits."""
    limits = _state(request).config.limits
    return types.ClientConfigResponse(
        proto_compress_fwdbwd=True,
        fwdbwd_max_chunk_len=limits.max_batch_datums,
        fwdbwd_max_chunk_bytes_count=min(5_000_000, limits.max_request_bytes // 2),
    ).model_dump()


@router.post("/create_session")
async def create_session(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    body = await state.parse(request, types.CreateSessionRequest)
    session_id = uuid.uuid4().hex
    state.db.add_session(session_id, owner, body.model_dump())
    state.core.create_session(body.user_metadata, session_id=session_id)
    return types.CreateSessionResponse(session_id=session_id).model_dump()


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    body = await state.parse(request, types.SessionHeartbeatRequest)
    state.session(owner, body.session_id)
    state.db.touch_session(body.session_id)
    return types.SessionHeartbeatResponse().model_dump()


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    state.session(owner, session_id)
    body = await state.parse(request, _FinishRequest)
    status = (body.reason or {}).get("type", "success")
    state.db.end_session(session_id, status)
    state.core.close_session(session_id, status, body.detail)
    return {}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    row = state.session(owner, session_id)
    return types.GetSessionResponse(
        training_run_ids=state.db.session_models(session_id),
        sampler_ids=state.db.session_samplers(session_id),
        display_name=row["display_name"],
    ).model_dump()


@router.get("/sessions")
async def list_sessions(
    request: Request, limit: int = 20, offset: int = 0, owner: str = Depends(authenticate)
):
    rows = _state(request).db.sessions(owner, limit, offset)
    return types.ListSessionsResponse(sessions=[r["session_id"] for r in rows]).model_dump()


@router.post("/telemetry")
async def telemetry(owner: str = Depends(authenticate)):
    return {"status": "accepted"}  # accepted and dropped: this server keeps no telemetry


@router.get("/get_server_capabilities")
async def get_server_capabilities(request: Request, owner: str = Depends(authenticate)):
    return _state(request).core.get_server_capabilities().model_dump(exclude_none=True)


@router.post("/retrieve_future")
async def retrieve_future(request: Request, owner: str = Depends(authenticate)):
    """The stored result, or `try_again` when it is not ready within `retrieve_wait_s` (the
    SDK polls again at once; it gives up on a connection held past 45 s)."""
    state = _state(request)
    body = await state.parse(request, types.FutureRetrieveRequest)
    row = await state.tracker.wait(body.request_id, state.config.retrieve_wait_s)
    if row is None or row["owner"] != owner:
        raise ApiError(404, "request_id", f"unknown request '{body.request_id}'")
    if row["status"] == "pending":
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
    return Response(row["payload"], media_type=row["content_type"])
