"""Asynchronous RL on the tiny model through the in-process backend: the deterministic schedule
(batch t sampled with the weights of step t - k, reproducible, exact resume), streaming (bounded
staleness, every group trained once or counted, a slow environment does not hold the others),
the off-policy metrics, and shutdown."""

import json
import threading
import time

import pytest

from skyrl_trainer.backend.futures import done
from skyrl_trainer.data import PromptStream
from skyrl_trainer.trainer.config import ConfigError, validate_config
from skyrl_trainer.trainer.loop import RLTrainer
from skyrl_trainer.trainer.setup import load_problems
from tests.trainer.loop_helpers import make_config, make_service, write_reward_module


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    return f"{write_reward_module(tmp_path, monkeypatch)}:vowel_share"


def comparable(metrics: dict) -> dict:
    return {
        k: v
        for k, v in metrics.items()
        if not k.startswith(("time/", "throughput/", "async/learner_wait_s", "async/sampler_idle"))
    }


def async_config(tmp_path, tiny_model_dir, reward, mode="deterministic", k=1, **overrides):
    return make_config(
        tmp_path,
        tiny_model_dir,
        reward,
        **{
            "algorithm.max_steps_off_policy": k,
            "algorithm.async_mode": mode,
            "eval.every": 0,
            **overrides,
        },
    )


def read_trajectories(run_dir):
    return [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]


def test_deterministic_mode_samples_batch_t_with_weights_of_step_t_minus_k(
    tmp_path, tiny_model_dir, reward_module
):
    k = 2
    cfg = async_config(tmp_path, tiny_model_dir, reward_module, k=k, steps=5)
    history = RLTrainer(cfg, make_service(tmp_path)).run()
    records = read_trajectories(tmp_path / "run")
    assert {r["step"] for r in records} == {1, 2, 3, 4, 5}
    for r in records:
        t = r["step"] - 1
        assert r["sampler_version"] == max(t - k, 0), r
        assert not r["dropped"]
    for t, m in enumerate(history):
        age = min(t, k)
        assert m["async/staleness_mean"] == age and m["async/staleness_max"] == age
        assert m[f"async/staleness_{age}"] == 16  # 4 prompts x 4 samples, all of that age
        assert m["async/dropped_groups"] == 0
        assert f"sampler_learner_logprob_gap/staleness_{age}" in m
    # fp32 on both sides: at staleness 0 the sampler serves exactly the learner's weights; later
    # the learner is k updates ahead of the sampler, and the gap shows it.
    assert history[0]["sampler_learner_logprob_gap/staleness_0"] < 1e-4
    assert history[-1][f"sampler_learner_logprob_gap/staleness_{k}"] > 1e-3


def test_deterministic_mode_is_reproducible_and_resumes_exactly(
    tmp_path, tiny_model_dir, reward_module
):
    def config(folder):  # with evaluation, which never shares the engine with a batch
        return async_config(
            folder, tiny_model_dir, reward_module, k=2, steps=5, **{"eval.every": 2}
        )

    straight = RLTrainer(config(tmp_path / "a"), make_service(tmp_path / "a")).run()
    again = RLTrainer(config(tmp_path / "c"), make_service(tmp_path / "c")).run()
    cfg = config(tmp_path / "b")
    first = RLTrainer(cfg, make_service(tmp_path / "b")).run(stop_after=2)  # checkpoint at 2
    resumed = RLTrainer(cfg, make_service(tmp_path / "b"))  # a new process: resume=auto
    assert resumed.start_step == 2
    pending = resumed.run_state.pending_pipeline
    assert sorted(pending["batches"]) == [2, 3]  # the k batches sampled ahead, saved
    rest = resumed.run()
    for other in (again, first + rest):
        assert len(other) == len(straight)
        for a, b in zip(straight, other, strict=True):
            assert comparable(a).keys() == comparable(b).keys()
            for key, value in comparable(a).items():
                assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_a_finished_deterministic_run_extends_to_more_steps(
    tmp_path, tiny_model_dir, reward_module
):
    """A run checkpointed at its last step has no batches sampled ahead: extended to more steps,
    its first new batch is sampled with the current weights (never older), then the schedule."""
    short = async_config(tmp_path, tiny_model_dir, reward_module, k=1, steps=2)
    RLTrainer(short, make_service(tmp_path)).run()
    longer = async_config(tmp_path, tiny_model_dir, reward_module, k=1, steps=4)
    resumed = RLTrainer(longer, make_service(tmp_path))
    assert resumed.start_step == 2
    history = resumed.run()
    assert [m["async/staleness_mean"] for m in history] == [0, 1]


def test_truncated_importance_sampling_corrects_stale_trajectories(
    tmp_path, tiny_model_dir, reward_module
):
    """tis_cap weighs a stale trajectory by min(exp(lp_learner - lp_sampler), cap): 1 where the
    learner still has the sampler's weights (fp32, step 1), away from 1 once it is k updates
    ahead; the synchronous run's weights stay 1 throughout."""
    overrides = {"steps": 3, "algorithm.tis_cap": 2.0, "algorithm.loss_fn": "ppo"}
    stale = RLTrainer(
        async_config(tmp_path / "a", tiny_model_dir, reward_module, k=1, **overrides),
        make_service(tmp_path / "a"),
    ).run()
    sync = RLTrainer(
        async_config(tmp_path / "s", tiny_model_dir, reward_module, k=0, **overrides),
        make_service(tmp_path / "s"),
    ).run()
    assert stale[0]["tis/weight_mean"] == pytest.approx(1.0, abs=1e-4)
    for m in stale[1:]:
        assert m["async/staleness_1"] == 16
        assert abs(m["tis/weight_mean"] - 1.0) > 1e-3
        assert m["tis/weight_mean"] <= 2.0
    for m in sync:
        assert m["tis/weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_off_policy_zero_is_the_synchronous_loop(tmp_path, tiny_model_dir, reward_module):
    """k = 0 in either mode is the synchronous loop, metric for metric (streaming k = 0 never
    samples with outdated weights; only the order of groups in a batch can differ)."""
    sync = RLTrainer(
        make_config(tmp_path / "s", tiny_model_dir, reward_module, **{"eval.every": 0}),
        make_service(tmp_path / "s"),
    ).run()
    zero = RLTrainer(
        async_config(tmp_path / "z", tiny_model_dir, reward_module, k=0),
        make_service(tmp_path / "z"),
    ).run()
    for a, b in zip(sync, zero, strict=True):
        assert comparable(a) == comparable(b)
    assert not any(k.startswith("async/") for k in sync[0])


def test_streaming_respects_the_bound_and_trains_every_group_once_across_a_resume(
    tmp_path, tiny_model_dir, reward_module
):
    k = 1
    overrides = {"checkpoint.every": 2}
    cfg = async_config(
        tmp_path, tiny_model_dir, reward_module, "streaming", k, steps=5, **overrides
    )
    RLTrainer(cfg, make_service(tmp_path)).run(stop_after=3)  # killed after step 3; ckpt at 2
    log_before = len(read_trajectories(tmp_path / "run"))
    resumed = RLTrainer(cfg, make_service(tmp_path))  # a new process: resume=auto
    assert resumed.start_step == 2
    saved = resumed.run_state.pending_pipeline
    history = resumed.run()
    final = history[-1]

    # The run as it counts: the first run's steps 1-2 (checkpointed), then the resumed run.
    records = read_trajectories(tmp_path / "run")
    timeline = [r for r in records[:log_before] if r["step"] <= 2] + records[log_before:]
    groups = {(r["step"], r["group_id"], r["dropped"], r["sampler_version"]) for r in timeline}
    trained = [gid for _, gid, dropped, _ in groups if not dropped]
    dropped = [gid for _, gid, was_dropped, _ in groups if was_dropped]
    for step, _, was_dropped, version in groups:
        if not was_dropped:
            assert step - 1 - version <= k  # never older than the bound
    assert len(trained) == len(set(trained)) == 5 * 4  # every batch full, no group twice
    assert not set(trained) & set(dropped)
    # Every group started is trained, dropped (counted), or still untrained when the run ended;
    # the ones in flight at the checkpoint were rolled out again after the resume.
    assert (
        final["async/groups_started"]
        == len(trained) + len(dropped) + final["async/groups_untrained"]
    )
    assert set(range(final["async/groups_started"])) >= set(trained) | set(dropped)
    assert final["async/resampled_after_resume"] == len(saved["in_flight"])
    assert sum(m["async/dropped_groups"] for m in history) <= final["async/dropped_total"]
    for m in history:
        assert m["async/staleness_max"] <= k


SLOW_REWARD = """
import time

def slow_on_multiples_of_three(response, sample):
    if int(sample["answer"]) % 3 == 0:
        time.sleep(3.0)
    return 0.1 * len(response) / 8
"""


def test_streaming_trains_fast_groups_while_a_slow_environment_runs(
    tmp_path, tiny_model_dir, monkeypatch
):
    (tmp_path / "slow_rewards.py").write_text(SLOW_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = "slow_rewards:slow_on_multiples_of_three"
    cfg = async_config(
        tmp_path, tiny_model_dir, reward, "streaming", 1, steps=3, **{"checkpoint.every": 0}
    )
    trainer = RLTrainer(cfg, make_service(tmp_path))
    # Group ids are the order groups started: the stream's order (nothing was re-queued).
    stream = PromptStream(load_problems(cfg)[0], 4, seed=cfg.seed)
    answers = [int(p.sample["answer"]) for p in stream.next_batch(8)]
    slow_ids = [i for i, answer in enumerate(answers) if answer % 3 == 0]
    assert slow_ids and slow_ids[0] < 4, answers  # a slow group among the first ones started
    trainer.run()
    records = [r for r in read_trajectories(tmp_path / "run") if r["index"] == 0]
    first_batch = [r["group_id"] for r in records if r["step"] == 1 and not r["dropped"]]
    assert len(first_batch) == 4
    assert not set(first_batch) & set(slow_ids), "a slow group held up the first batch"
    assert max(first_batch) > slow_ids[0]  # faster groups that started later overtook it


class FailingSampler:
    """A sampler whose engine dies at its `fail_at`-th request (counted across samplers)."""

    def __init__(self, inner, counter):
        self._inner, self._counter = inner, counter

    def sample(self, *args, **kwargs):
        self._counter["n"] += 1
        if self._counter["n"] == self._counter["fail_at"]:
            raise RuntimeError("sampling engine died")
        return self._inner.sample(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class FaultyTrainingClient:
    """The real client; its samplers fail at request `fail_at`, and `interrupt_at`-th
    forward_backward raises KeyboardInterrupt in the learner (what Ctrl-C does)."""

    def __init__(self, inner, fail_at=None, interrupt_at=None):
        self._inner = inner
        self._counter = {"n": 0, "fail_at": fail_at}
        self._interrupt_at, self._calls = interrupt_at, 0

    def save_weights_and_get_sampling_client(self, *args, **kwargs):
        future = self._inner.save_weights_and_get_sampling_client(*args, **kwargs)
        sampler = future.result()
        return done(FailingSampler(sampler, self._counter))

    def forward_backward(self, *args, **kwargs):
        self._calls += 1
        if self._calls == self._interrupt_at:
            raise KeyboardInterrupt
        return self._inner.forward_backward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def pipeline_threads():
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(("producer", "trajectory")) and t.is_alive()
    ]


@pytest.mark.parametrize("mode", ["deterministic", "streaming"])
@pytest.mark.parametrize("fault", ["engine", "ctrl_c"])
def test_a_fault_stops_producers_and_learner_and_the_run_resumes(
    tmp_path, tiny_model_dir, reward_module, mode, fault
):
    cfg = async_config(
        tmp_path, tiny_model_dir, reward_module, mode, 1, steps=5, **{"checkpoint.every": 1}
    )
    trainer = RLTrainer(cfg, make_service(tmp_path))
    # Step 3 of 5: the engine dies at its 3rd batch's requests / Ctrl-C in the 3rd update.
    kwargs = {"fail_at": 9} if fault == "engine" else {"interrupt_at": 5}
    trainer.training = FaultyTrainingClient(trainer.training, **kwargs)
    expected = RuntimeError if fault == "engine" else KeyboardInterrupt
    with pytest.raises(expected):
        trainer.run()
    started = time.monotonic()
    while pipeline_threads() and time.monotonic() - started < 10:
        time.sleep(0.1)
    assert not pipeline_threads()  # run() returned after stopping them; none hangs
    folders = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert folders and all((f / "loop_state.json").is_file() for f in folders)
    assert not list((tmp_path / "run" / "checkpoints").rglob(".tmp-*"))
    resumed = RLTrainer(cfg, make_service(tmp_path))
    assert 1 <= resumed.start_step < 5
    history = resumed.run()
    assert len(history) == 5 - resumed.start_step
    for m in history:
        assert m["async/staleness_max"] <= 1


def test_bad_async_settings_are_refused(tmp_path, tiny_model_dir, reward_module):
    cfg = async_config(tmp_path, tiny_model_dir, reward_module, **{"model.lora_rank": 0})
    with pytest.raises(ConfigError, match="algorithm.max_steps_off_policy.*LoRA"):
        validate_config(cfg)
    cfg = async_config(tmp_path, tiny_model_dir, reward_module, k=7)
    with pytest.raises(ConfigError, match="max_lora_snapshots"):
        validate_config(cfg)
    cfg = async_config(tmp_path, tiny_model_dir, reward_module, mode="eventual")
    with pytest.raises(ConfigError, match="algorithm.async_mode"):
        validate_config(cfg)
