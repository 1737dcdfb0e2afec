"""float32 and bfloat16 compute the same thing within bf16 rounding, end to end on the backend:
training log-probs, loss and gradient norm; the merged-LoRA sampler's log-probs (and its gap to
the learner: ~0 in float32, bf16 rounding in bf16); and saved weights keep their float32 contract
whatever the compute dtype. The tiny model keeps this fast even where bf16 is emulated."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.torch import load_file
from tinker import types

from skyrl_trainer.backend.clients import ServiceClient
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig
from skyrl_trainer.backend.core import BackendCore

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def clients(tmp_path_factory, tiny_model_dir):
    """One backend per dtype, each with a LoRA model of the same seed; (core, training client)."""
    out = {}
    for dtype in DTYPES:
        core = BackendCore(
            BackendConfig(
                storage_dir=str(tmp_path_factory.mktemp(f"storage_{dtype}")),
                training=TrainingConfig(dtype=dtype),
                sampling=SamplingConfig(engine="torch", dtype=dtype),
            )
        )
        tc = (
            ServiceClient(core=core)
            .create_lora_training_client(str(tiny_model_dir), rank=4, seed=0)
            .result()
        )
        out[dtype] = (core, tc)
    yield out
    for core, _ in out.values():
        core.shutdown()


def rl_data(vocab: int, seed: int = 0) -> list[types.Datum]:
    """importance_sampling datums: random sequences, prompt positions at zero advantage."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(4):
        n = int(rng.integers(12, 24))
        seq = rng.integers(0, vocab, size=n + 1)
        adv = rng.normal(size=n).astype(np.float32)
        adv[:4] = 0.0
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": seq[1:].tolist(),
                    "logprobs": np.full(n, -10.8, dtype=np.float32).tolist(),
                    "advantages": adv.tolist(),
                },
            )
        )
    return data


def test_training_agrees_across_dtypes(clients, vocab):
    data = rl_data(vocab)
    results = {}
    for dtype, (_, tc) in clients.items():
        out = tc.forward_backward(data, "importance_sampling").result()
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        results[dtype] = (
            [o["logprobs"].to_numpy().astype(np.float64) for o in out.loss_fn_outputs],
            out.metrics["loss:sum"],
            opt.metrics["grad_norm:mean"],
        )
    (lp32, loss32, gn32), (lp16, loss16, gn16) = results["float32"], results["bfloat16"]
    for a, b in zip(lp32, lp16, strict=True):
        assert np.abs(a - b).max() < 0.01  # bf16 rounding of activations, not a different model
    assert loss16 == pytest.approx(loss32, rel=0.02)
    assert gn16 == pytest.approx(gn32, rel=0.05)
    assert gn32 > 0


def test_saved_weights_are_float32_whatever_the_compute_dtype(clients):
    for dtype, (core, tc) in clients.items():
        path = tc.save_state(f"contract-{dtype}").result().path
        folder, _ = core.store.resolve(path)
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        assert tensors and {str(t.dtype) for t in tensors.values()} == {"torch.float32"}, dtype


def test_sampler_matches_learner_exactly_in_float32_and_within_rounding_in_bf16(clients, vocab):
    """The merged-LoRA sampler after a training step: its log-probs of a fixed sequence vs the
    learner's forward pass, per dtype; and the two dtypes vs each other."""
    seq = np.random.default_rng(1).integers(0, vocab, size=20).tolist()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    sampler_lps = {}
    for dtype, (_, tc) in clients.items():
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # the adapter is non-zero
        learner = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        sampler = tc.save_weights_and_get_sampling_client().result()
        got = sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result()[1:]
        gap = np.abs(np.asarray(got, dtype=np.float64) - learner.to_numpy()).max()
        assert gap < (1e-4 if dtype == "float32" else 0.02), (dtype, gap)
        sampler_lps[dtype] = np.asarray(got, dtype=np.float64)
    assert np.abs(sampler_lps["float32"] - sampler_lps["bfloat16"]).max() < 0.02
