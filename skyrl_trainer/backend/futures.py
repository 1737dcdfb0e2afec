"""Small helpers over `concurrent.futures.Future` used by the core and the clients."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
U = TypeVar("U")


def mapped(future: Future[T], fn: Callable[[T], U]) -> Future[U]:
    """A future of `fn(result)`; exceptions (from `future` or `fn`) pass through."""
    out: Future[U] = Future()

    def on_done(finished: Future[T]) -> None:
        try:
            out.set_result(fn(finished.result()))
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


def run_now(fn: Callable[[], T]) -> Future[T]:
    """Call `fn` here and now; its result or exception as a completed future."""
    try:
        return done(fn())
    except Exception as exc:
        return failed(exc)
