"""Checkpoint REST endpoints, as the SDK's `RestClient` calls them: training runs, their
checkpoints, weights info, delete, TTL and publish. Only the owner sees a run; a published
checkpoint can be loaded (not changed) by anyone."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel
from tinker import types

from skyrl_trainer.server.auth import authenticate
from skyrl_trainer.server.http_errors import ApiError
from skyrl_trainer.server.state import ServerState

router = APIRouter(prefix="/api/v1")


class _TtlRequest(BaseModel):
    ttl_seconds: int | None = None


class _WeightsInfoRequest(BaseModel):
    tinker_path: str


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _time(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def _checkpoint(row: dict) -> types.Checkpoint:
    return types.Checkpoint(
        checkpoint_id=row["tinker_path"].split("/", 3)[3],
        checkpoint_type=row["checkpoint_type"],
        time=_time(row["created"]),
        tinker_path=row["tinker_path"],
        size_bytes=row["size_bytes"],
        public=bool(row["public"]),
        expires_at=_time(row["expires_at"]),
    )


def access_scope(access_scope: str = "owned") -> str:
    """The SDK's `access_scope` query parameter: "owned" (the caller's own), or "accessible"
    (also what others published: training runs with a published checkpoint)."""
    if access_scope not in ("owned", "accessible"):
        raise ApiError(400, "access_scope", f"{access_scope!r} is not 'owned' or 'accessible'")
    return access_scope


def _training_run(state: ServerState, row: dict, owner: str | None = None) -> types.TrainingRun:
    """The run as `owner` sees it: another owner's run shows only its published checkpoints."""
    rows = state.db.run_checkpoints(row["model_id"])
    if owner is not None and row["owner"] != owner:
        rows = [c for c in rows if c["public"]]
    checkpoints = [_checkpoint(c) for c in rows]
    latest = {c.checkpoint_type: c for c in checkpoints}  # ordered by time: last wins
    return types.TrainingRun(
        training_run_id=row["model_id"],
        base_model=row["base_model"],
        model_owner=row["owner"],
        is_lora=bool(row["is_lora"]),
        lora_rank=row["lora_rank"],
        last_request_time=_time(row["last_request_time"]),
        last_checkpoint=latest.get("training"),
        last_sampler_checkpoint=latest.get("sampler"),
    )


def _run(state: ServerState, owner: str, run_id: str, scope: str = "owned") -> dict:
    row = state.db.model(run_id)
    visible = row is not None and (
        row["owner"] == owner or (scope == "accessible" and state.db.run_is_published(run_id))
    )
    if not visible:
        raise ApiError(404, "training_run_id", f"unknown training run '{run_id}'")
    return row


def _owned_checkpoint(state: ServerState, owner: str, run_id: str, checkpoint_id: str) -> dict:
    path = f"tinker://{run_id}/{checkpoint_id}"
    state.core.check_checkpoint_path(path, field="checkpoint_id")  # refuses traversal
    row = state.db.checkpoint(path)
    if row is None or row["owner"] != owner:
        raise ApiError(404, "checkpoint_id", f"no checkpoint at {path!r}")
    return row


def _page(limit: int, offset: int) -> None:
    if not 1 <= limit <= 1000 or offset < 0:
        raise ApiError(400, "limit", "limit must be 1-1000 and offset >= 0")


@router.get("/training_runs")
async def list_training_runs(
    request: Request,
    limit: int = 20,
    offset: int = 0,
    scope: str = Depends(access_scope),
    owner: str = Depends(authenticate),
):
    _page(limit, offset)
    state = _state(request)
    rows, total = state.db.models(owner, limit, offset, published=scope == "accessible")
    return types.TrainingRunsResponse(
        training_runs=[_training_run(state, r, owner) for r in rows],
        cursor=types.Cursor(offset=offset, limit=limit, total_count=total),
    ).model_dump(mode="json")


@router.get("/training_runs/{run_id}")
async def get_training_run(
    run_id: str,
    request: Request,
    scope: str = Depends(access_scope),
    owner: str = Depends(authenticate),
):
    state = _state(request)
    return _training_run(state, _run(state, owner, run_id, scope), owner).model_dump(mode="json")


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    _run(state, owner, run_id)
    rows = state.db.run_checkpoints(run_id)
    return types.CheckpointsListResponse(checkpoints=[_checkpoint(r) for r in rows]).model_dump(
        mode="json"
    )


@router.get("/checkpoints")
async def list_user_checkpoints(
    request: Request, limit: int = 100, offset: int = 0, owner: str = Depends(authenticate)
):
    _page(limit, offset)
    rows, total = _state(request).db.owner_checkpoints(owner, limit, offset)
    return types.CheckpointsListResponse(
        checkpoints=[_checkpoint(r) for r in rows],
        cursor=types.Cursor(offset=offset, limit=limit, total_count=total),
    ).model_dump(mode="json")


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def get_external_weights_urls(
    run_id: str, checkpoint_id: str, request: Request, owner: str = Depends(authenticate)
):
    raise ApiError(
        400,
        "checkpoint_id",
        "external weights checkpoints (save_weights_external) are not supported by this "
        "server, so it has no download URLs; sample a saved sampler checkpoint with "
        "create_sampling_client(model_path=...)",
    )


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(
    run_id: str, checkpoint_id: str, request: Request, owner: str = Depends(authenticate)
):
    state = _state(request)
    if checkpoint_id.endswith("/publish"):
        row = _owned_checkpoint(state, owner, run_id, checkpoint_id.removesuffix("/publish"))
        state.db.update_checkpoint(row["tinker_path"], public=0)
        return None
    row = _owned_checkpoint(state, owner, run_id, checkpoint_id)
    state.core.delete_checkpoint(row["tinker_path"])
    state.db.delete_checkpoint(row["tinker_path"])
    return None


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
async def publish_checkpoint(
    run_id: str, checkpoint_id: str, request: Request, owner: str = Depends(authenticate)
):
    state = _state(request)
    row = _owned_checkpoint(state, owner, run_id, checkpoint_id)
    state.db.update_checkpoint(row["tinker_path"], public=1)
    return None


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(
    run_id: str, checkpoint_id: str, request: Request, owner: str = Depends(authenticate)
):
    state = _state(request)
    row = _owned_checkpoint(state, owner, run_id, checkpoint_id)
    body = await state.parse(request, _TtlRequest)
    if body.ttl_seconds is not None and body.ttl_seconds <= 0:
        raise ApiError(400, "ttl_seconds", "must be positive, or null for no expiry")
    expires_at = time.time() + body.ttl_seconds if body.ttl_seconds else None
    state.core.set_checkpoint_expiry(row["tinker_path"], expires_at)
    state.db.update_checkpoint(row["tinker_path"], expires_at=expires_at)
    return None


@router.post("/weights_info")
async def weights_info(request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    body = await state.parse(request, _WeightsInfoRequest)
    state.checkpoint(owner, body.tinker_path, field="tinker_path")
    metadata = state.core.checkpoint_metadata(body.tinker_path, field="tinker_path")
    lora = metadata.lora_config or {}
    return types.WeightsInfoResponse(
        base_model=metadata.base_model,
        is_lora=metadata.is_lora,
        lora_rank=metadata.lora_rank,
        train_unembed=lora.get("train_unembed"),
        train_mlp=lora.get("train_mlp"),
        train_attn=lora.get("train_attn"),
    ).model_dump(mode="json")


def remove_expired_checkpoints(state: ServerState) -> int:
    """Delete every checkpoint whose TTL has passed (folder and record)."""
    expired = state.db.expired_checkpoints(time.time())
    for row in expired:
        state.core.delete_checkpoint(row["tinker_path"])
        state.db.delete_checkpoint(row["tinker_path"])
    return len(expired)
