"""What a resumed `grpo_vs_trl.py` session keeps and runs (`plan_runs`; no model, no TRL)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from grpo_vs_trl import plan_runs  # noqa: E402


def runs(*pairs):
    return [{"framework": f, "seed": s} for f, s in pairs]


def test_a_seed_runs_only_the_frameworks_it_lacks():
    old = runs(("ours", 0), ("trl", 0), ("ours", 1))  # seed 1's TRL run was cut off
    kept, plan = plan_runs(old, [0, 1, 2], ["ours", "trl"], redo=[])
    assert kept == old
    assert plan == [(0, []), (1, ["trl"]), (2, ["ours", "trl"])]


def test_redo_drops_one_side_and_keeps_the_other():
    old = runs(("ours", 0), ("trl", 0), ("ours", 1), ("trl", 1))
    kept, plan = plan_runs(old, [0, 1], ["ours", "trl"], redo=["ours"])
    assert kept == runs(("trl", 0), ("trl", 1))
    assert plan == [(0, ["ours"]), (1, ["ours"])]
    kept, plan = plan_runs(old, [0, 1], ["ours"], redo=["ours"])  # --frameworks ours
    assert plan == [(0, ["ours"]), (1, ["ours"])]
