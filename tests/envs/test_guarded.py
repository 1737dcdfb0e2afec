"""Guarded environment calls: results, exceptions, time-outs, and the concurrency bound."""

from __future__ import annotations

import threading
import time

import pytest

from skyrl_trainer.envs.guarded import GuardedEnvCalls


def test_value_exception_and_timeout():
    calls = GuardedEnvCalls(max_concurrency=2, timeout_s=0.2)
    assert calls.call(lambda x: x + 1, 1).value == 2
    failed = calls.call(lambda: 1 / 0)
    assert failed.value is None and failed.error.startswith("raised ZeroDivisionError")
    start = time.monotonic()
    hung = calls.call(time.sleep, 5)
    assert hung.error == "timed out after 0.2 s"
    assert time.monotonic() - start < 1.0


def test_exit_does_not_escape():
    def leave():
        raise SystemExit(3)

    assert GuardedEnvCalls().call(leave).error == "raised SystemExit: 3"


def test_at_most_max_concurrency_calls_run_at_once():
    calls = GuardedEnvCalls(max_concurrency=3, timeout_s=5)
    running, peak, lock = [0], [0], threading.Lock()

    def work():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    threads = [threading.Thread(target=calls.call, args=(work,)) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 3


def test_a_hung_call_gives_its_slot_back():
    calls = GuardedEnvCalls(max_concurrency=1, timeout_s=0.1)
    assert calls.call(time.sleep, 3).error is not None
    assert calls.call(lambda: "next").value == "next"  # not blocked by the abandoned call


@pytest.mark.parametrize("kwargs", [{"max_concurrency": 0}, {"timeout_s": 0}])
def test_bad_settings(kwargs):
    with pytest.raises(ValueError, match="env."):
        GuardedEnvCalls(**kwargs)
