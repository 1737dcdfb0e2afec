"""Turning a Ray actor's failure into a short, readable cause for error messages."""

from __future__ import annotations


def cause_of(exc: BaseException) -> BaseException:
    """The exception an actor method raised (Ray's RayTaskError wraps it)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def brief(exc: BaseException, limit: int = 600) -> str:
    """`Type: message` on one line, cut at `limit` characters."""
    text = " ".join(str(exc).split()).rstrip(".")
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[:limit] + " ..."
