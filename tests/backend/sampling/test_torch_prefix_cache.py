"""Prefix reuse in TorchSamplingEngine: multi-turn continuations start from the stored KV of the
previous turn and give the same tokens and log-probs as prefilling everything (tiny model, fp32)."""

from __future__ import annotations

import pytest
import torch

from skyrl_trainer.backend.model_loading import load_causal_lm
from skyrl_trainer.backend.sampling.prefix_cache import PrefixStore
from tests.backend.sampling.test_torch_engine import (
    LOGPROB_TOL,
    TIMEOUT,
    make_engine,
    make_lora,
    max_logprob_diff,
    request,
    run,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = [
    "The quick brown fox",
    "Question: what is 12 times 7? Answer:",
    "Once upon a time, in a land far away, there lived a",
    "Hi",
]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[tuple[int, ...]]:
    return [tuple(tokenizer.encode(t)) for t in TEXTS]


@pytest.fixture(scope="module")
def observations(tokenizer) -> list[tuple[int, ...]]:
    return [tuple(tokenizer.encode(f"\nobservation {k}: try again")) for k in range(4)]


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir, torch.float32)


def converse(engine, prompts, observations, turns=3, num_samples=1, **params):
    """`turns` turns of every conversation at once; turn k+1's prompt is turn k's prompt, its
    first sample's tokens and an observation. Returns [(prompt, result) per conversation] per turn."""
    history = []
    current = list(prompts)
    for turn in range(turns):
        futures = [
            engine.generate(
                request(
                    p, max_tokens=5 + turn, num_samples=num_samples, seed=10 * turn + i, **params
                )
            )
            for i, p in enumerate(current)
        ]
        results = [f.result(timeout=TIMEOUT) for f in futures]
        history.append(list(zip(current, results)))
        current = [
            p + tuple(r.sequences[0].tokens) + observations[turn % len(observations)]
            for p, r in zip(current, results)
        ]
    return history


def assert_same(history_a, history_b, tol=LOGPROB_TOL):
    for turn_a, turn_b in zip(history_a, history_b, strict=True):
        for (prompt_a, res_a), (prompt_b, res_b) in zip(turn_a, turn_b, strict=True):
            assert prompt_a == prompt_b
            for seq_a, seq_b in zip(res_a.sequences, res_b.sequences, strict=True):
                assert seq_a.tokens == seq_b.tokens
                assert seq_a.stop_reason == seq_b.stop_reason
                diff = max(abs(x - y) for x, y in zip(seq_a.logprobs, seq_b.logprobs))
                assert diff < tol


def expected_hits(history) -> int:
    """Prompt tokens of turns >= 2 whose KV the previous turn left: its prompt and its tokens but
    the last."""
    return sum(
        len(prompt) + len(res.sequences[0].tokens) - 1
        for turn in history[:-1]
        for prompt, res in turn
    )


def test_three_turn_continuation_equals_no_reuse(tiny_model_dir, ref_model, prompts, observations):
    reuse, plain = make_engine(tiny_model_dir), make_engine(tiny_model_dir, prefix_cache_tokens=0)
    try:
        assert plain.prefix_store is None
        got = converse(reuse, prompts, observations, temperature=1.0)
        want = converse(plain, prompts, observations, temperature=1.0)
        assert_same(got, want)
        stats = reuse.stats
        assert stats.prefix_hit_tokens == expected_hits(got) > 0
        assert stats.prefix_hit_requests == 2 * len(prompts)
        assert stats.prompt_tokens == plain.stats.prompt_tokens
        assert stats.prefilled_tokens == stats.prompt_tokens - stats.prefix_hit_tokens
        assert plain.stats.prefix_hit_tokens == 0
        for prompt, res in got[-1]:  # and both agree with a plain forward
            assert max_logprob_diff(ref_model, prompt, res.sequences[0]) < LOGPROB_TOL
        # Superseded entries are dropped: one entry per conversation, its latest turn.
        store = reuse.prefix_store
        assert len(store) == len(prompts)
        assert store.tokens == sum(len(p) + len(r.sequences[0].tokens) - 1 for p, r in got[-1])
        layers, kv_heads, head_dim = reuse.runner.cache_dims
        assert store.nbytes == store.tokens * layers * 2 * kv_heads * head_dim * 4

        # Greedy with a stop token and a stop string: same again.
        stop = dict(temperature=0.0, stop_token_ids=(2,), stop_strings=(" the",))
        assert_same(
            converse(reuse, prompts, observations, **stop),
            converse(plain, prompts, observations, **stop),
        )
    finally:
        reuse.shutdown()
        plain.shutdown()


def test_prompt_equal_to_stored_sequence_reuses_all_but_its_last_token(tiny_model_dir, prompts):
    reuse, plain = make_engine(tiny_model_dir), make_engine(tiny_model_dir, prefix_cache_tokens=0)
    try:
        first = run(reuse, request(prompts[2], max_tokens=6, temperature=0.0))
        again = prompts[2] + tuple(first.sequences[0].tokens[:-1])  # exactly the stored tokens
        before = reuse.stats.prefix_hit_tokens
        got = run(reuse, request(again, max_tokens=6, temperature=1.0, seed=3))
        assert reuse.stats.prefix_hit_tokens - before == len(again) - 1
        want = run(plain, request(again, max_tokens=6, temperature=1.0, seed=3))
        assert got.sequences[0].tokens == want.sequences[0].tokens
        assert got.sequences[0].logprobs == pytest.approx(want.sequences[0].logprobs, abs=1e-4)
    finally:
        reuse.shutdown()
        plain.shutdown()


def test_several_samples_continue_one_stored_row(tiny_model_dir, prompts, observations):
    reuse, plain = make_engine(tiny_model_dir), make_engine(tiny_model_dir, prefix_cache_tokens=0)
    try:
        got = converse(reuse, prompts[:3], observations, num_samples=3, temperature=1.0)
        want = converse(plain, prompts[:3], observations, num_samples=3, temperature=1.0)
        assert_same(got, want)
        assert reuse.stats.prefix_hit_tokens == expected_hits(got)
        assert reuse.stats.prefix_hit_requests == 2 * 3

        # Every sample of a request continues in its own request (a group of rollouts).
        def branch(engine, history):
            prompt, res = history[-1][0]
            futures = [
                engine.generate(
                    request(
                        prompt + tuple(seq.tokens) + observations[0],
                        max_tokens=4,
                        num_samples=2,
                        temperature=1.0,
                        seed=k,
                    )
                )
                for k, seq in enumerate(res.sequences)
            ]
            return [f.result(timeout=TIMEOUT) for f in futures]

        before = reuse.stats.prefix_hit_requests
        for a, b in zip(branch(reuse, got), branch(plain, want), strict=True):
            for seq_a, seq_b in zip(a.sequences, b.sequences, strict=True):
                assert seq_a.tokens == seq_b.tokens
                assert seq_a.logprobs == pytest.approx(seq_b.logprobs, abs=LOGPROB_TOL)
        assert reuse.stats.prefix_hit_requests - before == 3
    finally:
        reuse.shutdown()
        plain.shutdown()


def test_prompt_logprob_requests_prefill_in_full(tiny_model_dir, prompts, observations):
    reuse, plain = make_engine(tiny_model_dir), make_engine(tiny_model_dir, prefix_cache_tokens=0)
    try:
        first = run(reuse, request(prompts[1], max_tokens=5, temperature=0.0))
        follow = prompts[1] + tuple(first.sequences[0].tokens) + observations[0]
        before = reuse.stats.prefix_hit_tokens
        kwargs = dict(max_tokens=4, temperature=1.0, seed=5, prompt_logprobs=True)
        kwargs["topk_prompt_logprobs"] = 3
        got = run(reuse, request(follow, **kwargs))
        want = run(plain, request(follow, **kwargs))
        assert reuse.stats.prefix_hit_tokens == before  # no reuse: it needs every position
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(follow)
        assert got.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-4)
        assert [[t for t, _ in row] for row in got.topk_prompt_logprobs[1:]] == [
            [t for t, _ in row] for row in want.topk_prompt_logprobs[1:]
        ]
        assert got.sequences[0].tokens == want.sequences[0].tokens
        # Its rows are still kept for the next turn.
        nxt = follow + tuple(got.sequences[0].tokens) + observations[1]
        run(reuse, request(nxt, max_tokens=2))
        assert reuse.stats.prefix_hit_tokens - before == len(follow) + 4 - 1
    finally:
        reuse.shutdown()
        plain.shutdown()


@pytest.fixture(scope="module")
def lora_dir(tiny_model_dir, tmp_path_factory):
    return make_lora(tiny_model_dir, tmp_path_factory.mktemp("lora"), seed=2)


def test_adapters_are_keyed_and_replacing_one_drops_its_entries(
    tiny_model_dir, lora_dir, prompts, observations, tmp_path
):
    reuse, plain = make_engine(tiny_model_dir), make_engine(tiny_model_dir, prefix_cache_tokens=0)
    try:
        for eng in (reuse, plain):
            eng.add_lora("a", str(lora_dir))
        got = converse(reuse, prompts[:2], observations, adapter="a", temperature=1.0)
        want = converse(plain, prompts[:2], observations, adapter="a", temperature=1.0)
        assert_same(got, want)
        assert reuse.stats.prefix_hit_tokens == expected_hits(got)

        # The adapter's stored KV is not used for the base weights, nor the base's for "a".
        prompt, res = got[-1][0]
        follow = prompt + tuple(res.sequences[0].tokens) + observations[0]
        hits = reuse.stats.prefix_hit_tokens
        base_got = run(reuse, request(follow, max_tokens=4, temperature=1.0, seed=1))
        base_want = run(plain, request(follow, max_tokens=4, temperature=1.0, seed=1))
        assert reuse.stats.prefix_hit_tokens == hits
        assert base_got.sequences[0].tokens == base_want.sequences[0].tokens
        assert base_got.sequences[0].logprobs == pytest.approx(
            base_want.sequences[0].logprobs, abs=LOGPROB_TOL
        )

        # Replacing "a" drops its entries: the next turn under the new "a" prefills in full.
        other = make_lora(tiny_model_dir, tmp_path / "other", seed=5)
        for eng in (reuse, plain):
            eng.add_lora("a", str(other))
        assert all(adapter is None for adapter, _ in reuse.prefix_store._entries)
        new_got = run(reuse, request(follow, max_tokens=4, temperature=1.0, seed=1, adapter="a"))
        new_want = run(plain, request(follow, max_tokens=4, temperature=1.0, seed=1, adapter="a"))
        assert reuse.stats.prefix_hit_tokens == hits
        assert new_got.sequences[0].tokens == new_want.sequences[0].tokens
        assert new_got.sequences[0].logprobs == pytest.approx(
            new_want.sequences[0].logprobs, abs=LOGPROB_TOL
        )
        reuse.remove_lora("a")
        assert all(adapter is None for adapter, _ in reuse.prefix_store._entries)
    finally:
        reuse.shutdown()
        plain.shutdown()


def test_weight_update_between_turns_drops_stored_kv(tiny_model_dir, prompts, observations):
    new_model = load_causal_lm(tiny_model_dir, torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in new_model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    state = new_model.state_dict()
    reuse = make_engine(tiny_model_dir)
    fresh = make_engine(tiny_model_dir, prefix_cache_tokens=0)
    try:
        fresh.update_weights(state)
        turn1 = converse(reuse, prompts, observations, turns=1, temperature=1.0)
        assert len(reuse.prefix_store) == len(prompts)
        reuse.update_weights(state)
        assert len(reuse.prefix_store) == 0 and reuse.prefix_store.tokens == 0
        follow = [p + tuple(r.sequences[0].tokens) + observations[0] for p, r in turn1[0]]
        got = converse(reuse, follow, observations, turns=2, temperature=1.0)
        want = converse(fresh, follow, observations, turns=2, temperature=1.0)
        assert_same(got, want)
        # Nothing stored under the old weights was used; the second turn after the update reuses.
        assert reuse.stats.prefix_hit_tokens == expected_hits(got)
        assert reuse.stats.prefix_hit_requests == len(prompts)
    finally:
        reuse.shutdown()
        fresh.shutdown()


def test_lru_eviction_under_a_small_limit(tiny_model_dir, prompts):
    limit = 40
    eng = make_engine(tiny_model_dir, prefix_cache_tokens=limit)
    try:
        stored = {}
        for i in (0, 1, 3):  # stored lengths: prompt + 10 generated - 1
            res = run(eng, request(prompts[i], max_tokens=10, temperature=0.0))
            stored[i] = prompts[i] + tuple(res.sequences[0].tokens)
            assert eng.prefix_store.tokens <= limit
        sizes = {i: len(s) - 1 for i, s in stored.items()}
        assert sizes[0] + sizes[1] + sizes[3] > limit  # so the oldest (0) was evicted
        assert len(eng.prefix_store) == 2
        before = eng.stats.prefix_hit_tokens
        run(eng, request(stored[0] + (5,), max_tokens=1))
        assert eng.stats.prefix_hit_tokens == before
        run(eng, request(stored[3] + (5,), max_tokens=1))
        assert eng.stats.prefix_hit_tokens == before + sizes[3]
        # A sequence longer than the whole store is not kept.
        run(eng, request(prompts[2] * 4, max_tokens=2))
        assert eng.prefix_store.tokens <= limit
        assert all(len(tokens) <= limit for _, tokens in eng.prefix_store._entries)
    finally:
        eng.shutdown()


def test_prefix_store_lookup_and_lru():
    store = PrefixStore(max_tokens=10)
    kv = lambda n: torch.zeros(1, 2, 1, n, 2)  # noqa: E731
    assert store.put(None, (1, 2, 3), kv(3))
    assert store.put(None, (1, 2, 3, 4, 5), kv(5))
    assert store.put("a", (1, 2), kv(2))
    assert store.lookup(None, (1, 2, 3, 4, 5, 6)).length == 5  # the longest
    assert store.lookup(None, (1, 2, 3, 9)).length == 3
    assert store.lookup(None, (1, 2, 3)).length == 2  # all but the last prompt token
    assert store.lookup(None, (1, 2, 9)) is None  # no partial matches inside an entry
    assert store.lookup("a", (1, 2, 3)).length == 2
    assert store.lookup("b", (1, 2, 3)) is None
    # (1, 2, 3) was used last among None's: a new entry of 2 evicts the LRU one, (1, 2, 3, 4, 5).
    assert store.lookup(None, (1, 2, 3, 7)) is not None
    assert store.put(None, (7, 8), kv(2))
    assert store.tokens == 7 and store.lookup(None, (1, 2, 3, 4, 5, 6)).length == 3
    assert not store.put(None, tuple(range(11)), kv(11))
    store.drop_adapter("a")
    assert store.lookup("a", (1, 2, 3)) is None and store.tokens == 5
    store.clear()
    assert len(store) == 0 and store.tokens == 0 and store.nbytes == 0
