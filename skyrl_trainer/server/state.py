"""What every route handler shares: the backend core, the database, in-flight futures, and
the ownership checks that keep one caller away from another's sessions, models and
checkpoints (someone else's resource answers exactly like a missing one)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from tinker import types

from skyrl_trainer.backend.core import BackendCore
from skyrl_trainer.server.codec import decode_body
from skyrl_trainer.server.config import ServerConfig
from skyrl_trainer.server.database import ServerDatabase
from skyrl_trainer.server.future_tracker import Encoder, FutureTracker
from skyrl_trainer.server.http_errors import ApiError
from skyrl_trainer.server.sequencer import Sequencer

M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerState:
    config: ServerConfig
    core: BackendCore
    db: ServerDatabase
    tracker: FutureTracker
    sequencer: Sequencer
    redact: Callable[[str], str] = str
    """What every error message passes through (`redaction.PathRedactor`)."""
    _key_locks: dict[tuple[str, str], tuple[threading.Lock, int]] = field(default_factory=dict)
    _key_locks_guard: threading.Lock = field(default_factory=threading.Lock)

    # ----- request bodies -----------------------------------------------------------------

    async def body(self, request: Request) -> bytes:
        """The request body (zstd-decoded when so encoded), refused past the size cap."""
        cap = self.config.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise ApiError(413, "body", f"{declared} bytes is over the {cap}-byte request limit")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise ApiError(413, "body", f"over the {cap}-byte request limit")
            chunks.append(chunk)
        return decode_body(b"".join(chunks), request.headers.get("content-encoding"), cap)

    async def parse(self, request: Request, model: type[M]) -> M:
        """The JSON body validated against the SDK's own request type."""
        raw = await self.body(request)
        try:
            data = json.loads(raw or b"{}")
        except ValueError as exc:
            raise ApiError(400, "body", f"is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ApiError(400, "body", "must be a JSON object")
        return model.model_validate(data)

    # ----- ownership ----------------------------------------------------------------------

    def session(self, owner: str, session_id: str) -> dict:
        row = self.db.session(session_id)
        if row is None or row["owner"] != owner:
            raise ApiError(404, "session_id", f"unknown session '{session_id}'")
        self.core.create_session(session_id=session_id)  # re-attach after a restart
        return row

    def model(
        self, owner: str, model_id: str, request: Request | None = None, seq_id: int | None = None
    ) -> dict:
        """The caller's model. With `request` and `seq_id`, the request takes that place in
        the model's order: if it is refused before it starts (a check below fails), the
        error handler gives the place back, so the model's later requests do not wait for it
        (a 429 keeps it: the SDK resends the same request)."""
        row = self.db.model(model_id)
        if row is None or row["owner"] != owner:
            raise ApiError(404, "model_id", f"unknown model '{model_id}'")
        if request is not None and seq_id is not None:  # only the owner may free a place
            request.state.release_on_refusal = lambda: self.sequencer.skip(model_id, seq_id)
        try:
            self.core.model(model_id)
        except Exception:
            raise ApiError(
                404,
                "model_id",
                f"model '{model_id}' is no longer loaded (the server restarted); create it "
                "again from a checkpoint with create_training_client_from_state",
            ) from None
        return row

    def sampler(self, owner: str, sampler_id: str) -> dict:
        row = self.db.sampler(sampler_id)
        if row is None or row["owner"] != owner:
            raise ApiError(404, "sampling_session_id", f"unknown sampling session '{sampler_id}'")
        return row

    def checkpoint(self, owner: str, tinker_path: Any, field: str = "path") -> dict:
        """A checkpoint the caller may read: their own, or a published one."""
        row = self.db.checkpoint(tinker_path) if isinstance(tinker_path, str) else None
        if row is None or (row["owner"] != owner and not row["public"]):
            if isinstance(tinker_path, str) and not tinker_path.startswith("tinker://"):
                raise ApiError(400, field, f"{tinker_path!r} is not a tinker:// checkpoint path")
            raise ApiError(404, field, f"no checkpoint at {tinker_path!r}")
        return row

    # ----- futures ------------------------------------------------------------------------

    def check_capacity(self, owner: str) -> None:
        cap = self.config.limits.max_pending_futures
        if self.db.pending_futures(owner) >= cap:
            raise ApiError(429, "requests", f"{cap} requests already in flight; retry later")

    def start(
        self,
        owner: str,
        request_type: str,
        run: Callable[[], Future],
        encode: Encoder,
        model_id: str | None = None,
        seq_id: int | None = None,
        session_id: str | None = None,
    ) -> str:
        """Register a request, then start it (in `seq_id` order for a model); its result or
        error reaches the database. Returns the request id at once. `session_id`: cancel the
        request if that session stops sending heartbeats (sampling requests)."""
        self.check_capacity(owner)
        request_id = self.tracker.register(owner, request_type, model_id)

        def begin() -> None:
            try:
                future = run()
            except Exception as exc:
                self.tracker.fail(request_id, exc)
                return
            self.tracker.attach(request_id, future, encode, session_id)

        if model_id is not None:
            self.db.touch_model(model_id)
            self.sequencer.submit(model_id, seq_id, begin)  # the place is taken now
        else:
            begin()
        return request_id

    def respond_with_future(
        self,
        request: Request,
        owner: str,
        request_type: str,
        run: Callable[[], Future],
        encode: Encoder,
        *,
        model_id: str | None = None,
        seq_id: int | None = None,
        future_model_id: str | None = None,
    ) -> dict:
        """Start a training request (once per X-Idempotency-Key) and answer with its future.
        `model_id` orders it among the model's requests; `future_model_id` (default `model_id`)
        is the model the answer names."""

        def respond() -> dict:
            request_id = self.start(
                owner, request_type, run, encode, model_id=model_id, seq_id=seq_id
            )
            request.state.release_on_refusal = None  # started: its place is used
            return future_response(request_id, future_model_id or model_id)

        return self.idempotent(request, owner, respond)

    def idempotent(self, request: Request, owner: str, respond: Callable[[], dict]) -> dict:
        """`respond()`, or the answer already given to this X-Idempotency-Key: an SDK retry
        of a request whose response was lost must not run it twice, even when it arrives
        while the first is still being answered."""
        key = request.headers.get("x-idempotency-key")
        if not key:
            return respond()
        with self._key_lock(owner, key):
            earlier = self.db.idempotent_response(owner, key)
            if earlier is not None:
                request.state.release_on_refusal = None  # the first request used the place
                return earlier
            response = respond()
            self.db.remember_response(owner, key, response)
            return response

    @contextlib.contextmanager
    def _key_lock(self, owner: str, key: str) -> Iterator[None]:
        """One request at a time per idempotency key (the lock is dropped when unused)."""
        name = (owner, key)
        with self._key_locks_guard:
            lock, users = self._key_locks.get(name, (threading.Lock(), 0))
            self._key_locks[name] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._key_locks_guard:
                lock, users = self._key_locks[name]
                if users == 1:
                    del self._key_locks[name]
                else:
                    self._key_locks[name] = (lock, users - 1)


def future_response(request_id: str, model_id: str | None = None, **extra: Any) -> dict:
    return types.UntypedAPIFuture(request_id=request_id, model_id=model_id, **extra).model_dump(
        exclude_none=True
    )
