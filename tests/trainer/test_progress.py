"""Live status lines of long phases (trainer/progress.py)."""

from __future__ import annotations

import io
import re
import threading
import time
from concurrent.futures import Future

from skyrl_trainer.trainer.progress import PhaseTimer


def futures_done_after(delays: list[float]) -> list[Future]:
    """Futures that complete (with their index) after `delays` seconds, from other threads."""
    futures = [Future() for _ in delays]
    for i, (future, delay) in enumerate(zip(futures, delays, strict=True)):
        threading.Timer(delay, future.set_result, args=(i,)).start()
    return futures


def test_a_fast_phase_prints_nothing():
    out = io.StringIO()
    timer = PhaseTimer(every_s=5.0, stream=out)
    assert timer.results(futures_done_after([0.0, 0.01]), "sampling step 1", "groups") == [0, 1]
    assert out.getvalue() == ""


def test_a_slow_phase_prints_done_rate_eta_and_a_closing_line():
    out = io.StringIO()
    timer = PhaseTimer(every_s=0.1, stream=out)
    results = timer.results(futures_done_after([0.05, 0.5, 0.55]), "eval pass@1", "prompts")
    assert results == [0, 1, 2]
    lines = out.getvalue().strip().splitlines()
    # While only the first item is done: 1/3, a rate, and an ETA from that rate.
    assert any(
        re.search(r"eval pass@1: 1/3 prompts, \d+ s, [\d.]+ prompts/s, ETA \d+m\d\ds", line)
        for line in lines
    )
    assert lines[-1].strip().startswith("eval pass@1: 3/3 prompts in ")


def test_eta_before_the_first_item_comes_from_the_last_run_of_the_phase():
    out = io.StringIO()
    timer = PhaseTimer(every_s=0.1, stream=out)
    timer.results(futures_done_after([0.3]), "training", "mini-batches")
    assert timer.last_duration_s["training"] >= 0.25  # the timer started just before the phase
    out.truncate(0)
    out.seek(0)
    timer.results(futures_done_after([0.35]), "training", "mini-batches")
    assert "0/1 mini-batches" in out.getvalue()
    assert "(last took 0 s)" in out.getvalue()  # an estimate, not "?"
    # An empty phase (a step with nothing to train) leaves the estimate alone.
    timer.results([], "training", "mini-batches")
    assert timer.last_duration_s["training"] >= 0.25  # the timer started just before the phase
    # Phases with a step number share their history ("sampling step 1" -> "sampling step 2").
    timer.results(futures_done_after([0.0]), "sampling step 1", "groups")
    assert "sampling" in timer.last_duration_s


def test_a_failing_future_ends_the_phase_and_stops_its_ticker():
    timer = PhaseTimer(every_s=0.05, stream=io.StringIO())
    bad: Future = Future()
    bad.set_exception(RuntimeError("engine died"))
    before = threading.active_count()
    try:
        timer.results([bad], "sampling step 1", "groups")
    except RuntimeError as exc:
        assert "engine died" in str(exc)
    time.sleep(0.1)
    assert threading.active_count() <= before
    assert "sampling" not in timer.last_duration_s  # a failed phase is no estimate


def test_items_count_as_they_complete_not_in_order():
    """The first future is the slowest: the others still count as done when they finish."""
    out = io.StringIO()
    timer = PhaseTimer(every_s=0.15, stream=out)
    assert timer.results(futures_done_after([0.5, 0.02, 0.03]), "eval", "prompts") == [0, 1, 2]
    assert "eval: 2/3 prompts" in out.getvalue()
