"""API keys: who is calling. Every resource belongs to the key that created it."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from skyrl_trainer.server.http_errors import ApiError


def owner_of_key(key: str) -> str:
    """A stable, non-reversible id for an API key (what the database stores)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def authenticate(request: Request) -> str:
    """The caller's owner id. With keys configured, the key must be one of them; without,
    any `tml-` key is accepted (the server then binds loopback only)."""
    key = request.headers.get("x-api-key")
    if not key:
        raise ApiError(401, "X-API-Key", "missing; set TINKER_API_KEY (a 'tml-' key)")
    accepted = request.app.state.server.config.api_keys
    if accepted:
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in accepted):
            raise ApiError(401, "X-API-Key", "not an accepted API key")
    elif not key.startswith("tml-"):
        raise ApiError(401, "X-API-Key", "must start with 'tml-'")
    return owner_of_key(key)
