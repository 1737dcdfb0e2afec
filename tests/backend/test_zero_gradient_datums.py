"""Datums whose loss gradient is provably zero (all-zero advantages or weights) run forward only.

Checked against the same request with the skip turned off: identical loss, log-probs and
gradients, while the backward passes cover only the datums that carry gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from skyrl_trainer.backend.clients import ServiceClient
from skyrl_trainer.backend.config import BackendConfig, TrainingConfig
from skyrl_trainer.backend.core import BackendCore
from skyrl_trainer.backend.training_worker import TrainingWorker


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    storage = tmp_path_factory.mktemp("storage")
    core = BackendCore(
        BackendConfig(
            storage_dir=str(storage),
            training=TrainingConfig(dtype="float32", micro_batch_tokens=48),
        )
    )
    yield core
    core.shutdown()


def rl_data(vocab: int, zero: list[bool], seed: int = 0) -> list[types.Datum]:
    """RL datums (prompt positions carry advantage 0); `zero[i]`: datum i's advantages are all 0."""
    rng = np.random.default_rng(seed)
    data = []
    for all_zero in zero:
        prompt, completion = int(rng.integers(2, 8)), int(rng.integers(3, 12))
        seq = rng.integers(0, vocab, size=prompt + completion).tolist()
        advantage = 0.0 if all_zero else float(rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.0))
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={
                    "target_tokens": seq[1:],
                    "logprobs": (-rng.uniform(5, 12, size=len(seq) - 1)).tolist(),
                    "advantages": [0.0] * (prompt - 1) + [advantage] * completion,
                },
            )
        )
    return data


def grads_of(core: BackendCore, tc) -> list[torch.Tensor]:
    group = core._base_slot(core.model(tc.model_id).base_model).group
    return [p.grad.clone() for p in group._slots[tc.model_id].params]


def run(core, tc, data, loss_fn, monkeypatch, skip: bool):
    """forward_backward with the skip on/off; returns (output, grads, backward micro-batches)."""
    plan_fn = TrainingWorker._micro_batch_plan
    backward_rows: list[list[int]] = []

    def plan(self, examples, spec, backward, skip_zero_gradient=True):
        result = plan_fn(self, examples, spec, backward, skip_zero_gradient=skip)
        backward_rows.extend(indices for indices, with_grad in result if with_grad)
        return result

    monkeypatch.setattr(TrainingWorker, "_micro_batch_plan", plan)
    out = tc.forward_backward(data, loss_fn).result()
    grads = grads_of(core, tc)
    monkeypatch.undo()
    return out, grads, sorted(i for rows in backward_rows for i in rows)


@pytest.mark.parametrize("loss_fn", ["ppo", "importance_sampling", "cispo"])
def test_zero_advantage_datums_skip_backward_and_change_nothing(
    sc_core_tc, vocab, monkeypatch, loss_fn
):
    core, tc = sc_core_tc
    zero = [False, True, True, False, True, False, True]
    data = rl_data(vocab, zero)
    results = {}
    for skip in (False, True):
        tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # clears the gradients
        results[skip] = run(core, tc, data, loss_fn, monkeypatch, skip)
    (ref_out, ref_grads, ref_rows), (out, grads, rows) = results[False], results[True]

    assert ref_rows == list(range(len(data)))  # without the skip every datum runs backward
    assert rows == [i for i, z in enumerate(zero) if not z]
    assert out.metrics["loss:sum"] == pytest.approx(ref_out.metrics["loss:sum"], rel=1e-6)
    for a, b in zip(out.loss_fn_outputs, ref_out.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6)
    assert any(float(g.abs().max()) > 0 for g in grads)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7 + 1e-5 * float(ref.abs().max()))


def test_dro_never_skips(sc_core_tc, vocab, monkeypatch):
    """dro's penalty has a gradient even where every advantage is 0."""
    core, tc = sc_core_tc
    data = rl_data(vocab, [True, True, True])
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result()
    _, grads, rows = run(core, tc, data, "dro", monkeypatch, skip=True)
    assert rows == [0, 1, 2]
    assert any(float(g.abs().max()) > 0 for g in grads)


@pytest.fixture(scope="module")
def sc_core_tc(core, tiny_model_dir):
    tc = ServiceClient(core=core).create_full_training_client(str(tiny_model_dir)).result()
    return core, tc
