"""Sampling engine pools (`sampling.num_engines=2`): Ray actor replicas behind the registry.

CPU, float32, the PyTorch engine and the tiny random Llama, on one local Ray shared by the module.
The reference is one in-process engine: the pool must return the same tokens and log-probs for
seeded requests whichever replica serves them. The engine seeds each row from (seed, sample index),
but its tokens still depend on what else is in the batch through float rounding: inverse-CDF
sampling over the tiny random model's near-uniform 49k-token distributions moves an index by one
when a logit moves by ~1e-7 (measured: batch composition changes log-probs by up to 2e-6, and in the
RL loop one sample in 16 changed). So every request here runs alone (max_batch_size = num_samples),
on the pool and on the reference alike, which makes the comparison exact by construction.
Each replica must get every weight sync (checked by querying each one by hand against the
learner), keep the order of requests and syncs, and fail clearly and quickly when it dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import wait

import numpy as np
import pytest
import torch
from tinker import types

from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.sampling.engine import GenerationParams, GenerationRequest
from skyrl_trainer.backend.sampling.torch_engine import TorchSamplingEngine

ray = pytest.importorskip("ray")

from skyrl_trainer.backend.sampling.engine import EngineDiedError  # noqa: E402
from skyrl_trainer.backend.sampling.engine_pool import EnginePool  # noqa: E402
from tests import waiting  # noqa: E402

SAMPLING = dict(engine="torch", dtype="float32", device="cpu")
# A quarter CPU per engine: the base pool, a full fine-tuning pool and the kill test's pool fit
# on 2 CPUs.
POOL = dict(SAMPLING, num_engines=2, num_cpus_per_engine=0.25, max_batch_size=2)
NUM_SAMPLES = 2  # = max_batch_size: each request runs alone
LOGPROB_TOL = 1e-4  # sampler vs learner, float32 (measured ~1e-6)
TRAINED_MIN_GAP = 1e-2  # the base weights are at least this far from the trained ones


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def core(ray_session, tmp_path_factory):
    from skyrl_trainer.backend.core import BackendCore

    core = BackendCore(
        BackendConfig(
            storage_dir=str(tmp_path_factory.mktemp("storage")),
            training=TrainingConfig(dtype="float32", device="cpu"),
            sampling=SamplingConfig(**POOL),
        )
    )
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def base_sampler(sc, tiny_model_dir):
    return sc.create_sampling_client(base_model=str(tiny_model_dir)).result()


@pytest.fixture(scope="module")
def local_engine(tiny_model_dir):
    engine = TorchSamplingEngine(
        tiny_model_dir, dtype="float32", device="cpu", num_threads=1, max_batch_size=2
    )
    yield engine
    engine.shutdown()


def requests(vocab: int, n: int, seed: int, **kw) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    params = dict(max_tokens=12, temperature=1.0, seed=seed)
    return [
        GenerationRequest(
            prompt_ids=tuple(int(t) for t in rng.integers(3, vocab, size=int(rng.integers(4, 12)))),
            num_samples=NUM_SAMPLES,
            params=GenerationParams(**{**params, "seed": seed + i}),
            **kw,
        )
        for i in range(n)
    ]


def assert_same_results(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        for a, b in zip(g.sequences, w.sequences, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        if w.prompt_logprobs is not None:
            np.testing.assert_allclose(
                g.prompt_logprobs[1:], w.prompt_logprobs[1:], rtol=0, atol=1e-5
            )


def scoring(seq, adapter=None) -> GenerationRequest:
    """Score `seq`: its prompt log-probs (one throwaway generated token)."""
    params = GenerationParams(max_tokens=1, temperature=0.0)
    return GenerationRequest(tuple(seq), 1, params, prompt_logprobs=True, adapter=adapter)


def per_engine_logprobs(core, sampler, seq) -> list[np.ndarray]:
    """`seq`'s prompt log-probs from each engine of the sampler's pool, asked one by one."""
    pool = core.samplers.engine(sampler.sampler_id)
    adapter = core.samplers.binding(sampler.sampler_id).adapter
    assert isinstance(pool, EnginePool) and not pool.dead_engines
    results = [pool.generate_on(i, scoring(seq, adapter)).result(60) for i in range(2)]
    assert [r.extra["engine"] for r in results] == [0, 1]
    return [np.asarray(r.prompt_logprobs[1:], dtype=np.float64) for r in results]


def learner_logprobs(tc, seq) -> np.ndarray:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(seq[:-1])),
        loss_fn_inputs={"target_tokens": list(seq[1:]), "weights": [1.0] * (len(seq) - 1)},
    )
    out = tc.forward([datum], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)


def train_step(tc, tokenizer, lr: float) -> None:
    seq = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()


# ---------------------------------------------------------------------------------------------


def test_pool_equals_one_engine_and_routes_with_affinity(core, base_sampler, local_engine, vocab):
    """A batch of seeded requests in flight at once through the registry gives one in-process
    engine's tokens and log-probs, from both engines. One at a time (no load), routing is by
    affinity alone: distinct prompts spread over both engines, and the same session and prompt
    go to the same engine every time."""
    pool = core.samplers.engine(base_sampler.sampler_id)
    session = base_sampler.sampler_id
    batch = requests(vocab, 8, seed=1) + requests(vocab, 4, seed=2, prompt_logprobs=True)
    got = [core.samplers.generate(session, r) for r in batch]
    want = [local_engine.generate(r) for r in batch]
    got, want = [f.result(60) for f in got], [f.result(60) for f in want]
    assert_same_results(got, want)
    assert {r.extra["engine"] for r in got} == {0, 1}

    one_by_one = [core.samplers.generate(session, r).result(60) for r in batch]
    served_by = [r.extra["engine"] for r in one_by_one]
    assert set(served_by) == {0, 1}, served_by
    assert served_by == [pool.route(session, r) for r in batch]
    again = [core.samplers.generate(session, r).result(60) for r in batch]
    assert [r.extra["engine"] for r in again] == served_by
    assert_same_results(again, want)
    # An engine a full batch busier than the other loses new requests to it.
    preferred = pool.route(session, batch[0])
    pool._loads[preferred] += core.config.sampling.max_batch_size
    try:
        assert pool.route(session, batch[0]) == 1 - preferred
    finally:
        pool._loads[preferred] -= core.config.sampling.max_batch_size
    # The SamplingClient surface works through the pool too.
    resp = base_sampler.sample(
        types.ModelInput.from_ints(list(batch[0].prompt_ids)),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=12, seed=1, stop=[]),
    ).result()
    assert [list(s.tokens) for s in resp.sequences] == [s.tokens for s in want[0].sequences]
    bad = requests(vocab, 1, seed=3)[0]
    bad = GenerationRequest((vocab + 5,), 1, bad.params)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        core.samplers.generate(session, bad).result(10)


def test_lora_sync_reaches_every_engine(core, sc, tiny_model_dir, tokenizer, base_sampler):
    """After a training step, each engine by itself serves the trained adapter's log-probs."""
    tc = sc.create_lora_training_client(str(tiny_model_dir), rank=4, seed=1).result()
    train_step(tc, tokenizer, lr=5e-2)
    sampler = tc.save_weights_and_get_sampling_client().result()
    seq = tokenizer.encode("Once upon a time, in a land far away")
    learner = learner_logprobs(tc, seq)
    base = per_engine_logprobs(core, base_sampler, seq)[0]
    assert np.abs(base - learner).max() > TRAINED_MIN_GAP
    for lps in per_engine_logprobs(core, sampler, seq):
        np.testing.assert_allclose(lps, learner, rtol=0, atol=LOGPROB_TOL)
    stats = core.samplers.engine(sampler.sampler_id).engine_stats()
    assert [s["adapter_loads"] for s in stats] == [1, 1]


def test_full_sync_reaches_every_engine_after_queued_requests(
    core, sc, tiny_model_dir, tokenizer, vocab
):
    """Full fine-tuning: every engine serves each synced snapshot; requests issued before a sync
    are served by the old weights, on both engines."""
    tc = sc.create_full_training_client(str(tiny_model_dir)).result()
    train_step(tc, tokenizer, lr=3e-3)
    first = tc.save_weights_and_get_sampling_client().result()
    seq = tokenizer.encode("Once upon a time, in a land far away")
    learner = learner_logprobs(tc, seq)
    for lps in per_engine_logprobs(core, first, seq):
        np.testing.assert_allclose(lps, learner, rtol=0, atol=LOGPROB_TOL)

    batch = requests(vocab, 6, seed=4, prompt_logprobs=True)
    done_before = [core.samplers.generate(first.sampler_id, r).result(60) for r in batch]
    queued = [core.samplers.generate(first.sampler_id, r) for r in batch]  # then a sync
    train_step(tc, tokenizer, lr=3e-3)
    second = tc.save_weights_and_get_sampling_client().result()
    wait(queued, timeout=60)
    assert_same_results([f.result() for f in queued], done_before)
    assert {r.extra["engine"] for r in done_before} == {0, 1}

    learner2 = learner_logprobs(tc, seq)
    assert np.abs(learner2 - learner).max() > TRAINED_MIN_GAP / 10
    for lps in per_engine_logprobs(core, second, seq):
        np.testing.assert_allclose(lps, learner2, rtol=0, atol=LOGPROB_TOL)
    stats = core.samplers.engine(second.sampler_id).engine_stats()
    assert [s["weight_updates"] for s in stats] == [2, 2]


def test_dead_engine_fails_its_requests_clearly_and_fast(ray_session, tiny_model_dir, vocab):
    """A crashed engine's request fails within seconds naming the engine, its actor and Ray's
    reason; the other engine keeps serving; with none left, requests and syncs fail at once.
    Also: colocated engines sleep before training and wake on their next request."""
    config = SamplingConfig(**POOL, engine_placement="colocated")
    pool = EnginePool(tiny_model_dir, config)
    try:
        pool.before_training()
        assert [s["asleep"] for s in pool.engine_stats()] == [True, True]
        long = GenerationRequest((5, 6, 7), 8, GenerationParams(max_tokens=400, seed=0))
        assert len(pool.generate_on(0, long).result(60).sequences) == 8  # woke up and served
        assert pool.engine_stats()[0]["asleep"] is False

        victim_id = pool.actor_ids[1]
        in_flight = pool.generate_on(1, long)
        time.sleep(0.3)
        assert not in_flight.done()
        os.kill(pool.pids[1], signal.SIGKILL)  # a crash, not a polite ray.kill
        start = time.monotonic()
        with pytest.raises(EngineDiedError) as info:
            in_flight.result(timeout=60)
        assert time.monotonic() - start < 30
        message = str(info.value)
        assert "sampling engine 1" in message and victim_id in message and "died" in message

        # Routing now avoids the dead engine; asking it directly fails at once.
        for r in requests(vocab, 4, seed=5):
            assert pool.generate_for_session("s", r).result(60).extra["engine"] == 0
        with pytest.raises(EngineDiedError, match="sampling engine 1"):
            pool.generate_on(1, long).result(1)
        assert list(pool.dead_engines) == [1]

        ray.kill(pool.actors[0], no_restart=True)
        start = time.monotonic()
        with pytest.raises(EngineDiedError, match="sampling engine 0"):
            pool.generate_on(0, long).result(timeout=60)
        with pytest.raises(EngineDiedError, match="no sampling engine .* is left"):
            pool.generate(long).result(1)
        with pytest.raises(EngineDiedError, match="no sampling engine .* is left"):
            pool.remove_lora("anything")
        assert time.monotonic() - start < 30
    finally:
        pool.shutdown()


@pytest.mark.vllm
def test_vllm_replicas(ray_session, tiny_model_dir, vocab):
    """engine=vllm: each replica is an in-process vLLM engine inside its actor; seeded requests
    give one local vLLM engine's tokens, and a full-weights update reaches both replicas."""
    from transformers import AutoModelForCausalLM

    from skyrl_trainer.backend.sampling.engine_factory import make_engine

    vllm = dict(SAMPLING, engine="vllm", kv_cache_gib=0.25, max_batch_size=2)
    pool = EnginePool(
        tiny_model_dir, SamplingConfig(**vllm, num_engines=2, num_cpus_per_engine=0.25)
    )
    local = make_engine(tiny_model_dir, SamplingConfig(**vllm), lora=False)
    try:
        batch = requests(vocab, 6, seed=7, prompt_logprobs=True)
        got = [pool.generate_for_session("s", r) for r in batch]
        want = [local.generate(r) for r in batch]
        got, want = [f.result(120) for f in got], [f.result(120) for f in want]
        assert_same_results(got, want)
        assert {r.extra["engine"] for r in got} == {0, 1}

        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        generator = torch.Generator().manual_seed(0)
        weights = {
            k: v + 0.05 * torch.randn(v.shape, generator=generator)
            for k, v in model.state_dict().items()
        }
        pool.update_weights(weights)
        local.update_weights(weights)
        want = local.generate(scoring(batch[0].prompt_ids)).result(60)
        for index in range(2):
            got = pool.generate_on(index, scoring(batch[0].prompt_ids)).result(60)
            np.testing.assert_allclose(
                got.prompt_logprobs[1:], want.prompt_logprobs[1:], rtol=0, atol=1e-5
            )
    finally:
        pool.shutdown()
        local.shutdown()


def test_core_shutdown_kills_every_engine(core, base_sampler):
    pools = [slot.engine for slot in core.samplers._engines.values()]
    assert len(pools) == 2 and all(isinstance(p, EnginePool) for p in pools)  # base + full
    actors = [a for p in pools for a in p.actors]
    core.shutdown()
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.describe.remote(), timeout=30)
    assert all(p._pg is None for p in pools)
    with pytest.raises(EngineDiedError, match="shut down"):
        base_sampler.sample(
            types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)
        ).result()


def test_more_engines_than_the_cluster_holds_fails_fast(ray_session, tiny_model_dir):
    from skyrl_trainer.typed_config import ConfigError

    config = SamplingConfig(**{**POOL, "num_engines": 8, "num_cpus_per_engine": 1.0})
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"sampling\.num_engines.*sampling\.num_cpus_per_engine"):
        EnginePool(tiny_model_dir, config)
    assert time.monotonic() - start < 10


def test_broadcast_weight_sync(ray_session, tiny_model_dir, tokenizer):
    """`weight_sync: broadcast`: every engine serves each update exactly (float32 forward as the
    reference); after an engine dies, the group is formed again with the live one."""
    from skyrl_trainer.backend.model_loading import load_causal_lm

    config = SamplingConfig(**POOL, weight_sync="broadcast", weight_sync_timeout_s=20)
    pool = EnginePool(tiny_model_dir, config)
    model = load_causal_lm(tiny_model_dir, torch.float32)
    seq = tokenizer.encode("Once upon a time, in a land far away")

    def expected() -> np.ndarray:
        with torch.no_grad():
            logp = model(torch.tensor([seq])).logits[0].log_softmax(-1)
        return logp[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0].double().numpy()

    def update(scale: float) -> None:
        torch.manual_seed(int(scale * 100))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * scale)
        pool.update_weights(model.state_dict())

    def served(index: int) -> np.ndarray:
        result = pool.generate_on(index, scoring(seq)).result(60)
        return np.asarray(result.prompt_logprobs[1:], dtype=np.float64)

    try:
        before = served(0)
        for round_ in (1, 2):
            update(0.02)
            want = expected()
            assert np.abs(want - before).max() > TRAINED_MIN_GAP
            for index in (0, 1):
                np.testing.assert_allclose(served(index), want, rtol=0, atol=LOGPROB_TOL)
            assert [s["weight_updates"] for s in pool.engine_stats()] == [round_, round_]
        with pytest.raises(InvalidRequestError, match=r"named_tensors\['x'\]"):
            pool.update_weights({"x": torch.zeros(2, dtype=torch.long)})

        ray.kill(pool.actors[1], no_restart=True)
        # Depending on timing the survivor applies this one, or the broadcast fails as a whole.
        with contextlib.suppress(EngineDiedError, RuntimeError, ray.exceptions.RayError):
            update(0.02)
        update(0.02)  # a new group with the live engine
        assert list(pool.dead_engines) == [1]
        np.testing.assert_allclose(served(0), expected(), rtol=0, atol=LOGPROB_TOL)
    finally:
        pool.shutdown()


def test_one_engine_as_an_actor(ray_session, tiny_model_dir, local_engine, vocab):
    """`engines_as_actors`: a single engine runs in a Ray actor process of its own (the
    sampler of asynchronous RL, off the trainer's threads) and serves as the in-process one."""
    from skyrl_trainer.backend.sampler_registry import make_served_engine

    config = SamplingConfig(
        **SAMPLING, engines_as_actors=True, num_cpus_per_engine=0.25, max_batch_size=2
    )
    pool = make_served_engine(tiny_model_dir, config, lora=False)
    try:
        assert isinstance(pool, EnginePool) and len(pool.actors) == 1
        assert pool.pids[0] != os.getpid()
        batch = requests(vocab, 3, seed=7)
        got = [f.result(60) for f in [pool.generate(r) for r in batch]]
        assert_same_results(got, [local_engine.generate(r).result(60) for r in batch])
    finally:
        pool.shutdown()


def wait_until(condition, timeout: float = 30.0) -> bool:
    return waiting.wait_until(condition, timeout)


def test_cancel_frees_the_engine(ray_session, tiny_model_dir):
    """`cancel` reaches the actor: a request still waiting for its turn there never reaches the
    engine (and the calls after it still get theirs), one queued in the engine leaves the queue,
    a running one stops decoding. One row at a time: a short request behind them is served next,
    the engine decoded far fewer than a long request's tokens, and no load is left counted."""
    config = SamplingConfig(**SAMPLING, num_engines=1, num_cpus_per_engine=0.25, max_batch_size=1)
    pool = EnginePool(tiny_model_dir, config)
    long = GenerationRequest((5, 6, 7), 1, GenerationParams(max_tokens=500, seed=1))
    short = GenerationRequest((5, 6, 7), 1, GenerationParams(max_tokens=4, seed=2))

    def stats() -> dict:
        return pool.engine_stats()[0]

    try:
        # A turn the pool numbered but has not sent: the next call waits for it on the actor.
        with pool._submit_lock:
            held = pool._seqs[0]
            pool._seqs[0] += 1
        early = pool.generate_on(0, long)
        assert pool.cancel(early) and early.cancelled()
        assert wait_until(lambda: stats()["cancelled_before_turn"] == 1)
        pool.actors[0].skip.remote(held)

        running, queued = pool.generate_on(0, long), pool.generate_on(0, long)
        assert wait_until(lambda: stats()["requests"] == 2 and stats()["generated_tokens"] > 0)
        assert pool.cancel(queued) and pool.cancel(running)
        assert queued.cancelled() and running.cancelled()
        assert wait_until(lambda: stats()["cancelled_in_engine"] == 2)

        served = pool.generate_on(0, short)
        assert len(served.result(timeout=60).sequences[0].tokens) == 4
        after = stats()
        assert after["requests"] == 3  # `early` never reached the engine
        assert after["generated_tokens"] - 4 < 250, after  # neither long one ran its 500
        assert wait_until(lambda: pool._loads == [0] and not pool._in_flight)
        assert not pool.cancel(served)  # finished: nothing to cancel
        refused = pool.generate(GenerationRequest((10**9,), 1, short.params))
        assert not pool.cancel(refused)  # failed at once (token out of vocabulary)
    finally:
        pool.shutdown()
