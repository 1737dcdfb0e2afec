"""Per-step metrics to the console (a progress line with rate and ETA), `metrics.jsonl`, and wandb /
tensorboard when configured."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("pass_rate", "pass", "{:.2f}"),
    ("response/mean_tokens", "len", "{:.0f}"),
    ("groups/zero_variance_frac", "zvar", "{:.2f}"),
    ("eval/pass@1", "eval@1", "{:.3f}"),
)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class MetricsLogger:
    """Writes each step's metrics everywhere they are configured to go."""

    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        start_step: int = 0,
        wandb_project: str | None = None,
        wandb_mode: str | None = None,
        tensorboard: bool = False,
        run_config: dict | None = None,
        stream=None,
    ):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.start_step = start_step
        self.started = time.monotonic()
        self._step_times: list[float] = []
        self.stream = stream or sys.stdout
        self._wandb = None
        self._tb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(
                project=wandb_project, mode=wandb_mode, config=run_config, dir=str(output_dir)
            )
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ValueError(
                    "logging.tensorboard: needs the `tensorboard` package "
                    "(.venv/bin/pip install tensorboard), or set logging.tensorboard=false"
                ) from exc
            self._tb = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of `step` (1-based) and print the progress line."""
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        print(self.progress_line(step, metrics), file=self.stream, flush=True)

    def progress_line(self, step: int, metrics: dict[str, float]) -> str:
        if "time/step_s" in metrics:
            self._step_times.append(metrics["time/step_s"])
        if self._step_times:  # from step times alone: a long start-up eval is no step
            per_step = sum(self._step_times) / len(self._step_times)
            eta = (self.total_steps - step) * per_step
        else:
            done = step - self.start_step
            elapsed = time.monotonic() - self.started
            eta = (self.total_steps - step) * elapsed / done if done > 0 else math.inf
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, fmt in CONSOLE_KEYS:
            if key in metrics:
                parts.append(f"{label} {fmt.format(metrics[key])}")
        if "time/step_s" in metrics:
            parts.append(f"{metrics['time/step_s']:.1f} s/step")
        parts.append(f"ETA {format_duration(eta) if math.isfinite(eta) else '?'}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def _plain(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value
