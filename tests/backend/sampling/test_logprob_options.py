"""The SDK 0.38 sampling options: `topk_sample_logprobs`, `prompt_logprobs_last_n` (also what
`compute_logprobs` sends), `target_prompt_logprobs` and `prompt_alt_tokens_k`.

Each goes through the backend's own boundary (`to_generation_request` -> engine ->
`to_sample_response`) and the returned numbers are compared with a learner-style forward pass:
log_softmax of a plain transformers forward's logits (float64) on the same weights. Both engines:
the PyTorch one produces every option; vLLM produces the first two and refuses the others by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types
from transformers import AutoModelForCausalLM

from skyrl_trainer.backend.config import SamplingConfig
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.sample_requests import to_generation_request, to_sample_response
from skyrl_trainer.backend.sampling.torch_engine import TorchSamplingEngine

TIMEOUT = 120
TOL = 1e-4  # float32 engines vs a float64 forward (measured ~1e-6)
TEXTS = [
    "Question: what is 12 times 7? Answer:",
    "Once upon a time, in a land far away, there lived a",
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def torch_engine(tiny_model_dir):
    engine = TorchSamplingEngine(tiny_model_dir, dtype="float32", device="cpu", num_threads=1)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    from skyrl_trainer.backend.sampling.vllm_engine import VLLMSamplingEngine

    engine = VLLMSamplingEngine(
        tiny_model_dir, dtype="float32", kv_cache_gib=0.25, enable_lora=False
    )
    yield engine
    engine.shutdown()


@pytest.fixture(params=["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture(scope="module")
def learner(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


@torch.no_grad()
def logp_table(model, ids) -> np.ndarray:
    """Row i: log p(. | ids[:i+1]), from log_softmax of the logits (float64)."""
    logits = model(input_ids=torch.tensor([list(ids)])).logits[0]
    return torch.log_softmax(logits, dim=-1).numpy()


def sample(engine, prompt, num_samples=1, include_prompt_logprobs=False, topk_prompt=0, **kw):
    """One request through the backend's boundary; `kw`: SamplingParams fields and options."""
    options = {
        k: kw.pop(k)
        for k in (
            "topk_sample_logprobs",
            "prompt_logprobs_last_n",
            "target_prompt_logprobs",
            "prompt_alt_tokens_k",
        )
        if k in kw
    }
    request = to_generation_request(
        types.ModelInput.from_ints(list(prompt)),
        num_samples,
        types.SamplingParams(**kw),
        include_prompt_logprobs=include_prompt_logprobs,
        topk_prompt_logprobs=topk_prompt,
        vocab_size=engine.vocab_size,
        context_length=engine.max_model_len,
        eos_token_id=None,
        config=SamplingConfig(),
        **options,
    )
    result = engine.generate(request).result(timeout=TIMEOUT)
    options.pop("prompt_logprobs_last_n", None)
    return to_sample_response(result, "s", topk_prompt, **options)


# ---------------------------------------------------------------------------------------------
# topk_sample_logprobs


def test_topk_sample_logprobs_match_the_learner(engine, learner, prompts):
    k = 5
    response = sample(
        engine, prompts[0], num_samples=2, max_tokens=12, seed=3, stop=[], topk_sample_logprobs=k
    )
    for seq in response.sequences:
        n = len(seq.tokens)
        topk = seq.topk_logprobs_np
        assert topk.token_ids.shape == (n, k) and topk.logprobs.shape == (n, k)
        table = logp_table(learner, list(prompts[0]) + seq.tokens)[len(prompts[0]) - 1 : -1]
        for pos in range(n):
            want_ids = np.argsort(-table[pos])[:k]
            np.testing.assert_allclose(topk.logprobs[pos], table[pos][want_ids], atol=TOL)
            # Same tokens, up to ties within the tolerance.
            np.testing.assert_allclose(
                table[pos][topk.token_ids[pos]], topk.logprobs[pos], atol=TOL
            )
            assert np.all(np.diff(topk.logprobs[pos]) <= TOL)  # most likely first
            # The sampled token's own log-prob agrees with the same table.
            assert abs(seq.logprobs[pos] - table[pos][seq.tokens[pos]]) < TOL
        lists = seq.topk_logprobs  # the SDK's list view
        assert len(lists) == n and len(lists[0]) == k


def test_no_topk_sample_logprobs_unless_asked(engine, prompts):
    response = sample(engine, prompts[0], max_tokens=3, seed=1, stop=[])
    assert response.sequences[0].topk_logprobs_np is None


# ---------------------------------------------------------------------------------------------
# prompt_logprobs_last_n


@pytest.mark.parametrize("last_n", [1, 4])
def test_prompt_logprobs_last_n(engine, learner, prompts, last_n):
    prompt = prompts[1]
    table = logp_table(learner, prompt)
    want = [table[i - 1][prompt[i]] for i in range(1, len(prompt))]
    response = sample(
        engine,
        prompt,
        include_prompt_logprobs=True,
        topk_prompt=3,
        max_tokens=1,
        prompt_logprobs_last_n=last_n,
    )
    got = response.prompt_logprobs
    assert len(got) == len(prompt)
    assert all(lp is None for lp in got[:-last_n])
    np.testing.assert_allclose(got[-last_n:], want[-last_n:], atol=TOL)
    topk = response.topk_prompt_logprobs
    assert all(cell is None for cell in topk[:-last_n])
    for pos in range(len(prompt) - last_n, len(prompt)):
        ids = [t for t, _ in topk[pos]]
        np.testing.assert_allclose([lp for _, lp in topk[pos]], table[pos - 1][ids], atol=TOL)
        assert max(table[pos - 1]) == pytest.approx(topk[pos][0][1], abs=TOL)


def test_compute_logprobs_with_last_n_is_the_suffix_of_the_full_scoring(engine, prompts):
    """What SamplingClient.compute_logprobs(prompt, prompt_logprobs_last_n=N) sends."""
    full = sample(engine, prompts[1], include_prompt_logprobs=True, max_tokens=1).prompt_logprobs
    part = sample(
        engine, prompts[1], include_prompt_logprobs=True, max_tokens=1, prompt_logprobs_last_n=5
    ).prompt_logprobs
    assert part[:-5] == [None] * (len(full) - 5)
    np.testing.assert_allclose(part[-5:], full[-5:], atol=1e-6)


# ---------------------------------------------------------------------------------------------
# target_prompt_logprobs and prompt_alt_tokens_k (PyTorch engine)


def _target_ids(prompt, vocab, k=3, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(len(prompt) - 1, k))
    ids[:, 0] = prompt[1:]  # column 0: the prompt's own tokens
    ids[rng.uniform(size=ids.shape) < 0.3] = -1
    ids[2] = -1  # a row asking nothing
    ids[-1, 1] = ids[-1, 2] = 7  # a repeated id
    return ids


def test_target_prompt_logprobs_dense(torch_engine, learner, prompts, vocab):
    prompt = prompts[0]
    ids = _target_ids(prompt, vocab)
    response = sample(
        torch_engine,
        prompt,
        max_tokens=1,
        include_prompt_logprobs=True,
        target_prompt_logprobs=types.TensorData.from_numpy(ids),
    )
    got = response.target_prompt_logprobs
    assert got.dtype == "float32" and got.shape == list(ids.shape)
    got = got.to_numpy()
    table = logp_table(learner, prompt)
    for i, j in np.ndindex(*ids.shape):
        want = 0.0 if ids[i, j] < 0 else table[i][ids[i, j]]  # row i scores position i + 1
        assert got[i, j] == pytest.approx(want, abs=TOL)
    # Column 0 named the prompt's own tokens: the prompt log-probs.
    named = ids[:, 0] >= 0
    np.testing.assert_allclose(
        got[named, 0], np.asarray(response.prompt_logprobs[1:])[named], atol=1e-6
    )


def test_target_prompt_logprobs_sparse_as_in_the_sdk_docs(torch_engine, learner, prompts, vocab):
    """The SDK's example: one candidate at the last prompt position, sent as sparse CSR with
    pad -1; the response keeps that layout and `.to_torch()[position - 1, 0]` is the answer."""
    prompt = prompts[1]
    position = len(prompt) - 1
    candidate = 123
    ids = torch.full((len(prompt) - 1, 4), -1, dtype=torch.int64)  # K = 4: CSR pays off
    ids[position - 1, 0] = candidate
    target = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert target.sparse_crow_indices is not None
    response = sample(
        torch_engine,
        prompt,
        max_tokens=1,
        include_prompt_logprobs=True,
        target_prompt_logprobs=target,
    )
    got = response.target_prompt_logprobs
    assert got.sparse_crow_indices == target.sparse_crow_indices
    assert got.sparse_col_indices == target.sparse_col_indices
    table = logp_table(learner, prompt)
    assert float(got.to_torch()[position - 1, 0]) == pytest.approx(
        table[position - 1][candidate], abs=TOL
    )


def test_prompt_alt_tokens(torch_engine, learner, prompts):
    prompt = prompts[0]
    table = logp_table(learner, prompt)
    k = 6
    response = sample(
        torch_engine, prompt, max_tokens=1, temperature=1.0, seed=5, prompt_alt_tokens_k=k
    )
    alt = response.prompt_alt_tokens
    tokens, logprobs = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    assert alt.tokens.dtype == "int64" and alt.logprobs.dtype == "float32"
    assert tokens.shape == logprobs.shape == (len(prompt) - 1, k)
    for i, j in np.ndindex(*tokens.shape):  # the model's (raw) log-prob of each draw
        assert logprobs[i, j] == pytest.approx(table[i][tokens[i, j]], abs=TOL)
    # Seeded: the same draws again; greedy: the argmax k times.
    again = sample(
        torch_engine, prompt, max_tokens=1, temperature=1.0, seed=5, prompt_alt_tokens_k=k
    )
    np.testing.assert_array_equal(again.prompt_alt_tokens.tokens.to_numpy(), tokens)
    greedy = sample(torch_engine, prompt, max_tokens=1, temperature=0.0, prompt_alt_tokens_k=2)
    argmax = table[:-1].argmax(-1)
    np.testing.assert_array_equal(
        greedy.prompt_alt_tokens.tokens.to_numpy(), np.stack([argmax, argmax], 1)
    )


def test_prompt_alt_tokens_follow_the_tempered_distribution(torch_engine, learner, prompts):
    """20 draws x every position, at temperature 0.5: the empirical frequency of each position's
    most likely token matches softmax(logits / 0.5) within a loose binomial bound."""
    prompt = prompts[1]
    table = logp_table(learner, prompt)[:-1]
    tempered = np.exp(2 * table - np.logaddexp.reduce(2 * table, axis=-1, keepdims=True))
    top = tempered.argmax(-1)
    draws = np.concatenate(
        [
            sample(
                torch_engine, prompt, max_tokens=1, temperature=0.5, seed=s, prompt_alt_tokens_k=20
            ).prompt_alt_tokens.tokens.to_numpy()
            for s in range(5)
        ],
        axis=1,
    )  # (P - 1, 100)
    freq = (draws == top[:, None]).mean(axis=1)
    p = tempered[np.arange(len(top)), top]
    # Averaged over positions: sd of the mean frequency is <= 0.5 / sqrt(100 * positions).
    assert abs(freq.mean() - p.mean()) < 4 * 0.5 / np.sqrt(draws.size)


def test_vllm_refuses_what_it_cannot_produce(vllm_engine_or_skip, prompts, vocab):
    ids = types.TensorData.from_numpy(_target_ids(prompts[0], vocab))
    for option, value in (("target_prompt_logprobs", ids), ("prompt_alt_tokens_k", 2)):
        with pytest.raises(InvalidRequestError, match="vLLM") as err:
            sample(vllm_engine_or_skip, prompts[0], max_tokens=1, **{option: value})
        assert err.value.field == option
        assert "PyTorch engine" in err.value.problem


@pytest.fixture
def vllm_engine_or_skip(request):
    pytest.importorskip("vllm")
    return request.getfixturevalue("vllm_engine")


# ---------------------------------------------------------------------------------------------
# Validation (names the field)


@pytest.mark.parametrize(
    "options, field",
    [
        ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),  # without prompt logprobs
        ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": 0}, "prompt_logprobs_last_n"),
        ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": 99}, "prompt_logprobs_last_n"),
        ({"topk_sample_logprobs": 21}, "topk_sample_logprobs"),
        ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k"),
        ({"target_prompt_logprobs": "short"}, "target_prompt_logprobs"),
        ({"target_prompt_logprobs": "none"}, "target_prompt_logprobs"),
        ({"target_prompt_logprobs": "float"}, "target_prompt_logprobs"),
        ({"target_prompt_logprobs": "bad_id"}, "target_prompt_logprobs[1][0]"),
    ],
)
def test_bad_options_are_refused(torch_engine, prompts, vocab, options, field):
    prompt = prompts[0]
    rows = len(prompt) - 1
    tensors = {
        "short": types.TensorData.from_numpy(np.zeros((rows - 1, 1), np.int64)),
        "none": types.TensorData.from_numpy(np.full((rows, 2), -1, np.int64)),
        "float": types.TensorData.from_numpy(np.zeros((rows, 1), np.float32)),
        "bad_id": types.TensorData.from_numpy(
            np.array([[5]] + [[vocab]] + [[1]] * (rows - 2), np.int64)
        ),
    }
    if "target_prompt_logprobs" in options:
        options = {**options, "target_prompt_logprobs": tensors[options["target_prompt_logprobs"]]}
    with pytest.raises(InvalidRequestError) as err:
        sample(torch_engine, prompt, max_tokens=1, **options)
    assert err.value.field == field
