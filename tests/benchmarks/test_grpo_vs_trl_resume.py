"""What a resumed `grpo_vs_trl.py` session keeps and runs (`plan_runs`; no model, no TRL)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from grpo_vs_trl import adapters_identical, plan_runs  # noqa: E402


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


def test_redo_of_some_seeds_keeps_the_others():
    old = runs(("ours", 0), ("trl", 0), ("ours", 1), ("trl", 1))
    kept, plan = plan_runs(old, [1], ["ours", "trl"], redo=["ours"])
    assert kept == runs(("ours", 0), ("trl", 0), ("trl", 1))
    assert plan == [(1, ["ours"])]


def test_adapters_compared_from_the_stored_checks():
    adapter = {"lora_targets": ["q_proj", "v_proj"], "trainable_params": 10}
    record = [
        {"framework": "ours", "seed": 0, "checks": adapter},
        {"framework": "trl", "seed": 0, "checks": {**adapter, "prompt_tokens_identical": True}},
        {"framework": "ours", "seed": 1, "checks": {**adapter, "trainable_params": 12}},
        {"framework": "trl", "seed": 1, "checks": adapter},
        {"framework": "ours", "seed": 2, "checks": {}},  # a run from before the check
        {"framework": "trl", "seed": 2, "checks": adapter},
        {"framework": "trl", "seed": 3, "checks": adapter},  # no pair
    ]
    assert adapters_identical(record) == {0: True, 1: False, 2: False}
