"""Configuration of the Tinker-compatible HTTP server."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from skyrl_trainer.backend.base_models import BaseModelCatalog
from skyrl_trainer.backend.config import BackendConfig


@dataclass
class ServerLimits:
    """Caps on what one request may ask for; a request over a cap is refused with 413/400."""

    max_request_bytes: int = 64 * 1024 * 1024
    """Largest request body, after decompression."""
    max_batch_datums: int = 1024
    """Most datums in one forward/backward request (the SDK is told to chunk below this)."""
    max_num_samples: int = 128
    """Most samples in one sample request."""
    max_tokens: int = 4096
    """Largest `sampling_params.max_tokens`."""
    max_pending_futures: int = 4096
    """Most unfinished requests per API key; more are answered 429 (the SDK backs off)."""


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    """Accepted keys. Empty: any `tml-` key is accepted, and only a loopback bind is allowed
    unless `allow_unauthenticated_remote` is set."""
    allow_unauthenticated_remote: bool = False
    database: str | None = None
    """SQLite file; default <storage_dir>/server.sqlite3."""
    retrieve_wait_s: float = 30.0
    """How long `retrieve_future` holds a poll for an unfinished result before `try_again`
    (well under the SDK's 45 s timeout)."""
    future_retention_s: float = 3600.0
    """Finished results are kept this long for re-polls, then purged."""
    sequencer_gap_timeout_s: float = 30.0
    """A training request that arrives before a lower `seq_id` of its model waits this long
    for the gap to fill, then runs anyway."""
    housekeeping_interval_s: float = 15.0
    """How often expired checkpoints and old futures are removed, and silent sessions' sampling
    requests cancelled."""
    session_expiry_s: float = 60.0
    """A session whose SDK heartbeat (every 10 s) is older than this has gone away: its
    unfinished sampling requests are cancelled, freeing their engine rows."""
    limits: ServerLimits = field(default_factory=ServerLimits)
    backend: BackendConfig = field(default_factory=BackendConfig)

    def database_path(self) -> Path:
        if self.database:
            return Path(self.database).expanduser()
        return self.backend.resolved_storage_dir() / "server.sqlite3"

    def validate(self) -> None:
        """Refuse settings that would expose an unauthenticated server, and a served-model
        list that names no model or gives two models one name."""
        for key in self.api_keys:
            if not key.startswith("tml-"):
                raise ValueError(
                    f"api key {key[:8]}... must start with 'tml-' (the SDK refuses other keys)"
                )
        if (
            not self.api_keys
            and not _is_loopback(self.host)
            and not (self.allow_unauthenticated_remote)
        ):
            raise ValueError(
                f"host {self.host!r} is reachable from other machines but no API keys are "
                "configured; pass --api-key (or SKYRL_SERVER_API_KEYS), bind 127.0.0.1, or pass "
                "--allow-unauthenticated-remote"
            )
        BaseModelCatalog(self.backend.base_models, served_only=True)  # names, no loading
        if self.housekeeping_interval_s <= 0:
            raise ValueError("housekeeping_interval_s must be positive")
        if self.session_expiry_s < 30:
            raise ValueError(
                "session_expiry_s must be at least 30: the SDK sends a heartbeat every 10 s"
            )
        if not 0 < self.retrieve_wait_s < 40:
            raise ValueError("retrieve_wait_s must be in (0, 40): the SDK times out at 45 s")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
