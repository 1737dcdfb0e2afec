"""End-to-end tests of the in-process Tinker training surface (ServiceClient / TrainingClient).

Numbers are checked against independent references: a plain transformers forward in float64
(log-probs, gradients), PEFT's own adapter loader (LoRA weights), a hand-written float64 AdamW,
and numpy versions of the loss formulas (ALGORITHMS.md section 1). Backend internals
(`core._base_slot(...).group._slots[...]`) are read only to capture parameters and gradients.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import re
import time

import numpy as np
import pytest
import torch
from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture
from transformers import AutoModelForCausalLM, AutoTokenizer

from skyrl_trainer.backend.clients import ServiceClient, TrainingClient
from skyrl_trainer.backend.config import BackendConfig, TrainingConfig
from skyrl_trainer.backend.core import BackendCore
from skyrl_trainer.backend.losses import get_loss, resolve_loss_config

LORA_LR = 1e-2


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers


def make_core(tmp_path_factory, **training) -> BackendCore:
    storage = tmp_path_factory.mktemp("storage")
    return BackendCore(
        BackendConfig(
            storage_dir=str(storage), training=TrainingConfig(dtype="float32", **training)
        )
    )


@pytest.fixture(scope="module")
def core(tmp_path_factory) -> BackendCore:
    core = make_core(tmp_path_factory)
    yield core
    core.shutdown()


def lora(sc: ServiceClient, model_dir, seed: int = 0, rank: int = 8, **kw) -> TrainingClient:
    return sc.create_lora_training_client(str(model_dir), rank=rank, seed=seed, **kw).result()


def make_data(
    vocab: int, n: int, seed: int, lo: int = 3, hi: int = 24, zero_frac: float = 0.25
) -> list[types.Datum]:
    """`n` cross_entropy datums of random lengths in [lo, hi), random ids, random weights
    (some exactly 0, like prompt positions)."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n):
        length = int(rng.integers(lo, hi))
        seq = rng.integers(0, vocab, size=length + 1)
        weights = rng.uniform(0.1, 1.5, size=length).astype(np.float32)
        weights[rng.uniform(size=length) < zero_frac] = 0.0
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": seq[1:].tolist(),
                    "weights": weights.tolist(),
                },
            )
        )
    return data


def text_data(tokenizer, texts: list[str]) -> list[types.Datum]:
    data = []
    for text in texts:
        ids = tokenizer.encode(text)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return data


def worker(core: BackendCore, tc: TrainingClient):
    group = core._base_slot(core.model(tc.model_id).base_model).group
    assert group is not None
    return group


def slot(core: BackendCore, tc: TrainingClient):
    return worker(core, tc)._slots[tc.model_id]


def params(core: BackendCore, tc: TrainingClient) -> list[torch.Tensor]:
    """The model's trainable parameters, in their stable order, as float64 copies."""
    return [p.detach().double().clone() for p in slot(core, tc).params]


def grads(core: BackendCore, tc: TrainingClient) -> list[torch.Tensor]:
    """The accumulated gradients (zeros where none), as float64 copies."""
    return [
        torch.zeros(p.shape, dtype=torch.float64) if p.grad is None else p.grad.double().clone()
        for p in slot(core, tc).params
    ]


def logprobs(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy().astype(np.float64) for o in out.loss_fn_outputs]


def assert_tensors_close(a, b, rtol=1e-5, atol=1e-7, msg=""):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m, i=i: f"{msg}[{i}] {m}")


def assert_grads_close(a, b, rel=1e-5, msg="grads"):
    """Elementwise close, with an absolute tolerance relative to each tensor's largest entry
    (float32 sums in a different order differ by ~1e-7 of the scale)."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        atol = rel * float(y.abs().max()) + 1e-12
        torch.testing.assert_close(x, y, rtol=rel, atol=atol, msg=lambda m, i=i: f"{msg}[{i}] {m}")


def max_abs_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def adam(lr=1e-3, **kw) -> types.AdamParams:
    return types.AdamParams(learning_rate=lr, **kw)


def train_step(tc: TrainingClient, data, lr=LORA_LR, **kw) -> float:
    loss = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(adam(lr, **kw)).result()
    return loss


def reference_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64)
    model.eval()
    return model


def reference_logprobs(model, datum: types.Datum) -> torch.Tensor:
    """log_softmax of a plain transformers forward, gathered at the targets (model's dtype)."""
    ids = torch.tensor([datum.model_input.to_ints()])
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
    logits = model(input_ids=ids).logits[0]
    return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]


# ---------------------------------------------------------------------------------------------
# Loss semantics and exactness


def test_one_request_equals_two_accumulated_requests(sc, core, tiny_model_dir, vocab):
    data = make_data(vocab, 8, seed=1)
    one, two = lora(sc, tiny_model_dir), lora(sc, tiny_model_dir)
    assert_tensors_close(params(core, one), params(core, two), rtol=0, atol=0)
    # A first step so that lora_A's gradients are nonzero too (lora_B starts at 0).
    train_step(one, data)
    train_step(two, data)

    full_loss = one.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    loss_a = two.forward_backward(data[:4], "cross_entropy").result().metrics["loss:sum"]
    loss_b = two.forward_backward(data[4:], "cross_entropy").result().metrics["loss:sum"]
    assert full_loss == pytest.approx(loss_a + loss_b, rel=1e-5)
    g_one, g_two = grads(core, one), grads(core, two)
    assert max(float(g.abs().max()) for g in g_one) > 0
    assert_grads_close(g_one, g_two)

    # A first Adam step is lr * g / (|g| + eps): a large eps keeps it a smooth function of g, so
    # float noise in g (one request vs two accumulated) stays far below the tolerance.
    eps = 1e-4
    one.optim_step(adam(LORA_LR, eps=eps)).result()
    two.optim_step(adam(LORA_LR, eps=eps)).result()
    assert_tensors_close(params(core, one), params(core, two), rtol=1e-5, atol=1e-6)


def test_micro_batching_does_not_change_results(tmp_path_factory, tiny_model_dir, vocab):
    data = make_data(vocab, 7, seed=2, lo=1, hi=40)
    results = []
    for training in (
        dict(micro_batch_tokens=16, logprob_chunk_tokens=5),  # ~1 row per micro-batch
        dict(micro_batch_tokens=10**6, logprob_chunk_tokens=10**6),  # one micro-batch
    ):
        core = make_core(tmp_path_factory, **training)
        try:
            tc = lora(ServiceClient(core=core), tiny_model_dir, seed=3)
            train_step(tc, data)  # makes lora_B nonzero
            out = tc.forward_backward(data, "cross_entropy").result()
            results.append((out, grads(core, tc)))
        finally:
            core.shutdown()
    (small, g_small), (big, g_big) = results
    assert small.metrics["loss:sum"] == pytest.approx(big.metrics["loss:sum"], rel=1e-5)
    for a, b in zip(logprobs(small), logprobs(big), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert_grads_close(g_small, g_big, rel=1e-4)


def test_logprobs_loss_and_grads_match_plain_transformers(sc, core, tiny_model_dir, vocab):
    """Full fine-tuning at step 0 is the base model: compare with a float64 HF forward."""
    data = make_data(vocab, 5, seed=4, lo=2, hi=30)
    tc = sc.create_full_training_client(str(tiny_model_dir)).result()
    out = tc.forward_backward(data, "cross_entropy").result()

    ref = reference_model(tiny_model_dir)
    ref_loss = torch.zeros((), dtype=torch.float64)
    for datum, got in zip(data, logprobs(out), strict=True):
        assert got.shape == (datum.model_input.length,)
        want = reference_logprobs(ref, datum)
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=0, atol=2e-5)
        weights = torch.tensor(datum.loss_fn_inputs["weights"].data, dtype=torch.float64)
        ref_loss = ref_loss - (want * weights).sum()
    ref_loss.backward()

    # loss:sum is sum(-lp * w) over every token of every datum (by hand, on returned lps).
    by_hand = sum(
        float(-(lp * np.asarray(d.loss_fn_inputs["weights"].data, np.float64)).sum())
        for lp, d in zip(logprobs(out), data, strict=True)
    )
    assert out.metrics["loss:sum"] == pytest.approx(by_hand, rel=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(ref_loss.item(), rel=1e-5)

    ref_grads = dict(ref.named_parameters())
    got = dict(zip([n for n, _ in slot(core, tc).named_params], grads(core, tc), strict=True))
    assert set(got) == set(ref_grads)
    for name, g in got.items():
        want = ref_grads[name].grad
        scale = float(want.abs().max())
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_lora_logprobs_match_peft_loading_the_saved_adapter(sc, core, tiny_model_dir, vocab):
    """After training, the LoRA model equals PEFT's own loading of the saved adapter folder
    (alpha/rank scale, targets incl. the tied lm_head, file names)."""
    from peft import PeftModel

    data = make_data(vocab, 4, seed=5)
    tc = lora(sc, tiny_model_dir, seed=6)
    for _ in range(3):
        train_step(tc, data, lr=3e-2)
    path = tc.save_state("peft_check").result().path
    folder, _ = core.store.resolve(path)
    got = logprobs(tc.forward(data, "cross_entropy").result())

    base = reference_model(tiny_model_dir)
    base_lps = [reference_logprobs(base, d).detach().numpy() for d in data]
    peft_model = PeftModel.from_pretrained(base, str(folder)).double().eval()
    for datum, lp, base_lp in zip(data, got, base_lps, strict=True):
        want = reference_logprobs(peft_model, datum).detach().numpy()
        assert np.abs(want - base_lp).max() > 1e-3  # the adapter does change the model
        np.testing.assert_allclose(lp, want, rtol=0, atol=5e-5)


def test_loss_is_a_sum_over_datums_and_tokens(sc, core, tiny_model_dir, vocab):
    data = make_data(vocab, 3, seed=7)
    tc = lora(sc, tiny_model_dir)
    single = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    doubled = tc.forward(data + data, "cross_entropy").result().metrics["loss:sum"]
    assert doubled == pytest.approx(2 * single, rel=1e-5)
    # Doubling every weight doubles the loss too (no normalisation by weight sum or tokens).
    twice = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": [2 * w for w in d.loss_fn_inputs["weights"].data],
            },
        )
        for d in data
    ]
    assert tc.forward(twice, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        2 * single, rel=1e-5
    )
    # And gradients: twice the data, twice the gradient.
    tc.forward_backward(data, "cross_entropy").result()
    g1 = grads(core, tc)
    tc.optim_step(adam(0.0)).result()  # lr 0: clears gradients, leaves the weights
    tc.forward_backward(data + data, "cross_entropy").result()
    assert_grads_close(grads(core, tc), [2 * g for g in g1])


def test_forward_does_not_accumulate_gradients(sc, core, tiny_model_dir, vocab):
    data = make_data(vocab, 3, seed=8)
    a, b = lora(sc, tiny_model_dir, seed=9), lora(sc, tiny_model_dir, seed=9)
    a.forward_backward(data, "cross_entropy").result()
    a.forward(data, "cross_entropy").result()
    a.forward(data[:1], "cross_entropy").result()
    b.forward_backward(data, "cross_entropy").result()
    assert_tensors_close(grads(core, a), grads(core, b), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The optimizer


class ReferenceAdamW:
    """AdamW written out in float64 (Loshchilov & Hutter; Tinker's AdamParams semantics):
    global-norm clipping, m/v moments with bias correction by the CURRENT betas, decoupled
    weight decay `p -= lr * wd * p`, update `lr * m_hat / (sqrt(v_hat) + eps)`."""

    def __init__(self, shapes):
        self.m = [torch.zeros(s, dtype=torch.float64) for s in shapes]
        self.v = [torch.zeros(s, dtype=torch.float64) for s in shapes]
        self.t = 0

    def step(self, ps, gs, hp: types.AdamParams):
        norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
        scale = 1.0
        if hp.grad_clip_norm > 0:
            scale = min(1.0, hp.grad_clip_norm / (norm + 1e-6))
        self.t += 1
        bc1 = 1 - hp.beta1**self.t
        bc2 = 1 - hp.beta2**self.t
        out = []
        for i, (p, g) in enumerate(zip(ps, gs, strict=True)):
            g = g * scale
            self.m[i] = hp.beta1 * self.m[i] + (1 - hp.beta1) * g
            self.v[i] = hp.beta2 * self.v[i] + (1 - hp.beta2) * g * g
            m_hat, v_hat = self.m[i] / bc1, self.v[i] / bc2
            p = p - hp.learning_rate * hp.weight_decay * p
            out.append(p - hp.learning_rate * m_hat / (v_hat.sqrt() + hp.eps))
        return out, norm


def test_optim_step_matches_hand_written_adamw(sc, core, tiny_model_dir, vocab):
    tc = sc.create_full_training_client(str(tiny_model_dir)).result()
    data = make_data(vocab, 4, seed=10)
    ref = ReferenceAdamW([p.shape for p in params(core, tc)])
    steps = [
        dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0),
        dict(learning_rate=5e-4, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
        dict(learning_rate=2e-3, beta1=0.95, beta2=0.9, eps=1e-10, weight_decay=0.01),
        dict(learning_rate=1e-3, beta1=0.5, beta2=0.999, eps=1e-7, weight_decay=0.3),
    ]
    clip_factor = [0.0, 0.5, 10.0, 0.25]  # x pre-clip norm; 0 = no clipping
    for step, (hp_kw, clip) in enumerate(zip(steps, clip_factor, strict=True)):
        # Two requests accumulate into one step.
        tc.forward_backward(data[:2], "cross_entropy").result()
        tc.forward_backward(data[1:], "cross_entropy").result()
        before, g = params(core, tc), grads(core, tc)
        norm = math.sqrt(sum(float((x * x).sum()) for x in g))
        hp = types.AdamParams(**hp_kw, grad_clip_norm=clip * norm)
        want, ref_norm = ref.step(before, g, hp)
        metrics = tc.optim_step(hp).result().metrics
        assert metrics["grad_norm:mean"] == pytest.approx(ref_norm, rel=1e-4), step
        after = params(core, tc)
        for i, (a, w, b) in enumerate(zip(after, want, before, strict=True)):
            # Compare the updates (after - before): tolerance relative to the learning rate,
            # plus the float32 rounding of the stored parameter itself.
            atol = 1e-4 * hp.learning_rate + 2.0**-23 * float(b.abs().max())
            torch.testing.assert_close(
                a - b, w - b, rtol=1e-4, atol=atol, msg=lambda m, s=step, i=i: f"step {s} p{i}: {m}"
            )
        assert max_abs_diff(after, before) > 0.5 * hp.learning_rate
        # The step consumed the gradients.
        assert all(p.grad is None or not p.grad.any() for p in slot(core, tc).params)


def test_nonfinite_gradients_skip_the_step(sc, core, tiny_model_dir, vocab):
    """An overflowing ratio gives inf/NaN gradients: the step is skipped and reported, the
    weights and the optimizer state stay as they were."""
    data = make_data(vocab, 2, seed=11)
    tc, ref = lora(sc, tiny_model_dir, seed=12), lora(sc, tiny_model_dir, seed=12)
    train_step(tc, data)
    train_step(ref, data)
    before = params(core, tc)
    n = data[0].model_input.length
    bad = types.Datum(
        model_input=data[0].model_input,
        loss_fn_inputs={
            "target_tokens": data[0].loss_fn_inputs["target_tokens"],
            "logprobs": [-1e4] * n,
            "advantages": [1.0] * n,
        },
    )
    tc.forward_backward([bad], "importance_sampling").result()
    metrics = tc.optim_step(adam(LORA_LR)).result().metrics
    assert metrics.get("skipped_nonfinite_step:sum") == 1.0
    assert not math.isfinite(metrics["grad_norm:mean"])
    assert_tensors_close(params(core, tc), before, rtol=0, atol=0)
    # The next good step is exactly the reference's second step (no Adam count consumed).
    train_step(tc, data)
    train_step(ref, data)
    assert_tensors_close(params(core, tc), params(core, ref), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Checkpoints


def test_save_and_resume(sc, core, tiny_model_dir, vocab):
    data = make_data(vocab, 4, seed=13)
    hp = dict(lr=2e-2, beta1=0.9, beta2=0.99, eps=1e-8)
    run = lora(sc, tiny_model_dir, seed=14)
    for _ in range(2):
        train_step(run, data, **hp)
    saved = params(core, run)
    path = run.save_state("mid").result().path
    assert path == f"tinker://{run.model_id}/weights/mid"
    assert re.fullmatch(r"tinker://[^/]+:train:\d+/weights/mid", path)
    train_step(run, data, **hp)
    uninterrupted = params(core, run)

    # create_training_client_from_state_with_optimizer: same next step.
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id != run.model_id
    info = resumed.get_info()
    assert info.is_lora and info.lora_rank == 8
    assert_tensors_close(params(core, resumed), saved, rtol=0, atol=0)
    train_step(resumed, data, **hp)
    assert_tensors_close(params(core, resumed), uninterrupted, rtol=1e-6, atol=1e-7)

    # create_training_client_from_state: same weights, fresh optimizer, different next step.
    fresh = sc.create_training_client_from_state(path).result()
    assert_tensors_close(params(core, fresh), saved, rtol=0, atol=0)
    train_step(fresh, data, **hp)
    fresh_step = params(core, fresh)
    assert max_abs_diff(fresh_step, uninterrupted) > 1e-3

    # load_state_with_optimizer / load_state on an existing client (trained elsewhere first).
    other = lora(sc, tiny_model_dir, seed=15)
    train_step(other, data[:2], **hp)
    other.load_state_with_optimizer(path).result()
    assert_tensors_close(params(core, other), saved, rtol=0, atol=0)
    train_step(other, data, **hp)
    assert_tensors_close(params(core, other), uninterrupted, rtol=1e-6, atol=1e-7)

    response = other.load_state(path).result()
    assert response.path == path
    assert_tensors_close(params(core, other), saved, rtol=0, atol=0)
    train_step(other, data, **hp)
    assert_tensors_close(params(core, other), fresh_step, rtol=1e-6, atol=1e-7)
    assert max_abs_diff(params(core, other), uninterrupted) > 1e-3


def test_save_state_metadata_and_ttl(sc, core, tiny_model_dir):
    tc = lora(sc, tiny_model_dir, seed=34, rank=4)
    before = time.time()
    path = tc.save_state("with_ttl", ttl_seconds=3600, user_metadata={"step": "7"}).result().path
    folder, meta = core.store.resolve(path)
    assert before + 3600 <= meta.expires_at <= time.time() + 3600
    assert meta.user_metadata == {"step": "7"}
    assert meta.is_lora and meta.lora_rank == 4 and meta.has_optimizer
    assert meta.model_id == tc.model_id
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    forever = tc.save_state("no_ttl").result().path
    assert core.store.resolve(forever)[1].expires_at is None


def test_checkpoint_of_a_model_created_by_relative_path(
    sc, core, tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(tiny_model_dir.parent)
    tc = sc.create_lora_training_client(tiny_model_dir.name, rank=8, seed=35).result()
    path = tc.save_state("relative").result().path
    monkeypatch.chdir(tmp_path)
    resumed = sc.create_training_client_from_state(path).result()
    assert_tensors_close(params(core, resumed), params(core, tc), rtol=0, atol=0)


def test_full_finetuning_save_and_resume(sc, core, tiny_model_dir, vocab):
    data = make_data(vocab, 3, seed=16)
    run = sc.create_full_training_client(str(tiny_model_dir)).result()
    train_step(run, data, lr=1e-3)
    path = run.save_state("full").result().path
    saved = params(core, run)
    train_step(run, data, lr=1e-3)
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    assert not resumed.get_info().is_lora
    assert_tensors_close(params(core, resumed), saved, rtol=0, atol=0)
    train_step(resumed, data, lr=1e-3)
    assert_tensors_close(params(core, resumed), params(core, run), rtol=1e-6, atol=1e-7)
    # The checkpoint folder is a plain Hugging Face model folder with the trained weights.
    folder, _ = core.store.resolve(path)
    hf = reference_model(folder)
    got = logprobs(resumed.forward(data, "cross_entropy").result())
    got_saved = logprobs(
        sc.create_training_client_from_state(path).result().forward(data, "cross_entropy").result()
    )
    for d, lp in zip(data, got_saved, strict=True):
        np.testing.assert_allclose(lp, reference_logprobs(hf, d).detach().numpy(), atol=2e-5)
    assert max(np.abs(a - b).max() for a, b in zip(got, got_saved, strict=True)) > 1e-4


# ---------------------------------------------------------------------------------------------
# Several models on one base


def test_multi_lora_isolation_and_shared_base(sc, core, tiny_model_dir, vocab):
    data = make_data(vocab, 3, seed=17)
    a = lora(sc, tiny_model_dir, seed=18)
    b = lora(sc, tiny_model_dir, seed=19, rank=4, train_mlp=False)
    train_step(b, data)  # b is not at its initial (= base) state
    b_before = logprobs(b.forward(data, "cross_entropy").result())
    a_before = logprobs(a.forward(data, "cross_entropy").result())
    b_params = params(core, b)

    # b accumulates a gradient, then a trains hard, then b steps: b's step is unaffected.
    b.forward_backward(data, "cross_entropy").result()
    b_grads = grads(core, b)
    for _ in range(4):
        train_step(a, data, lr=0.1)
    assert_tensors_close(grads(core, b), b_grads, rtol=0, atol=0)
    assert_tensors_close(params(core, b), b_params, rtol=0, atol=0)
    b_after = logprobs(b.forward(data, "cross_entropy").result())
    for x, y in zip(b_before, b_after, strict=True):
        np.testing.assert_array_equal(x, y)  # bit-identical
    a_after = logprobs(a.forward(data, "cross_entropy").result())
    assert max(np.abs(x - y).max() for x, y in zip(a_before, a_after, strict=True)) > 0.1
    # b's step equals that of a twin that never shared the base with a training neighbour.
    twin = lora(sc, tiny_model_dir, seed=19, rank=4, train_mlp=False)
    train_step(twin, data)
    twin.forward_backward(data, "cross_entropy").result()
    b.optim_step(adam(LORA_LR)).result()
    twin.optim_step(adam(LORA_LR)).result()
    assert_tensors_close(params(core, b), params(core, twin), rtol=0, atol=0)

    # One base in memory: both adapters run on the same model and base weight storage.
    slot_a, slot_b = slot(core, a), slot(core, b)
    assert slot_a.hf_model is slot_b.hf_model
    weight_a = slot_a.hf_model.get_decoder().layers[0].self_attn.q_proj.base_layer.weight
    weight_b = slot_b.hf_model.get_decoder().layers[0].self_attn.q_proj.base_layer.weight
    assert weight_a.data_ptr() == weight_b.data_ptr()
    assert not weight_a.requires_grad
    # The shared base itself never changed: it still equals the checkpoint on disk.
    ref = reference_model(tiny_model_dir)
    ref_q = ref.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(weight_a.double(), ref_q, rtol=0, atol=0)
    # Adapter parameters are disjoint.
    ids_a = {id(p) for p in slot_a.params}
    assert ids_a.isdisjoint(id(p) for p in slot_b.params)


def test_full_finetuning_does_not_touch_lora_models(sc, core, tiny_model_dir, vocab):
    data = make_data(vocab, 2, seed=20)
    a = lora(sc, tiny_model_dir, seed=21)
    train_step(a, data)
    before = logprobs(a.forward(data, "cross_entropy").result())
    full = sc.create_full_training_client(str(tiny_model_dir)).result()
    for _ in range(2):
        train_step(full, data, lr=1e-2)
    after = logprobs(a.forward(data, "cross_entropy").result())
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)
    full_q = slot(core, full).hf_model.get_decoder().layers[0].self_attn.q_proj.weight
    base_q = slot(core, a).hf_model.get_decoder().layers[0].self_attn.q_proj.base_layer.weight
    assert full_q.data_ptr() != base_q.data_ptr()


MEMORISE = [
    "The quick brown fox jumps over the lazy dog.",
    "Tinker is a training API: forward_backward, then optim_step.",
]


@pytest.mark.parametrize(("kind", "lr", "max_ratio"), [("lora", 1e-2, 0.35), ("full", 3e-3, 0.5)])
def test_learns_to_memorise(sc, tiny_model_dir, tokenizer, kind, lr, max_ratio):
    data = text_data(tokenizer, MEMORISE)
    if kind == "lora":
        tc = lora(sc, tiny_model_dir, seed=22)
    else:
        tc = sc.create_full_training_client(str(tiny_model_dir)).result()
    losses = [train_step(tc, data, lr=lr) for _ in range(20)]
    final = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert final < max_ratio * losses[0], (kind, losses, final)
    assert all(math.isfinite(x) for x in losses)


# ---------------------------------------------------------------------------------------------
# forward_backward_custom


def _ce_custom(data, lps):
    loss = sum(
        (-lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum()
        for d, lp in zip(data, lps, strict=True)
    )
    return loss, {"custom_metric:mean": 3.5}


def test_custom_loss_equals_cross_entropy(sc, core, tiny_model_dir, vocab):
    data = make_data(vocab, 4, seed=23)
    custom, builtin = lora(sc, tiny_model_dir, seed=24), lora(sc, tiny_model_dir, seed=24)
    train_step(custom, data)
    train_step(builtin, data)

    out_c = custom.forward_backward_custom(data, _ce_custom).result()
    out_b = builtin.forward_backward(data, "cross_entropy").result()
    assert out_c.metrics["custom_metric:mean"] == 3.5
    assert out_c.metrics["loss:sum"] == pytest.approx(out_b.metrics["loss:sum"], rel=1e-5)
    # The surrogate's weights are -dloss/dlp = w, so the surrogate equals the loss here.
    assert out_c.metrics["surrogate_loss:sum"] == pytest.approx(out_b.metrics["loss:sum"], 1e-5)
    for x, y in zip(logprobs(out_c), logprobs(out_b), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    assert_grads_close(grads(core, custom), grads(core, builtin))

    # Submitted without waiting: the optim step must include the custom gradients.
    custom.optim_step(adam(LORA_LR)).result()
    builtin.optim_step(adam(LORA_LR)).result()
    assert_tensors_close(params(core, custom), params(core, builtin), rtol=1e-5, atol=1e-7)


def test_custom_loss_nonlinear_gradient_and_ordering(sc, core, tiny_model_dir, vocab):
    """loss = sum((lp - c)^2): gradient 2(lp - c), surrogate weights -2(lp - c)."""
    data = make_data(vocab, 3, seed=25)
    custom, builtin = lora(sc, tiny_model_dir, seed=26), lora(sc, tiny_model_dir, seed=26)
    c = -5.0

    def square(batch, lps):
        return sum(((lp - c) ** 2).sum() for lp in lps), {"n:sum": float(len(lps))}

    lps = logprobs(builtin.forward(data, "cross_entropy").result())
    # Submit the custom request and the step back to back, without waiting.
    fut = custom.forward_backward_custom(data, square)
    step = custom.optim_step(adam(LORA_LR))
    out = fut.result()
    step.result()

    want_loss = sum(float(((lp - c) ** 2).sum()) for lp in lps)
    assert out.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5)
    assert out.metrics["n:sum"] == 3.0
    surrogate = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": (-2 * (lp - c)).astype(np.float32).tolist(),
            },
        )
        for d, lp in zip(data, lps, strict=True)
    ]
    sur_loss = sum(float((-lp * (-2 * (lp - c))).sum()) for lp in lps)
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(sur_loss, rel=1e-4)
    builtin.forward_backward(surrogate, "cross_entropy").result()
    builtin.optim_step(adam(LORA_LR)).result()
    assert_tensors_close(params(core, custom), params(core, builtin), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Futures and ordering


def test_futures_sync_and_async(sc, tiny_model_dir, vocab):
    data = make_data(vocab, 2, seed=27)
    creating = sc.create_lora_training_client(str(tiny_model_dir), rank=8, seed=28)
    assert isinstance(creating, APIFuture)
    with pytest.warns(FutureWarning):
        model_id = creating.model_id  # the future also works as the client (deprecated)
    with pytest.warns(FutureWarning):
        via_future = creating.forward(data, "cross_entropy").result()
    tc = creating.result(timeout=60)
    assert isinstance(tc, TrainingClient) and tc.model_id == model_id

    fut = tc.forward(data, "cross_entropy")
    assert isinstance(fut, APIFuture)
    assert isinstance(fut.future(), concurrent.futures.Future)
    sync = fut.result()
    assert sync.metrics == via_future.metrics
    assert isinstance(sync, types.ForwardBackwardOutput)
    assert sync.loss_fn_output_type
    assert sync.loss_fn_outputs[0]["logprobs"].dtype == "float32"

    async def main():
        awaited = await tc.forward(data, "cross_entropy")
        via_result_async = await tc.forward(data, "cross_entropy").result_async()
        via_coroutine = await tc.forward(data, "cross_entropy").coroutine()
        inner = await tc.forward_backward_async(data, "cross_entropy")
        assert isinstance(inner, APIFuture)
        fb = await inner
        step = await (await tc.optim_step_async(adam(LORA_LR)))
        assert isinstance(step, types.OptimStepResponse)
        after = await (await tc.forward_async(data, "cross_entropy"))
        client = await sc.create_lora_training_client_async(str(tiny_model_dir), rank=8, seed=28)
        assert isinstance(client, TrainingClient)
        awaited_client = await sc.create_lora_training_client(str(tiny_model_dir), rank=4)
        assert isinstance(awaited_client, TrainingClient)
        info = await client.get_info_async()
        with pytest.raises(ValueError):
            await tc.forward_backward([], "cross_entropy")
        return awaited, via_result_async, via_coroutine, fb, after, info

    awaited, via_result_async, via_coroutine, fb, after, info = asyncio.run(main())
    for r in (awaited, via_result_async, via_coroutine, fb):
        assert r.metrics["loss:sum"] == pytest.approx(sync.metrics["loss:sum"], rel=1e-6)
    assert after.metrics["loss:sum"] < sync.metrics["loss:sum"]
    assert info.is_lora and info.lora_rank == 8


def test_responses_follow_the_protocol(sc, tiny_model_dir, vocab):
    """Metric keys are `name:reduction` with exactly one colon (the SDK splits on it); every
    datum gets float32 logprobs of shape (N,); optim_step also takes `adam_params=`."""
    data = make_data(vocab, 3, seed=36)
    tc = lora(sc, tiny_model_dir, seed=37)
    outputs = [
        tc.forward(data, "cross_entropy").result(),
        tc.forward_backward(data, "cross_entropy").result(),
        tc.forward_backward_custom(data, _ce_custom).result(),
    ]
    step = tc.optim_step(adam_params=adam(LORA_LR)).result()
    for metrics in [o.metrics for o in outputs] + [step.metrics]:
        assert metrics
        for key, value in metrics.items():
            assert key.count(":") == 1, key
            assert isinstance(value, float | int)
    for out in outputs:
        assert len(out.loss_fn_outputs) == len(data)
        for o, d in zip(out.loss_fn_outputs, data, strict=True):
            td = o["logprobs"]
            assert td.dtype == "float32"
            assert list(td.to_numpy().shape) == [d.model_input.length]
            assert (td.to_numpy() <= 0).all()


def test_closed_session_keeps_its_models(core, tiny_model_dir, vocab):
    sc = ServiceClient(core=core)
    with sc:
        tc = lora(sc, tiny_model_dir, seed=38)
    data = make_data(vocab, 2, seed=39)
    train_step(tc, data)  # still usable after close()
    with pytest.raises(ValueError):
        sc.create_lora_training_client(str(tiny_model_dir)).result()


def test_requests_run_in_submission_order(sc, core, tiny_model_dir, vocab):
    data = make_data(vocab, 3, seed=29)
    queued, waited = lora(sc, tiny_model_dir, seed=30), lora(sc, tiny_model_dir, seed=30)

    futures = [
        queued.forward(data, "cross_entropy"),
        queued.forward_backward(data, "cross_entropy"),
        queued.optim_step(adam(LORA_LR)),
        queued.forward_backward(data, "cross_entropy"),
        queued.optim_step(adam(LORA_LR / 2)),
        queued.forward(data, "cross_entropy"),
    ]
    results = [f.result() for f in futures]

    w0 = waited.forward(data, "cross_entropy").result()
    w1 = waited.forward_backward(data, "cross_entropy").result()
    waited.optim_step(adam(LORA_LR)).result()
    w3 = waited.forward_backward(data, "cross_entropy").result()
    waited.optim_step(adam(LORA_LR / 2)).result()
    w5 = waited.forward(data, "cross_entropy").result()

    for got, want in zip([results[i] for i in (0, 1, 3, 5)], [w0, w1, w3, w5], strict=True):
        assert got.metrics["loss:sum"] == want.metrics["loss:sum"]
    assert results[0].metrics["loss:sum"] == results[1].metrics["loss:sum"]
    assert results[3].metrics["loss:sum"] < results[1].metrics["loss:sum"]
    assert_tensors_close(params(core, queued), params(core, waited), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Every built-in loss, end to end


def _np_loss(name: str, lp, inputs, config) -> float:
    """The ALGORITHMS.md section 1 formulas in numpy float64 (values only)."""
    if name == "cross_entropy":
        return float(-(lp * inputs["weights"]).sum())
    slp, adv = inputs["logprobs"], inputs["advantages"]
    ratio = np.exp(lp - slp)
    # Per-token thresholds (loss_fn_inputs) override the config's scalars.
    lo = inputs.get("clip_low_threshold", config.get("clip_low_threshold", 0.8))
    hi = inputs.get("clip_high_threshold", config.get("clip_high_threshold", 1.2))
    if name == "importance_sampling":
        return float(-(ratio * adv).sum())
    if name == "ppo":
        return float(-np.minimum(ratio * adv, np.clip(ratio, lo, hi) * adv).sum())
    if name == "cispo":
        return float(-(np.clip(ratio, lo, hi) * lp * adv).sum())
    if name == "dro":
        beta = config.get("beta", 0.05)
        return float(-(lp * adv - 0.5 * beta * (lp - slp) ** 2).sum())
    if name == "gspo":
        mask = inputs["sequence_ratio_mask"] != 0
        seq_ratio = np.exp((lp - slp)[mask].mean())
        return float(-np.minimum(seq_ratio * adv, np.clip(seq_ratio, lo, hi) * adv).sum())
    raise AssertionError(name)


LOSS_CASES = [
    ("cross_entropy", None),
    ("importance_sampling", None),
    ("ppo", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", None),
    ("cispo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),
    ("dro", None),
    ("dro", {"beta": 0.5}),
    ("gspo", None),
    ("gspo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}),
    ("ppo", "per-token"),
    ("cispo", "per-token"),
]


@pytest.mark.parametrize(("loss_fn", "config"), LOSS_CASES)
def test_every_loss_end_to_end(sc, core, tiny_model_dir, vocab, loss_fn, config):
    base = make_data(vocab, 3, seed=31)
    tc = lora(sc, tiny_model_dir, seed=32)
    current = logprobs(tc.forward(base, "cross_entropy").result())
    rng = np.random.default_rng(33)
    data, np_inputs = [], []
    for d, lp in zip(base, current, strict=True):
        n = len(lp)
        # Ratios spread over [0.7, 1.3]: inside and outside every clip range above.
        log_ratio = np.log(rng.uniform(0.7, 1.3, size=n))
        inputs = {
            "target_tokens": np.asarray(d.loss_fn_inputs["target_tokens"].data),
            "weights": np.asarray(d.loss_fn_inputs["weights"].data, np.float32),
            "logprobs": (lp - log_ratio).astype(np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
            "sequence_ratio_mask": (rng.uniform(size=n) < 0.7).astype(np.float32),
        }
        inputs["sequence_ratio_mask"][0] = 1.0
        keys = ["target_tokens", *get_loss(loss_fn).required_inputs]
        if config == "per-token":
            inputs["clip_low_threshold"] = rng.uniform(0.75, 0.95, size=n).astype(np.float32)
            inputs["clip_high_threshold"] = rng.uniform(1.05, 1.25, size=n).astype(np.float32)
            keys += ["clip_low_threshold", "clip_high_threshold"]
        np_inputs.append({k: inputs[k] for k in keys})  # what the datum carries
        data.append(
            types.Datum(
                model_input=d.model_input,
                loss_fn_inputs={k: types.TensorData.from_numpy(inputs[k]) for k in keys},
            )
        )
    per_token = config == "per-token"
    if per_token:
        config = None
    out = tc.forward_backward(data, loss_fn, config).result()
    got_lps = logprobs(out)
    for lp, want in zip(got_lps, current, strict=True):
        np.testing.assert_allclose(lp, want, rtol=0, atol=1e-6)

    spec = get_loss(loss_fn)
    resolved = resolve_loss_config(spec, config)
    via_module = sum(
        float(
            spec.fn(
                torch.tensor(lp),
                {k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()},
                resolved,
            )
        )
        for lp, inputs in zip(got_lps, np_inputs, strict=True)
    )
    via_numpy = sum(
        _np_loss(loss_fn, lp, {k: np.asarray(v, np.float64) for k, v in inputs.items()}, resolved)
        for lp, inputs in zip(got_lps, np_inputs, strict=True)
    )
    assert out.metrics["loss:sum"] == pytest.approx(via_module, rel=1e-5, abs=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(via_numpy, rel=1e-5, abs=1e-5)
    if config or per_token:  # the config / per-token thresholds are applied: defaults differ
        clip_keys = ("clip_low_threshold", "clip_high_threshold")
        default = sum(
            _np_loss(
                loss_fn,
                lp,
                {k: np.asarray(v, np.float64) for k, v in i.items() if k not in clip_keys},
                {},
            )
            for lp, i in zip(got_lps, np_inputs, strict=True)
        )
        assert abs(default - via_numpy) > 1e-3
    g = grads(core, tc)
    assert all(torch.isfinite(x).all() for x in g)
    assert max(float(x.abs().max()) for x in g) > 0


# ---------------------------------------------------------------------------------------------
# Info


def test_get_info_tokenizer_and_capabilities(sc, tiny_model_dir, tokenizer):
    tc = lora(sc, tiny_model_dir, rank=4)
    info = tc.get_info()
    assert info.model_id == tc.model_id
    assert re.fullmatch(rf"{sc.session_id}:train:\d+", info.model_id)
    assert info.is_lora is True and info.lora_rank == 4
    assert info.model_data.arch == "LlamaForCausalLM"
    text = "Hello, tinker! 12345"
    loaded = AutoTokenizer.from_pretrained(info.model_data.tokenizer_id)
    assert loaded.encode(text) == tokenizer.encode(text)
    assert tc.get_tokenizer().encode(text) == tokenizer.encode(text)

    full = sc.create_full_training_client(str(tiny_model_dir)).result()
    full_info = full.get_info()
    assert full_info.is_lora is False and full_info.lora_rank is None
    assert full_info.model_id != info.model_id

    caps = sc.get_server_capabilities()
    assert isinstance(caps, types.GetServerCapabilitiesResponse)
    assert "SmolLM2-135M-Instruct" in [m.model_name for m in caps.supported_models]
    assert all(m.trainable and m.sampleable for m in caps.supported_models)
    assert asyncio.run(sc.get_server_capabilities_async()) == caps


# ---------------------------------------------------------------------------------------------
# Realism: the real SmolLM2-135M with the default (bfloat16) configuration


def test_real_model_default_dtype(tmp_path_factory, smollm2_dir, tokenizer):
    """Default TrainingConfig (bf16 base + autocast): the log-probs are a bf16 approximation of
    a float32 HF forward, the model finds the obvious answer likely, and LoRA training works."""
    storage = tmp_path_factory.mktemp("real_storage")
    core = BackendCore(BackendConfig(storage_dir=str(storage)))
    try:
        sc = ServiceClient(core=core)
        tc = lora(sc, smollm2_dir, seed=0)
        messages = [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
        ]
        prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        full = full if isinstance(full, list) else full["input_ids"]
        assert full[: len(prompt)] == prompt
        n = len(full) - 1
        weights = [0.0] * (len(prompt) - 1) + [1.0] * (n - len(prompt) + 1)
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
            )
        ]
        out = tc.forward(data, "cross_entropy").result()
        got = logprobs(out)[0]

        ref = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
        with torch.no_grad():
            want = reference_logprobs(ref, data[0]).double().numpy()
        # bf16 rounding (measured: mean 0.05, max 0.11 nats on this prompt).
        assert np.abs(got - want).max() < 0.4
        assert np.abs(got - want).mean() < 0.1
        answer = np.asarray(weights) > 0
        assert got[answer].mean() > -1.0  # "The capital of France is Paris." is likely

        losses = [train_step(tc, data, lr=1e-3) for _ in range(3)]
        assert losses[-1] < 0.8 * losses[0], losses
    finally:
        core.shutdown()
