"""The server's state in SQLite (WAL): sessions, models, samplers, futures, checkpoints.

Many request handlers and worker callbacks touch the database at once. Writes go through one
lock (so this process never sees "database is locked"), every thread reads through its own
connection, and WAL lets readers run while a write commits. `busy_timeout` covers a second
process on the same file. Rows are plain dicts; the schema is below.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL,
    last_heartbeat REAL NOT NULL, end_status TEXT, tags TEXT, user_metadata TEXT,
    display_name TEXT, sdk_version TEXT);
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    base_model TEXT NOT NULL, is_lora INTEGER NOT NULL, lora_rank INTEGER,
    created REAL NOT NULL, last_request_time REAL NOT NULL, user_metadata TEXT);
CREATE TABLE IF NOT EXISTS samplers (
    sampler_id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT,
    base_model TEXT NOT NULL, model_path TEXT, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS futures (
    request_id TEXT PRIMARY KEY, owner TEXT NOT NULL, request_type TEXT NOT NULL,
    model_id TEXT, status TEXT NOT NULL, content_type TEXT, payload BLOB,
    created REAL NOT NULL, completed REAL);
CREATE INDEX IF NOT EXISTS futures_by_time ON futures (created);
CREATE INDEX IF NOT EXISTS futures_by_owner_status ON futures (owner, status);
CREATE TABLE IF NOT EXISTS checkpoints (
    tinker_path TEXT PRIMARY KEY, run_id TEXT NOT NULL, owner TEXT NOT NULL,
    checkpoint_type TEXT NOT NULL, name TEXT NOT NULL, created REAL NOT NULL,
    expires_at REAL, size_bytes INTEGER, public INTEGER NOT NULL DEFAULT 0,
    user_metadata TEXT);
CREATE INDEX IF NOT EXISTS checkpoints_by_run ON checkpoints (run_id);
CREATE TABLE IF NOT EXISTS idempotency (
    owner TEXT NOT NULL, key TEXT NOT NULL, response TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (owner, key));
"""

PENDING, COMPLETE, FAILED = "pending", "complete", "failed"


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


class ServerDatabase:
    """Thread-safe access to the server's SQLite file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write_lock = threading.Lock()
        self._local = threading.local()
        with self._write_lock:
            conn = self._connection()
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(SCHEMA)

    def _connection(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
        return conn

    @contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        with self._write_lock:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _one(self, sql: str, args: tuple = ()) -> dict | None:
        row = self._connection().execute(sql, args).fetchone()
        return dict(row) if row is not None else None

    def _all(self, sql: str, args: tuple = ()) -> list[dict]:
        return [dict(r) for r in self._connection().execute(sql, args).fetchall()]

    # ----- sessions -----------------------------------------------------------------------

    def add_session(self, session_id: str, owner: str, request: dict) -> None:
        now = time.time()
        with self._writing() as db:
            db.execute(
                "INSERT INTO sessions VALUES (?, ?, ?, ?, NULL, ?, ?, ?, ?)",
                (
                    session_id,
                    owner,
                    now,
                    now,
                    _json(request.get("tags")),
                    _json(request.get("user_metadata")),
                    request.get("display_name"),
                    request.get("sdk_version"),
                ),
            )

    def session(self, session_id: str) -> dict | None:
        return self._one("SELECT * FROM sessions WHERE session_id = ?", (session_id,))

    def sessions(self, owner: str, limit: int, offset: int) -> list[dict]:
        return self._all(
            "SELECT * FROM sessions WHERE owner = ? ORDER BY created DESC LIMIT ? OFFSET ?",
            (owner, limit, offset),
        )

    def session_summaries(self, owner: str) -> list[dict]:
        """The owner's sessions, newest first (ties by session id, descending), each with
        `checkpoints_count` and `checkpoint_bytes` over its models' checkpoints."""
        return self._all(
            "SELECT s.*, COUNT(c.tinker_path) AS checkpoints_count, "
            "SUM(c.size_bytes) AS checkpoint_bytes FROM sessions s "
            "LEFT JOIN models m ON m.session_id = s.session_id "
            "LEFT JOIN checkpoints c ON c.run_id = m.model_id "
            "WHERE s.owner = ? GROUP BY s.session_id "
            "ORDER BY s.created DESC, s.session_id DESC",
            (owner,),
        )

    def touch_session(self, session_id: str) -> None:
        with self._writing() as db:
            db.execute(
                "UPDATE sessions SET last_heartbeat = ? WHERE session_id = ?",
                (time.time(), session_id),
            )

    def end_session(self, session_id: str, status: str) -> None:
        with self._writing() as db:
            db.execute(
                "UPDATE sessions SET end_status = ? WHERE session_id = ?", (status, session_id)
            )

    # ----- models (training runs) and samplers --------------------------------------------

    def add_model(
        self, model_id: str, session_id: str, owner: str, base_model: str, lora_rank: int | None,
        user_metadata: dict | None,
    ) -> None:  # fmt: skip
        now = time.time()
        with self._writing() as db:
            db.execute(
                "INSERT OR REPLACE INTO models VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    model_id,
                    session_id,
                    owner,
                    base_model,
                    int(lora_rank is not None),
                    lora_rank,
                    now,
                    now,
                    _json(user_metadata),
                ),
            )

    def model(self, model_id: str) -> dict | None:
        return self._one("SELECT * FROM models WHERE model_id = ?", (model_id,))

    def models(
        self, owner: str, limit: int, offset: int, published: bool = False
    ) -> tuple[list[dict], int]:
        """The owner's models; with `published`, also every model with a published
        checkpoint."""
        where = "owner = ?"
        if published:
            where += " OR model_id IN (SELECT run_id FROM checkpoints WHERE public = 1)"
        rows = self._all(
            f"SELECT * FROM models WHERE {where} ORDER BY created DESC LIMIT ? OFFSET ?",
            (owner, limit, offset),
        )
        total = self._one(f"SELECT COUNT(*) AS n FROM models WHERE {where}", (owner,))
        return rows, total["n"] if total else 0

    def run_is_published(self, model_id: str) -> bool:
        """Whether any checkpoint of the model is published."""
        row = self._one(
            "SELECT 1 AS yes FROM checkpoints WHERE run_id = ? AND public = 1 LIMIT 1", (model_id,)
        )
        return row is not None

    def session_models(self, session_id: str) -> list[str]:
        rows = self._all("SELECT model_id FROM models WHERE session_id = ?", (session_id,))
        return [r["model_id"] for r in rows]

    def touch_model(self, model_id: str) -> None:
        with self._writing() as db:
            db.execute(
                "UPDATE models SET last_request_time = ? WHERE model_id = ?",
                (time.time(), model_id),
            )

    def add_sampler(
        self, sampler_id: str, owner: str, session_id: str | None, base_model: str,
        model_path: str | None,
    ) -> None:  # fmt: skip
        with self._writing() as db:
            db.execute(
                "INSERT OR REPLACE INTO samplers VALUES (?, ?, ?, ?, ?, ?)",
                (sampler_id, owner, session_id, base_model, model_path, time.time()),
            )

    def sampler(self, sampler_id: str) -> dict | None:
        return self._one("SELECT * FROM samplers WHERE sampler_id = ?", (sampler_id,))

    def session_samplers(self, session_id: str) -> list[str]:
        rows = self._all("SELECT sampler_id FROM samplers WHERE session_id = ?", (session_id,))
        return [r["sampler_id"] for r in rows]

    # ----- futures ------------------------------------------------------------------------

    def add_future(self, request_id: str, owner: str, request_type: str, model_id: str | None):
        with self._writing() as db:
            db.execute(
                "INSERT INTO futures VALUES (?, ?, ?, ?, ?, NULL, NULL, ?, NULL)",
                (request_id, owner, request_type, model_id, PENDING, time.time()),
            )

    def finish_future(self, request_id: str, status: str, content_type: str, payload: bytes):
        with self._writing() as db:
            db.execute(
                "UPDATE futures SET status = ?, content_type = ?, payload = ?, completed = ? "
                "WHERE request_id = ?",
                (status, content_type, payload, time.time(), request_id),
            )

    def future(self, request_id: str) -> dict | None:
        return self._one("SELECT * FROM futures WHERE request_id = ?", (request_id,))

    def pending_futures(self, owner: str | None = None) -> int:
        if owner is None:
            row = self._one("SELECT COUNT(*) AS n FROM futures WHERE status = ?", (PENDING,))
        else:
            row = self._one(
                "SELECT COUNT(*) AS n FROM futures WHERE status = ? AND owner = ?",
                (PENDING, owner),
            )
        return row["n"] if row else 0

    def fail_pending_futures(self, payload: bytes) -> int:
        """At start-up: futures of a previous process can never complete; fail them."""
        with self._writing() as db:
            cursor = db.execute(
                "UPDATE futures SET status = ?, content_type = 'application/json', payload = ?, "
                "completed = ? WHERE status = ?",
                (FAILED, payload, time.time(), PENDING),
            )
            return cursor.rowcount

    def purge_futures(self, older_than: float) -> int:
        with self._writing() as db:
            cursor = db.execute(
                "DELETE FROM futures WHERE status != ? AND completed < ?", (PENDING, older_than)
            )
            db.execute("DELETE FROM idempotency WHERE created < ?", (older_than,))
            return cursor.rowcount

    # ----- idempotency (SDK retries reuse X-Idempotency-Key) --------------------------------

    def idempotent_response(self, owner: str, key: str) -> dict | None:
        row = self._one(
            "SELECT response FROM idempotency WHERE owner = ? AND key = ?", (owner, key)
        )
        return json.loads(row["response"]) if row else None

    def remember_response(self, owner: str, key: str, response: dict) -> None:
        with self._writing() as db:
            db.execute(
                "INSERT OR REPLACE INTO idempotency VALUES (?, ?, ?, ?)",
                (owner, key, json.dumps(response), time.time()),
            )

    # ----- checkpoints --------------------------------------------------------------------

    def add_checkpoint(
        self, tinker_path: str, run_id: str, owner: str, checkpoint_type: str, name: str,
        expires_at: float | None, size_bytes: int, user_metadata: dict | None,
    ) -> None:  # fmt: skip
        with self._writing() as db:
            db.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                (
                    tinker_path,
                    run_id,
                    owner,
                    checkpoint_type,
                    name,
                    time.time(),
                    expires_at,
                    size_bytes,
                    _json(user_metadata),
                ),
            )

    def checkpoint(self, tinker_path: str) -> dict | None:
        return self._one("SELECT * FROM checkpoints WHERE tinker_path = ?", (tinker_path,))

    def run_checkpoints(self, run_id: str) -> list[dict]:
        return self._all("SELECT * FROM checkpoints WHERE run_id = ? ORDER BY created", (run_id,))

    def owner_checkpoints(self, owner: str, limit: int, offset: int) -> tuple[list[dict], int]:
        rows = self._all(
            "SELECT * FROM checkpoints WHERE owner = ? ORDER BY created DESC LIMIT ? OFFSET ?",
            (owner, limit, offset),
        )
        total = self._one("SELECT COUNT(*) AS n FROM checkpoints WHERE owner = ?", (owner,))
        return rows, total["n"] if total else 0

    def update_checkpoint(self, tinker_path: str, **fields: Any) -> None:
        allowed = {"expires_at", "public"}
        if not set(fields) <= allowed:
            raise ValueError(f"can only update {sorted(allowed)}")
        assignments = ", ".join(f"{name} = ?" for name in fields)
        with self._writing() as db:
            db.execute(
                f"UPDATE checkpoints SET {assignments} WHERE tinker_path = ?",
                (*fields.values(), tinker_path),
            )

    def delete_checkpoint(self, tinker_path: str) -> None:
        with self._writing() as db:
            db.execute("DELETE FROM checkpoints WHERE tinker_path = ?", (tinker_path,))

    def expired_checkpoints(self, now: float) -> list[dict]:
        return self._all(
            "SELECT * FROM checkpoints WHERE expires_at IS NOT NULL AND expires_at < ?", (now,)
        )
