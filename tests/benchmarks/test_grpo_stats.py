"""benchmarks/grpo_stats.py against numbers worked out by hand (no model, no TRL)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import grpo_stats  # noqa: E402


def run(framework, seed, elapsed, rewards, eval_pass1=None):
    steps = [{"elapsed_s": e, "reward_mean": r} for e, r in zip(elapsed, rewards, strict=True)]
    return {"framework": framework, "seed": seed, "steps": steps, "eval_pass1": eval_pass1}


def test_run_metrics():
    m = grpo_stats.run_metrics(run("ours", 0, [1, 2, 3, 4], [0.0, 0.5, 1.0, 0.5], 0.25), 2)
    assert m == {"reward_last_k": 0.75, "reward_all_steps": 0.5, "eval_pass1": 0.25}


def test_time_window_mean():
    # points (0, .2) [held], (10, .2), (20, .6): area 10 * .2 + 10 * (.2 + .6) / 2 = 6
    mean = grpo_stats.time_window_mean
    assert mean([10, 20], [0.2, 0.6], 20) == pytest.approx(6 / 20)
    assert mean([10, 20], [0.2, 0.6], 15) == pytest.approx((2 + 5 * (0.2 + 0.4) / 2) / 15)
    assert mean([10, 20], [0.2, 0.6], 5) == pytest.approx(0.2)
    assert mean([10, 20], [0.2, 0.6], 30) == pytest.approx((6 + 10 * 0.6) / 30)


def test_describe():
    d = grpo_stats.describe([1.0, 2.0, 3.0, 6.0])
    assert d["n"] == 4 and d["mean"] == 3.0
    assert d["se"] == pytest.approx(math.sqrt(14 / 3) / 2)  # sample sd sqrt((4+1+0+9)/3) / sqrt(4)
    assert d == grpo_stats.describe([1.0, 2.0, 3.0, 6.0])  # fixed generator: reproducible
    # resampling two seeds: the mean is 0, 0.5 or 1 with probabilities 1/4, 1/2, 1/4
    assert grpo_stats.describe([0.0, 1.0])["ci95"] == [0.0, 1.0]
    one = grpo_stats.describe([0.25])
    assert one["se"] is None and one["ci95"] == [0.25, 0.25]
    assert grpo_stats.describe([])["mean"] is None


def test_paired():
    runs = [
        run("ours", 0, [10, 20], [0.2, 0.6], 0.5),
        run("trl", 0, [30, 60], [0.0, 0.4], 0.25),
        run("ours", 1, [10, 20], [0.0, 0.2], 0.5),
        run("trl", 1, [30, 60], [0.1, 0.1], None),  # no eval: seed 1 drops out of eval_pass1
        run("ours", 2, [10, 20], [1.0, 1.0], 1.0),  # no TRL run: not paired
    ]
    p = grpo_stats.paired(runs, last_k=1)
    assert p["seeds"] == [0, 1] and p["n_seeds"] == 2
    m = p["metrics"]
    assert m["reward_last_k"]["diff"] == pytest.approx([0.6 - 0.4, 0.2 - 0.1])
    assert m["reward_last_k"]["mean_diff"] == pytest.approx(0.15)
    assert m["reward_last_k"]["se_diff"] == pytest.approx(0.05)  # sd 0.0707 / sqrt(2)
    assert m["reward_all_steps"]["diff"] == pytest.approx([0.4 - 0.2, 0.1 - 0.1])
    assert m["eval_pass1"]["seeds"] == [0] and m["eval_pass1"]["diff"] == [0.25]
    # window [0, 20] (ours' total time): seed 0 ours 6/20 vs TRL 0; seed 1 ours (10 * .1)/20 vs .1
    assert m["reward_common_time"]["diff"] == pytest.approx([0.3, 0.05 - 0.1])
    assert m["reward_common_time"]["mean_ours"] == pytest.approx((0.3 + 0.05) / 2)
    lo, hi = m["reward_last_k"]["ci95_diff"]
    assert lo == pytest.approx(0.1) and hi == pytest.approx(0.2)
    assert grpo_stats.paired([run("ours", 0, [1], [0.0])], 1) is None


def test_per_framework_and_duplicates():
    runs = [run("ours", 0, [1, 2], [0.0, 1.0], 0.5), run("ours", 1, [1, 2], [0.0, 0.0], None)]
    f = grpo_stats.per_framework(runs, last_k=1)
    assert list(f) == ["ours"] and f["ours"]["seeds"] == [0, 1]
    assert f["ours"]["reward_last_k"] == {"values": [1.0, 0.0], "mean": 0.5, "se": 0.5}
    assert f["ours"]["eval_pass1"]["mean"] == 0.5  # the missing eval is left out
    with pytest.raises(ValueError, match="seed appears twice"):
        grpo_stats.paired(runs + [runs[0]], 1)
