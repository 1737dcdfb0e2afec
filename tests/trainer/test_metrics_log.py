"""Metrics logging: the JSONL file, the progress line, wandb (offline) and tensorboard errors."""

import io
import json

import pytest

from skyrl_trainer.trainer.metrics_log import MetricsLogger, format_duration


def test_jsonl_and_progress_line(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=10, start_step=4, stream=out)
    logger.log(5, {"reward/mean": 0.25, "pass_rate": 0.5, "time/step_s": 2.0})
    logger.log(6, {"reward/mean": 0.5, "eval/pass@1": 0.125})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 5, "reward/mean": 0.25, "pass_rate": 0.5, "time/step_s": 2.0},
        {"step": 6, "reward/mean": 0.5, "eval/pass@1": 0.125},
    ]
    first, second = out.getvalue().splitlines()
    assert first.startswith("step 5/10 | reward 0.250 | pass 0.50 | 2.0 s/step | ETA ")
    assert "eval@1 0.125" in second and "ETA" in second
    # The ETA is the remaining steps at the mean step time (here 2 s), not the wall time since
    # start (a long evaluation before the first step is no step).
    assert first.endswith("ETA 0m10s") and second.endswith("ETA 0m08s")
    assert format_duration(3725) == "1h02m" and format_duration(65) == "1m05s"


def test_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(
        tmp_path,
        total_steps=1,
        wandb_project="skyrl-test",
        wandb_mode="offline",
        stream=io.StringIO(),
    )
    logger.log(1, {"reward/mean": 1.0})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_tensorboard_without_the_package_names_the_field(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="logging.tensorboard"):
            MetricsLogger(tmp_path, total_steps=1, tensorboard=True, stream=io.StringIO())
    else:
        logger = MetricsLogger(tmp_path, total_steps=1, tensorboard=True, stream=io.StringIO())
        logger.log(1, {"reward/mean": 1.0})
        logger.close()
        assert any((tmp_path / "tensorboard").iterdir())
