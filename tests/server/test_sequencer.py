"""Sequencer: a model's training requests start in seq_id order whatever order they arrive in."""

from __future__ import annotations

import threading
import time

from skyrl_trainer.server.sequencer import Sequencer


class Recorder:
    def __init__(self):
        self.started: list = []
        self._lock = threading.Lock()

    def __call__(self, tag):
        def start() -> None:
            with self._lock:
                self.started.append(tag)

        return start


def test_out_of_order_arrivals_start_in_seq_order() -> None:
    seq, rec = Sequencer(gap_timeout_s=30), Recorder()
    seq.start_model("m")
    for s in (3, 5, 2, 4):
        seq.submit("m", s, rec(s))
    assert rec.started == []  # all wait for seq 1
    seq.submit("m", 1, rec(1))
    assert rec.started == [1, 2, 3, 4, 5]
    seq.submit("m", 6, rec(6))  # the next one runs at once
    assert rec.started == [1, 2, 3, 4, 5, 6]


def test_models_are_sequenced_independently() -> None:
    seq, rec = Sequencer(gap_timeout_s=30), Recorder()
    seq.start_model("a")
    seq.start_model("b", next_seq=0)
    seq.submit("a", 2, rec("a2"))
    seq.submit("b", 0, rec("b0"))
    seq.submit("b", 1, rec("b1"))
    assert rec.started == ["b0", "b1"]
    seq.submit("a", 1, rec("a1"))
    assert rec.started == ["b0", "b1", "a1", "a2"]


def test_parallel_chunks_lowest_last_from_threads() -> None:
    """Like the SDK's parallel forward_backward chunks: many threads, lowest seq_id last."""
    seq, rec = Sequencer(gap_timeout_s=30), Recorder()
    seq.start_model("m")
    threads = [threading.Thread(target=seq.submit, args=("m", s, rec(s))) for s in range(40, 1, -1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rec.started == []
    seq.submit("m", 1, rec(1))
    assert rec.started == list(range(1, 41))


def test_gap_timeout_flushes_held_requests() -> None:
    seq, rec = Sequencer(gap_timeout_s=0.2), Recorder()
    seq.start_model("m")
    seq.submit("m", 3, rec(3))
    seq.submit("m", 4, rec(4))
    time.sleep(0.05)
    assert rec.started == []
    deadline = time.monotonic() + 5
    while rec.started != [3, 4] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rec.started == [3, 4]  # seq 1 and 2 never came: skipped, in order
    seq.submit("m", 5, rec(5))  # the sequence carries on after the gap
    assert rec.started == [3, 4, 5]
    seq.submit("m", 1, rec(1))  # a late arrival below the cursor runs at once
    assert rec.started == [3, 4, 5, 1]


def test_gap_timeout_releases_only_up_to_the_next_gap() -> None:
    seq, rec = Sequencer(gap_timeout_s=0.3), Recorder()
    seq.start_model("m")
    seq.submit("m", 2, rec(2))
    time.sleep(0.15)
    seq.submit("m", 4, rec(4))  # arrives later: its own gap (3) has its own timeout
    deadline = time.monotonic() + 5
    while not rec.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rec.started == [2]
    seq.submit("m", 3, rec(3))
    assert rec.started == [2, 3, 4]


def test_none_lower_and_unknown_start_immediately() -> None:
    seq, rec = Sequencer(gap_timeout_s=30), Recorder()
    seq.start_model("m")
    seq.submit("m", None, rec("none"))  # unordered request
    assert rec.started == ["none"]
    seq.submit("m", 1, rec(1))
    seq.submit("m", 1, rec("resent-1"))  # a re-sent (lower than the cursor) seq_id
    seq.submit("m", 0, rec(0))
    assert rec.started == ["none", 1, "resent-1", 0]
    seq.submit("never-started", 7, rec("unknown"))  # e.g. a model of a previous process
    assert rec.started == ["none", 1, "resent-1", 0, "unknown"]
    seq.submit("m", 3, rec(3))  # still held: the None/lower ones did not move the cursor
    assert rec.started[-1] == "unknown"
    seq.submit("m", 2, rec(2))
    assert rec.started[-2:] == [2, 3]


def test_start_model_resets_the_cursor() -> None:
    seq, rec = Sequencer(gap_timeout_s=30), Recorder()
    seq.start_model("m")
    seq.submit("m", 1, rec(1))
    seq.start_model("m")  # the same id created again (load into a fresh model)
    seq.submit("m", 2, rec(2))
    assert rec.started == [1]
    seq.submit("m", 1, rec("1b"))
    assert rec.started == [1, "1b", 2]


def test_skip_frees_the_place_and_releases_what_waits() -> None:
    """A refused request's seq_id: skipping it starts the requests held behind it at once,
    and a skip ahead of the cursor is remembered until the cursor reaches it."""
    seq, rec = Sequencer(gap_timeout_s=30), Recorder()
    seq.start_model("m")
    seq.submit("m", 2, rec(2))
    seq.skip("m", 1)
    assert rec.started == [2]
    seq.skip("m", 4)  # refused before 3 arrived
    seq.submit("m", 5, rec(5))
    assert rec.started == [2]
    seq.submit("m", 3, rec(3))
    assert rec.started == [2, 3, 5]
    seq.skip("m", 1)  # already past: nothing changes
    seq.skip("m", None)
    seq.skip("unknown", 1)
    seq.submit("m", 6, rec(6))
    assert rec.started == [2, 3, 5, 6]
