"""Service endpoints: client config, sessions, heartbeats, telemetry, capabilities, and
`retrieve_future` (how the SDK collects every asynchronous result)."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel
from tinker import types

from skyrl_trainer.backend.futures import run_now
from skyrl_trainer.server.auth import authenticate
from skyrl_trainer.server.checkpoint_routes import access_scope
from skyrl_trainer.server.future_tracker import json_result
from skyrl_trainer.server.http_errors import ApiError
from skyrl_trainer.server.state import ServerState

router = APIRouter(prefix="/api/v1")


class _CancelRequest(BaseModel):
    request_id: str


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
    """Feature flags for the SDK: zstd request bodies, forward/backward chunks that stay
    under this server's batch and size limits, and server-side custom losses
    (`create_custom_loss` uploads the traced loss; `forward_backward_custom` with its handle
    runs it here in one pass)."""
    limits = _state(request).config.limits
    return types.ClientConfigResponse(
        custom_loss_server_side=True,
        proto_compress_fwdbwd=True,
        fwdbwd_max_chunk_len=limits.max_batch_datums,
        fwdbwd_max_chunk_bytes_count=min(5_000_000, limits.max_request_bytes // 2),
    ).model_dump()


@router.post("/client/dynamic_config")
async def client_dynamic_config(owner: str = Depends(authenticate)):
    """Flags the SDK re-reads every `refresh_interval_sec`: abandoned sampling futures are
    cancelled here (`cancel_future`), which frees their engine slots."""
    return types.ClientDynamicConfigResponse(sample_cancel_enabled=True).model_dump()


@router.post("/cancel_future")
async def cancel_future(request: Request, owner: str = Depends(authenticate)):
    """Stop an unfinished sampling request the client abandoned; its result becomes a
    'cancelled' error. A finished request is left as it is."""
    state = _state(request)
    body = await state.parse(request, _CancelRequest)
    row = state.db.future(body.request_id)
    if row is None or row["owner"] != owner:
        raise ApiError(404, "request_id", f"unknown request '{body.request_id}'")
    if row["request_type"] != "Sample":
        raise ApiError(
            400, "request_id", f"is a {row['request_type']} request; only samples can be cancelled"
        )
    cancelled = state.tracker.cancel(body.request_id)
    return {"request_id": body.request_id, "cancelled": cancelled}


@router.post("/create_custom_loss")
async def create_custom_loss(request: Request, owner: str = Depends(authenticate)):
    """Store a traced custom loss for the session (`ServiceClient.create_custom_loss`). The
    graph is rebuilt from the backend's allowlist (`backend.custom_loss_graph`); a refusal
    arrives through the future, naming what was refused. The result is `{loss_id}`."""
    state = _state(request)
    body = await state.parse(request, types.CreateCustomLossRequest)
    state.session(owner, body.session_id)

    def run():
        return run_now(
            lambda: types.CreateCustomLossResponse(
                loss_id=state.core.create_custom_loss(
                    body.session_id,
                    body.name,
                    body.inputs,
                    body.graph,
                    custom_loss_seq_id=body.custom_loss_seq_id,
                )
            )
        )

    return state.respond_with_future(request, owner, "CreateCustomLoss", run, json_result)


@router.post("/create_session")
async def create_session(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    body = await state.parse(request, types.CreateSessionRequest)
    if body.project_id not in (
        None,
        DEFAULT_PROJECT,
    ):  # ServiceClient(project_id=) / TINKER_PROJECT_ID
        raise ApiError(
            400,
            "project_id",
            f"{body.project_id!r} is not a project on this server; the only one is "
            f"{DEFAULT_PROJECT!r} (leave project_id and TINKER_PROJECT_ID unset)",
        )
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


@router.post("/sessions/search")
async def search_sessions(request: Request, owner: str = Depends(authenticate)):
    """`RestClient.search_sessions`: the caller's sessions, newest first, filtered and paged
    as `SessionSearchRequest` says. Sessions are never shared and there are no projects
    here: every owner filter sees the caller's own sessions (a user filter only when it names
    the caller), and the only project is 'default'."""
    state = _state(request)
    body = await state.parse(request, types.SessionSearchRequest)
    unknown = sorted(set(body.project_ids or ()) - {DEFAULT_PROJECT})
    if unknown:
        raise ApiError(
            400, "project_ids", f"{unknown[0]!r} is not a project; the only one is 'default'"
        )
    if isinstance(body.owner, types.UserSearchOwner) and owner not in body.owner.owner_urns:
        rows = []
    else:
        rows = state.db.session_summaries(owner)
    matches = [r for r in rows if _session_matches(r, body, time.time())]
    matches.sort(key=lambda r: (_created_at(r), r["session_id"]), reverse=True)
    if body.cursor is not None:
        # Compared as the cursor carries them: datetimes (microseconds), then the id.
        after = (body.cursor.last_created_at, body.cursor.last_session_id)
        matches = [r for r in matches if (_created_at(r), r["session_id"]) < after]
    page = matches[: body.limit]
    cursor = None
    if len(matches) > body.limit:
        last = page[-1]
        cursor = types.SessionSearchCursor(
            last_created_at=_created_at(last),
            last_session_id=last["session_id"],
        )
    return types.SessionSearchResponse(
        sessions=[_session_summary(r, time.time()) for r in page], next_cursor=cursor
    ).model_dump(mode="json")


DEFAULT_PROJECT = "default"
ACTIVE_HEARTBEAT_S = 60.0
"""A session without `close()` counts as active while its SDK heartbeat (every 10 s) is
younger than this."""


def _created_at(row: dict) -> datetime:
    return datetime.fromtimestamp(row["created"], UTC)


def _session_status(row: dict, now: float) -> types.SessionStatus | None:
    if row["end_status"] in ("success", "errored", "interrupted"):
        return types.ClientSessionFinished(reason={"type": row["end_status"]})
    if row["end_status"] is None and now - row["last_heartbeat"] < ACTIVE_HEARTBEAT_S:
        return types.SessionActive()
    return None


def _session_matches(row: dict, body: types.SessionSearchRequest, now: float) -> bool:
    by_id = body.session_id is not None and row["session_id"] == body.session_id
    name = (row["display_name"] or "").lower()
    by_name = body.display_name is not None and all(
        word in name for word in body.display_name.lower().split()
    )
    if (body.session_id is not None or body.display_name is not None) and not (by_id or by_name):
        return False
    metadata = json.loads(row["user_metadata"]) if row["user_metadata"] else {}
    if any(metadata.get(k) != v for k, v in body.user_metadata.items()):
        return False
    if body.statuses is None:
        return True
    status = _session_status(row, now)
    for query in body.statuses:
        if query.type == "active" and isinstance(status, types.SessionActive):
            return True
        if query.type == "client_finished" and isinstance(status, types.ClientSessionFinished):
            reasons = query.reasons or ("success", "errored", "interrupted")
            if status.reason.type in reasons:
                return True
    return False  # "cancelled" and "failed" sessions do not occur here


def _session_summary(row: dict, now: float) -> types.SessionSummary:
    return types.SessionSummary(
        session_id=row["session_id"],
        created_at=_created_at(row),
        owner=row["owner"],
        project_id=DEFAULT_PROJECT,
        status=_session_status(row, now),
        checkpoints_count=row["checkpoints_count"],
        display_name=row["display_name"],
        user_metadata=json.loads(row["user_metadata"]) if row["user_metadata"] else None,
        checkpoint_storage_bytes=row["checkpoint_bytes"] or 0,
    )


@router.get("/sessions/{session_id}")
async def get_session(
    session_id: str,
    request: Request,
    scope: str = Depends(access_scope),
    owner: str = Depends(authenticate),
):
    """A session (`access_scope` "owned" or "accessible": sessions are never shared, so both
    mean the caller's own)."""
    state = _state(request)
    row = state.session(owner, session_id)
    return types.GetSessionResponse(
        training_run_ids=state.db.session_models(session_id),
        sampler_ids=state.db.session_samplers(session_id),
        display_name=row["display_name"],
    ).model_dump()


@router.get("/sessions")
async def list_sessions(
    request: Request,
    limit: int = 20,
    offset: int = 0,
    scope: str = Depends(access_scope),
    owner: str = Depends(authenticate),
):
    """The caller's sessions, newest first (either `access_scope`: sessions are never shared)."""
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
