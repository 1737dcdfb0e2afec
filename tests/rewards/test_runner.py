"""RewardRunner: concurrent scoring where a raising, invalid or hung reward only costs its item."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from skyrl_trainer.rewards import RewardResult, RewardRunner, get_reward_fn


def mixed_reward(response: str, sample: dict):
    if response == "raise":
        raise ValueError("bad sample")
    if response == "hang":
        time.sleep(30)
    if response == "invalid":
        return None
    if response == "components":
        return {"correct": 1.0, "format": -0.1}
    return float(response == sample["answer"])


def test_scores_in_order_with_the_registered_gsm8k_reward():
    with RewardRunner(get_reward_fn("gsm8k")) as runner:
        results = runner.score_many(
            [("#### 1,080", {"answer": "#### 1080"}), ("#### 7", {"answer": "#### 1080"})] * 50
        )
    assert [r.total for r in results] == [1.0, 0.0] * 50
    assert all(r.error is None and r.components == {} for r in results)


def test_bad_rewards_score_zero_and_do_not_hurt_the_batch():
    runner = RewardRunner(mixed_reward, timeout_s=0.5, max_workers=4)
    items = [
        ("7", {"answer": "7"}),
        ("raise", {}),
        ("hang", {}),
        ("invalid", {}),
        ("components", {}),
        ("8", {"answer": "7"}),
    ]
    start = time.perf_counter()
    results = runner.score_many(items)
    elapsed = time.perf_counter() - start

    assert elapsed < 1.2
    assert results[0] == RewardResult(1.0, {})
    assert results[1] == RewardResult(0.0, {}, error="raised ValueError: bad sample")
    assert results[2] == RewardResult(0.0, {}, error="timed out after 0.5 s")
    assert results[3].total == 0.0 and results[3].components == {}
    assert results[3].error.startswith("invalid return value: reward function returned value None")
    assert results[4].total == pytest.approx(0.9)
    assert results[4].components == {"correct": 1.0, "format": -0.1}
    assert results[5] == RewardResult(0.0, {})

    # Still usable: the hung thread was abandoned and replaced.
    start = time.perf_counter()
    again = runner.score_many([("7", {"answer": "7"})] * 8)
    assert time.perf_counter() - start < 0.5
    assert [r.total for r in again] == [1.0] * 8
    runner.close()


def test_more_hung_items_than_workers():
    release = threading.Event()

    def reward(response: str, sample: dict) -> float:
        if response == "hang":
            release.wait(30)
        return 1.0

    runner = RewardRunner(reward, timeout_s=0.3, max_workers=2)
    try:
        start = time.perf_counter()
        results = runner.score_many([("hang", {})] * 3 + [("ok", {})] * 3)
        elapsed = time.perf_counter() - start
        # Two waves of hung items at most (3 hung on 2 workers): ~0.6 s, not 3 x 0.3 s + more.
        assert elapsed < 1.5
        assert [r.error is not None for r in results] == [True] * 3 + [False] * 3
        assert [r.total for r in results[3:]] == [1.0] * 3
    finally:
        release.set()
    # The abandoned workers exit once released; the replacements are the pool.
    assert _wait_for(lambda: _worker_count(runner) == 2)
    runner.close()
    assert _wait_for(lambda: _worker_count(runner) == 0)


def _worker_count(runner: RewardRunner) -> int:
    name = f"reward-worker-{id(runner):x}"
    return sum(thread.name == name for thread in threading.enumerate())


def _wait_for(condition, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_items_run_concurrently():
    def slow(response: str, sample: dict) -> float:
        time.sleep(0.2)
        return 1.0

    with RewardRunner(slow, max_workers=4) as runner:
        start = time.perf_counter()
        results = runner.score_many([("", {})] * 8)
        elapsed = time.perf_counter() - start
    assert [r.total for r in results] == [1.0] * 8
    assert elapsed < 1.0  # two rounds of 0.2 s, not eight


def test_empty_batch_and_close():
    runner = RewardRunner(mixed_reward)
    assert runner.score_many([]) == []
    runner.close()
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.score_many([("7", {"answer": "7"})])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"timeout_s": 0}, "timeout_s"), ({"max_workers": 0}, "max_workers")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardRunner(mixed_reward, **kwargs)


def test_hung_reward_does_not_block_interpreter_exit():
    script = textwrap.dedent(
        """
        import time
        from skyrl_trainer.rewards import RewardRunner

        def hang(response, sample):
            time.sleep(60)

        results = RewardRunner(hang, timeout_s=0.2).score_many([("", {})])
        assert results[0].error == "timed out after 0.2 s", results
        """
    )
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    assert time.perf_counter() - start < 10
