"""The RL loop end to end with the in-process backend beyond one process: 2 Ray training workers
(`training.num_workers=2`) and 2 Ray sampling engines (`sampling.num_engines=2`), on CPU in float32
with the tiny model. The run completes and writes finite metrics; every step's sampler-vs-learner
log-prob gap stays at float32 noise (each engine serves the learner's weights after every sync).

Its first step equals the 1-worker/1-engine run's: the weights are the same, sampling is seeded per
prompt and the engines are identical replicas. That holds exactly only when each request runs alone
(`max_batch_size=1`): the PyTorch engine's seeded tokens otherwise depend on what shares its batch
(float rounding moves inverse-CDF samples over the tiny random model's near-uniform distributions;
one sample in 16 changed here). Later steps are not compared: the 2-worker gradient sum differs
from one process by float rounding (grad norm ~1e-7 relative), which can move a sample the same way.
"""

import json
import math

import pytest

from skyrl_trainer.backend.clients import ServiceClient
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig
from skyrl_trainer.trainer.loop import RLTrainer

from .loop_helpers import REWARD_MODULE, make_config
from .test_loop import comparable

ray = pytest.importorskip("ray")

STEPS = 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards:vowel_share"


def run(tmp_path, tiny_model_dir, reward, workers: int, engines: int) -> list[dict]:
    service = ServiceClient(
        BackendConfig(
            storage_dir=str(tmp_path / "storage"),
            training=TrainingConfig(
                dtype="float32", device="cpu", num_workers=workers, num_cpus_per_worker=0.5
            ),
            sampling=SamplingConfig(
                engine="torch",
                dtype="float32",
                device="cpu",
                num_engines=engines,
                num_cpus_per_engine=0.5,
                max_batch_size=1,
            ),
        )
    )
    cfg = make_config(
        tmp_path, tiny_model_dir, reward, steps=STEPS, **{"eval.every": 0, "checkpoint.every": 0}
    )
    try:
        return RLTrainer(cfg, service).run()
    finally:
        service.core.shutdown()


def test_two_workers_two_engines_run_end_to_end(
    ray_session, tmp_path, tiny_model_dir, reward_module
):
    history = run(tmp_path / "dist", tiny_model_dir, reward_module, workers=2, engines=2)
    assert len(history) == STEPS
    path = tmp_path / "dist" / "run" / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    for line in lines:
        for key in ("reward/mean", "train/grad_norm", "sampler_learner_logprob_gap/max"):
            assert math.isfinite(line[key]), (key, line[key])
        # fp32 everywhere: every engine serves exactly the learner's weights
        assert line["sampler_learner_logprob_gap/max"] < 1e-4

    single = run(tmp_path / "single", tiny_model_dir, reward_module, workers=1, engines=1)
    assert len(single) == STEPS
    a, b = comparable(history[0]), comparable(single[0])
    assert a.keys() == b.keys()
    for key, value in b.items():
        if "logprob_gap" not in key:  # float noise on both sides, compared to zero
            assert a[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
