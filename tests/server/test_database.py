"""ServerDatabase: the server's SQLite state under concurrent use, start-up recovery, purging,
idempotency rows and checkpoint queries (no server, no model)."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import pytest

from skyrl_trainer.server.database import COMPLETE, FAILED, PENDING, ServerDatabase


@pytest.fixture
def db(tmp_path) -> ServerDatabase:
    return ServerDatabase(tmp_path / "server.sqlite3")


def test_wal_mode_is_on(db: ServerDatabase) -> None:
    conn = sqlite3.connect(db.path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    finally:
        conn.close()


def _hammer(database: ServerDatabase, prefix: str, n: int, errors: list) -> None:
    """n futures: add, read, finish (every other one failed), read again."""
    try:
        for i in range(n):
            rid = f"{prefix}-{i}"
            database.add_future(rid, f"owner-{prefix}", "Sample", None)
            assert database.future(rid)["status"] == PENDING
            status = COMPLETE if i % 2 == 0 else FAILED
            database.finish_future(rid, status, "application/json", f"{rid}".encode())
            row = database.future(rid)
            assert row["status"] == status and row["payload"] == rid.encode()
            database.pending_futures(f"owner-{prefix}")
    except BaseException as exc:  # collected: an exception in a thread would be lost
        errors.append(exc)


def test_concurrent_writes_and_reads_lose_nothing(db: ServerDatabase) -> None:
    """16 threads x 200 futures on one object, plus 2 threads on a second object (a second
    connection set with its own write lock) on the same file: no 'database is locked', every
    row present with its own payload."""
    other = ServerDatabase(db.path)
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_hammer, args=(db, f"t{k}", 200, errors)) for k in range(16)
    ] + [threading.Thread(target=_hammer, args=(other, f"o{k}", 100, errors)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:3]
    count = db._one("SELECT COUNT(*) AS n FROM futures")["n"]
    assert count == 16 * 200 + 2 * 100
    assert db.pending_futures() == 0
    for prefix, n in [("t7", 200), ("o1", 100)]:
        for i in (0, n - 1):
            row = other.future(f"{prefix}-{i}")
            assert row["payload"] == f"{prefix}-{i}".encode()
            assert row["owner"] == f"owner-{prefix}"


def test_fail_pending_futures_at_startup(db: ServerDatabase, tmp_path) -> None:
    db.add_future("done", "o", "Sample", None)
    db.finish_future("done", COMPLETE, "application/x-protobuf", b"result")
    db.add_future("left-1", "o", "ForwardBackward", "m")
    db.add_future("left-2", "o", "Sample", None)
    restarted = ServerDatabase(tmp_path / "server.sqlite3")  # a new process on the same file
    payload = json.dumps({"error": "restarted", "category": "server"}).encode()
    assert restarted.fail_pending_futures(payload) == 2
    for rid in ("left-1", "left-2"):
        row = restarted.future(rid)
        assert row["status"] == FAILED
        assert row["content_type"] == "application/json"
        assert json.loads(row["payload"])["error"] == "restarted"
        assert row["completed"] is not None
    done = restarted.future("done")
    assert (done["status"], done["payload"]) == (COMPLETE, b"result")
    assert restarted.fail_pending_futures(payload) == 0
    assert restarted.pending_futures() == 0


def test_purge_removes_only_old_finished_futures_and_idempotency_rows(db: ServerDatabase) -> None:
    db.add_future("old", "o", "Sample", None)
    db.finish_future("old", COMPLETE, "application/json", b"{}")
    db.add_future("old-pending", "o", "Sample", None)
    db.remember_response("o", "old-key", {"request_id": "old"})
    time.sleep(0.05)
    cutoff = time.time()
    time.sleep(0.05)
    db.add_future("new", "o", "Sample", None)
    db.finish_future("new", FAILED, "application/json", b"{}")
    db.remember_response("o", "new-key", {"request_id": "new"})

    assert db.purge_futures(cutoff) == 1
    assert db.future("old") is None
    assert db.future("old-pending")["status"] == PENDING  # never purged while running
    assert db.future("new") is not None
    assert db.idempotent_response("o", "old-key") is None
    assert db.idempotent_response("o", "new-key") == {"request_id": "new"}


def test_idempotency_rows_are_per_owner(db: ServerDatabase) -> None:
    assert db.idempotent_response("alice", "k1") is None
    db.remember_response("alice", "k1", {"request_id": "r1", "model_id": "m"})
    assert db.idempotent_response("alice", "k1") == {"request_id": "r1", "model_id": "m"}
    assert db.idempotent_response("bob", "k1") is None
    db.remember_response("alice", "k1", {"request_id": "r2"})
    assert db.idempotent_response("alice", "k1") == {"request_id": "r2"}


def test_checkpoint_update_and_expiry_queries(db: ServerDatabase) -> None:
    now = time.time()
    db.add_checkpoint("tinker://run/weights/a", "run", "o", "training", "a", None, 10, None)
    db.add_checkpoint(
        "tinker://run/weights/b", "run", "o", "training", "b", now - 1, 20, {"k": "v"}
    )
    db.add_checkpoint(
        "tinker://run/sampler_weights/c", "run", "o", "sampler", "c", now + 3600, 30, None
    )

    expired = db.expired_checkpoints(now)
    assert [r["tinker_path"] for r in expired] == ["tinker://run/weights/b"]
    assert json.loads(expired[0]["user_metadata"]) == {"k": "v"}

    db.update_checkpoint("tinker://run/weights/a", expires_at=now - 5, public=1)
    row = db.checkpoint("tinker://run/weights/a")
    assert row["expires_at"] == pytest.approx(now - 5) and row["public"] == 1
    assert {r["name"] for r in db.expired_checkpoints(now)} == {"a", "b"}
    assert {r["name"] for r in db.expired_checkpoints(now + 7200)} == {"a", "b", "c"}

    db.update_checkpoint("tinker://run/weights/a", expires_at=None)
    assert {r["name"] for r in db.expired_checkpoints(now)} == {"b"}
    with pytest.raises(ValueError, match="can only update"):
        db.update_checkpoint("tinker://run/weights/a", owner="mallory")
    assert db.checkpoint("tinker://run/weights/a")["owner"] == "o"

    assert [r["name"] for r in db.run_checkpoints("run")] == ["a", "b", "c"]
    rows, total = db.owner_checkpoints("o", limit=2, offset=0)
    assert total == 3 and len(rows) == 2
    db.delete_checkpoint("tinker://run/weights/b")
    assert db.checkpoint("tinker://run/weights/b") is None
    assert db.owner_checkpoints("someone-else", 10, 0) == ([], 0)
