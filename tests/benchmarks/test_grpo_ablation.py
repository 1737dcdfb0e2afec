"""benchmarks/grpo_ablation.py on hand-made results files (no model, no TRL)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import grpo_ablation  # noqa: E402

SETTINGS = {"mode": "lora", "steps": 2, "lr": 5e-4, "our_overrides": {}, "seeds": [0, 1]}


def run(framework, seed, rewards, eval_pass1, gap_max=None):
    steps = []
    for i, r in enumerate(rewards):
        extra = {"groups/zero_variance_frac": 0.5 + 0.25 * i}
        if gap_max is not None:
            extra["sampler_learner_logprob_gap/max"] = gap_max * (i + 1)
        steps.append({"elapsed_s": 10.0 * (i + 1), "reward_mean": r, "extra": extra})
    return {"framework": framework, "seed": seed, "steps": steps, "eval_pass1": eval_pass1}


def record(runs, **settings):
    return {"settings": {**SETTINGS, **settings}, "machine": {"cpu": "test"}, "runs": runs}


def test_variant_minus_baseline_per_seed():
    baseline = record(
        [
            run("ours", 0, [0.0, 0.2], 0.25),
            run("trl", 0, [0.9, 0.9], 0.9),  # the other framework's runs are not an arm
            run("ours", 1, [0.1, 0.1], 0.5),
        ]
    )
    variant = record(
        [run("ours", 0, [0.0, 0.6], 0.5, gap_max=1e-6), run("ours", 1, [0.1, 0.3], 0.5)],
        our_overrides={"model.train_unembed": True},
        seeds=[0, 1],
    )
    out = grpo_ablation.compare(baseline, variant, "ours", last_k=1)
    assert out["changed"] == {"our_overrides": [{}, {"model.train_unembed": True}]}
    m = out["paired_variant_minus_baseline"]["metrics"]
    assert m["reward_last_k"]["diff"] == pytest.approx([0.4, 0.2])
    assert m["reward_last_k"]["mean_variant"] == pytest.approx(0.45)
    assert m["reward_last_k"]["mean_baseline"] == pytest.approx(0.15)
    assert m["eval_pass1"]["diff"] == pytest.approx([0.25, 0.0])
    assert out["per_arm"]["baseline"]["reward_last_k"]["values"] == pytest.approx([0.2, 0.1])
    # diagnostics: a mean over all steps of all runs; the gap's maximum is a maximum
    assert out["diagnostics"]["baseline"] == {"groups/zero_variance_frac": pytest.approx(0.625)}
    assert out["diagnostics"]["variant"]["sampler_learner_logprob_gap/max"] == pytest.approx(2e-6)


def test_files_run_with_other_settings_are_refused():
    baseline = record([run("ours", 0, [0.0], 0.0)])
    variant = record([run("ours", 0, [0.0], 0.0)], lr=1e-3)
    with pytest.raises(SystemExit, match=r"different settings \(lr: 0.0005 vs 0.001\)"):
        grpo_ablation.compare(baseline, variant, "ours", last_k=1)
    with pytest.raises(SystemExit, match="no 'trl' runs"):
        grpo_ablation.compare(baseline, baseline, "trl", last_k=1)


def test_command_line_writes_the_record(tmp_path):
    base, var = tmp_path / "base.json", tmp_path / "var.json"
    base.write_text(json.dumps(record([run("ours", 0, [0.0, 0.5], 0.5)])))
    var.write_text(json.dumps(record([run("ours", 0, [0.0, 1.0], 0.75)])))
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "grpo_ablation.py"), "--name", "x"]
        + ["--baseline", str(base), "--variant", str(var), "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "variant - baseline" in done.stdout
    written = json.loads((tmp_path / "grpo_ablation_x.json").read_text())
    assert written["benchmark"] == "grpo_ablation_x" and written["variant_file"] == "var.json"
    assert written["paired_variant_minus_baseline"]["metrics"]["eval_pass1"]["diff"] == [0.25]
