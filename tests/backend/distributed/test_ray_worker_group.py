"""The Ray training worker group (`training.num_workers > 1`) against the single-process worker.

Everything runs on CPU in float32 on one local Ray (2 CPUs, shared by the module), with the tiny
random Llama. The reference is the in-process `TrainingWorker` fed the same requests: a 2-worker
group must give the same losses, log-probs (in datum order), grad norms and weights (LoRA:
replicated data parallel; full fine-tuning: FSDP2-sharded), checkpoints either can load, and
bounded, clear failures. The group's micro-batch budget is small, so ranks run different numbers
of micro-batches (the sharded path's filler batches) and differ from the reference's one batch.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tinker import types

from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig
from skyrl_trainer.backend.datums import to_training_examples
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.losses import LossSpec, get_loss
from skyrl_trainer.backend.training_worker import TrainingWorker
from skyrl_trainer.typed_config import ConfigError

ray = pytest.importorskip("ray")

from skyrl_trainer.backend.distributed import ray_cluster  # noqa: E402
from skyrl_trainer.backend.distributed.ray_group import (  # noqa: E402
    RayTrainingWorkerGroup,
    WorkerGroupError,
)
from skyrl_trainer.backend.worker_group import make_worker_group  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
LORA = types.LoraConfig(rank=4, seed=3)
ADAM = {
    "lora": types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0),
    "full": types.AdamParams(learning_rate=1e-3, weight_decay=0.01),
}
# Half a CPU per worker: the shared group and one more (core / kill tests) fit on 2 CPUs.
GROUP_CONFIG = dict(dtype="float32", num_workers=2, num_cpus_per_worker=0.5, micro_batch_tokens=40)
CE = get_loss("cross_entropy")


@pytest.fixture(scope="module")
def group(ray_session, tiny_model_dir):
    group = RayTrainingWorkerGroup(tiny_model_dir, TrainingConfig(**GROUP_CONFIG))
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def single(tiny_model_dir) -> TrainingWorker:
    return TrainingWorker(tiny_model_dir, TrainingConfig(dtype="float32"))


@pytest.fixture(scope="module")
def vocab(single) -> int:
    return single.description.vocab_size


def make_examples(vocab: int, n: int, seed: int, weight_value: float | None = None):
    """`n` cross_entropy examples of random lengths (3..23), some zero weights."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n):
        length = int(rng.integers(3, 24))
        seq = rng.integers(0, vocab, size=length + 1)
        weights = rng.uniform(0.1, 1.5, size=length) * (rng.uniform(size=length) > 0.25)
        if weight_value is not None:
            weights[:] = weight_value
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                loss_fn_inputs={"target_tokens": seq[1:].tolist(), "weights": weights.tolist()},
            )
        )
    return to_training_examples(data, CE, vocab, 512)


def create(worker, model_id: str, kind: str) -> None:
    worker.create_model(model_id, LORA if kind == "lora" else None)


def assert_results_equal(got, want, what: str) -> None:
    assert got.loss_sum == pytest.approx(want.loss_sum, rel=RTOL), what
    assert len(got.logprobs) == len(want.logprobs)
    for i, (a, b) in enumerate(zip(got.logprobs, want.logprobs, strict=True)):
        assert a.shape == b.shape, f"{what}: datum {i} out of order"
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=f"{what}: datum {i}")


def weights_of(worker, model_id: str, kind: str, folder) -> dict[str, torch.Tensor]:
    """The trainable weights as a checkpoint holds them (LoRA) or by full_weights (full)."""
    if kind == "full":
        return {k: v.cpu() for k, v in worker.full_weights(model_id).items()}
    folder.mkdir(parents=True, exist_ok=True)
    worker.save_state(model_id, folder, with_optimizer=False)
    return load_file(folder / "adapter_model.safetensors")


def assert_weights_equal(a: dict, b: dict, kind: str) -> None:
    """Weights after AdamW steps, to float noise. Adam divides by sqrt(v), so rounding-level
    gradient differences move weights by more than rounding: one process with two micro-batch
    budgets already differs by 6.5e-6 (norm, relative) and 3.3e-5 (max) for LoRA at lr 1e-2.
    Allowed: 1% of a step per element, 2e-5 relative norm. (Summing versus averaging over ranks
    is caught by the grad norms, rtol 1e-5: Adam hides a gradient's scale.)"""
    assert sorted(a) == sorted(b)
    step = ADAM[kind].learning_rate
    for key in a:
        torch.testing.assert_close(
            a[key], b[key], rtol=0, atol=0.01 * step, msg=lambda m, key=key: f"{key}: {m}"
        )
    diff = torch.cat([(a[k] - b[k]).flatten() for k in a]).norm()
    assert diff <= 2e-5 * torch.cat([b[k].flatten() for k in b]).norm()


def train_round(worker, model_id, kind, batches) -> tuple[list, dict]:
    results = [worker.forward_backward(model_id, b, CE, {}, True) for b in batches]
    return results, worker.optim_step(model_id, ADAM[kind])


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_training_matches_single_process(group, single, vocab, kind, tmp_path):
    """3 rounds (the first accumulates over two calls): same losses, log-probs, grad norms and
    weights as one process; a forward-only call in between changes nothing."""
    model_id = f"match-{kind}"
    create(group, model_id, kind)
    create(single, model_id, kind)
    rounds = [
        [make_examples(vocab, 5, seed=1), make_examples(vocab, 3, seed=2)],
        [make_examples(vocab, 7, seed=3)],
        [make_examples(vocab, 1, seed=4)],  # fewer examples than workers: one rank idles
    ]
    for r, batches in enumerate(rounds):
        got, got_metrics = train_round(group, model_id, kind, batches)
        want, want_metrics = train_round(single, model_id, kind, batches)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_results_equal(g, w, f"round {r} call {i}")
        assert got_metrics["grad_norm:mean"] == pytest.approx(
            want_metrics["grad_norm:mean"], rel=RTOL
        )
        probe = make_examples(vocab, 4, seed=10 + r)
        assert_results_equal(
            group.forward_backward(model_id, probe, CE, {}, False),
            single.forward_backward(model_id, probe, CE, {}, False),
            f"forward-only after round {r}",
        )
    assert_weights_equal(
        weights_of(group, model_id, kind, tmp_path / "group"),
        weights_of(single, model_id, kind, tmp_path / "single"),
        kind,
    )
    assert (model_id in group._sharded) == (kind == "full")
    if kind == "lora":  # replicas stay bit-identical
        rank0, rank1 = ray.get([a.local_weights.remote(model_id) for a in group.actors])
        assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_checkpoints_cross_load(group, single, vocab, kind, tmp_path):
    """A 2-worker checkpoint (weights + optimizer) loads into one process and vice versa: same
    forward log-probs, and the next step (restored AdamW moments) gives the same weights."""
    batch = [make_examples(vocab, 6, seed=20)]
    probe = make_examples(vocab, 3, seed=21)
    for src, dst, name in [(group, single, "group-to-single"), (single, group, "single-to-group")]:
        model_id = f"ckpt-{kind}-{name}"
        create(src, model_id, kind)
        create(dst, model_id, kind)
        train_round(src, model_id, kind, batch)
        folder = tmp_path / name
        folder.mkdir()
        src.save_state(model_id, folder, with_optimizer=True)
        dst.load_state(model_id, folder, with_optimizer=True)
        assert_results_equal(
            dst.forward_backward(model_id, probe, CE, {}, False),
            src.forward_backward(model_id, probe, CE, {}, False),
            name,
        )
        train_round(src, model_id, kind, batch)
        train_round(dst, model_id, kind, batch)
        assert_weights_equal(
            weights_of(src, model_id, kind, tmp_path / f"{name}-src"),
            weights_of(dst, model_id, kind, tmp_path / f"{name}-dst"),
            kind,
        )


def test_failed_request_changes_nothing(group, single, vocab):
    """A loss that fails on one rank only, and a refused request, leave every rank's gradients
    as they were; the group keeps working."""
    model_id = "rollback"
    create(group, model_id, "lora")
    create(single, model_id, "lora")
    good = make_examples(vocab, 4, seed=30)
    group.forward_backward(model_id, good, CE, {}, True)
    single.forward_backward(model_id, good, CE, {}, True)

    def fussy_loss(lp, inputs, config):
        if bool((inputs["weights"] == 7.0).any()):
            raise RuntimeError("fussy loss refuses weight 7")
        return CE.fn(lp, inputs, config)

    fussy = LossSpec("fussy", fussy_loss, CE.required_inputs)
    bad = make_examples(vocab, 3, seed=31) + make_examples(vocab, 1, seed=32, weight_value=7.0)
    with pytest.raises(RuntimeError, match="fussy loss refuses"):
        group.forward_backward(model_id, bad, fussy, {}, True)
    with pytest.raises(InvalidRequestError, match="unknown model"):
        group.forward_backward("no-such-model", good, CE, {}, True)
    assert group.optim_step(model_id, ADAM["lora"])["grad_norm:mean"] == pytest.approx(
        single.optim_step(model_id, ADAM["lora"])["grad_norm:mean"], rel=RTOL
    )


def test_backend_core_with_two_workers(ray_session, tiny_model_dir, tmp_path):
    """The real core and in-process clients with training.num_workers=2: a LoRA RL-style round
    (forward_backward, optim_step, sampler on the new weights, sample) gives what one worker
    gives; core.shutdown() kills the workers."""
    from skyrl_trainer.backend.clients import ServiceClient
    from skyrl_trainer.backend.core import BackendCore

    def run(num_workers: int):
        training = dict(GROUP_CONFIG, num_workers=num_workers)
        core = BackendCore(
            BackendConfig(
                storage_dir=str(tmp_path / f"storage{num_workers}"),
                training=TrainingConfig(**training),
                sampling=SamplingConfig(engine="torch", dtype="float32", device="cpu"),
            )
        )
        try:
            sc = ServiceClient(core=core)
            tc = sc.create_lora_training_client(str(tiny_model_dir), rank=4, seed=0).result()
            group = core._base_slot(str(tiny_model_dir)).group
            data = [
                types.Datum(
                    model_input=types.ModelInput.from_ints(list(range(5 + i, 15 + 2 * i))),
                    loss_fn_inputs={
                        "target_tokens": list(range(6 + i, 16 + 2 * i)),
                        "weights": [1.0] * (10 + i),
                    },
                )
                for i in range(4)
            ]
            fb = tc.forward_backward(data, "cross_entropy")
            step = tc.optim_step(types.AdamParams(learning_rate=5e-2))
            sampler = tc.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints([5, 6, 7, 8])
            params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
            sample = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
            out = (fb.result(), step.result(), sample.sequences[0])
        finally:
            core.shutdown()
        return group, out

    group, (fb2, step2, seq2) = run(2)
    assert isinstance(group, RayTrainingWorkerGroup)
    with pytest.raises(WorkerGroupError, match="shut down"):
        group.optim_step("anything", ADAM["lora"])
    _, (fb1, step1, seq1) = run(1)
    assert fb2.metrics["loss:sum"] == pytest.approx(fb1.metrics["loss:sum"], rel=RTOL)
    for a, b in zip(fb2.loss_fn_outputs, fb1.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=RTOL)
    assert step2.metrics["grad_norm:mean"] == pytest.approx(
        step1.metrics["grad_norm:mean"], rel=RTOL
    )
    assert seq2.tokens == seq1.tokens
    np.testing.assert_allclose(seq2.logprobs, seq1.logprobs, rtol=1e-4, atol=1e-5)


def test_worker_dying_mid_call_fails_fast_and_for_good(ray_session, tiny_model_dir, vocab):
    """Killing rank 1 of a sharded (FSDP2) model in the middle of a forward_backward: rank 0
    would wait for it in a collective, yet the call raises within bounded time naming the dead
    rank and its actor, and every later call fails at once with the same message."""
    group = RayTrainingWorkerGroup(tiny_model_dir, TrainingConfig(**GROUP_CONFIG))
    try:
        create(group, "victim", "full")
        batch = make_examples(vocab, 4, seed=40)
        group.forward_backward("victim", batch, CE, {}, True)

        def slow_loss(lp, inputs, config):
            time.sleep(3.0)  # keeps both ranks inside the call
            return CE.fn(lp, inputs, config)

        slow = LossSpec("slow", slow_loss, CE.required_inputs)
        dead_id = group.actors[1]._actor_id.hex()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(group.forward_backward, "victim", batch, slow, {}, True)
            time.sleep(1.0)
            assert not call.done()
            ray.kill(group.actors[1], no_restart=True)
            start = time.monotonic()
            with pytest.raises(WorkerGroupError) as first:
                call.result(timeout=60)
            assert time.monotonic() - start < 30
        message = str(first.value)
        assert "rank 1" in message and dead_id in message and "died" in message
        start = time.monotonic()
        with pytest.raises(WorkerGroupError) as later:
            group.optim_step("victim", ADAM["full"])
        assert time.monotonic() - start < 1
        assert str(later.value) == message
        assert group.actors == []  # the survivor was killed too
    finally:
        group.shutdown()


OWNER_THREAD_SCRIPT = """
import threading, ray
from skyrl_trainer.backend.config import RayConfig
from skyrl_trainer.backend.distributed import ray_cluster
starter = threading.Thread(target=ray_cluster.connect, args=(RayConfig(num_cpus=1),))
starter.start()
starter.join()
print("resources", ray.get(ray.remote(lambda: 42).remote(), timeout=30), ray.cluster_resources()["CPU"])
"""


def test_local_ray_outlives_the_thread_that_started_it():
    """The core creates groups on executor threads. A local Ray started from a thread must keep
    working after that thread ends (its GCS and raylet die with the starting thread otherwise:
    parent-death signal), so `connect` starts it on a long-lived thread of its own."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    out = subprocess.run(
        [sys.executable, "-c", OWNER_THREAD_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert "resources 42 1.0" in out.stdout, out.stdout + out.stderr[-3000:]


def test_misconfiguration_fails_fast(ray_session, tiny_model_dir):
    """Start-up refuses what cannot work at once, naming the field; nothing is left running."""
    cpus = ray.available_resources().get("CPU", 0.0)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"training\.num_workers"):
        make_worker_group(tiny_model_dir, TrainingConfig(num_workers=8))
    with pytest.raises(ConfigError, match=r"training\.num_workers"):
        make_worker_group(tiny_model_dir, TrainingConfig(num_workers=0))
    with pytest.raises(ConfigError, match=r"training\.placement_strategy"):
        make_worker_group(tiny_model_dir, TrainingConfig(num_workers=2, placement_strategy="X"))
    with pytest.raises(ConfigError, match=r"training\.num_gpus_per_worker"):
        make_worker_group(tiny_model_dir, TrainingConfig(num_workers=2, num_gpus_per_worker=0.5))
    with pytest.raises(ConfigError, match=r"training\.ray\.address"):
        ray_cluster.check_reachable("127.0.0.1:1", timeout_s=2.0)
    assert time.monotonic() - start < 10
    assert ray.available_resources().get("CPU", 0.0) == cpus
    assert isinstance(make_worker_group(tiny_model_dir, TrainingConfig()), TrainingWorker)
