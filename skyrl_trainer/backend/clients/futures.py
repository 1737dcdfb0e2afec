"""Futures with the Tinker SDK's shape: `result()`, `result_async()`, `future()`, awaitable."""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from typing import Any, TypeVar

from tinker.lib.public_interfaces.api_future import APIFuture, AwaitableConcurrentFuture

from skyrl_trainer.backend.futures import done, failed, mapped, run_now  # noqa: F401 (re-exported)

T = TypeVar("T")


def api_future(future: Future[T]) -> APIFuture[T]:
    """Wrap a `concurrent.futures.Future` as the SDK's `APIFuture`."""
    return AwaitableConcurrentFuture(future)


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
