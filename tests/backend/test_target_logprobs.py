"""target_logprobs against log_softmax in float64, values and gradients."""

import pytest
import torch

from skyrl_trainer.backend.target_logprobs import target_logprobs


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_values_and_gradients_match_log_softmax(chunk):
    torch.manual_seed(0)
    logits = torch.randn(7, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (7,))
    weights = torch.randn(7, dtype=torch.float64)

    ours = target_logprobs(logits, targets, chunk=chunk)
    (ours * weights).sum().backward()
    ours_grad = logits.grad.clone()

    logits.grad = None
    reference = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    (reference * weights).sum().backward()

    torch.testing.assert_close(ours.double(), reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_grad, logits.grad, rtol=0, atol=1e-6)


def test_gradcheck_in_float64():
    torch.manual_seed(1)
    logits = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (4,))
    # forward runs its log-sum-exp in float32, so compare at float32 precision.
    assert torch.autograd.gradcheck(
        lambda x: target_logprobs(x, targets, 2).double(), (logits,), eps=1e-3, atol=1e-3
    )


def test_bf16_logits_keep_their_dtype_and_give_float32_logprobs():
    logits = torch.randn(5, 9).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 9, (5,))
    out = target_logprobs(logits, targets)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    reference = logits.float().log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)


def test_recomputed_logits_give_the_same_training_step(tiny_model_dir, tmp_path):
    """TrainingConfig.recompute_logits trades memory for compute; results must not change."""
    from tinker import types

    from skyrl_trainer.backend.clients import ServiceClient
    from skyrl_trainer.backend.config import BackendConfig, TrainingConfig

    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(5, 40))),
        loss_fn_inputs={"target_tokens": list(range(6, 41)), "weights": [1.0] * 35},
    )
    grads = []
    for recompute in (False, True):
        config = TrainingConfig(dtype="float32", recompute_logits=recompute, logprob_chunk_tokens=8)
        service = ServiceClient(BackendConfig(storage_dir=str(tmp_path), training=config))
        client = service.create_full_training_client(str(tiny_model_dir)).result()
        loss = client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        slot = service.core._bases[str(tiny_model_dir)].group._slots[client.model_id]
        grads.append((loss, {name: p.grad.clone() for name, p in slot.named_params}))
        service.core.shutdown()
    (loss_a, a), (loss_b, b) = grads
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for name in a:  # float32, different chunking: summation order differs
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
