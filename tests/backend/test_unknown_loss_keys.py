"""Nothing in a training request is silently ignored: a `loss_fn_inputs` or `loss_fn_config` key
the loss does not read is refused, naming the key, the loss and the keys it accepts; and the
unpublished `stable_reinforce` says what to pass instead."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from skyrl_trainer.backend.config import BackendConfig, TrainingConfig
from skyrl_trainer.backend.core import BackendCore
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.losses import LOSS_FNS

N = 6


@pytest.fixture(scope="module")
def core(tmp_path_factory) -> BackendCore:
    core = BackendCore(
        BackendConfig(
            storage_dir=str(tmp_path_factory.mktemp("storage")),
            training=TrainingConfig(dtype="float32"),
        )
    )
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def tc(sc, tiny_model_dir):
    return sc.create_lora_training_client(str(tiny_model_dir), rank=4, seed=0).result()


def _datum(**inputs) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10, 10 + N))),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.arange(11, 11 + N, dtype=np.int64)),
            **{
                k: types.TensorData.from_numpy(np.full(N, v, np.float32)) for k, v in inputs.items()
            },
        },
    )


def _full_inputs(loss: str) -> dict[str, float]:
    spec = LOSS_FNS[loss]
    values = {"weights": 1.0, "logprobs": -1.0, "advantages": 0.5, "sequence_ratio_mask": 1.0}
    return {k: values[k] for k in spec.required_inputs}


def _refused(tc, data, loss, config=None) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        tc.forward_backward(data, loss, config).result()
    return err.value


@pytest.mark.parametrize("loss", sorted(LOSS_FNS))
def test_misspelt_clip_threshold_input_is_refused(tc, loss):
    """`clip_low_treshold` (sic) used to vanish; now it names itself, the loss and its keys."""
    err = _refused(tc, [_datum(**_full_inputs(loss), clip_low_treshold=0.9)], loss)
    assert err.field == "data[0].loss_fn_inputs.clip_low_treshold"
    assert f"'{loss}'" in err.problem
    for key in LOSS_FNS[loss].accepted_inputs:
        assert key in err.problem


def test_an_input_of_another_loss_is_refused(tc):
    """A ppo datum (with logprobs/advantages) sent to cross_entropy is a caller's mistake."""
    err = _refused(tc, [_datum(weights=1.0, advantages=1.0)], "cross_entropy")
    assert err.field == "data[0].loss_fn_inputs.advantages"
    assert "target_tokens, weights" in err.problem
    # ppo accepts per-token clip thresholds; importance_sampling does not read them.
    inputs = _full_inputs("importance_sampling")
    err = _refused(tc, [_datum(**inputs, clip_high_threshold=1.3)], "importance_sampling")
    assert err.field == "data[0].loss_fn_inputs.clip_high_threshold"


def test_the_second_datum_is_named(tc):
    data = [_datum(weights=1.0), _datum(weights=1.0, mask=1.0)]
    err = _refused(tc, data, "cross_entropy")
    assert err.field == "data[1].loss_fn_inputs.mask"


def test_accepted_optional_inputs_still_work(tc):
    inputs = _full_inputs("ppo")
    out = tc.forward_backward(
        [_datum(**inputs, clip_low_threshold=0.9, clip_high_threshold=1.1)], "ppo"
    ).result()
    assert np.isfinite(out.metrics["loss:sum"])
    out = tc.forward([_datum(**_full_inputs("dro"), weights=0.5)], "dro").result()
    assert np.isfinite(out.metrics["loss:sum"])


@pytest.mark.parametrize(
    "loss, config, key",
    [
        ("ppo", {"clip_low_treshold": 0.9}, "clip_low_treshold"),
        ("importance_sampling", {"clip_low_threshold": 0.9}, "clip_low_threshold"),
        ("cross_entropy", {"beta": 0.1}, "beta"),
        ("dro", {"kl_coeff": 0.1}, "kl_coeff"),
    ],
)
def test_unknown_config_key_is_refused(tc, loss, config, key):
    err = _refused(tc, [_datum(**_full_inputs(loss))], loss, config)
    assert err.field == f"loss_fn_config.{key}"
    assert f"'{loss}'" in err.problem and "accepted keys" in err.problem
    for accepted in LOSS_FNS[loss].config_defaults:
        assert accepted in err.problem


def test_stable_reinforce_says_what_to_pass_instead(tc):
    err = _refused(tc, [_datum(**_full_inputs("importance_sampling"))], "stable_reinforce")
    assert err.field == "loss_fn"
    assert "not supported" in err.problem
    assert "loss_fn='importance_sampling'" in err.problem and "'ppo'" in err.problem
