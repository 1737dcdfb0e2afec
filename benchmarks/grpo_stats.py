"""Learning metrics of `grpo_vs_trl.py` runs, and their paired comparison over seeds.

Per run (one framework, one seed):
- `reward_last_k`: mean training reward of the last K steps (where the run ended up);
- `reward_all_steps`: mean training reward over all steps, i.e. the area under the reward-vs-step
  curve drawn as a step function, divided by the number of steps (how fast it got there);
- `eval_pass1`: greedy pass@1 on the held-out problems after the last step (None if not run).
Per seed (both frameworks, so per pair):
- `reward_common_time`: mean of the reward-vs-cumulative-step-time curve over [0, T], T = the
  shorter run's total step time; the curve joins the points (elapsed_s, reward) of every step with
  straight lines and holds the first step's reward from time 0. This is reward per wall-clock: a
  side that is faster gets more steps inside the same window.

The seed is the unit of replication: the two runs of a seed share its prompts and initial weights,
so ours - TRL is taken per seed and summarised by its mean, standard error and a percentile
bootstrap interval over seeds (10,000 resamples, fixed generator).
"""

from __future__ import annotations

import math

import numpy as np

RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
METRICS = ("reward_last_k", "reward_all_steps", "eval_pass1", "reward_common_time")


def run_metrics(run: dict, last_k: int) -> dict[str, float | None]:
    """The per-run metrics (all but `reward_common_time`, which needs the other side's run)."""
    rewards = [r["reward_mean"] for r in run["steps"]]
    return {
        "reward_last_k": float(np.mean(rewards[-last_k:])),
        "reward_all_steps": float(np.mean(rewards)),
        "eval_pass1": run.get("eval_pass1"),
    }


def time_window_mean(elapsed: list[float], rewards: list[float], horizon: float) -> float:
    """Mean over [0, horizon] of the piecewise-linear curve through (elapsed[i], rewards[i]),
    held at rewards[0] before elapsed[0] (and at the last reward after the last point)."""
    x = np.concatenate([[0.0], elapsed])
    y = np.concatenate([[rewards[0]], rewards])
    inside = x < horizon
    xs = np.append(x[inside], horizon)
    ys = np.append(y[inside], np.interp(horizon, x, y))
    return float(np.trapezoid(ys, xs) / horizon)


def describe(values: list[float], resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict:
    """Mean, standard error (None below 2 values) and 95% percentile bootstrap interval of the
    mean, resampling the values (seeds) with replacement."""
    d = np.asarray(values, dtype=float)
    n = len(d)
    if n == 0:
        return {"n": 0, "mean": None, "se": None, "ci95": None}
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else None
    means = d[np.random.default_rng(seed).integers(0, n, size=(resamples, n))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"n": n, "mean": float(d.mean()), "se": se, "ci95": [float(lo), float(hi)]}


def _by_seed(runs: list[dict], framework: str) -> dict[int, dict]:
    mine = [run for run in runs if run["framework"] == framework]
    seeds = [run["seed"] for run in mine]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{framework}: a seed appears twice in the runs: {sorted(seeds)}")
    return {run["seed"]: run for run in mine}


def per_framework(
    runs: list[dict], last_k: int, frameworks: tuple[str, ...] = ("ours", "trl")
) -> dict:
    """Each framework's per-run metrics over its seeds (for one-sided, controlled experiments)."""
    out = {}
    for framework in frameworks:
        runs_by_seed = _by_seed(runs, framework)
        if not runs_by_seed:
            continue
        seeds = sorted(runs_by_seed)
        rows = [run_metrics(runs_by_seed[s], last_k) for s in seeds]
        out[framework] = {"seeds": seeds}
        for name in rows[0]:
            values = [row[name] for row in rows]
            kept = [v for v in values if v is not None]
            summary = describe(kept)
            out[framework][name] = {"values": values, "mean": summary["mean"], "se": summary["se"]}
    return out


def paired(runs: list[dict], last_k: int, first: str = "ours", second: str = "trl") -> dict | None:
    """`first` - `second` per seed for every metric (seeds that have runs of both frameworks,
    e.g. ours and TRL, or an ablation and its baseline), with the mean, standard error and
    bootstrap interval of the differences; None when no seed has both. Per-metric values are keyed
    by the two labels (`ours`, `mean_ours`, ...)."""
    firsts, seconds = _by_seed(runs, first), _by_seed(runs, second)
    seeds = sorted(set(firsts) & set(seconds))
    if not seeds:
        return None
    rows = []
    for seed in seeds:
        o, t = firsts[seed], seconds[seed]
        mo, mt = run_metrics(o, last_k), run_metrics(t, last_k)
        horizon = min(o["steps"][-1]["elapsed_s"], t["steps"][-1]["elapsed_s"])
        for m, run in ((mo, o), (mt, t)):
            elapsed = [r["elapsed_s"] for r in run["steps"]]
            m["reward_common_time"] = time_window_mean(
                elapsed, [r["reward_mean"] for r in run["steps"]], horizon
            )
        rows.append((seed, mo, mt))
    metrics = {}
    for name in METRICS:
        kept = [(s, mo[name], mt[name]) for s, mo, mt in rows if None not in (mo[name], mt[name])]
        if not kept:
            continue
        diffs = [o - t for _, o, t in kept]
        d = describe(diffs)
        metrics[name] = {
            "seeds": [s for s, _, _ in kept],
            first: [o for _, o, _ in kept],
            second: [t for _, _, t in kept],
            "diff": diffs,
            f"mean_{first}": float(np.mean([o for _, o, _ in kept])),
            f"mean_{second}": float(np.mean([t for _, _, t in kept])),
            "mean_diff": d["mean"],
            "se_diff": d["se"],
            "ci95_diff": d["ci95"],
        }
    n = len(seeds)
    if n == 1:
        note = "1 seed: no standard error, and the interval is that seed's difference."
    else:
        note = (
            f"{n} seeds: the bootstrap mean takes at most {math.comb(2 * n - 1, n)} distinct "
            "values, and a percentile interval from few seeds is too narrow; read it with the "
            "per-seed differences. An interval containing 0 resolves no difference."
        )
    return {
        "first": first,
        "second": second,
        "seeds": seeds,
        "n_seeds": n,
        "last_k": last_k,
        "resamples": RESAMPLES,
        "note": note,
        "metrics": metrics,
    }


def print_paired(result: dict | None) -> None:
    if result is None:
        return
    a, b = result.get("first", "ours"), result.get("second", "trl")
    print(f"\npaired over seeds {result['seeds']}: {a} - {b} per seed (K = {result['last_k']})")
    print(f"{'metric':20s}{a[:9]:>10s}{b[:9]:>10s}{'diff':>8s}{'se':>8s}   95% bootstrap")
    for name, m in result["metrics"].items():
        se = f"{m['se_diff']:8.3f}" if m["se_diff"] is not None else f"{'-':>8s}"
        lo, hi = m["ci95_diff"]
        print(
            f"{name:20s}{m[f'mean_{a}']:10.3f}{m[f'mean_{b}']:10.3f}{m['mean_diff']:+8.3f}{se}"
            f"   [{lo:+.3f}, {hi:+.3f}]"
        )
    print(result["note"])
