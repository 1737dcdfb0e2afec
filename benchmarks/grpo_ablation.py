"""One controlled experiment on our side: a `grpo_vs_trl.py` run with one change (`--frameworks ours
--our-override KEY=VALUE`) against a run without it, paired seed by seed.

    # the variant (the baseline is our side of an existing grpo_vs_trl results file)
    .venv/bin/python benchmarks/grpo_vs_trl.py --mode lora --seeds 0 1 2 3 4 5 6 7 ... \\
        --frameworks ours --our-override model.train_unembed=true --tag arithmetic_unembed
    .venv/bin/python benchmarks/grpo_ablation.py --name lora_on_lm_head \\
        --baseline benchmarks/results/grpo_vs_trl_lora_arithmetic_paired.json \\
        --variant benchmarks/results/grpo_vs_trl_lora_arithmetic_unembed.json

Both files must hold the same settings apart from the overrides (checked; the difference is
recorded). Writes `results/grpo_ablation_<name>.json` (both arms' per-seed metrics, the paired
variant - baseline differences with standard error and bootstrap interval, and the mean of each
diagnostic metric the runs recorded per step) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_stats  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Settings that may differ between the arms: what was changed, and bookkeeping.
VARYING = {"our_overrides", "frameworks", "seeds", "last_k"}
DIAGNOSTICS = (
    "groups/zero_variance_frac",
    "train/grad_norm",
    "train/clip_frac",
    "sampler_learner_logprob_gap/mean",
    "sampler_learner_logprob_gap/max",
    "tis/weight_mean",
)


def arm_runs(record: dict, framework: str, label: str) -> list[dict]:
    """`framework`'s runs of one results file, relabelled as `label`."""
    runs = [dict(run, framework=label) for run in record["runs"] if run["framework"] == framework]
    if not runs:
        raise SystemExit(f"no {framework!r} runs in this results file")
    return runs


def setting_differences(baseline: dict, variant: dict) -> dict:
    """{key: [baseline, variant]} for every setting that differs, refusing any outside VARYING."""
    keys = (set(baseline) | set(variant)) - VARYING
    differing = sorted(k for k in keys if baseline.get(k) != variant.get(k))
    if differing:
        detail = ", ".join(f"{k}: {baseline.get(k)!r} vs {variant.get(k)!r}" for k in differing)
        raise SystemExit(f"the two files were run with different settings ({detail}); rerun one")
    return {"our_overrides": [baseline.get("our_overrides", {}), variant.get("our_overrides", {})]}


def diagnostics(runs: list[dict]) -> dict[str, float]:
    """The mean over every step of every run of each diagnostic metric the runs recorded (max for
    the log-prob gap's maximum)."""
    out = {}
    for key in DIAGNOSTICS:
        values = [s["extra"][key] for run in runs for s in run["steps"] if key in s["extra"]]
        if values:
            out[key] = float(np.max(values) if key.endswith("/max") else np.mean(values))
    return out


def compare(baseline: dict, variant: dict, framework: str, last_k: int) -> dict:
    """The record written to disk (without date and paths)."""
    changed = setting_differences(baseline["settings"], variant["settings"])
    base_runs = arm_runs(baseline, framework, "baseline")
    variant_runs = arm_runs(variant, framework, "variant")
    runs = base_runs + variant_runs
    return {
        "changed": changed,
        "settings": variant["settings"],
        "machine": variant["machine"],
        "per_arm": grpo_stats.per_framework(runs, last_k, ("baseline", "variant")),
        "paired_variant_minus_baseline": grpo_stats.paired(runs, last_k, "variant", "baseline"),
        "diagnostics": {"baseline": diagnostics(base_runs), "variant": diagnostics(variant_runs)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="results go to grpo_ablation_<name>.json")
    p.add_argument("--baseline", required=True, metavar="JSON", help="grpo_vs_trl.py results")
    p.add_argument("--variant", required=True, metavar="JSON", help="grpo_vs_trl.py results")
    p.add_argument("--framework", default="ours", choices=["ours", "trl"])
    p.add_argument("--last-k", type=int, default=5)
    p.add_argument("--what", default="", help="a sentence on what the change is, for the record")
    p.add_argument("--out-dir", default=str(RESULTS))
    a = p.parse_args()
    for path in (a.baseline, a.variant):
        if not Path(path).is_file():
            p.error(f"{path}: no such file")
    baseline = json.loads(Path(a.baseline).read_text())
    variant = json.loads(Path(a.variant).read_text())
    record = {
        "benchmark": f"grpo_ablation_{a.name}",
        "date": datetime.now().isoformat(timespec="seconds"),
        "what": a.what,
        "baseline_file": Path(a.baseline).name,
        "variant_file": Path(a.variant).name,
        **compare(baseline, variant, a.framework, a.last_k),
    }
    out = Path(a.out_dir) / f"grpo_ablation_{a.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"changed: {record['changed']['our_overrides'][0]} -> {record['changed']['our_overrides'][1]}"
    )
    grpo_stats.print_paired(record["paired_variant_minus_baseline"])
    for label, values in record["diagnostics"].items():
        print(f"{label:9s} " + ", ".join(f"{k} {v:.3g}" for k, v in values.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
