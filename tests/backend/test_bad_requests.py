"""Refused requests: each raises InvalidRequestError (through the future) naming the offending
field, and leaves the model exactly as if the request had never been sent.

The pattern: accumulate a good forward_backward, send the bad request, then optim_step. The
parameters must be bit-identical to a reference run (same seed) that never saw the bad request.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tinker import types

from skyrl_trainer.backend.clients import ServiceClient, TrainingClient
from skyrl_trainer.backend.config import BackendConfig, TrainingConfig
from skyrl_trainer.backend.core import BackendCore
from skyrl_trainer.backend.errors import InvalidRequestError, NotFoundError
from skyrl_trainer.backend.losses import LOSS_FNS
from skyrl_trainer.backend.micro_batches import plan_micro_batches

MICRO_BATCH_TOKENS = 48
STEP = types.AdamParams(learning_rate=1e-2, eps=1e-8)
SEED = 0
RANK = 8


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module")
def core(tmp_path_factory) -> BackendCore:
    storage = tmp_path_factory.mktemp("storage")
    core = BackendCore(
        BackendConfig(
            storage_dir=str(storage),
            training=TrainingConfig(dtype="float32", micro_batch_tokens=MICRO_BATCH_TOKENS),
        )
    )
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory, tokenizer):
    """A second tiny Llama: same shapes as `tiny_model_dir`, different random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY_CONFIG

    folder = tmp_path_factory.mktemp("other_tiny_llama")
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **TINY_CONFIG)).save_pretrained(
        str(folder)
    )
    tokenizer.save_pretrained(str(folder))
    return folder


def make_data(vocab: int, n: int = 4, seed: int = 1) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n):
        length = int(rng.integers(4, 20))
        seq = rng.integers(0, vocab, size=length + 1)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": seq[1:].tolist(),
                    "weights": rng.uniform(0, 1, size=length).tolist(),
                },
            )
        )
    return data


@pytest.fixture(scope="module")
def good(vocab) -> list[types.Datum]:
    return make_data(vocab)


def new_lora(sc: ServiceClient, model_dir, rank: int = RANK, **kw) -> TrainingClient:
    return sc.create_lora_training_client(str(model_dir), rank=rank, seed=SEED, **kw).result()


def params(core: BackendCore, tc: TrainingClient) -> list[torch.Tensor]:
    group = core._base_slot(core.model(tc.model_id).base_model).group
    return [p.detach().clone() for p in group._slots[tc.model_id].params]


def grads(core: BackendCore, tc: TrainingClient) -> list[torch.Tensor | None]:
    group = core._base_slot(core.model(tc.model_id).base_model).group
    return [None if p.grad is None else p.grad.clone() for p in group._slots[tc.model_id].params]


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert torch.equal(x, y)


@pytest.fixture(scope="module")
def reference(sc, core, tiny_model_dir, good) -> list[torch.Tensor]:
    """Parameters after the undisturbed run: forward_backward(good), optim_step."""
    tc = new_lora(sc, tiny_model_dir)
    tc.forward_backward(good, "cross_entropy").result()
    tc.optim_step(STEP).result()
    return params(core, tc)


def expect_refused(future, field: str, error=InvalidRequestError) -> InvalidRequestError:
    with pytest.raises(error) as info:
        future.result(timeout=60)
    assert info.value.field == field, str(info.value)
    return info.value


def check_refused(sc, core, tiny_model_dir, good, reference, send_bad, field, tc=None):
    """Accumulate good gradients, send the bad request (must be refused with `field`),
    step, and compare with the undisturbed reference."""
    tc = tc or new_lora(sc, tiny_model_dir)
    tc.forward_backward(good, "cross_entropy").result()
    before_grads = grads(core, tc)
    error = expect_refused(send_bad(tc), field)
    assert_same(grads(core, tc), before_grads)
    tc.optim_step(STEP).result()
    assert_same(params(core, tc), reference)
    return error


def datum(tokens, **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


# ---------------------------------------------------------------------------------------------
# Bad forward_backward requests


def _bad_data_cases(vocab: int):
    n = 5
    ok_tokens = [5, 6, 7, 8, 9]
    targets = [6, 7, 8, 9, 10]
    w = [1.0] * n
    rl = {"logprobs": [-1.0] * n, "advantages": [0.5] * n}
    image = types.ImageChunk(data=b"\x89PNG\r\n", format="png", expected_tokens=2)
    return {
        "unknown loss": (
            "nope",
            [datum(ok_tokens, target_tokens=targets, weights=w)],
            None,
            "loss_fn",
        ),
        "ppo without advantages": (
            "ppo",
            [datum(ok_tokens, target_tokens=targets, logprobs=[-1.0] * n)],
            None,
            "data[0].loss_fn_inputs.advantages",
        ),
        "cross_entropy without weights": (
            "cross_entropy",
            [datum(ok_tokens, target_tokens=targets)],
            None,
            "data[0].loss_fn_inputs.weights",
        ),
        "target_tokens longer than model_input": (
            "cross_entropy",
            [
                datum(ok_tokens, target_tokens=targets, weights=w),
                datum(ok_tokens, target_tokens=[*targets, 11], weights=w),
            ],
            None,
            "data[1].loss_fn_inputs.target_tokens",
        ),
        "weights shorter than model_input": (
            "cross_entropy",
            [datum(ok_tokens, target_tokens=targets, weights=w[:-1])],
            None,
            "data[0].loss_fn_inputs.weights",
        ),
        "advantages mis-shaped": (
            "importance_sampling",
            [
                datum(
                    ok_tokens,
                    target_tokens=targets,
                    logprobs=rl["logprobs"],
                    advantages=[0.5] * (n + 2),
                )
            ],
            None,
            "data[0].loss_fn_inputs.advantages",
        ),
        "model_input id >= vocab": (
            "cross_entropy",
            [datum([5, 6, vocab, 8, 9], target_tokens=targets, weights=w)],
            None,
            "data[0].model_input[2]",
        ),
        "target id >= vocab": (
            "cross_entropy",
            [datum(ok_tokens, target_tokens=[6, vocab + 7, 8, 9, 10], weights=w)],
            None,
            "data[0].loss_fn_inputs.target_tokens[1]",
        ),
        "negative model_input id": (
            "cross_entropy",
            [datum([-1, 6, 7, 8, 9], target_tokens=targets, weights=w)],
            None,
            "data[0].model_input[0]",
        ),
        "negative target id": (
            "cross_entropy",
            [datum(ok_tokens, target_tokens=[6, 7, 8, 9, -3], weights=w)],
            None,
            "data[0].loss_fn_inputs.target_tokens[4]",
        ),
        "2-D target_tokens": (
            "cross_entropy",
            [
                datum(
                    ok_tokens,
                    target_tokens=types.TensorData(data=targets, dtype="int64", shape=[1, n]),
                    weights=w,
                )
            ],
            None,
            "data[0].loss_fn_inputs.target_tokens",
        ),
        "float target_tokens": (
            "cross_entropy",
            [datum(ok_tokens, target_tokens=np.asarray(targets, np.float32), weights=w)],
            None,
            "data[0].loss_fn_inputs.target_tokens",
        ),
        "empty data": ("cross_entropy", [], None, "data"),
        "empty model_input": (
            "cross_entropy",
            [datum([], target_tokens=[], weights=[])],
            None,
            "data[0].model_input",
        ),
        "longer than the context": (
            "cross_entropy",
            [datum([5] * 600, target_tokens=[6] * 600, weights=[1.0] * 600)],
            None,
            "data[0].model_input",
        ),
        "image chunk": (
            "cross_entropy",
            [
                types.Datum(
                    model_input=types.ModelInput(
                        chunks=[types.EncodedTextChunk(tokens=[5, 6, 7]), image]
                    ),
                    loss_fn_inputs={"target_tokens": targets, "weights": w},
                )
            ],
            None,
            "data[0].model_input.chunks[1]",
        ),
        "NaN advantage": (
            "ppo",
            [
                datum(
                    ok_tokens,
                    target_tokens=targets,
                    logprobs=rl["logprobs"],
                    advantages=[0.5, float("nan"), 0.5, 0.5, 0.5],
                )
            ],
            None,
            "data[0].loss_fn_inputs.advantages",
        ),
        "unknown loss_fn_config key": (
            "ppo",
            [datum(ok_tokens, target_tokens=targets, **rl)],
            {"clip_low": 0.5},
            "loss_fn_config.clip_low",
        ),
        "clip_low_threshold 1.5": (
            "ppo",
            [datum(ok_tokens, target_tokens=targets, **rl)],
            {"clip_low_threshold": 1.5},
            "loss_fn_config.clip_low_threshold",
        ),
        "clip_high_threshold below 1 (an epsilon)": (
            "cispo",
            [datum(ok_tokens, target_tokens=targets, **rl)],
            {"clip_high_threshold": 0.2},
            "loss_fn_config.clip_high_threshold",
        ),
        "string config value": (
            "dro",
            [datum(ok_tokens, target_tokens=targets, **rl)],
            {"beta": "0.1"},
            "loss_fn_config.beta",
        ),
        "config for a loss without config": (
            "cross_entropy",
            [datum(ok_tokens, target_tokens=targets, weights=w)],
            {"clip_low_threshold": 0.8},
            "loss_fn_config.clip_low_threshold",
        ),
        "per-token clip threshold out of range": (
            "ppo",
            [
                datum(
                    ok_tokens,
                    target_tokens=targets,
                    **rl,
                    clip_low_threshold=np.full(n, 1.5, np.float32),
                )
            ],
            None,
            "data[0].loss_fn_inputs.clip_low_threshold",
        ),
    }


BAD_DATA_NAMES = list(_bad_data_cases(100))


# forward (no backward) validates the same way; check it on a representative subset.
FORWARD_CASES = ["unknown loss", "ppo without advantages", "target id >= vocab", "image chunk"]


@pytest.mark.parametrize(
    ("method", "case"),
    [("forward_backward", c) for c in BAD_DATA_NAMES] + [("forward", c) for c in FORWARD_CASES],
)
def test_bad_forward_backward_is_refused(
    sc, core, tiny_model_dir, good, reference, vocab, case, method
):
    loss_fn, data, config, field = _bad_data_cases(vocab)[case]
    check_refused(
        sc,
        core,
        tiny_model_dir,
        good,
        reference,
        lambda tc: getattr(tc, method)(data, loss_fn, config),
        field,
    )


def test_bad_datum_in_the_middle_refuses_the_whole_request(
    sc, core, tiny_model_dir, good, reference, vocab
):
    bad = datum([1, 2, 3], target_tokens=[2, 3, vocab], weights=[1.0, 1.0, 1.0])
    check_refused(
        sc,
        core,
        tiny_model_dir,
        good,
        reference,
        lambda tc: tc.forward_backward([*good[:2], bad, *good[2:]], "cross_entropy"),
        "data[2].loss_fn_inputs.target_tokens[2]",
    )


def test_failure_in_the_second_micro_batch_restores_gradients(
    sc, core, tiny_model_dir, good, reference, monkeypatch
):
    """A loss that raises in the 2nd micro-batch, after the 1st one's backward already added
    gradients: the request fails and the accumulated gradients are exactly as before."""
    lengths = [d.model_input.length for d in good]
    batches = plan_micro_batches(lengths, MICRO_BATCH_TOKENS // 2)  # float32: half the tokens
    assert len(batches) >= 2
    spec = LOSS_FNS["cross_entropy"]
    calls = []

    def flaky(lp, inputs, config):
        calls.append(1)
        if len(calls) == len(batches[0]) + 1:
            raise RuntimeError("boom in micro-batch 2")
        return spec.fn(lp, inputs, config)

    tc = new_lora(sc, tiny_model_dir)
    tc.forward_backward(good, "cross_entropy").result()
    before = grads(core, tc)
    monkeypatch.setitem(LOSS_FNS, "cross_entropy", dataclasses.replace(spec, fn=flaky))
    with pytest.raises(RuntimeError, match="boom"):
        tc.forward_backward(good, "cross_entropy").result()
    assert len(calls) == len(batches[0]) + 1  # the 1st micro-batch ran (and did backward)
    monkeypatch.setitem(LOSS_FNS, "cross_entropy", spec)
    assert_same(grads(core, tc), before)
    tc.optim_step(STEP).result()
    assert_same(params(core, tc), reference)


def test_failing_custom_losses(sc, core, tiny_model_dir, good, reference):
    def raises(data, lps):
        raise ValueError("user bug")

    tc = new_lora(sc, tiny_model_dir)
    tc.forward_backward(good, "cross_entropy").result()
    with pytest.raises(ValueError, match="user bug"):
        tc.forward_backward_custom(good, raises).result()

    def ignores_datum_1(data, lps):
        return lps[0].sum(), {}

    # Datum 1's log-probs get no gradient: refused, naming the loss.
    error = expect_refused(tc.forward_backward_custom(good, ignores_datum_1), "loss_fn (datum 1)")
    assert "datum 1" in str(error)
    expect_refused(tc.forward_backward_custom(good, "not callable"), "loss_fn")
    expect_refused(
        tc.forward_backward_custom(good, ignores_datum_1, loss_type_input="logits"),
        "loss_type_input",
    )
    no_targets = [datum([1, 2, 3], weights=[1.0, 1.0, 1.0])]
    expect_refused(
        tc.forward_backward_custom(no_targets, ignores_datum_1),
        "data[0].loss_fn_inputs.target_tokens",
    )
    tc.optim_step(STEP).result()
    assert_same(params(core, tc), reference)


# ---------------------------------------------------------------------------------------------
# Bad optimizer steps


@pytest.mark.parametrize(
    ("adam_kwargs", "field"),
    [
        ({"learning_rate": -1e-3}, "adam_params.learning_rate"),
        ({"learning_rate": float("nan")}, "adam_params.learning_rate"),
        ({"beta1": 1.0}, "adam_params.beta1"),
        ({"beta2": -0.1}, "adam_params.beta2"),
        ({"eps": 0.0}, "adam_params.eps"),
        ({"weight_decay": -0.1}, "adam_params.weight_decay"),
        ({"grad_clip_norm": -1.0}, "adam_params.grad_clip_norm"),
    ],
)
def test_bad_adam_params(sc, core, tiny_model_dir, good, reference, adam_kwargs, field):
    """A refused step keeps the accumulated gradients; the next good step applies them."""
    bad = types.AdamParams(**{"learning_rate": 1e-2, **adam_kwargs})
    check_refused(sc, core, tiny_model_dir, good, reference, lambda tc: tc.optim_step(bad), field)


def test_non_adam_optimizer_params(sc, core, tiny_model_dir, good, reference):
    check_refused(
        sc,
        core,
        tiny_model_dir,
        good,
        reference,
        lambda tc: tc.optim_step(types.DimuonParams(learning_rate=1e-3)),
        "optim_params",
    )


def test_optim_step_without_params_raises_at_the_call(sc, tiny_model_dir):
    """As in the SDK: a TypeError at the call, before anything is queued."""
    tc = new_lora(sc, tiny_model_dir)
    with pytest.raises(TypeError):
        tc.optim_step()


def test_optim_step_with_both_params_is_refused(sc, core, tiny_model_dir, good, reference):
    def both(tc):
        return tc.optim_step(STEP, adam_params=types.AdamParams(learning_rate=1.0))

    tc = new_lora(sc, tiny_model_dir)
    tc.forward_backward(good, "cross_entropy").result()
    with pytest.raises(ValueError, match="not both"):
        both(tc)
    tc.optim_step(STEP).result()
    assert_same(params(core, tc), reference)


# ---------------------------------------------------------------------------------------------
# Bad checkpoint requests


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("tinker://nope/weights/x", NotFoundError),
        ("tinker://nope:train:0/sampler_weights/x", NotFoundError),
        ("/etc/passwd", InvalidRequestError),
        ("tinker://a/b", InvalidRequestError),
        ("tinker://a/weights/../../x", InvalidRequestError),
        ("tinker://../weights/x", InvalidRequestError),
        ("tinker://a/external_weights/x", InvalidRequestError),
        ("", InvalidRequestError),
    ],
)
def test_bad_checkpoint_paths(sc, core, tiny_model_dir, good, reference, path, error):
    err = check_refused(
        sc, core, tiny_model_dir, good, reference, lambda tc: tc.load_state(path), "path"
    )
    assert isinstance(err, error)


@pytest.mark.parametrize("path", ["tinker://nope/weights/x", "/etc/passwd"])
def test_bad_checkpoint_paths_with_optimizer(sc, core, tiny_model_dir, good, reference, path):
    check_refused(
        sc,
        core,
        tiny_model_dir,
        good,
        reference,
        lambda tc: tc.load_state_with_optimizer(path),
        "path",
    )


@pytest.mark.parametrize("path", ["tinker://a/weights/..", "tinker://a/weights/.x"])
def test_bad_name_segment_in_a_path_is_reported_as_path(sc, core, tiny_model_dir, path):
    tc = new_lora(sc, tiny_model_dir)
    expect_refused(tc.load_state(path), "path")


@pytest.mark.parametrize("path", ["tinker://nope/weights/x", "/etc/passwd", "tinker://a/b"])
@pytest.mark.parametrize(
    "create",
    ["create_training_client_from_state", "create_training_client_from_state_with_optimizer"],
)
def test_bad_paths_when_creating_from_state(sc, core, path, create):
    n_models = len(core._models)
    expect_refused(getattr(sc, create)(path), "path")
    assert len(core._models) == n_models


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "", ".hidden", "x" * 200, "a\x00b", "/abs"])
def test_bad_checkpoint_names(sc, core, tiny_model_dir, good, reference, name):
    check_refused(sc, core, tiny_model_dir, good, reference, lambda tc: tc.save_state(name), "name")
    assert not any(core.store.root.rglob("x"))  # nothing escaped the run folder


def test_save_to_an_existing_name_without_overwrite(sc, core, tiny_model_dir, good, reference):
    tc = new_lora(sc, tiny_model_dir)
    path = tc.save_state("taken").result().path
    folder, metadata = core.store.resolve(path)
    weights_before = (folder / "adapter_model.safetensors").read_bytes()
    check_refused(
        sc, core, tiny_model_dir, good, reference, lambda c: c.save_state("taken"), "name", tc=tc
    )
    # The old checkpoint is intact; overwrite=True replaces it (the weights have changed).
    folder, again = core.store.resolve(path)
    assert again == metadata
    assert (folder / "adapter_model.safetensors").read_bytes() == weights_before
    assert tc.save_state("taken", overwrite=True).result().path == path
    folder, replaced = core.store.resolve(path)
    assert replaced.created_at > metadata.created_at
    assert (folder / "adapter_model.safetensors").read_bytes() != weights_before


def _load_both_ways(tc: TrainingClient, path: str):
    return [tc.load_state(path), tc.load_state_with_optimizer(path)]


def test_checkpoint_from_another_base_model(
    sc, core, tiny_model_dir, other_model_dir, good, reference
):
    other = new_lora(sc, other_model_dir)
    other.forward_backward(good, "cross_entropy").result()
    other.optim_step(STEP).result()
    path = other.save_state("other_base").result().path
    for i in range(2):
        check_refused(
            sc,
            core,
            tiny_model_dir,
            good,
            reference,
            lambda tc, i=i: _load_both_ways(tc, path)[i],
            "path",
        )
    # A different base model passed explicitly when creating from a checkpoint.
    n_models = len(core._models)
    expect_refused(
        sc.create_training_client_from_state(path, base_model=str(tiny_model_dir)), "base_model"
    )
    assert len(core._models) == n_models
    # Without base_model, it is created on the checkpoint's own base.
    created = sc.create_training_client_from_state(path).result()
    assert created.get_info().model_data.model_name == str(other_model_dir)


def test_checkpoint_with_another_lora_rank_or_targets(sc, core, tiny_model_dir, good, reference):
    rank4 = new_lora(sc, tiny_model_dir, rank=4)
    path4 = rank4.save_state("rank4").result().path
    attn_only = new_lora(sc, tiny_model_dir, train_mlp=False, train_unembed=False)
    path_attn = attn_only.save_state("attn_only").result().path
    for path in (path4, path_attn):
        for i in range(2):
            check_refused(
                sc,
                core,
                tiny_model_dir,
                good,
                reference,
                lambda tc, p=path, i=i: _load_both_ways(tc, p)[i],
                "path",
            )


def test_lora_and_full_checkpoints_do_not_mix(sc, core, tiny_model_dir, good, reference):
    lora_path = new_lora(sc, tiny_model_dir).save_state("a_lora").result().path
    full = sc.create_full_training_client(str(tiny_model_dir)).result()
    full_path = full.save_state("a_full").result().path

    # A full checkpoint into a LoRA model.
    for i in range(2):
        check_refused(
            sc,
            core,
            tiny_model_dir,
            good,
            reference,
            lambda tc, i=i: _load_both_ways(tc, full_path)[i],
            "path",
        )
    # A LoRA checkpoint into a full model: its weights stay the same.
    full.forward_backward(good, "cross_entropy").result()
    before_params, before_grads = params(core, full), grads(core, full)
    for future in _load_both_ways(full, lora_path):
        expect_refused(future, "path")
    assert_same(params(core, full), before_params)
    assert_same(grads(core, full), before_grads)


def test_optimizer_state_missing_from_checkpoint(sc, core, tiny_model_dir, good, reference):
    """A checkpoint folder without optimizer.pt: load_state works, the _with_optimizer forms
    are refused, and a refused create-from-state leaves no model (nor adapter) behind."""
    src = new_lora(sc, tiny_model_dir)
    path = src.save_state("no_optim").result().path
    folder, _ = core.store.resolve(path)
    (folder / "optimizer.pt").unlink()
    check_refused(
        sc,
        core,
        tiny_model_dir,
        good,
        reference,
        lambda tc: tc.load_state_with_optimizer(path),
        "path",
    )
    group = core._base_slot(str(tiny_model_dir)).group
    n_models, n_slots = len(core._models), len(group._slots)
    expect_refused(sc.create_training_client_from_state_with_optimizer(path), "path")
    assert (len(core._models), len(group._slots)) == (n_models, n_slots)
    tc = sc.create_training_client_from_state(path).result()  # weights only: fine
    assert_same(params(core, tc), params(core, src))


# ---------------------------------------------------------------------------------------------
# Unknown ids and bad model creation


def test_unknown_model_id(core, good):
    model_id = "nope:train:0"
    futures = [
        core.forward_backward(model_id, good, "cross_entropy"),
        core.forward_backward_custom(model_id, good, lambda d, lps: (lps[0].sum(), {})),
        core.optim_step(model_id, STEP),
        core.save_state(model_id, "x"),
        core.load_state(model_id, "tinker://nope/weights/x", with_optimizer=False),
    ]
    for future in futures:
        expect_refused(future, "model_id", NotFoundError)
    with pytest.raises(NotFoundError) as info:
        TrainingClient(core, model_id)
    assert info.value.field == "model_id"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": 100_000}, "rank"),
        ({"train_mlp": False, "train_attn": False, "train_unembed": False}, "train_mlp"),
        ({"optimizer": types.DimuonOptimizerConfig()}, "optimizer"),
    ],
)
def test_bad_lora_creation(sc, core, tiny_model_dir, kwargs, field):
    n_models = len(core._models)
    expect_refused(sc.create_lora_training_client(str(tiny_model_dir), **kwargs), field)
    assert len(core._models) == n_models


def test_bad_base_model_and_closed_session(core, tiny_model_dir):
    sc = ServiceClient(core=core)
    expect_refused(sc.create_lora_training_client(""), "base_model")
    sc.close()
    expect_refused(sc.create_lora_training_client(str(tiny_model_dir)), "session_id")
    expect_refused(sc.create_full_training_client(str(tiny_model_dir)), "session_id")
