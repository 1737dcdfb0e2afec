"""Every advantage estimator x every loss x KL on/off x overlong filter on/off x dynamic sampling
on/off, two steps each through the real loop on a tiny model.

The whole product is 4 x 5 x 2 x 2 x 2 = 160 runs, about 1.5 s each on a 2-core CPU: too slow
for every CI run. So the default run is a covering array of STRENGTH 3 (40 runs): every value
combination of ANY three dimensions appears in some run (every estimator x loss x KL setting,
every loss x overlong x dynamic, every KL x overlong x dynamic, ...), so a bug that needs up to
three options to meet is caught, which a pairwise design would not guarantee (dro only
misbehaves off the prompt mask, the overlong filter only leaked with KL on). Construction: each
(estimator e, loss l) pair runs twice, with switches v and their complement, where v is the
(e + l) mod 4-th of (000, 001, 010, 100); every estimator and every loss meets all four classes,
which covers all four value pairs of any two switches, and the classes and their complements
are all eight switch triples (`test_the_default_runs_cover_every_triple` checks it). The other
120 runs are marked `slow` (`pytest -m slow tests/trainer/test_combinations.py` runs the full
product). Per-option behaviour is pinned down by the unit and loop tests of
test_algorithm_options.py and test_advantages.py; this matrix proves the options compose.

Every run shares one in-process backend (the base model is loaded once; each run is a new LoRA
adapter on it) and is as small as a run can be while still exercising every branch: 2 prompts x
2 samples of at most 4 tokens, one mini-batch, one refill round.

The model is the tiny random Llama with its <|im_end|> (eos) embedding pointed along the mean
final hidden state, so about a third of the responses stop and the rest are cut at max_tokens:
the overlong filter has both kinds to tell apart. The reward is 0 for prompts with an even answer
(zero-variance groups, which dynamic sampling drops and refills) and the responses' vowel share
for the others.

For every run: it completes, every metric is finite, and prompt positions receive no gradient,
checked two ways on the requests the loop really sent: (1) with the backend's own loss, the
gradient wrt the learner log-prob of every prompt position is exactly 0; (2) the model's
parameter gradients are the same when the prompt positions' placeholder sampler log-probs are
replaced by other values (the loss must not read them).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from tinker import types

from skyrl_trainer.trainer.loop import RLTrainer
from skyrl_trainer.trainer.policy_losses import POLICY_LOSSES
from tests.trainer.loop_helpers import (
    make_config,
    make_service,
    record,
    spy_on_batches,
    write_reward_module,
)
from tests.trainer.test_algorithm_options import lp_gradient

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce++")
LOSSES = tuple(sorted(POLICY_LOSSES))
SWITCHES = (False, True)  # kl, overlong filter, dynamic sampling
COMBOS = list(itertools.product(ESTIMATORS, LOSSES, SWITCHES, SWITCHES, SWITCHES))
_CLASSES = ((0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0))


def covering_runs() -> set[tuple]:
    """The strength-3 covering array described above (40 runs)."""
    runs = set()
    for i, estimator in enumerate(ESTIMATORS):
        for j, loss in enumerate(LOSSES):
            v = _CLASSES[(i + j) % 4]
            for bits in (v, tuple(1 - b for b in v)):
                runs.add((estimator, loss, *(bool(b) for b in bits)))
    return runs


DEFAULT_RUNS = covering_runs()


def test_the_default_runs_cover_every_triple():
    dims = (ESTIMATORS, LOSSES, SWITCHES, SWITCHES, SWITCHES)
    assert len(DEFAULT_RUNS) == 40
    for a, b, c in itertools.combinations(range(5), 3):
        seen = {(run[a], run[b], run[c]) for run in DEFAULT_RUNS}
        assert seen == set(itertools.product(dims[a], dims[b], dims[c])), (a, b, c)


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with eos = mean final hidden direction * 2.2 (tied embeddings)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("eos_llama")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True
    )
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        mean = model.model.norm(out.hidden_states[-1][0]).mean(0)
        model.model.embed_tokens.weight[tokenizer.eos_token_id] = 2.2 * mean / mean.norm()
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def shared(tmp_path_factory, eos_model_dir):
    folder = tmp_path_factory.mktemp("matrix")
    with pytest.MonkeyPatch.context() as mp:
        module = write_reward_module(folder, mp)
        service = make_service(folder)
        yield folder, service, f"{module}:odd_vowel_share"
        service.core.shutdown()


def parameter_grads(service, client, datums, loss_fn, config) -> list[torch.Tensor]:
    """The adapter's parameter gradients of one forward_backward (cleared before, by an
    optim_step with learning rate 0, which changes no weight)."""
    client.optim_step(types.AdamParams(learning_rate=0.0)).result()
    client.forward_backward(datums, loss_fn, config).result()
    core = service.core
    group = core._base_slot(core.model(client.model_id).base_model).group
    return [p.grad.clone() for p in group._slots[client.model_id].params if p.grad is not None]


def with_prompt_logprobs(datum, prompt_len: int, rng) -> types.Datum:
    logprobs = np.asarray(datum.loss_fn_inputs["logprobs"].tolist(), dtype=np.float32)
    logprobs[: prompt_len - 1] = -rng.uniform(0.1, 20.0, prompt_len - 1)
    inputs = dict(datum.loss_fn_inputs)
    inputs["logprobs"] = types.TensorData.from_numpy(logprobs)
    return types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)


@pytest.mark.parametrize(
    ("estimator", "loss_fn", "kl", "overlong", "dynamic"),
    [
        pytest.param(
            *combo,
            id="{}-{}-kl{:d}-ol{:d}-ds{:d}".format(*combo),
            marks=() if combo in DEFAULT_RUNS else pytest.mark.slow,
        )
        for combo in COMBOS
    ],
)
@pytest.mark.usefixtures("one_torch_thread")
def test_combination(shared, eos_model_dir, estimator, loss_fn, kl, overlong, dynamic, monkeypatch):
    folder, service, reward = shared
    name = f"{estimator}-{loss_fn}-{kl}-{overlong}-{dynamic}"
    cfg = make_config(
        folder / name,
        eos_model_dir,
        reward,
        steps=2,
        **{
            "eval.every": 0,
            "checkpoint.resume": "never",
            "sampling.max_tokens": 4,
            "algorithm.advantage_estimator": estimator,
            "algorithm.loss_fn": loss_fn,
            "algorithm.kl_coef": 0.1 if kl else 0.0,
            "algorithm.overlong_filter": overlong,
            "algorithm.dynamic_sampling": dynamic,
            "algorithm.max_refill_rounds": 1,
            "algorithm.batch_size": 2,
            "algorithm.group_size": 2,
            "algorithm.num_mini_batches": 1,
        },
    )
    trainer = RLTrainer(cfg, service)
    calls = record(trainer)
    batches = spy_on_batches(monkeypatch)
    history = [trainer.step(0), trainer.step(1)]

    for metrics in history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(float(v))}
        assert not bad, bad
        assert ("kl/mean" in metrics) == kl
    if not calls.calls:  # every datum was without gradient (all filtered or zero-variance)
        assert all(m["train/datums_without_gradient"] == m["train/sequences"] for m in history)
        return
    prompts = [g.prompt_tokens for b in batches for g in b.sampled]
    rng = np.random.default_rng(0)
    for datums, fn, config, future in calls.calls:
        perturbed = []
        for datum, out in zip(datums, future.result().loss_fn_outputs, strict=True):
            ints = datum.model_input.to_ints()
            prompt_len = next(len(p) for p in prompts if ints[: len(p)] == p)
            grad = lp_gradient(fn, config, datum, out["logprobs"].tolist())
            assert np.all(grad[: prompt_len - 1] == 0), name
            perturbed.append(with_prompt_logprobs(datum, prompt_len, rng))
    # Parameter gradients of the last request, with and without other prompt placeholders.
    client = calls._inner
    before = parameter_grads(service, client, datums, fn, config)
    after = parameter_grads(service, client, perturbed, fn, config)
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
