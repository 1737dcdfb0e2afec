"""End-to-end tests of the in-process Tinker sampling surface (SamplingClient and the training
client's sampler snapshots), in float32 on the tiny random Llama.

References are independent of the backend: a plain transformers greedy loop, PEFT / transformers
loading the saved sampler checkpoints, and the learner's own log-probs (`TrainingClient.forward`),
which a correct weight sync must reproduce to float32 noise. Each tolerance is checked to be far
below the gap a wrong sync (the previous snapshot) would show.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture
from transformers import AutoModelForCausalLM, AutoTokenizer

from skyrl_trainer.backend.clients import SamplingClient, ServiceClient, TrainingClient
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig
from skyrl_trainer.backend.core import BackendCore
from skyrl_trainer.backend.errors import InvalidRequestError, NotFoundError
from skyrl_trainer.backend.sampler_registry import StaleSnapshotError

LOGPROB_TOL = 1e-4  # learner vs sampler, float32 (measured ~1e-6)
CKPT_TOL = 1e-5  # saved checkpoint loaded by transformers/PEFT vs the learner
STALE_MIN_GAP = 1e-2  # a wrong (previous) snapshot is at least this far off after training
LORA_LR = 2e-2
FULL_LR = 3e-3

TEXTS = [
    "The quick brown fox",
    "Question: what is 12 times 7? Answer:",
    "Once upon a time, in a land far away, there lived a",
]
TRAIN_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tinker is a training API: forward_backward, then optim_step.",
]

GAPS: dict[str, float] = {}  # measured learner-vs-sampler gaps, printed at module teardown


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers


# Every test runs on both engines: their observable behaviour must be the same. vLLM engines are
# kept small (a 0.25 GiB KV cache each); one base engine serves the whole module.
ENGINES = ["torch", pytest.param("vllm", marks=pytest.mark.vllm)]
ENGINE_SETTINGS = {"torch": {}, "vllm": {"kv_cache_gib": 0.25, "max_lora_rank": 8}}


@pytest.fixture(scope="module", params=ENGINES)
def engine(request) -> str:
    return request.param


def make_core(tmp_path_factory, engine: str, **sampling) -> BackendCore:
    return BackendCore(
        BackendConfig(
            storage_dir=str(tmp_path_factory.mktemp("storage")),
            training=TrainingConfig(dtype="float32", device="cpu"),
            sampling=SamplingConfig(
                engine=engine, dtype="float32", device="cpu", **ENGINE_SETTINGS[engine], **sampling
            ),
        )
    )


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def core(tmp_path_factory, one_torch_thread, engine) -> BackendCore:
    core = make_core(tmp_path_factory, engine)
    yield core
    core.shutdown()
    if GAPS:  # shown with pytest -s
        print(f"\nlearner-vs-sampler log-prob gaps, {engine} engine:")
        for key, value in sorted(GAPS.items()):
            print(f"  {key}: {value:.3e}")
        GAPS.clear()


@pytest.fixture(scope="module")
def base_sampler(sc, tiny_model_dir) -> SamplingClient:
    return sc.create_sampling_client(base_model=str(tiny_model_dir)).result()


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def context_length(tiny_model_dir) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings)


def mi(ids) -> types.ModelInput:
    return types.ModelInput.from_ints(list(ids))


def params(**kw) -> types.SamplingParams:
    kw.setdefault("max_tokens", 16)
    return types.SamplingParams(**kw)


def sample(sampler: SamplingClient, ids, num_samples=1, **kw) -> types.SampleResponse:
    return sampler.sample(mi(ids), num_samples=num_samples, sampling_params=params(**kw)).result()


def greedy(sampler: SamplingClient, ids, max_tokens=16, stop=()) -> list[int]:
    """Greedy tokens with no stop condition at all (stop=[] disables EOS too)."""
    resp = sample(sampler, ids, max_tokens=max_tokens, temperature=0.0, stop=list(stop))
    return list(resp.sequences[0].tokens)


def lora(sc: ServiceClient, model_dir, seed=0, rank=8) -> TrainingClient:
    return sc.create_lora_training_client(str(model_dir), rank=rank, seed=seed).result()


def full_client(sc: ServiceClient, model_dir) -> TrainingClient:
    return sc.create_full_training_client(str(model_dir)).result()


def ce_datum(seq, weights=None) -> types.Datum:
    seq = list(seq)
    n = len(seq) - 1
    return types.Datum(
        model_input=mi(seq[:-1]),
        loss_fn_inputs={
            "target_tokens": seq[1:],
            "weights": [1.0] * n if weights is None else list(weights),
        },
    )


def text_data(tokenizer, texts) -> list[types.Datum]:
    return [ce_datum(tokenizer.encode(t)) for t in texts]


def queue_steps(tc: TrainingClient, data, lr: float, steps: int) -> list:
    """Queue `steps` training steps without waiting for any (requests run in order)."""
    futures = []
    for _ in range(steps):
        futures.append(tc.forward_backward(data, "cross_entropy"))
        futures.append(tc.optim_step(types.AdamParams(learning_rate=lr)))
    return futures


def learner_logprobs(tc: TrainingClient, seqs) -> list[np.ndarray]:
    """The learner's log p(seq[i] | seq[:i]) for i >= 1 of each sequence (float64 copies)."""
    out = tc.forward([ce_datum(s) for s in seqs], "cross_entropy").result()
    return [o["logprobs"].to_numpy().astype(np.float64) for o in out.loss_fn_outputs]


def prompt_lps(sampler: SamplingClient, ids) -> np.ndarray:
    """The sampler's prompt log-probs of `ids` for positions >= 1."""
    lps = sampler.compute_logprobs(mi(ids)).result()
    assert lps[0] is None
    return np.asarray(lps[1:], dtype=np.float64)


def ref_logprobs(model, ids) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0, :-1].float()
    targets = torch.tensor(list(ids)[1:])
    return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0].double().numpy()


def reference_greedy(model, ids, n: int) -> tuple[list[int], list[float], list[float]]:
    """Argmax decoding with plain full-sequence transformers forwards: (tokens, log-probs of the
    tokens, top-1 minus top-2 logit margin at each step)."""
    seq, tokens, logprobs, margins = list(ids), [], [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
            top2 = logits.topk(2)
            token = int(top2.indices[0])
            tokens.append(token)
            logprobs.append(float(logits.log_softmax(-1)[token]))
            margins.append(float(top2.values[0] - top2.values[1]))
            seq.append(token)
    return tokens, logprobs, margins


def seqs_of(resp: types.SampleResponse) -> list[tuple[list[int], list[float], str]]:
    return [(list(s.tokens), list(s.logprobs), s.stop_reason) for s in resp.sequences]


def assert_same_sequences(a: types.SampleResponse, b: types.SampleResponse, atol=1e-5):
    assert len(a.sequences) == len(b.sequences)
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert list(x.tokens) == list(y.tokens)
        assert x.stop_reason == y.stop_reason
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=atol)


def record_gap(key: str, value: float) -> None:
    GAPS[key] = max(GAPS.get(key, 0.0), value)


# ---------------------------------------------------------------------------------------------
# Seeds and greedy decoding


def test_seeded_sampling_is_reproducible_and_seeds_differ(base_sampler, prompts):
    ids = prompts[1]
    kw = dict(max_tokens=16, temperature=1.0, stop=[])
    first = sample(base_sampler, ids, 4, seed=3, **kw)
    again = sample(base_sampler, ids, 4, seed=3, **kw)
    other = sample(base_sampler, ids, 4, seed=4, **kw)
    assert_same_sequences(first, again, atol=0)
    toks = [list(s.tokens) for s in first.sequences]
    assert all(len(t) == 16 for t in toks)
    assert toks != [list(s.tokens) for s in other.sequences]
    # The samples of one request use different random streams.
    assert len({tuple(t) for t in toks}) > 1
    # temperature 1 samples the raw distribution: the random model is close to uniform, so
    # samples are mostly not the greedy continuation.
    g = greedy(base_sampler, ids, 16)
    assert sum(t == g for t in toks) == 0


def test_greedy_equals_plain_transformers_argmax(base_sampler, ref_model, prompts):
    for ids in prompts:
        n = 24
        resp = sample(base_sampler, ids, 3, max_tokens=n, temperature=0.0, stop=[])
        got = [list(s.tokens) for s in resp.sequences]
        assert got[0] == got[1] == got[2]  # greedy ignores the random streams
        ref_tokens, ref_lps, margins = reference_greedy(ref_model, ids, n)
        # Compare up to the first near-tie (where fp32 noise may legitimately pick the other).
        upto = next((i for i, m in enumerate(margins) if m < 1e-4), n)
        assert upto >= 8, margins
        assert got[0][:upto] == ref_tokens[:upto]
        np.testing.assert_allclose(
            resp.sequences[0].logprobs[:upto], ref_lps[:upto], rtol=0, atol=LOGPROB_TOL
        )
        record_gap(
            "base greedy vs transformers (max)",
            float(np.max(np.abs(np.array(resp.sequences[0].logprobs[:upto]) - ref_lps[:upto]))),
        )


# ---------------------------------------------------------------------------------------------
# Stop conditions


def test_stop_token_id(base_sampler, prompts):
    ids = prompts[0]
    g = greedy(base_sampler, ids, 16)
    stop_id = g[2]
    expected = g[: g.index(stop_id) + 1]
    resp = sample(base_sampler, ids, max_tokens=16, temperature=0.0, stop=[stop_id])
    seq = resp.sequences[0]
    assert seq.stop_reason == "stop"
    assert list(seq.tokens) == expected and seq.tokens[-1] == stop_id
    assert len(seq.logprobs) == len(expected)
    # Several ids: stops at the first one generated.
    resp = sample(base_sampler, ids, max_tokens=16, temperature=0.0, stop=[g[5], stop_id])
    first = min(g.index(stop_id), g.index(g[5]))
    assert list(resp.sequences[0].tokens) == g[: first + 1]
    # Sampled rows: a stop id only ever appears as the last token.
    resp = sample(base_sampler, ids, 8, max_tokens=16, temperature=1.0, seed=1, stop=g[:4])
    for s in resp.sequences:
        toks = list(s.tokens)
        if s.stop_reason == "stop":
            assert toks[-1] in g[:4]
        else:
            assert len(toks) == 16
        assert not set(toks[:-1]) & set(g[:4])


def _pick_stop_string(tokenizer, g: list[int]) -> str:
    for tok in g[2:]:
        piece = tokenizer.decode([tok], skip_special_tokens=True).strip()
        if piece and piece.isascii() and piece.isprintable():
            return piece
    pytest.fail(f"no printable ASCII token in the greedy continuation {g}")


def test_stop_strings(base_sampler, prompts, tokenizer):
    ids = prompts[2]
    g = greedy(base_sampler, ids, 24)
    stop = _pick_stop_string(tokenizer, g)

    def decoded(n):
        return tokenizer.decode(g[:n], skip_special_tokens=True)

    n = next(n for n in range(1, len(g) + 1) if stop in decoded(n))
    assert stop not in decoded(n - 1)
    for form in (stop, [stop], ["\x00never\x00", stop]):
        seq = sample(base_sampler, ids, max_tokens=24, temperature=0.0, stop=form).sequences[0]
        assert seq.stop_reason == "stop", form
        assert list(seq.tokens) == g[:n], form
        assert len(seq.logprobs) == n
    # A stop string that never occurs: runs to max_tokens.
    seq = sample(base_sampler, ids, max_tokens=24, temperature=0.0, stop="\x00never\x00")
    assert seq.sequences[0].stop_reason == "length"
    assert list(seq.sequences[0].tokens) == g


def test_max_tokens_gives_length(base_sampler, prompts):
    resp = sample(base_sampler, prompts[0], 3, max_tokens=7, temperature=1.0, seed=5, stop=[])
    for s in resp.sequences:
        assert s.stop_reason == "length"
        assert len(s.tokens) == 7 and len(s.logprobs) == 7
        assert all(lp <= 0 for lp in s.logprobs)
    resp = sample(base_sampler, prompts[0], max_tokens=1, temperature=0.0)
    assert len(resp.sequences[0].tokens) == 1


@pytest.fixture(scope="module")
def eos_model(sc, tiny_model_dir, tokenizer):
    """A full fine-tune trained until, after its prompt, ' Farewell' then EOS each have
    probability > 0.6 (so greedy decoding surely produces them). The random model's EOS row of
    the tied embedding starts at 0 (pad_token_id = eos), so EOS needs a few dozen steps."""
    prompt = tokenizer.encode("Say goodbye:")
    completion = tokenizer.encode(" Farewell") + [tokenizer.eos_token_id]
    seq = prompt + completion
    datum = ce_datum(seq, [0.0] * (len(prompt) - 1) + [1.0] * len(completion))
    tc = full_client(sc, tiny_model_dir)
    for _ in range(80):
        out = tc.forward_backward([datum], "cross_entropy").result()
        lps = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
        if lps.min() > np.log(0.6):
            break
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    else:
        pytest.fail(f"did not learn the completion: {lps}")
    return tc, prompt, completion


def test_default_stop_is_eos_and_empty_stop_disables_it(eos_model, tokenizer):
    tc, prompt, completion = eos_model
    eos = tokenizer.eos_token_id
    sampler = tc.save_weights_and_get_sampling_client().result()
    seq = sample(sampler, prompt, max_tokens=16, temperature=0.0).sequences[0]
    assert list(seq.tokens) == completion
    assert seq.stop_reason == "stop" and seq.tokens[-1] == eos
    # stop=[] disables EOS: same tokens up to and including EOS, then on to max_tokens.
    seq = sample(sampler, prompt, max_tokens=16, temperature=0.0, stop=[]).sequences[0]
    assert seq.stop_reason == "length" and len(seq.tokens) == 16
    assert list(seq.tokens[: len(completion)]) == completion
    no_stop = list(seq.tokens)
    # A stop list replaces EOS: with an unrelated stop id, EOS does not stop the sequence.
    other = next(t for t in range(3, 100) if t not in no_stop[: len(completion)])
    expected = no_stop[: no_stop.index(other) + 1] if other in no_stop else no_stop
    seq = sample(sampler, prompt, max_tokens=16, temperature=0.0, stop=[other]).sequences[0]
    assert list(seq.tokens) == expected and eos in expected[:-1]
    # Sampled: EOS, when generated, ends the sequence.
    resp = sample(sampler, prompt, 8, max_tokens=12, temperature=1.0, seed=2)
    n_eos = 0
    for s in resp.sequences:
        toks = list(s.tokens)
        assert eos not in toks[:-1]
        if s.stop_reason == "stop":
            assert toks[-1] == eos
            n_eos += 1
        else:
            assert len(toks) == 12
    assert n_eos > 0


def test_empty_stop_never_stops_early(base_sampler, prompts):
    resp = sample(base_sampler, prompts[1], 4, max_tokens=40, temperature=1.0, seed=9, stop=[])
    for s in resp.sequences:
        assert s.stop_reason == "length" and len(s.tokens) == 40


# ---------------------------------------------------------------------------------------------
# Sampler log-probs agree with the learner


def _check_sync(tc, new_sampler, old_sampler, prompt, label):
    """Sample from `new_sampler`; the learner's log-probs of those sequences must match the
    sampler's to LOGPROB_TOL, and `old_sampler`'s (pre-training weights) must not."""
    resp = new_sampler.sample(
        mi(prompt),
        num_samples=4,
        sampling_params=params(max_tokens=16, temperature=1.0, seed=3, stop=[]),
        include_prompt_logprobs=True,
    ).result()
    fulls = [list(prompt) + list(s.tokens) for s in resp.sequences]
    learner = learner_logprobs(tc, fulls)
    p = len(prompt) - 1  # completion log-probs start at this index of the learner's
    diffs, old_diffs = [], []
    for s, full, lp in zip(resp.sequences, fulls, learner, strict=True):
        diffs.append(np.abs(np.asarray(s.logprobs, dtype=np.float64) - lp[p:]))
        old_diffs.append(np.abs(prompt_lps(old_sampler, full)[p:] - lp[p:]))
    prompt_diff = np.abs(np.asarray(resp.prompt_logprobs[1:], dtype=np.float64) - learner[0][:p])
    diffs, old_diffs = np.concatenate(diffs), np.concatenate(old_diffs)
    gap, old_gap = float(diffs.max()), float(old_diffs.max())
    record_gap(f"{label} completion max", gap)
    record_gap(f"{label} completion mean", float(diffs.mean()))
    record_gap(f"{label} prompt max", float(prompt_diff.max()))
    record_gap(f"{label} previous snapshot max", old_gap)
    record_gap(f"{label} previous snapshot mean", float(old_diffs.mean()))
    assert gap < LOGPROB_TOL, (gap, diffs)
    assert float(prompt_diff.max()) < LOGPROB_TOL
    assert old_gap > STALE_MIN_GAP and old_gap > 100 * max(gap, 1e-7), (old_gap, gap)
    return resp


def test_lora_sampler_logprobs_match_learner(sc, tiny_model_dir, tokenizer, prompts):
    tc = lora(sc, tiny_model_dir, seed=5)
    before = tc.save_weights_and_get_sampling_client().result()
    # Not waiting: the snapshot is queued behind the steps, so it must hold all of them.
    steps = queue_steps(tc, text_data(tokenizer, TRAIN_TEXTS), LORA_LR, steps=3)
    after = tc.save_weights_and_get_sampling_client().result()
    assert all(f.future().done() for f in steps)
    _check_sync(tc, after, before, prompts[0], "lora")


def test_full_sampler_logprobs_match_learner(sc, tiny_model_dir, tokenizer, base_sampler, prompts):
    tc = full_client(sc, tiny_model_dir)
    steps = queue_steps(tc, text_data(tokenizer, TRAIN_TEXTS), FULL_LR, steps=3)
    after = tc.save_weights_and_get_sampling_client().result()
    assert all(f.future().done() for f in steps)
    # The full model started from the base weights: the base sampler is its "before".
    _check_sync(tc, after, base_sampler, prompts[0], "full")


# ---------------------------------------------------------------------------------------------
# New snapshots, old snapshots


def _push_away(tc, prompt, lr, steps=2):
    """Train `tc` to continue `prompt` with a fixed unlikely text (moves greedy decoding)."""
    target = list(prompt) + [1000 + i for i in range(8)]
    for f in queue_steps(tc, [ce_datum(target)], lr, steps):
        f.result()


def test_lora_old_snapshot_keeps_serving_old_weights(sc, tiny_model_dir, prompts):
    ids = prompts[1]
    tc = lora(sc, tiny_model_dir, seed=6)
    old = tc.save_weights_and_get_sampling_client().result()
    g_old = greedy(old, ids, 12)
    lp_old = prompt_lps(old, ids + g_old)
    _push_away(tc, ids, lr=5e-2)
    new = tc.save_weights_and_get_sampling_client().result()
    g_new = greedy(new, ids, 12)
    assert g_new != g_old
    # The old client still serves the old snapshot, bit for bit (float32, same request).
    assert greedy(old, ids, 12) == g_old
    np.testing.assert_allclose(prompt_lps(old, ids + g_old), lp_old, rtol=0, atol=1e-6)
    assert np.abs(prompt_lps(new, ids + g_old) - lp_old).max() > STALE_MIN_GAP
    # ... and the learner agrees with the new one.
    learner = learner_logprobs(tc, [ids + g_new])[0]
    np.testing.assert_allclose(prompt_lps(new, ids + g_new), learner, rtol=0, atol=LOGPROB_TOL)


def test_full_old_snapshot_fails_clearly(sc, tiny_model_dir, prompts):
    ids = prompts[1]
    tc = full_client(sc, tiny_model_dir)
    old = tc.save_weights_and_get_sampling_client().result()
    g_old = greedy(old, ids, 12)
    _push_away(tc, ids, lr=1e-2)
    new = tc.save_weights_and_get_sampling_client().result()
    assert greedy(new, ids, 12) != g_old
    for fut in (
        old.sample(mi(ids), num_samples=1, sampling_params=params(temperature=0.0)),
        old.compute_logprobs(mi(ids)),
    ):
        with pytest.raises(StaleSnapshotError) as info:
            fut.result()
        assert isinstance(info.value, InvalidRequestError)
        assert info.value.field == "sampling_session_id"
        assert "snapshot" in str(info.value)
    # The new client keeps serving.
    assert len(greedy(new, ids, 4)) == 4


def test_lora_snapshots_beyond_the_limit_fail_clearly(
    tmp_path_factory, engine, tiny_model_dir, prompts
):
    core = make_core(tmp_path_factory, engine, max_lora_snapshots=2)
    try:
        sc = ServiceClient(core=core)
        ids = prompts[0]
        tc, other = lora(sc, tiny_model_dir, seed=1), lora(sc, tiny_model_dir, seed=2)
        s1 = tc.save_weights_and_get_sampling_client().result()
        assert len(greedy(s1, ids, 4)) == 4
        s2 = tc.save_weights_and_get_sampling_client().result()
        s3 = tc.save_weights_for_sampler("third").result()  # a named save is a snapshot too
        s3 = sc.create_sampling_client(model_path=s3.path).result()  # (its own owner: the path)
        s4 = tc.save_weights_and_get_sampling_client().result()
        # Another model's snapshots do not count against this one's.
        o1 = other.save_weights_and_get_sampling_client().result()
        o2 = other.save_weights_and_get_sampling_client().result()
        with pytest.raises(StaleSnapshotError) as info:
            sample(s1, ids, max_tokens=4)
        assert info.value.field == "sampling_session_id"
        assert "snapshot" in str(info.value)
        for live in (s3, s4, o1, o2):
            assert len(sample(live, ids, max_tokens=4).sequences[0].tokens) == 4
        # tc's third save (named) plus s4: s2 is the oldest beyond the limit by now.
        with pytest.raises(StaleSnapshotError):
            sample(s2, ids, max_tokens=4)
    finally:
        core.shutdown()


# ---------------------------------------------------------------------------------------------
# Sampler checkpoints


def test_lora_sampler_checkpoint_loads_in_peft(sc, core, tiny_model_dir, tokenizer, prompts):
    from peft import PeftModel

    tc = lora(sc, tiny_model_dir, seed=8)
    for f in queue_steps(tc, text_data(tokenizer, TRAIN_TEXTS), LORA_LR, steps=2):
        f.result()
    saved = tc.save_weights_for_sampler("s1").result()
    assert isinstance(saved, types.SaveWeightsForSamplerResponse)
    assert saved.path == f"tinker://{tc.model_id}/sampler_weights/s1"
    folder, metadata = core.store.resolve(saved.path)
    assert metadata.is_lora and metadata.lora_rank == 8
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    seqs = [tokenizer.encode(t) for t in TRAIN_TEXTS + TEXTS]
    learner = learner_logprobs(tc, seqs)
    gap = 0.0
    for ids, lp in zip(seqs, learner, strict=True):
        gap = max(gap, float(np.abs(ref_logprobs(peft_model, ids) - lp).max()))
    record_gap("lora PEFT checkpoint vs learner max", gap)
    assert gap < CKPT_TOL
    # The weights moved: PEFT's base alone is far off.
    with peft_model.disable_adapter():
        assert np.abs(ref_logprobs(peft_model, seqs[0]) - learner[0]).max() > STALE_MIN_GAP

    live = tc.save_weights_and_get_sampling_client().result()
    from_path = sc.create_sampling_client(model_path=saved.path).result()
    assert from_path.model_path == saved.path
    # save_weights_and_get_sampling_client with a name also saves a sampler checkpoint.
    named = tc.save_weights_and_get_sampling_client("s2").result()
    assert named.model_path == f"tinker://{tc.model_id}/sampler_weights/s2"
    assert core.store.resolve(named.model_path)[1].is_lora
    for ids in prompts:
        assert greedy(from_path, ids, 16) == greedy(live, ids, 16)
    # TrainingClient.create_sampling_client serves the checkpoint too.
    assert greedy(tc.create_sampling_client(saved.path).result(), prompts[0], 8) == greedy(
        live, prompts[0], 8
    )


def test_full_sampler_checkpoint_loads_in_transformers(
    sc, core, tiny_model_dir, tokenizer, prompts
):
    tc = full_client(sc, tiny_model_dir)
    for f in queue_steps(tc, text_data(tokenizer, TRAIN_TEXTS), FULL_LR, steps=2):
        f.result()
    saved = tc.save_weights_for_sampler("f1").result()
    assert saved.path == f"tinker://{tc.model_id}/sampler_weights/f1"
    folder, metadata = core.store.resolve(saved.path)
    assert not metadata.is_lora
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    loaded_tok = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert loaded_tok.encode(text) == tokenizer.encode(text)
    assert loaded_tok.eos_token_id == tokenizer.eos_token_id
    seqs = [tokenizer.encode(t) for t in TRAIN_TEXTS + TEXTS]
    learner = learner_logprobs(tc, seqs)
    gap = 0.0
    for ids, lp in zip(seqs, learner, strict=True):
        gap = max(gap, float(np.abs(ref_logprobs(model, ids) - lp).max()))
    record_gap("full HF checkpoint vs learner max", gap)
    assert gap < CKPT_TOL

    live = tc.save_weights_and_get_sampling_client().result()
    from_path = sc.create_sampling_client(model_path=saved.path).result()
    for ids in prompts:
        assert greedy(from_path, ids, 16) == greedy(live, ids, 16)
    assert from_path.get_base_model() == live.get_base_model()


def test_full_sampler_checkpoint_overwritten_serves_new_weights(sc, tiny_model_dir, prompts):
    ids = prompts[1]
    tc = full_client(sc, tiny_model_dir)
    path = tc.save_weights_for_sampler("same").result().path
    first = sc.create_sampling_client(model_path=path).result()
    g_first = greedy(first, ids, 12)
    _push_away(tc, ids, lr=1e-2)
    assert tc.save_weights_for_sampler("same").result().path == path  # overwritten
    live = tc.save_weights_and_get_sampling_client().result()
    assert greedy(live, ids, 12) != g_first
    second = sc.create_sampling_client(model_path=path).result()
    assert greedy(second, ids, 12) == greedy(live, ids, 12)


def test_lora_sampler_checkpoint_overwritten_serves_new_weights(sc, tiny_model_dir, prompts):
    ids = prompts[1]
    tc = lora(sc, tiny_model_dir, seed=15)
    path = tc.save_weights_for_sampler("same").result().path
    first = sc.create_sampling_client(model_path=path).result()
    g_first = greedy(first, ids, 12)
    _push_away(tc, ids, lr=5e-2)
    assert tc.save_weights_for_sampler("same").result().path == path
    live = tc.save_weights_and_get_sampling_client().result()
    assert greedy(live, ids, 12) != g_first
    second = sc.create_sampling_client(model_path=path).result()
    assert greedy(second, ids, 12) == greedy(live, ids, 12)
    assert greedy(first, ids, 12) == g_first  # the first client keeps its own snapshot


def _training_checkpoint_sampler(sc, tc, ids):
    """create_sampling_client on a training checkpoint (tinker://.../weights/...): it either
    serves exactly those weights or refuses clearly (InvalidRequestError on model_path)."""
    wpath = tc.save_state("w1").result().path
    live = tc.save_weights_and_get_sampling_client().result()
    try:
        sampler = sc.create_sampling_client(model_path=wpath).result()
    except InvalidRequestError as exc:
        assert exc.field == "model_path"
        return
    assert greedy(sampler, ids, 12) == greedy(live, ids, 12)


def test_sampling_client_on_lora_training_checkpoint(sc, tiny_model_dir, prompts):
    tc = lora(sc, tiny_model_dir, seed=16)
    _push_away(tc, prompts[0], lr=5e-2)
    _training_checkpoint_sampler(sc, tc, prompts[0])


def test_sampling_client_on_full_training_checkpoint(sc, tiny_model_dir, prompts):
    tc = full_client(sc, tiny_model_dir)
    _push_away(tc, prompts[0], lr=1e-2)
    _training_checkpoint_sampler(sc, tc, prompts[0])


# ---------------------------------------------------------------------------------------------
# Prompt log-probs


def test_compute_logprobs_matches_sample_and_learner(sc, tiny_model_dir, tokenizer, prompts):
    tc = lora(sc, tiny_model_dir, seed=9)
    for f in queue_steps(tc, text_data(tokenizer, TRAIN_TEXTS), LORA_LR, steps=1):
        f.result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    for ids in prompts:
        cl = sampler.compute_logprobs(mi(ids)).result()
        assert len(cl) == len(ids) and cl[0] is None
        resp = sampler.sample(
            mi(ids), 2, params(max_tokens=3, temperature=1.0, seed=1), include_prompt_logprobs=True
        ).result()
        sp = resp.prompt_logprobs
        assert len(sp) == len(ids) and sp[0] is None
        np.testing.assert_allclose(cl[1:], sp[1:], rtol=0, atol=1e-6)
        learner = learner_logprobs(tc, [ids])[0]
        np.testing.assert_allclose(np.asarray(cl[1:]), learner, rtol=0, atol=LOGPROB_TOL)
        record_gap("lora compute_logprobs max", float(np.abs(np.asarray(cl[1:]) - learner).max()))
    # A one-token prompt has only the first position, which has no log-prob.
    assert sampler.compute_logprobs(mi(prompts[0][:1])).result() == [None]
    # Without include_prompt_logprobs there are none.
    plain = sample(sampler, prompts[0], max_tokens=2)
    assert plain.prompt_logprobs is None


def test_topk_prompt_logprobs(base_sampler, ref_model, prompts):
    k = 5
    for ids in prompts:
        resp = base_sampler.sample(
            mi(ids),
            1,
            params(max_tokens=2),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=k,
        ).result()
        topk, lps = resp.topk_prompt_logprobs, resp.prompt_logprobs
        assert len(topk) == len(ids) and topk[0] is None
        with torch.no_grad():
            ref = ref_model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        for pos in range(1, len(ids)):
            cell = topk[pos]
            assert len(cell) == k
            values = [lp for _, lp in cell]
            assert values == sorted(values, reverse=True)
            assert values[0] >= lps[pos] - 1e-6
            for token, lp in cell:
                assert lp == pytest.approx(float(ref[pos - 1, token]), abs=LOGPROB_TOL)
                if token == ids[pos]:
                    assert lp == pytest.approx(lps[pos], abs=1e-6)
            ref_top = ref[pos - 1].topk(k).values
            np.testing.assert_allclose(values, ref_top.numpy(), rtol=0, atol=LOGPROB_TOL)
    # topk alone (without include_prompt_logprobs) still gives the top-k.
    resp = base_sampler.sample(mi(prompts[0]), 1, params(max_tokens=1), topk_prompt_logprobs=2)
    assert all(len(c) == 2 for c in resp.result().topk_prompt_logprobs[1:])


# ---------------------------------------------------------------------------------------------
# Bad input


def _bad_cases(vocab: int, context: int, max_num_samples: int, cap: int):
    ok = [1, 2, 3, 4]
    return [
        ("empty prompt", [], 1, {}, {}, "prompt"),
        ("id == vocab", [5, 6, vocab], 1, {}, {}, "prompt[2]"),
        ("negative id", [-1, 6], 1, {}, {}, "prompt[0]"),
        ("prompt fills the context", [5] * context, 1, {"max_tokens": 1}, {}, "prompt"),
        ("num_samples 0", ok, 0, {}, {}, "num_samples"),
        ("num_samples above cap", ok, max_num_samples + 1, {}, {}, "num_samples"),
        ("max_tokens above cap", ok, 1, {"max_tokens": cap + 1}, {}, "sampling_params.max_tokens"),
        (
            "max_tokens beyond context",
            ok,
            1,
            {"max_tokens": context - len(ok) + 1},
            {},
            "sampling_params.max_tokens",
        ),
        ("negative temperature", ok, 1, {"temperature": -0.5}, {}, "sampling_params.temperature"),
        (
            "nan temperature",
            ok,
            1,
            {"temperature": float("nan")},
            {},
            "sampling_params.temperature",
        ),
        ("top_p 0", ok, 1, {"top_p": 0.0}, {}, "sampling_params.top_p"),
        ("top_p 1.5", ok, 1, {"top_p": 1.5}, {}, "sampling_params.top_p"),
        ("top_k 0", ok, 1, {"top_k": 0}, {}, "sampling_params.top_k"),
        ("top_k -2", ok, 1, {"top_k": -2}, {}, "sampling_params.top_k"),
        ("empty stop string", ok, 1, {"stop": [""]}, {}, "sampling_params.stop"),
        ("topk too big", ok, 1, {}, {"topk_prompt_logprobs": 21}, "topk_prompt_logprobs"),
    ]


BAD_CASE_NAMES = [c[0] for c in _bad_cases(10, 10, 1, 1)]


@pytest.mark.parametrize("case", BAD_CASE_NAMES)
def test_bad_sample_requests_fail_clearly(base_sampler, tokenizer, context_length, case):
    cfg = SamplingConfig()
    cases = {c[0]: c for c in _bad_cases(len(tokenizer), context_length, cfg.max_num_samples, 4096)}
    _, ids, n, kw, extra, field = cases[case]
    kw = {"max_tokens": 4, **kw}
    fut = base_sampler.sample(
        mi(ids), num_samples=n, sampling_params=types.SamplingParams(**kw), **extra
    )  # errors come through the future, not as an exception here
    with pytest.raises(InvalidRequestError) as info:
        fut.result()
    assert info.value.field == field, str(info.value)
    # The sampler keeps serving.
    assert len(sample(base_sampler, [1, 2, 3], max_tokens=3, stop=[]).sequences[0].tokens) == 3


def test_largest_valid_requests_are_accepted(base_sampler, context_length):
    ids = [5] * (context_length - 2)
    resp = sample(base_sampler, ids, max_tokens=2, temperature=0.0, stop=[])
    assert len(resp.sequences[0].tokens) == 2
    resp = sample(base_sampler, [5, 6], SamplingConfig().max_num_samples, max_tokens=1)
    assert len(resp.sequences) == SamplingConfig().max_num_samples
    # max_tokens=None means "as much as fits" (bounded by the context here).
    resp = sample(base_sampler, [5] * (context_length - 3), max_tokens=None, stop=[])
    assert len(resp.sequences[0].tokens) == 3


def test_bad_sampling_client_creation(sc, tiny_model_dir, base_sampler):
    with pytest.raises(NotFoundError) as info:
        sc.create_sampling_client(model_path="tinker://nobody:train:0/sampler_weights/x").result()
    assert info.value.field == "model_path"
    with pytest.raises(InvalidRequestError) as info:
        sc.create_sampling_client(model_path="/not/a/tinker/path").result()
    assert info.value.field == "model_path"
    with pytest.raises(InvalidRequestError) as info:
        sc.create_sampling_client().result()
    assert info.value.field == "model_path"
    with pytest.raises(InvalidRequestError) as info:
        sc.create_sampling_client(
            model_path="tinker://x/sampler_weights/y", base_model=str(tiny_model_dir)
        ).result()
    assert info.value.field == "model_path"
    assert len(sample(base_sampler, [1, 2, 3], max_tokens=2).sequences) == 1


# ---------------------------------------------------------------------------------------------
# Concurrency


def test_concurrent_requests_equal_one_at_a_time(sc, tiny_model_dir, tokenizer, base_sampler):
    tc = lora(sc, tiny_model_dir, seed=12)
    for f in queue_steps(tc, text_data(tokenizer, TRAIN_TEXTS), LORA_LR, steps=1):
        f.result()
    snap = tc.save_weights_and_get_sampling_client().result()
    prompts = [tokenizer.encode(t) for t in TEXTS + TRAIN_TEXTS]
    requests = []  # (sampler, ids, num_samples, params)
    for i in range(16):
        sampler = snap if i % 4 == 3 else base_sampler  # adapter and base rows mixed
        kw = dict(max_tokens=6 + i % 7, temperature=[1.0, 0.7, 0.0][i % 3], seed=100 + i)
        if i % 5 == 1:
            kw.update(top_k=20, top_p=0.9)
        requests.append((sampler, prompts[i % len(prompts)], 1 + i % 3, params(stop=[], **kw)))

    def run(req):
        sampler, ids, n, p = req
        return sampler.sample(mi(ids), num_samples=n, sampling_params=p)

    futures = [run(r) for r in requests]  # all in flight together
    threaded: dict[int, types.SampleResponse] = {}

    def in_thread(j):
        threaded[j] = run(requests[j]).result()

    threads = [threading.Thread(target=in_thread, args=(j,)) for j in (0, 5, 10, 15)]
    for t in threads:
        t.start()
    together = [f.result(timeout=120) for f in futures]
    for t in threads:
        t.join(timeout=120)
    assert sorted(threaded) == [0, 5, 10, 15]
    ids_seen = [s.sequence_id for r in together + list(threaded.values()) for s in r.sequences]
    assert len(set(ids_seen)) == len(ids_seen)  # sequence ids are unique
    alone = [run(r).result() for r in requests]
    for j, (a, b) in enumerate(zip(together, alone, strict=True)):
        assert len(a.sequences) == requests[j][2]
        assert_same_sequences(a, b)
    for j, resp in threaded.items():
        assert_same_sequences(resp, alone[j])
    # Adapter rows really used the adapter (they differ from the base on the same request).
    base_version = base_sampler.sample(*_args(requests[3])).result()
    assert seqs_of(base_version) != seqs_of(alone[3])


def _args(req):
    _, ids, n, p = req
    return mi(ids), n, p


# ---------------------------------------------------------------------------------------------
# Async forms, client info


def test_async_forms(sc, tiny_model_dir, base_sampler, prompts):
    tc = lora(sc, tiny_model_dir, seed=13)
    ids = prompts[0]
    p = params(max_tokens=8, temperature=1.0, seed=21, stop=[])
    expected = base_sampler.sample(mi(ids), 2, p).result()

    async def main():
        fut = base_sampler.sample(mi(ids), 2, p)
        assert isinstance(fut, APIFuture)
        awaited = await fut
        direct = await base_sampler.sample_async(mi(ids), 2, p)
        via_result_async = await base_sampler.sample(mi(ids), 2, p).result_async()
        logprobs = await base_sampler.compute_logprobs_async(mi(ids))
        snap = await tc.save_weights_and_get_sampling_client_async()
        from_sc = await sc.create_sampling_client_async(base_model=str(tiny_model_dir))
        snap_resp = await snap.sample_async(mi(ids), num_samples=1, sampling_params=p)
        return awaited, direct, via_result_async, logprobs, snap, from_sc, snap_resp

    awaited, direct, via_result_async, logprobs, snap, from_sc, snap_resp = asyncio.run(main())
    for resp in (awaited, direct, via_result_async):
        assert isinstance(resp, types.SampleResponse)
        assert_same_sequences(resp, expected, atol=0)
    assert logprobs == base_sampler.compute_logprobs(mi(ids)).result()
    assert isinstance(snap, SamplingClient) and isinstance(from_sc, SamplingClient)
    # A fresh LoRA (B = 0) equals the base model.
    assert list(snap_resp.sequences[0].tokens) == list(expected.sequences[0].tokens)


def test_get_base_model_and_tokenizer(sc, tiny_model_dir, tokenizer, base_sampler):
    canonical = str(tiny_model_dir.resolve())
    assert base_sampler.get_base_model() == canonical
    tc = lora(sc, tiny_model_dir, seed=14)
    snap = tc.save_weights_and_get_sampling_client().result()
    assert snap.get_base_model() == canonical
    for sampler in (base_sampler, snap):
        tok = sampler.get_tokenizer()
        assert tok.encode("hello world") == tokenizer.encode("hello world")
        assert tok.eos_token_id == tokenizer.eos_token_id
        assert len(tok) == len(tokenizer)
