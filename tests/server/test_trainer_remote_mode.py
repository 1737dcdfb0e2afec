"""The trainer in remote mode (`backend=remote`, the official SDK) against this package's
server produces the same metrics as with the in-process backend: tiny model, fixed seeds."""

from __future__ import annotations

import pytest

from skyrl_trainer.backend.clients import ServiceClient
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig
from skyrl_trainer.connect import make_service_client
from skyrl_trainer.trainer.config import BackendSettings
from skyrl_trainer.trainer.loop import RLTrainer
from tests.server.conftest import API_KEY, LiveServer
from tests.trainer import test_loop
from tests.trainer.test_loop import comparable, make_config

reward_module = test_loop.reward_module  # the trainer tests' user-reward fixture


@pytest.fixture(scope="module")
def one_row_server(tiny_model_dir, tmp_path_factory):
    """Requests reach a server in whatever order the network delivers them, and a batched
    forward's float sums depend on which rows share the batch. With one row at a time on
    both sides, sampling does not depend on arrival order and the runs can match exactly."""
    server = LiveServer(
        tiny_model_dir, tmp_path_factory.mktemp("server"), ["--max-batch-size", "1"]
    )
    yield server.start()
    server.stop()


def one_row_local_service(folder) -> ServiceClient:
    """The in-process backend with one row per forward, as the server runs (`one_row_server`)."""
    return ServiceClient(
        BackendConfig(
            storage_dir=str(folder / "storage"),
            training=TrainingConfig(dtype="float32", device="cpu"),
            sampling=SamplingConfig(
                engine="torch", dtype="float32", device="cpu", max_batch_size=1
            ),
        )
    )


def test_remote_trainer_metrics_equal_local(
    one_row_server, tiny_model_dir, reward_module, tmp_path, monkeypatch
):
    live_server = one_row_server
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    remote_service = make_service_client(
        BackendSettings(kind="remote", base_url=live_server.base_url)
    )
    assert type(remote_service).__module__.startswith("tinker")
    overrides = {"steps": 3, "eval.every": 3, "checkpoint.every": 3}
    remote_cfg = make_config(tmp_path / "remote", tiny_model_dir, reward_module, **overrides)
    local_cfg = make_config(tmp_path / "local", tiny_model_dir, reward_module, **overrides)
    remote = RLTrainer(remote_cfg, remote_service).run()
    local = RLTrainer(local_cfg, one_row_local_service(tmp_path / "local")).run()

    assert len(remote) == len(local) == 3
    for step, (r, q) in enumerate(zip(remote, local, strict=True), start=1):
        assert comparable(r).keys() == comparable(q).keys()
        for key, value in comparable(q).items():
            assert r[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)
    assert "eval/pass@1" in remote[-1]
    # The server names the model "tiny_llama0", never its folder: the SDK cannot load that
    # tokenizer here, so the trainer loaded its configured model.base_model's.
    # the checkpoint was written by the server, into its storage
    saved = list((live_server.storage_dir).rglob("step-000003"))
    assert saved, "the remote run's checkpoint is in the server's storage"


def test_remote_multi_turn_rollouts_equal_local(
    one_row_server, tiny_model_dir, tmp_path, monkeypatch
):
    """The same multi-turn environment rollouts through the official SDK against our server."""
    from tests.trainer.test_rollouts import SCRIPTED_ENVS

    (tmp_path / "scripted_envs.py").write_text(SCRIPTED_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    overrides = {
        "steps": 2,
        "eval.every": 0,
        "checkpoint.every": 2,
        "env.name": "scripted_envs:Scripted",
        "env.config": {"turns": 3, "vowel_reward": True},
    }
    remote_service = make_service_client(
        BackendSettings(kind="remote", base_url=one_row_server.base_url)
    )
    remote_cfg = make_config(tmp_path / "remote", tiny_model_dir, "arithmetic", **overrides)
    local_cfg = make_config(tmp_path / "local", tiny_model_dir, "arithmetic", **overrides)
    remote = RLTrainer(remote_cfg, remote_service).run()
    local = RLTrainer(local_cfg, one_row_local_service(tmp_path / "local")).run()
    for step, (r, q) in enumerate(zip(remote, local, strict=True), start=1):
        assert r["rollout/turns_mean"] == 3
        assert comparable(r).keys() == comparable(q).keys()
        for key, value in comparable(q).items():
            assert r[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)
