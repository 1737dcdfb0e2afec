"""Asynchronous RL in remote mode (the official SDK against this package's server): the
deterministic schedule gives the same metrics as in-process, and streaming keeps its bound."""

from __future__ import annotations

import pytest

from skyrl_trainer.connect import make_service_client
from skyrl_trainer.trainer.config import BackendSettings
from skyrl_trainer.trainer.loop import RLTrainer
from tests.server.conftest import API_KEY
from tests.server.test_trainer_remote_mode import one_row_local_service, one_row_server  # noqa: F401
from tests.trainer import test_loop
from tests.trainer.test_async_pipeline import async_config, comparable, read_trajectories

reward_module = test_loop.reward_module


@pytest.fixture
def remote_service(one_row_server, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    return make_service_client(BackendSettings(kind="remote", base_url=one_row_server.base_url))


def test_remote_deterministic_async_equals_local(
    remote_service, tiny_model_dir, reward_module, tmp_path
):
    overrides = {"steps": 4, "checkpoint.every": 2}
    remote_cfg = async_config(tmp_path / "r", tiny_model_dir, reward_module, k=1, **overrides)
    local_cfg = async_config(tmp_path / "l", tiny_model_dir, reward_module, k=1, **overrides)
    remote = RLTrainer(remote_cfg, remote_service).run()
    local = RLTrainer(local_cfg, one_row_local_service(tmp_path / "l")).run()
    for step, (r, q) in enumerate(zip(remote, local, strict=True)):
        assert r["async/staleness_mean"] == min(step, 1)
        assert comparable(r).keys() == comparable(q).keys()
        for key, value in comparable(q).items():
            assert r[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


def test_remote_streaming_keeps_the_bound(remote_service, tiny_model_dir, reward_module, tmp_path):
    cfg = async_config(tmp_path, tiny_model_dir, reward_module, "streaming", 1, steps=3)
    history = RLTrainer(cfg, remote_service).run()
    assert len(history) == 3
    trained = [r for r in read_trajectories(tmp_path / "run") if not r["dropped"]]
    assert len({r["group_id"] for r in trained}) == 3 * 4
    for r in trained:
        assert r["step"] - 1 - r["sampler_version"] <= 1
