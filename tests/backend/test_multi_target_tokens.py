"""Two-dimensional `target_tokens` / `weights` ([T, K]: K candidate targets per position).

The Tinker SDK documents them for `cross_entropy` (and so for `forward` and
`forward_backward_custom`, whose logprobs "have the shape of the datum's target_tokens"); the
tinker-cookbook's off-policy distillation and SDFT send a teacher's top-K this way. Semantics:
`logprobs[t, k] = log p(target_tokens[t, k] | model_input[:t+1])`, returned as [T, K] float32,
and the loss is `sum_t sum_k -weights[t, k] * logprobs[t, k]`.

References are independent: a float64 transformers forward with a hand-written
log_softmax + gather, and torch autograd on that reference for the gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types
from transformers import AutoModelForCausalLM

from skyrl_trainer.backend.config import BackendConfig, TrainingConfig
from skyrl_trainer.backend.core import BackendCore
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.target_logprobs import target_logprobs


@pytest.fixture(scope="module")
def core(tmp_path_factory) -> BackendCore:
    core = BackendCore(
        BackendConfig(
            storage_dir=str(tmp_path_factory.mktemp("storage")),
            # A small budget: several micro-batches, 1-D and 2-D datums mixed in one.
            training=TrainingConfig(dtype="float32", micro_batch_tokens=40),
        )
    )
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64)
    return model.eval()


def _slot(core, tc):
    group = core._base_slot(core.model(tc.model_id).base_model).group
    return group._slots[tc.model_id]


def _grads(core, tc) -> dict[str, torch.Tensor]:
    slot = _slot(core, tc)
    return {
        name: torch.zeros(p.shape, dtype=torch.float64) if p.grad is None else p.grad.double()
        for name, p in slot.named_params
    }


def _ref_logprobs(model, ids: list[int], targets: np.ndarray) -> torch.Tensor:
    """Hand-written float64 log_softmax gathered at (T,) or (T, K) targets."""
    logits = model(input_ids=torch.tensor([ids])).logits[0]  # (T, V) float64
    logz = torch.logsumexp(logits, dim=-1, keepdim=True)
    t = torch.as_tensor(targets, dtype=torch.long)
    if t.dim() == 1:
        return logits.gather(-1, t[:, None])[:, 0] - logz[:, 0]
    return logits.gather(-1, t) - logz


def _multi_datum(rng, vocab: int, length: int, k: int, sparse: bool = False) -> types.Datum:
    ids = rng.integers(3, vocab, size=length).tolist()
    targets = rng.integers(0, vocab, size=(length, k))
    weights = rng.uniform(0.1, 1.0, size=(length, k)).astype(np.float32)
    weights[: length // 3] = 0.0  # "prompt" rows carry no weight
    weights[rng.uniform(size=(length, k)) < (0.7 if sparse else 0.3)] = 0.0
    if sparse:  # torch tensors: the SDK's Datum stores 2-D target_tokens / weights as CSR
        inputs = {
            "target_tokens": torch.from_numpy(targets),
            "weights": torch.from_numpy(weights),
        }
    else:
        inputs = {
            "target_tokens": types.TensorData.from_numpy(targets.astype(np.int64)),
            "weights": types.TensorData.from_numpy(weights),
        }
    return types.Datum(model_input=types.ModelInput.from_ints(ids), loss_fn_inputs=inputs)


def _one_target_datum(rng, vocab: int, length: int) -> types.Datum:
    seq = rng.integers(3, vocab, size=length + 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
        loss_fn_inputs={
            "target_tokens": seq[1:].tolist(),
            "weights": rng.uniform(0.0, 1.0, size=length).astype(np.float32).tolist(),
        },
    )


def _dense(td: types.TensorData) -> np.ndarray:
    return np.asarray(td.to_numpy(), dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# The log-prob kernel


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_kernel_values_and_gradients_with_k_targets(chunk):
    torch.manual_seed(0)
    logits = torch.randn(9, 13, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (9, 4))
    targets[2, 1] = targets[2, 0]  # a repeated candidate: its gradient counts twice
    weights = torch.randn(9, 4, dtype=torch.float64)

    ours = target_logprobs(logits, targets, chunk=chunk)
    assert ours.shape == (9, 4) and ours.dtype == torch.float32
    (ours * weights).sum().backward()
    ours_grad = logits.grad.clone()

    logits.grad = None
    reference = logits - torch.logsumexp(logits, -1, keepdim=True)
    reference = torch.stack([reference[i, targets[i]] for i in range(9)])
    (reference * weights).sum().backward()
    torch.testing.assert_close(ours.double(), reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_grad, logits.grad, rtol=0, atol=1e-6)


def test_kernel_gradcheck_with_k_targets():
    torch.manual_seed(1)
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (5, 3))
    assert torch.autograd.gradcheck(
        lambda x: target_logprobs(x, targets, 2).double(), (logits,), eps=1e-3, atol=1e-3
    )


# ---------------------------------------------------------------------------------------------
# Through the training client


def test_forward_backward_k_targets_matches_float64_reference(
    sc, core, tiny_model_dir, vocab, reference
):
    """Mixed request: K = 3, K = 1 (2-D), sparse K = 5, and a plain 1-D datum; several
    micro-batches. Logprobs, loss:sum and every gradient match the float64 reference."""
    rng = np.random.default_rng(0)
    data = [
        _multi_datum(rng, vocab, 11, 3),
        _one_target_datum(rng, vocab, 9),
        _multi_datum(rng, vocab, 7, 1),
        _multi_datum(rng, vocab, 13, 5, sparse=True),
    ]
    assert data[3].loss_fn_inputs["weights"].sparse_crow_indices is not None  # really CSR
    tc = sc.create_full_training_client(str(tiny_model_dir)).result()
    out = tc.forward_backward(data, "cross_entropy").result()

    ref_loss = torch.zeros((), dtype=torch.float64)
    for datum, got in zip(data, out.loss_fn_outputs, strict=True):
        targets = _dense(datum.loss_fn_inputs["target_tokens"]).astype(np.int64)
        weights = torch.from_numpy(_dense(datum.loss_fn_inputs["weights"]))
        lp = got["logprobs"]
        assert lp.dtype == "float32"
        assert list(lp.to_numpy().shape) == list(targets.shape)
        want = _ref_logprobs(reference, datum.model_input.to_ints(), targets)
        np.testing.assert_allclose(lp.to_numpy(), want.detach().numpy(), rtol=0, atol=2e-5)
        ref_loss = ref_loss - (want * weights).sum()
    assert out.metrics["loss:sum"] == pytest.approx(ref_loss.item(), rel=1e-5)

    ref_loss.backward()
    ref_grads = dict(reference.named_parameters())
    for name, g in _grads(core, tc).items():
        want = ref_grads[name].grad
        scale = float(want.abs().max())
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5 * scale, msg=name)
    reference.zero_grad()


def test_forward_returns_k_target_logprobs_without_gradients(sc, core, tiny_model_dir, vocab):
    rng = np.random.default_rng(1)
    data = [_multi_datum(rng, vocab, 10, 4), _multi_datum(rng, vocab, 6, 2)]
    tc = sc.create_lora_training_client(str(tiny_model_dir), rank=4, seed=0).result()
    fwd = tc.forward(data, "cross_entropy").result()
    assert all(g.abs().max() == 0 for g in _grads(core, tc).values())
    fb = tc.forward_backward(data, "cross_entropy").result()
    for a, b in zip(fwd.loss_fn_outputs, fb.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6)
    assert fwd.loss_fn_outputs[0]["logprobs"].to_numpy().shape == (10, 4)
    assert fwd.metrics["loss:sum"] == pytest.approx(fb.metrics["loss:sum"], rel=1e-6)


def test_k_targets_equal_the_same_request_written_one_target_per_row(
    sc, core, tiny_model_dir, vocab
):
    """Each column of a [T, K] datum is a [T] datum on the same input: the losses add up and
    so do the gradients (finite-difference-free check of the backward's bookkeeping)."""
    rng = np.random.default_rng(2)
    multi = _multi_datum(rng, vocab, 12, 3)
    targets = multi.loss_fn_inputs["target_tokens"].to_numpy()
    weights = multi.loss_fn_inputs["weights"].to_numpy()
    columns = [
        types.Datum(
            model_input=multi.model_input,
            loss_fn_inputs={
                "target_tokens": targets[:, k].tolist(),
                "weights": weights[:, k].tolist(),
            },
        )
        for k in range(3)
    ]
    tc_multi = sc.create_full_training_client(str(tiny_model_dir)).result()
    tc_cols = sc.create_full_training_client(str(tiny_model_dir)).result()
    out_multi = tc_multi.forward_backward([multi], "cross_entropy").result()
    out_cols = tc_cols.forward_backward(columns, "cross_entropy").result()
    assert out_multi.metrics["loss:sum"] == pytest.approx(out_cols.metrics["loss:sum"], rel=1e-5)
    lp = out_multi.loss_fn_outputs[0]["logprobs"].to_numpy()
    for k, o in enumerate(out_cols.loss_fn_outputs):
        np.testing.assert_allclose(lp[:, k], o["logprobs"].to_numpy(), atol=1e-6)
    g_multi, g_cols = _grads(core, tc_multi), _grads(core, tc_cols)
    for name in g_multi:
        scale = float(g_cols[name].abs().max()) + 1e-12
        torch.testing.assert_close(
            g_multi[name], g_cols[name], rtol=1e-4, atol=1e-5 * scale, msg=name
        )


def test_forward_backward_custom_gets_k_target_logprobs(sc, core, tiny_model_dir, vocab, reference):
    """The custom loss sees [T, K] logprobs; its gradient reaches the weights exactly
    (a KL-like distillation loss against fixed teacher probabilities)."""
    rng = np.random.default_rng(3)
    data = [_multi_datum(rng, vocab, 9, 4), _multi_datum(rng, vocab, 5, 2)]
    teacher = [
        torch.softmax(torch.randn(d.model_input.length, k), -1) for d, k in zip(data, (4, 2))
    ]
    shapes = []

    def loss_fn(batch, logprobs):
        shapes.extend(tuple(lp.shape) for lp in logprobs)
        loss = sum(-(p * lp * lp.exp()).sum() for p, lp in zip(teacher, logprobs))
        return loss, {"custom:sum": float(loss.detach())}

    tc = sc.create_full_training_client(str(tiny_model_dir)).result()
    out = tc.forward_backward_custom(data, loss_fn).result()
    assert shapes == [(9, 4), (5, 2)]
    assert [o["logprobs"].to_numpy().shape for o in out.loss_fn_outputs] == [(9, 4), (5, 2)]

    ref_loss = torch.zeros((), dtype=torch.float64)
    for datum, p in zip(data, teacher, strict=True):
        targets = datum.loss_fn_inputs["target_tokens"].to_numpy()
        lp = _ref_logprobs(reference, datum.model_input.to_ints(), targets)
        ref_loss = ref_loss - (p.double() * lp * lp.exp()).sum()
    assert out.metrics["loss:sum"] == pytest.approx(ref_loss.item(), rel=1e-5)
    ref_loss.backward()
    ref_grads = dict(reference.named_parameters())
    for name, g in _grads(core, tc).items():
        want = ref_grads[name].grad
        scale = float(want.abs().max())
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5 * scale, msg=name)
    reference.zero_grad()


# ---------------------------------------------------------------------------------------------
# Refusals


def _refused(tc, data, loss_fn="cross_entropy") -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        tc.forward_backward(data, loss_fn).result()
    return err.value


def test_k_target_refusals_name_the_field(sc, tiny_model_dir, vocab):
    tc = sc.create_lora_training_client(str(tiny_model_dir), rank=4, seed=1).result()
    rng = np.random.default_rng(4)
    good = _multi_datum(rng, vocab, 6, 3)
    targets = good.loss_fn_inputs["target_tokens"]

    def with_inputs(**inputs):
        return types.Datum(model_input=good.model_input, loss_fn_inputs=inputs)

    # weights must have target_tokens' [T, K] shape (a [T] weight vector is refused).
    err = _refused(tc, [with_inputs(target_tokens=targets, weights=[1.0] * 6)])
    assert err.field == "data[0].loss_fn_inputs.weights" and "[6, 3]" in err.problem
    # Rows must match model_input.
    short = types.TensorData.from_numpy(targets.to_numpy()[:5])
    err = _refused(tc, [with_inputs(target_tokens=short, weights=good.loss_fn_inputs["weights"])])
    assert err.field == "data[0].loss_fn_inputs.target_tokens" and "[6, K]" in err.problem
    # Token ids are checked in every cell.
    bad = targets.to_numpy().copy()
    bad[4, 2] = vocab
    err = _refused(
        tc,
        [
            with_inputs(
                target_tokens=types.TensorData.from_numpy(bad),
                weights=good.loss_fn_inputs["weights"],
            )
        ],
    )
    assert err.field.startswith("data[0].loss_fn_inputs.target_tokens")
    # Losses with one target per position refuse [T, K], saying which loss takes it.
    rl = with_inputs(
        target_tokens=targets,
        logprobs=types.TensorData.from_numpy(np.zeros((6, 3), np.float32)),
        advantages=types.TensorData.from_numpy(np.ones((6, 3), np.float32)),
    )
    err = _refused(tc, [rl], "importance_sampling")
    assert err.field == "data[0].loss_fn_inputs.target_tokens"
    assert "cross_entropy" in err.problem


def test_sparse_k_targets_to_a_one_target_loss_get_the_shape_message(sc, tiny_model_dir):
    """A 2-D torch tensor arrives as CSR; the refusal is about the shape, not the encoding."""
    tc = sc.create_lora_training_client(str(tiny_model_dir), rank=4, seed=2).result()
    targets = torch.zeros((6, 3), dtype=torch.int64)
    targets[1, 0] = 5
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10, 16))),
        loss_fn_inputs={
            "target_tokens": targets,
            "logprobs": np.zeros((6, 3), np.float32),
            "advantages": np.ones((6, 3), np.float32),
        },
    )
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    err = _refused(tc, [datum], "ppo")
    assert err.field == "data[0].loss_fn_inputs.target_tokens"
    assert "[6, 3]" in err.problem and "cross_entropy" in err.problem
