"""RL datums: shift, masks and alignment on a known sequence."""

import numpy as np
import pytest

from skyrl_trainer.trainer.datums import (
    Rollout,
    build_rl_datum,
    build_scoring_datum,
    response_logprobs,
)


def make_rollout():
    return Rollout(
        prompt_tokens=[10, 11, 12],
        tokens=[20, 21, 2],
        sampler_logprobs=[-0.1, -0.2, -0.3],
        stop_reason="stop",
    )


def test_rl_datum_alignment():
    r = make_rollout()
    d = build_rl_datum(r, np.array([1.0, 2.0, 3.0]))
    assert d.model_input.to_ints() == [10, 11, 12, 20, 21]
    inputs = {k: v.tolist() for k, v in d.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == [11, 12, 20, 21, 2]
    # target position len(prompt) - 1 + j holds response token j's values; prompt positions are 0
    assert inputs["advantages"] == [0.0, 0.0, 1.0, 2.0, 3.0]
    assert inputs["logprobs"] == pytest.approx([0.0, 0.0, -0.1, -0.2, -0.3])
    own = build_rl_datum(r, np.zeros(3), logprobs=np.array([-1.0, -2.0, -3.0]))
    assert own.loss_fn_inputs["logprobs"].tolist() == [0.0, 0.0, -1.0, -2.0, -3.0]


def test_bad_lengths_refused():
    r = make_rollout()
    with pytest.raises(ValueError, match="advantages"):
        build_rl_datum(r, np.zeros(2))
    with pytest.raises(ValueError, match="logprobs"):
        build_rl_datum(r, np.zeros(3), logprobs=np.zeros(4))


def test_scoring_datum_and_response_slice():
    r = make_rollout()
    d = build_scoring_datum(r)
    assert d.loss_fn_inputs["target_tokens"].tolist() == [11, 12, 20, 21, 2]
    assert d.loss_fn_inputs["weights"].tolist() == [0.0] * 5
    out = [-9.0, -8.0, -0.5, -0.6, -0.7]
    np.testing.assert_allclose(response_logprobs(r, out), [-0.5, -0.6, -0.7])
