"""Issue 17: the SDK 0.38 options the backend computes, reached through the official SDK against
a live `python -m skyrl_trainer.server` (tiny model, float32, PyTorch engine), and through the
in-process clients.

- `SamplingClient.sample(..., topk_sample_logprobs, prompt_logprobs_last_n,
  target_prompt_logprobs (dense and sparse CSR), prompt_alt_tokens_k)` and
  `compute_logprobs(prompt, prompt_logprobs_last_n)`: each value is checked against a learner
  forward pass, either a float64 transformers forward of the base weights or, for trained
  weights, `TrainingClient.forward(..., "cross_entropy")` with 2-D target_tokens;
- the in-process `SamplingClient` gives the same results as the server for the same request;
- `forward_backward` / `forward` with 2-D target_tokens of mixed K in one request (1-D, K=1,
  K=3, sparse CSR K=4) equal the same data as one-target datums (loss, logprobs, gradients);
- `forward_backward_custom` with [T, K] target_tokens and no weights (sparse CSR included);
- wrong values are refused with the field named; the server's codec round-trips the new
  response fields and mixed-K outputs through the SDK's decoders.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)
from transformers import AutoModelForCausalLM

from skyrl_trainer.backend.clients import ServiceClient as LocalServiceClient
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig
from skyrl_trainer.server.codec import encode_forward_backward_output, encode_sample_response

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]

PROMPT = [1, 504, 3300, 314, 253, 1789, 30, 902, 41, 77, 1200, 5]
P = len(PROMPT)
ATOL = 1e-4  # float32 server vs float64 reference / float32 learner (measured ~1e-6)
ADAM = types.AdamParams(learning_rate=2e-2)


def model_input(tokens) -> types.ModelInput:
    return types.ModelInput.from_ints(list(tokens))


def ce_datum(tokens, targets, weights=None) -> types.Datum:
    """A cross_entropy datum; `targets` (and `weights`, default 0) as dense numpy TensorData."""
    targets = np.asarray(targets, dtype=np.int64)
    weights = np.zeros(targets.shape, np.float32) if weights is None else weights
    return types.Datum(
        model_input=model_input(tokens),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(targets),
            "weights": types.TensorData.from_numpy(np.asarray(weights, dtype=np.float32)),
        },
    )


def learner_logprobs(tc, tokens, targets) -> np.ndarray:
    """The learner's log p(targets[t, k] | tokens[:t+1]) from TrainingClient.forward."""
    out = tc.forward([ce_datum(tokens, targets)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Row i of `reference(ids)`: log p(. | ids[:i+1]) from a float64 transformers forward of
    the base weights (log_softmax of the logits)."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64).eval()

    @torch.no_grad()
    def table(ids) -> np.ndarray:
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0]
        return torch.log_softmax(logits, dim=-1).numpy()

    return table


@pytest.fixture(scope="module")
def service(live_server):
    return live_server.service_client()


@pytest.fixture(scope="module")
def base_sampler(service, tiny_model_dir):
    return service.create_sampling_client(base_model=str(tiny_model_dir)).result()


@pytest.fixture(scope="module")
def trained(service, tiny_model_dir):
    """A LoRA model one step away from the base, and a sampler of exactly its weights."""
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=8, seed=21).result()
    tokens = [(7 + 91 * i) % 3000 + 10 for i in range(17)]
    tc.forward_backward([ce_datum(tokens[:-1], tokens[1:], np.ones(16))], "cross_entropy").result()
    tc.optim_step(ADAM).result()
    return tc, tc.save_weights_and_get_sampling_client().result()


# ---------------------------------------------------------------- topk_sample_logprobs


def test_topk_sample_logprobs_match_the_reference(base_sampler, reference):
    params = types.SamplingParams(max_tokens=6, seed=3, temperature=1.0, stop=[])
    r = base_sampler.sample(model_input(PROMPT), 2, params, topk_sample_logprobs=5).result()
    assert len(r.sequences) == 2
    for seq in r.sequences:
        table = reference(PROMPT + seq.tokens)
        assert len(seq.tokens) == 6 and len(seq.topk_logprobs) == 6
        assert seq.topk_logprobs_np.token_ids.shape == (6, 5)
        for j, (token, lp, cells) in enumerate(
            zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True)
        ):
            row = table[P - 1 + j]
            assert lp == pytest.approx(row[token], abs=ATOL)
            ids, values = [t for t, _ in cells], [v for _, v in cells]
            assert len(ids) == 5 and len(set(ids)) == 5
            np.testing.assert_allclose(values, np.sort(row)[::-1][:5], atol=ATOL)
            np.testing.assert_allclose(values, row[ids], atol=ATOL)


def test_topk_sample_logprobs_of_trained_weights_match_the_learner(trained):
    tc, sampler = trained
    params = types.SamplingParams(max_tokens=5, seed=8, temperature=1.0, stop=[])
    seq = sampler.sample(model_input(PROMPT), 1, params, topk_sample_logprobs=4).result()
    seq = seq.sequences[0]
    full = PROMPT + seq.tokens
    # Learner targets: column 0 the next token; at the 5 generated rows, columns 1-4 the top-4.
    targets = np.zeros((len(full) - 1, 5), np.int64)
    targets[:, 0] = full[1:]
    targets[P - 1 :, 1:] = seq.topk_logprobs_np.token_ids
    learner = learner_logprobs(tc, full[:-1], targets)
    np.testing.assert_allclose(seq.topk_logprobs_np.logprobs, learner[P - 1 :, 1:], atol=ATOL)
    np.testing.assert_allclose(seq.logprobs, learner[P - 1 :, 0], atol=ATOL)


# ---------------------------------------------------------------- prompt_logprobs_last_n


def test_prompt_logprobs_last_n_and_compute_logprobs(base_sampler, reference):
    params = types.SamplingParams(max_tokens=1, seed=1)
    full = base_sampler.sample(
        model_input(PROMPT), 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3
    ).result()
    part = base_sampler.sample(
        model_input(PROMPT), 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3,
        prompt_logprobs_last_n=4,
    ).result()  # fmt: skip
    table = reference(PROMPT)
    want = [table[i - 1, PROMPT[i]] for i in range(1, P)]
    np.testing.assert_allclose(full.prompt_logprobs[1:], want, atol=ATOL)
    assert part.prompt_logprobs[: P - 4] == [None] * (P - 4)
    np.testing.assert_allclose(part.prompt_logprobs[-4:], want[-4:], atol=ATOL)
    assert part.topk_prompt_logprobs[: P - 4] == [None] * (P - 4)
    for got, whole in zip(part.topk_prompt_logprobs[-4:], full.topk_prompt_logprobs[-4:]):
        assert [t for t, _ in got] == [t for t, _ in whole] and len(got) == 3
        np.testing.assert_allclose([v for _, v in got], [v for _, v in whole], atol=1e-6)
    logprobs = base_sampler.compute_logprobs(model_input(PROMPT), prompt_logprobs_last_n=2)
    logprobs = logprobs.result()
    assert len(logprobs) == P and logprobs[: P - 2] == [None] * (P - 2)
    np.testing.assert_allclose(logprobs[-2:], want[-2:], atol=ATOL)


def test_compute_logprobs_last_n_of_trained_weights_match_the_learner(trained):
    tc, sampler = trained
    learner = learner_logprobs(tc, PROMPT[:-1], PROMPT[1:])
    logprobs = sampler.compute_logprobs(model_input(PROMPT), prompt_logprobs_last_n=5).result()
    assert logprobs[: P - 5] == [None] * (P - 5)
    np.testing.assert_allclose(logprobs[-5:], learner[-5:], atol=ATOL)
    whole = sampler.compute_logprobs(model_input(PROMPT)).result()
    np.testing.assert_allclose(whole[1:], learner, atol=ATOL)


# ---------------------------------------------------------------- target_prompt_logprobs


def test_dense_target_prompt_logprobs_match_the_learner(trained):
    tc, sampler = trained
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 4000, size=(P - 1, 3))
    ids[:, 0] = PROMPT[1:]  # column 0: the prompt's own tokens
    ids[2, 1], ids[5, 1:] = -1, -1  # cells not asked for
    r = sampler.sample(
        model_input(PROMPT), 1, types.SamplingParams(max_tokens=1, seed=2),
        include_prompt_logprobs=True, target_prompt_logprobs=types.TensorData.from_numpy(ids),
    ).result()  # fmt: skip
    got = r.target_prompt_logprobs
    assert got.sparse_crow_indices is None and got.dtype == "float32" and got.shape == [P - 1, 3]
    learner = learner_logprobs(tc, PROMPT[:-1], np.where(ids < 0, 0, ids))
    want = np.where(ids < 0, 0.0, learner)
    np.testing.assert_allclose(got.to_numpy(), want, atol=ATOL)
    np.testing.assert_allclose(r.prompt_logprobs[1:], got.to_numpy()[:, 0], atol=1e-6)


def test_sparse_target_prompt_logprobs_stay_sparse_and_match_the_learner(trained):
    tc, sampler = trained
    ids = torch.full((P - 1, 4), -1, dtype=torch.int64)
    ids[P - 2, 0] = 777  # the SDK docstring's case: one candidate at the last prompt position
    ids[3, 2] = 1234
    target = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert target.sparse_crow_indices is not None  # the SDK sends it as CSR
    r = sampler.sample(
        model_input(PROMPT), 1, types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True, target_prompt_logprobs=target,
    ).result()  # fmt: skip
    got = r.target_prompt_logprobs
    assert got.sparse_crow_indices == target.sparse_crow_indices
    assert got.sparse_col_indices == target.sparse_col_indices
    assert got.shape == [P - 1, 4] and len(got.data) == 2
    learner = learner_logprobs(tc, PROMPT[:-1], np.where(ids.numpy() < 0, 0, ids.numpy()))
    dense = got.to_torch()  # as the SDK docstring reads it
    assert dense[P - 2, 0].item() == pytest.approx(learner[P - 2, 0], abs=ATOL)
    assert dense[3, 2].item() == pytest.approx(learner[3, 2], abs=ATOL)


# ---------------------------------------------------------------- prompt_alt_tokens_k


def test_prompt_alt_tokens_match_the_reference(base_sampler, reference):
    def draw(temperature, seed):
        params = types.SamplingParams(max_tokens=1, temperature=temperature, seed=seed)
        r = base_sampler.sample(model_input(PROMPT), 1, params, prompt_alt_tokens_k=4).result()
        alt = r.prompt_alt_tokens
        assert alt.tokens.dtype == "int64" and alt.logprobs.dtype == "float32"
        assert alt.tokens.shape == alt.logprobs.shape == [P - 1, 4]
        return alt.tokens.to_numpy(), alt.logprobs.to_numpy()

    table = reference(PROMPT)
    tokens, logprobs = draw(1.0, 7)
    rows = np.arange(P - 1)[:, None]
    np.testing.assert_allclose(logprobs, table[:-1][rows, tokens], atol=ATOL)
    assert len(np.unique(tokens)) > P - 1  # real draws, not one token per row
    again, _ = draw(1.0, 7)
    np.testing.assert_array_equal(again, tokens)  # seeded: reproducible
    greedy, greedy_lp = draw(0.0, 1)
    np.testing.assert_allclose(greedy_lp, np.repeat(table[:-1].max(-1)[:, None], 4, 1), atol=ATOL)


def test_prompt_alt_tokens_of_trained_weights_match_the_learner(trained):
    tc, sampler = trained
    params = types.SamplingParams(max_tokens=1, temperature=0.8, seed=4)
    alt = sampler.sample(model_input(PROMPT), 1, params, prompt_alt_tokens_k=3).result()
    tokens = alt.prompt_alt_tokens.tokens.to_numpy()
    learner = learner_logprobs(tc, PROMPT[:-1], tokens)
    np.testing.assert_allclose(alt.prompt_alt_tokens.logprobs.to_numpy(), learner, atol=ATOL)


# ---------------------------------------------------------------- in-process = server


@pytest.fixture(scope="module")
def local_service(tmp_path_factory):
    local = LocalServiceClient(
        BackendConfig(
            storage_dir=str(tmp_path_factory.mktemp("local_storage")),
            training=TrainingConfig(dtype="float32", device="cpu"),
            sampling=SamplingConfig(engine="torch", dtype="float32", device="cpu"),
        )
    )
    yield local
    local.core.shutdown()


def all_options(sampler) -> types.SampleResponse:
    ids = torch.full((P - 1, 3), -1, dtype=torch.int64)
    ids[P - 2, 1], ids[4, 0] = 900, 31
    return sampler.sample(
        model_input(PROMPT), 2, types.SamplingParams(max_tokens=4, seed=9, temperature=1.0),
        include_prompt_logprobs=True, topk_prompt_logprobs=2, topk_sample_logprobs=3,
        target_prompt_logprobs=types.TensorData.from_torch_sparse(ids, pad_value=-1),
        prompt_alt_tokens_k=2, prompt_logprobs_last_n=5,
    ).result()  # fmt: skip


def test_in_process_sampling_client_equals_the_server(base_sampler, local_service, tiny_model_dir):
    local = local_service.create_sampling_client(base_model=str(tiny_model_dir)).result()
    r, s = all_options(base_sampler), all_options(local)
    for x, y in zip(r.sequences, s.sequences, strict=True):
        assert x.tokens == y.tokens
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
        np.testing.assert_array_equal(x.topk_logprobs_np.token_ids, y.topk_logprobs_np.token_ids)
        np.testing.assert_allclose(x.topk_logprobs_np.logprobs, y.topk_logprobs_np.logprobs, 1e-5)
    assert r.prompt_logprobs[: P - 5] == s.prompt_logprobs[: P - 5] == [None] * (P - 5)
    np.testing.assert_allclose(r.prompt_logprobs[-5:], s.prompt_logprobs[-5:], atol=1e-5)
    assert r.topk_prompt_logprobs[: P - 5] == [None] * (P - 5)
    assert (
        r.target_prompt_logprobs.sparse_crow_indices == s.target_prompt_logprobs.sparse_crow_indices
    )
    np.testing.assert_allclose(
        r.target_prompt_logprobs.to_numpy(), s.target_prompt_logprobs.to_numpy(), atol=1e-5
    )
    np.testing.assert_array_equal(
        r.prompt_alt_tokens.tokens.to_numpy(), s.prompt_alt_tokens.tokens.to_numpy()
    )
    np.testing.assert_allclose(
        r.prompt_alt_tokens.logprobs.to_numpy(), s.prompt_alt_tokens.logprobs.to_numpy(), atol=1e-5
    )
    local_lp = local.compute_logprobs(model_input(PROMPT), prompt_logprobs_last_n=3).result()
    remote_lp = base_sampler.compute_logprobs(model_input(PROMPT), prompt_logprobs_last_n=3)
    remote_lp = remote_lp.result()
    assert local_lp[: P - 3] == remote_lp[: P - 3] == [None] * (P - 3)
    np.testing.assert_allclose(local_lp[-3:], remote_lp[-3:], atol=1e-5)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "options, says",
    [
        (dict(topk_sample_logprobs=21), "topk_sample_logprobs.*must be an integer in \\[0, 20\\]"),
        (dict(prompt_alt_tokens_k=50), "prompt_alt_tokens_k.*\\[0, 20\\]"),
        (
            dict(include_prompt_logprobs=True, prompt_logprobs_last_n=P),
            f"prompt_logprobs_last_n.*must be in \\[1, {P - 1}\\]",
        ),
        (
            dict(target_prompt_logprobs=types.TensorData.from_numpy(np.ones((P, 2), np.int64))),
            f"target_prompt_logprobs.*must be \\[{P - 1}, K\\]",
        ),
        (
            dict(
                target_prompt_logprobs=types.TensorData.from_numpy(-np.ones((P - 1, 2), np.int64))
            ),
            "target_prompt_logprobs.*names no token id",
        ),
        (  # a sparse shape this large is refused before it is densified
            dict(
                target_prompt_logprobs=types.TensorData(
                    data=[5],
                    dtype="int64",
                    shape=[P - 1, 10**9],
                    sparse_crow_indices=[0] + [1] * (P - 1),
                    sparse_col_indices=[0],
                )  # fmt: skip
            ),
            "target_prompt_logprobs.*1 <= K <= 20",
        ),
        (
            dict(target_prompt_logprobs=types.TensorData.from_numpy(np.full((P - 1, 1), 10**7))),
            "target_prompt_logprobs\\[0\\]\\[0\\].*token id",
        ),
    ],
)
def test_bad_options_are_refused_by_name(base_sampler, options, says):
    with pytest.raises(tinker.RequestFailedError, match=says):
        base_sampler.sample(
            model_input(PROMPT), 1, types.SamplingParams(max_tokens=1), **options
        ).result()


# ---------------------------------------------------------------- 2-D target_tokens


def multi_target_data() -> list[types.Datum]:
    """Mixed K in one request: [6, 3], [5, 1], 1-D [7], and sparse CSR [8, 4] (sent as the SDK
    sends 2-D torch tensors)."""
    rng = np.random.default_rng(5)
    data = []
    for n, k, offset in ((6, 3, 0), (5, 1, 1), (7, None, 2), (8, 4, 3)):
        tokens = [(100 + 37 * i + 11 * offset) % 4000 + 10 for i in range(n + 1)]
        if k is None:
            data.append(ce_datum(tokens[:-1], tokens[1:], rng.uniform(0.5, 1, n)))
            continue
        targets = rng.integers(10, 4000, size=(n, k))
        targets[:, 0] = tokens[1:]
        weights = rng.uniform(0.1, 1.0, size=(n, k)).astype(np.float32)
        if k == 4:  # mostly zero, so the SDK's Datum turns both into CSR
            targets[:, 1:] = 0
            targets[2, 3] = 555
            weights[:, 1:] = 0
            weights[2, 3] = 0.5
        datum = types.Datum(
            model_input=model_input(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": torch.tensor(targets),
                "weights": torch.tensor(weights),
            },
        )
        if k == 4:
            assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
            assert datum.loss_fn_inputs["weights"].sparse_crow_indices is not None
        data.append(datum)
    return data


def one_target_views(data: list[types.Datum]) -> list[list[types.Datum]]:
    """Each datum as K one-target datums (column k of its targets and weights)."""
    views = []
    for d in data:
        targets = d.loss_fn_inputs["target_tokens"].to_numpy()
        weights = d.loss_fn_inputs["weights"].to_numpy()
        if targets.ndim == 1:
            views.append([d])
        else:
            views.append(
                [
                    ce_datum(d.model_input.to_ints(), targets[:, k], weights[:, k])
                    for k in range(targets.shape[1])
                ]
            )
    return views


def test_mixed_k_forward_backward_equals_one_target_datums(service, tiny_model_dir):
    data = multi_target_data()
    views = one_target_views(data)
    flat = [v for group in views for v in group]
    multi = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=31).result()
    single = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=31).result()

    fwd = multi.forward(data, "cross_entropy").result()
    fb = multi.forward_backward(data, "cross_entropy").result()
    fb_single = single.forward_backward(flat, "cross_entropy").result()
    shapes = [list(o["logprobs"].to_numpy().shape) for o in fb.loss_fn_outputs]
    assert shapes == [[6, 3], [5, 1], [7], [8, 4]]
    assert fb.metrics["loss:sum"] == pytest.approx(fb_single.metrics["loss:sum"], rel=1e-5)
    expected = sum(
        -float(np.sum(d.loss_fn_inputs["weights"].to_numpy() * o["logprobs"].to_numpy()))
        for d, o in zip(data, fb.loss_fn_outputs, strict=True)
    )
    assert fb.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    singles = iter(fb_single.loss_fn_outputs)
    for out, fout, group in zip(fb.loss_fn_outputs, fwd.loss_fn_outputs, views, strict=True):
        lp = out["logprobs"].to_numpy()
        np.testing.assert_allclose(fout["logprobs"].to_numpy(), lp, atol=1e-6)
        columns = [next(singles)["logprobs"].to_numpy() for _ in group]
        want = columns[0] if lp.ndim == 1 else np.stack(columns, axis=1)
        np.testing.assert_allclose(lp, want, atol=1e-5)
    # Same gradients: the same gradient norm, and the same weights after one Adam step.
    step, step_single = multi.optim_step(ADAM).result(), single.optim_step(ADAM).result()
    assert step.metrics["grad_norm:mean"] == pytest.approx(
        step_single.metrics["grad_norm:mean"], rel=1e-4
    )
    after = multi.forward(data[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    after_single = single.forward(data[:1], "cross_entropy").result()
    np.testing.assert_allclose(
        after.to_numpy(), after_single.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-5
    )
    assert not np.allclose(after.to_numpy(), fwd.loss_fn_outputs[0]["logprobs"].to_numpy())


def distill_loss(data, logprobs):
    """A distillation-style loss on [T, K] logprobs (1-D for a 1-D datum)."""
    loss = sum((torch.exp(lp) * lp).sum() for lp in logprobs)
    return loss, {"ndim:max": float(max(lp.ndim for lp in logprobs))}


def test_forward_backward_custom_with_2d_targets(service, local_service, tiny_model_dir):
    """[T, K] logprobs reach the custom loss through the SDK (which sends the surrogate's
    2-D weights back) and in-process, where target_tokens without weights may be sparse."""
    data = multi_target_data()
    remote = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=33).result()
    local = local_service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=33)
    local = local.result()
    got = remote.forward_backward_custom(data, distill_loss).result()
    # In-process, with no weights at all: the backend builds zero weights of the targets' shape
    # (the [8, 4] datum's target_tokens stay sparse CSR).
    no_weights = [
        types.Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"]})
        for d in data
    ]
    assert no_weights[3].loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    want = local.forward_backward_custom(no_weights, distill_loss).result()
    assert got.metrics["ndim:max"] == want.metrics["ndim:max"] == 2.0
    for key in ("loss:sum", "surrogate_loss:sum"):
        assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-4), key
    for x, y in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=1e-5)
    step = remote.optim_step(ADAM).result()
    local_step = local.optim_step(ADAM).result()
    assert step.metrics["grad_norm:mean"] == pytest.approx(
        local_step.metrics["grad_norm:mean"], rel=1e-4
    )


# ---------------------------------------------------------------- codec (no server)


def test_mixed_k_outputs_round_trip_as_several_records():
    shapes = [(3, 2), (4, 2), (5,), (2, 3), (6,), (1, 1)]
    outputs = [
        {
            "logprobs": types.TensorData.from_numpy(-np.arange(np.prod(s), dtype=np.float32).reshape(s)),
            "ids": types.TensorData.from_numpy(np.arange(np.prod(s), dtype=np.int64).reshape(s)),
        }
        for s in shapes
    ]  # fmt: skip
    sent = types.ForwardBackwardOutput("ArrayRecord", outputs, {"loss:sum": 2.0})
    body = encode_forward_backward_output(sent)
    from tinker.proto import tinker_public_pb2 as public_pb

    msg = public_pb.ForwardBackwardOutput.FromString(body)
    assert [r.num_datums for r in msg.loss_fn_outputs] == [2, 1, 1, 1, 1]
    got = deserialize_forward_backward_output(body)
    assert len(got.loss_fn_outputs) == len(shapes)
    for g, w in zip(got.loss_fn_outputs, outputs, strict=True):
        for name in ("logprobs", "ids"):
            assert g[name].dtype == w[name].dtype and g[name].shape == w[name].shape
            np.testing.assert_array_equal(g[name].to_numpy(), w[name].to_numpy())


def test_sample_response_target_and_alt_tokens_round_trip():
    dense = types.TensorData.from_numpy(np.array([[-0.5, 0.0], [-1.25, -2.0]], np.float32))
    sparse = types.TensorData(
        data=np.array([-0.75, -3.0], np.float32), dtype="float32", shape=[3, 4],
        sparse_crow_indices=[0, 1, 1, 2], sparse_col_indices=[2, 0],
    )  # fmt: skip
    alt = types.PromptAltTokens(
        tokens=types.TensorData.from_numpy(np.array([[5, 6, 7], [8, 9, 10]], np.int64)),
        logprobs=types.TensorData.from_numpy(np.full((2, 3), -1.5, np.float32)),
    )
    seq = types.SampledSequence(
        stop_reason="length", sequence_id="s:0", tokens_np=np.array([4], np.int32),
        logprobs_np=np.array([-0.5], np.float32),
    )  # fmt: skip
    for target in (dense, sparse):
        sent = types.SampleResponse(sequences=[seq], target_prompt_logprobs=target)
        got = deserialize_sample_response(encode_sample_response(sent)).target_prompt_logprobs
        assert got.shape == target.shape and got.dtype == "float32"
        assert got.sparse_crow_indices == target.sparse_crow_indices
        assert got.sparse_col_indices == target.sparse_col_indices
        np.testing.assert_array_equal(got.to_numpy(), target.to_numpy())
    sent = types.SampleResponse(sequences=[seq], prompt_alt_tokens=alt)
    got = deserialize_sample_response(encode_sample_response(sent))
    assert got.target_prompt_logprobs is None
    for name in ("tokens", "logprobs"):
        g, w = getattr(got.prompt_alt_tokens, name), getattr(alt, name)
        assert g.dtype == w.dtype and g.shape == w.shape == [2, 3]
        np.testing.assert_array_equal(g.to_numpy(), w.to_numpy())
