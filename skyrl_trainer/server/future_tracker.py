"""Requests in flight: each gets a request id at once; its result lands in the database.

A backend `concurrent.futures.Future` is attached to a request id. When it finishes (on a
worker thread) its result is encoded (protobuf or JSON) and stored; pollers waiting in
`retrieve_future` on the event loop are woken. Results stay in the database, so any poller
(another connection, a retry after a dropped connection) reads the same answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.server.database import COMPLETE, FAILED, ServerDatabase

logger = logging.getLogger(__name__)

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
Encoder = Callable[[Any], tuple[str, bytes]]
CANCELLED = json.dumps(
    {
        "error": "the request was cancelled before it finished (cancel_future, or its session "
        "sent no heartbeat for session_expiry_s)",
        "category": "user",
    }
).encode()


def json_result(value: Any) -> tuple[str, bytes]:
    """A pydantic response (or a plain dict) as the JSON body the SDK validates."""
    body = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    return JSON, json.dumps(body).encode()


def error_payload(exc: BaseException, redact: Callable[[str], str] = str) -> bytes:
    """The SDK's RequestFailedResponse: a message (passed through `redact`) and whose fault
    it was."""
    if isinstance(exc, InvalidRequestError):
        return json.dumps({"error": redact(str(exc)), "category": "user"}).encode()
    message = redact(f"{type(exc).__name__}: {exc}")
    return json.dumps({"error": message, "category": "server"}).encode()


class FutureTracker:
    """Maps request ids to results in the database and wakes the pollers waiting for them."""

    def __init__(
        self,
        db: ServerDatabase,
        loop: asyncio.AbstractEventLoop,
        redact: Callable[[str], str] = str,
    ):
        """`redact`: what every error message passes through (`redaction.PathRedactor`)."""
        self.db = db
        self.loop = loop
        self.redact = redact
        self._events: dict[str, asyncio.Event] = {}
        self._running: dict[str, Future] = {}  # attached backend futures not yet finished
        self._session_of: dict[str, str] = {}  # running request id -> the session it serves
        self._running_lock = threading.Lock()

    def register(self, owner: str, request_type: str, model_id: str | None = None) -> str:
        request_id = uuid.uuid4().hex
        self.db.add_future(request_id, owner, request_type, model_id)
        return request_id

    def attach(
        self, request_id: str, future: Future, encode: Encoder, session_id: str | None = None
    ) -> None:
        """Store `future`'s outcome under `request_id` when it finishes. `session_id`: the
        session whose going away cancels it (`cancel_sessions`)."""
        with self._running_lock:
            self._running[request_id] = future
            if session_id is not None:
                self._session_of[request_id] = session_id
        future.add_done_callback(lambda done: self._finish(request_id, done, encode))

    def cancel(self, request_id: str) -> bool:
        """Cancel the backend work of an unfinished request (its `Future.cancel()`; a sample's
        also stops the engine's work). The request then fails with a 'cancelled' error.
        False when it had finished, or its work can no longer be cancelled."""
        with self._running_lock:
            future = self._running.get(request_id)
        return future is not None and future.cancel()

    def running_sessions(self) -> set[str]:
        """The sessions that have cancellable requests running."""
        with self._running_lock:
            return set(self._session_of.values())

    def cancel_sessions(self, session_ids: set[str]) -> int:
        """Cancel the running requests attached to any of `session_ids`; how many were."""
        with self._running_lock:
            ids = [r for r, s in self._session_of.items() if s in session_ids]
        return sum(self.cancel(r) for r in ids)

    def fail(self, request_id: str, exc: BaseException) -> None:
        self.db.finish_future(request_id, FAILED, JSON, error_payload(exc, self.redact))
        self.loop.call_soon_threadsafe(self._wake, request_id)

    def _finish(self, request_id: str, done: Future, encode: Encoder) -> None:
        with self._running_lock:
            self._running.pop(request_id, None)
            self._session_of.pop(request_id, None)
        try:
            content_type, payload = encode(done.result())
            status = COMPLETE
        except CancelledError:
            content_type, payload, status = JSON, CANCELLED, FAILED
        except BaseException as exc:
            if not isinstance(exc, InvalidRequestError):
                logger.exception("request %s failed", request_id)
            content_type, payload, status = JSON, error_payload(exc, self.redact), FAILED
        try:
            self.db.finish_future(request_id, status, content_type, payload)
        except Exception:
            logger.exception("could not store the result of request %s", request_id)
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._wake, request_id)

    def _wake(self, request_id: str) -> None:
        event = self._events.pop(request_id, None)
        if event is not None:
            event.set()

    async def wait(self, request_id: str, timeout: float) -> dict | None:
        """The future's row once it is finished, or its pending row after `timeout` seconds.

        The event is created before the database is read, on this (the loop's) thread, so a
        completion between the read and the wait still wakes us.
        """
        event = self._events.setdefault(request_id, asyncio.Event())
        row = self.db.future(request_id)
        if row is None or row["status"] != "pending":
            return row
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            if self._events.get(request_id) is event:
                del self._events[request_id]
        return self.db.future(request_id)
