"""Futures with the Tinker SDK's shape: `result()`, `result_async()`, `future()`, awaitable."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from tinker.lib.public_interfaces.api_future import APIFuture, AwaitableConcurrentFuture

T = TypeVar("T")
U = TypeVar("U")


def api_future(future: Future[T]) -> APIFuture[T]:
    """Wrap a `concurrent.futures.Future` as the SDK's `APIFuture`."""
    return AwaitableConcurrentFuture(future)


def mapped(future: Future[T], fn: Callable[[T], U]) -> Future[U]:
    """A future of `fn(result)`; exceptions (from `future` or `fn`) pass through."""
    out: Future[U] = Future()

    def on_done(done: Future[T]) -> None:
        try:
            out.set_result(fn(done.result()))
        except BaseException as exc:
            out.set_exception(exc)

    future.add_done_callback(on_done)
    return out


def done(value: T) -> Future[T]:
    out: Future[T] = Future()
    out.set_result(value)
    return out


def failed(exc: BaseException) -> Future[Any]:
    out: Future[Any] = Future()
    out.set_exception(exc)
    return out


class ClientFuture(AwaitableConcurrentFuture[T]):
    """A future of a client that, like the SDK's `Backcompat*ClientFuture`, can still be used
    as the client itself (deprecated: each such use warns with a FutureWarning)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        warnings.warn(
            f"Using the future as the client is deprecated; call .result() on it, or await it, "
            f"to get the client first (attribute {name!r})",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(self.result(), name)
