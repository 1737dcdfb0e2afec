"""The FastAPI application: the backend core behind the Tinker HTTP protocol.

`create_app` wires the routes to one `BackendCore` (the same core the in-process clients
use), the SQLite database and the future tracker. On start-up, futures left pending by a
previous process are failed (they can never complete); a housekeeping task removes expired
checkpoints and old results, and cancels the sampling requests of sessions whose client stopped
sending heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from skyrl_trainer.backend.core import BackendCore
from skyrl_trainer.server import (
    checkpoint_routes,
    sampling_routes,
    service_routes,
    tokenizer_routes,
    training_routes,
)
from skyrl_trainer.server.config import ServerConfig
from skyrl_trainer.server.database import ServerDatabase
from skyrl_trainer.server.future_tracker import FutureTracker
from skyrl_trainer.server.http_errors import install_error_handlers
from skyrl_trainer.server.redaction import PathRedactor, server_folders
from skyrl_trainer.server.sequencer import Sequencer
from skyrl_trainer.server.state import ServerState

logger = logging.getLogger(__name__)

_RESTARTED = json.dumps(
    {"error": "the server restarted before this request finished; send it again",
     "category": "server"}
).encode()  # fmt: skip


def housekeeping(state: ServerState) -> None:
    """Remove expired checkpoints and results older than the retention period; cancel the
    sampling requests of sessions whose client went away."""
    removed = checkpoint_routes.remove_expired_checkpoints(state)
    purged = state.db.purge_futures(time.time() - state.config.future_retention_s)
    if removed or purged:
        logger.info("housekeeping: %d expired checkpoints, %d old results removed", removed, purged)
    cancel_requests_of_silent_sessions(state)


def cancel_requests_of_silent_sessions(state: ServerState) -> int:
    """A client that dies (killed, crashed, machine gone) never cancels its futures; without
    this its sampling requests would hold engine rows until they finish. Its session's
    heartbeat stops, so after `session_expiry_s` they are cancelled (they end failed with a
    'cancelled' error, as a `cancel_future` would leave them)."""
    cutoff = time.time() - state.config.session_expiry_s
    silent = set()
    for session_id in state.tracker.running_sessions():
        row = state.db.session(session_id)
        if row is not None and row["last_heartbeat"] < cutoff:
            silent.add(session_id)
    cancelled = state.tracker.cancel_sessions(silent) if silent else 0
    if cancelled:
        logger.warning(
            "cancelled %d sampling requests of %d sessions with no heartbeat for %.0f s",
            cancelled, len(silent), state.config.session_expiry_s,
        )  # fmt: skip
    return cancelled


async def _housekeeping_loop(state: ServerState) -> None:
    while True:
        try:
            await asyncio.to_thread(housekeeping, state)
        except Exception:
            logger.exception("housekeeping failed")
        await asyncio.sleep(state.config.housekeeping_interval_s)


def create_app(config: ServerConfig, core: BackendCore | None = None) -> FastAPI:
    """The server application. `core` defaults to a new backend from `config.backend`; one
    given must serve only its base models (`BackendCore(..., served_only=True)`)."""
    config.validate()
    if core is not None and not core.base_models.served_only:
        raise ValueError(
            "core: a server's backend must serve only its base models; create it with "
            "BackendCore(config, served_only=True)"
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        db = ServerDatabase(config.database_path())
        stale = db.fail_pending_futures(_RESTARTED)
        if stale:
            logger.warning("%d requests of a previous server process were failed", stale)
        backend = core if core is not None else BackendCore(config.backend, served_only=True)
        redact = PathRedactor(
            server_folders(
                backend.config.resolved_storage_dir(),
                backend.config.resolved_cache_dir(),
                config.database_path(),
                [m.source for m in backend.base_models.served],
            )
        )
        state = ServerState(
            config=config,
            core=backend,
            db=db,
            tracker=FutureTracker(db, asyncio.get_running_loop(), redact),
            sequencer=Sequencer(config.sequencer_gap_timeout_s),
            redact=redact,
        )
        app.state.server = state
        task = asyncio.create_task(_housekeeping_loop(state))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if core is None:
                await asyncio.to_thread(backend.shutdown)

    app = FastAPI(title="skyrl-trainer Tinker-compatible server", lifespan=lifespan)
    install_error_handlers(app)
    routes = (service_routes, training_routes, sampling_routes, checkpoint_routes, tokenizer_routes)
    for module in routes:
        app.include_router(module.router)
    return app
