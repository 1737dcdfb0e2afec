"""Learning curves of our trainer's runs: train reward (and eval pass@1 where present) against step.

Reads one or more `metrics.jsonl` files written by `python -m skyrl_trainer.main` (one line per step;
a step-0 line holds the evaluation before training when `eval.at_start` is set), and writes
`benchmarks/results/learning_curve_<name>.png` and `learning_curve_<name>.json` (a summary per run).
A run directory may be given instead of its metrics.jsonl. When a resumed run logged a step twice,
the last record of that step wins.

Usage:
  python benchmarks/plot_learning_curves.py outputs/arithmetic_grpo [more runs ...] \\
      [--labels seed0 ...] [--name arithmetic_grpo] [--last-k 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def load_metrics(path: Path) -> list[dict]:
    """The run's records by step (last record of a step wins), in step order."""
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no such metrics file (give a metrics.jsonl or a run directory)")
    by_step: dict[int, dict] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}:{number}: not JSON ({exc})") from exc
        by_step[int(record["step"])] = record
    if not by_step:
        raise SystemExit(f"{path}: no records")
    return [by_step[step] for step in sorted(by_step)]


def summarise(records: list[dict], last_k: int, metric: str = "reward/mean") -> dict:
    train = [r for r in records if metric in r]
    rewards = [r[metric] for r in train]
    k = max(1, min(last_k, len(rewards))) if rewards else 0
    step_times = [r["time/step_s"] for r in train if "time/step_s" in r]
    summary = {
        "metric": metric,
        "by_step": {r["step"]: r[metric] for r in train},
        "train_steps": len(train),
        "last_step": records[-1]["step"],
        "eval_pass@1": {r["step"]: r["eval/pass@1"] for r in records if "eval/pass@1" in r},
    }
    if rewards:
        summary.update(
            {
                f"mean_first_{k}": statistics.fmean(rewards[:k]),
                f"mean_last_{k}": statistics.fmean(rewards[-k:]),
                "mean_all": statistics.fmean(rewards),
            }
        )
    if step_times:
        summary["median_step_s"] = statistics.median(step_times)
        summary["total_step_s"] = sum(step_times)
    lengths = [r["response/mean_tokens"] for r in train if "response/mean_tokens" in r]
    if lengths:
        summary["response_tokens_first_last"] = [lengths[0], lengths[-1]]
    return summary


def plot(
    runs: list[tuple[str, list[dict]]],
    title: str,
    out: Path,
    smooth: int,
    metric: str = "reward/mean",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_eval = any("eval/pass@1" in r for _, records in runs for r in records)
    fig, axes = plt.subplots(1, 2 if has_eval else 1, figsize=(10 if has_eval else 5.5, 3.8))
    axes = list(axes) if has_eval else [axes]
    for i, (label, records) in enumerate(runs):
        color = f"C{i % 10}"
        train = [r for r in records if metric in r]
        steps = [r["step"] for r in train]
        rewards = [r[metric] for r in train]
        smoothed = 1 < smooth <= len(rewards)
        axes[0].plot(
            steps,
            rewards,
            color=color,
            marker=".",
            alpha=0.35 if smoothed else 1.0,
            label=None if smoothed else label,
        )
        if smoothed:
            avg = [
                statistics.fmean(rewards[j + 1 - smooth : j + 1])
                for j in range(smooth - 1, len(rewards))
            ]
            axes[0].plot(
                steps[smooth - 1 :], avg, color=color, label=f"{label} ({smooth}-step mean)"
            )
        if has_eval:
            points = [(r["step"], r["eval/pass@1"]) for r in records if "eval/pass@1" in r]
            if points:
                xs, ys = zip(*points)
                axes[1].plot(xs, ys, color=color, marker="o", label=label)
    axes[0].set_ylabel("mean train reward" if metric == "reward/mean" else f"train {metric}")
    if has_eval:
        axes[1].set_ylabel("eval pass@1 (greedy)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+", type=Path, help="metrics.jsonl files or run directories")
    p.add_argument("--labels", nargs="+", default=None, help="one per path (default: run dir name)")
    p.add_argument("--name", default=None, help="output name (default: the first run's dir name)")
    p.add_argument("--title", default=None)
    p.add_argument("--last-k", type=int, default=4, help="steps averaged for first/last reward")
    p.add_argument(
        "--metric", default="reward/mean", help="the train metric to plot (env/won, ...)"
    )
    p.add_argument("--smooth", type=int, default=1, help="also draw a moving average over N steps")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument(
        "--ran-here",
        action="store_true",
        help="record this machine (CPU model, capability, dtype policy) as where the runs ran",
    )
    a = p.parse_args()
    if a.labels and len(a.labels) != len(a.paths):
        p.error(f"--labels: {len(a.labels)} labels for {len(a.paths)} paths")
    dirs = [path if path.is_dir() else path.parent for path in a.paths]
    labels = a.labels or [d.resolve().name for d in dirs]
    name = a.name or dirs[0].resolve().name
    runs = [(label, load_metrics(path)) for label, path in zip(labels, a.paths)]

    a.out_dir.mkdir(parents=True, exist_ok=True)
    png = a.out_dir / f"learning_curve_{name}.png"
    plot(runs, a.title or f"{name}: train {a.metric} and eval pass@1", png, a.smooth, a.metric)
    summary = {
        "name": name,
        "date": datetime.now().isoformat(timespec="seconds"),
        "runs": [
            {"label": label, "path": str(path), **summarise(records, a.last_k, a.metric)}
            for (label, records), path in zip(runs, a.paths)
        ],
    }
    if a.ran_here:
        from _machine import machine_info, resolve_dtype

        summary["machine"] = machine_info(trainer=resolve_dtype("auto"))
    out = png.with_suffix(".json")
    out.write_text(json.dumps(summary, indent=1))
    for run in summary["runs"]:
        rewards = {k: round(v, 3) for k, v in run.items() if k.startswith("mean_")}
        print(
            f"{run['label']}: {run['train_steps']} steps, {rewards}, eval pass@1 {run['eval_pass@1']}"
        )
    print(f"wrote {png} and {out}")


if __name__ == "__main__":
    main()
