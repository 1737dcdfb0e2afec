"""Every error answers with a status and a JSON body naming the problem (never a bare 400:
the SDK takes an empty 400 for a proxy rejection and retries it)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from skyrl_trainer.backend.errors import InvalidRequestError, NotFoundError

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """A refused request: HTTP `status`, the offending `field` and what is wrong with it."""

    def __init__(self, status: int, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.status = status
        self.field = field
        self.problem = problem


def error_response(status: int, message: str, field: str | None = None, **headers: str):
    category = "user" if status < 500 else "server"
    body = {"error": message, "category": category}
    if field:
        body["field"] = field
    return JSONResponse(body, status_code=status, headers=headers or None)


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str]:
    """(field, message) for the first problem pydantic found."""
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    return field, f"{field}: {first.get('msg', 'invalid value')}"


def _redacted(request: Request, message: str) -> str:
    """`message` without the server's folders (`redaction`), once the server is running."""
    server = getattr(request.app.state, "server", None)
    return server.redact(message) if server is not None else message


def refused(request: Request, status: int) -> None:
    """A request answered with an error never reaches the core: run what it left to undo
    (`request.state.release_on_refusal`: its place in a model's seq_id order). Not for 429:
    the SDK resends that request, which takes the place again."""
    release = getattr(request.state, "release_on_refusal", None)
    if release is not None and status != 429:
        request.state.release_on_refusal = None
        release()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        refused(request, exc.status)
        headers = {"retry-after": "1"} if exc.status == 429 else {}
        return error_response(exc.status, _redacted(request, str(exc)), exc.field, **headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError):
        status = 404 if isinstance(exc, NotFoundError) else 400
        refused(request, status)
        return error_response(status, _redacted(request, str(exc)), exc.field)

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc):
        refused(request, 400)
        field, message = validation_message(exc)
        return error_response(400, message, field)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        refused(request, exc.status_code)
        if exc.status_code in (404, 405):  # no such route, or not with this method
            message = f"{request.method} {request.url.path} is not supported by this server"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message)

    @app.exception_handler(ClientDisconnect)
    async def _disconnected(request: Request, exc: ClientDisconnect):
        refused(request, 400)
        # The caller hung up mid-upload: nobody gets this answer, and it is not a server fault.
        logger.info("client disconnected during %s %s", request.method, request.url.path)
        return error_response(
            400, "the client disconnected before the request body was complete", "body"
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        refused(request, 500)
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        message = f"internal error: {type(exc).__name__}: {exc}"
        return error_response(500, _redacted(request, message))
