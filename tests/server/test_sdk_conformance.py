"""The official `tinker` SDK against a live `python -m skyrl_trainer.server` on loopback.

Every public method of ServiceClient, TrainingClient, SamplingClient and RestClient that the
backend supports is called through the SDK, and its results equal those of the in-process
clients doing the same thing with the same seeds (tiny model, float32). What the server
deliberately does not support answers with an error that says so.
"""

from __future__ import annotations

import asyncio
import pickle
import warnings

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from skyrl_trainer.backend.clients import ServiceClient as LocalServiceClient
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig
from tests.server.conftest import API_KEY

warnings.filterwarnings("ignore", category=FutureWarning)

PROMPT = [1, 504, 3300, 314, 253, 1789, 30]
LORA = dict(rank=8, seed=11)
ADAM = types.AdamParams(learning_rate=5e-3)


def make_datum(n: int, offset: int = 0) -> types.Datum:
    tokens = [(100 + 37 * i + offset) % 4000 + 10 for i in range(n + 1)]
    rng = np.random.default_rng(n + offset)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [1.0] * n,
            "logprobs": (-rng.uniform(5, 12, n)).astype(np.float32).tolist(),
            "advantages": rng.normal(size=n).astype(np.float32).tolist(),
        },
    )


def rl_view(d: types.Datum) -> types.Datum:
    inputs = {k: v for k, v in d.loss_fn_inputs.items() if k != "weights"}
    return types.Datum(model_input=d.model_input, loss_fn_inputs=inputs)


def ce_view(d: types.Datum) -> types.Datum:
    inputs = {k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")}
    return types.Datum(model_input=d.model_input, loss_fn_inputs=inputs)


BATCH = [make_datum(n, i) for i, n in enumerate((5, 9, 7, 12))]


def scenario(service, base_model: str) -> dict:
    """One LoRA model through training, sampling and checkpoints; everything it returns is
    compared between the remote SDK and the in-process clients."""
    out: dict = {}
    tc = service.create_lora_training_client(base_model=base_model, **LORA).result()
    info = tc.get_info()
    out["is_lora"], out["lora_rank"] = info.is_lora, info.lora_rank
    out["fwd"] = tc.forward([ce_view(d) for d in BATCH], "cross_entropy").result()
    out["ce"] = tc.forward_backward([ce_view(d) for d in BATCH], "cross_entropy").result()
    out["is"] = tc.forward_backward([rl_view(d) for d in BATCH], "importance_sampling").result()
    ppo_config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    out["ppo"] = tc.forward_backward([rl_view(d) for d in BATCH], "ppo", ppo_config).result()
    out["optim"] = tc.optim_step(ADAM).result()

    def custom_loss(data, logprobs):
        loss = sum((lp * lp).sum() for lp in logprobs)
        return loss, {"squares:sum": float(loss.detach())}

    out["custom"] = tc.forward_backward_custom([ce_view(d) for d in BATCH], custom_loss).result()
    out["optim2"] = tc.optim_step(ADAM).result()
    out["after"] = tc.forward([ce_view(d) for d in BATCH], "cross_entropy").result()

    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=8, seed=5, temperature=1.0)
    out["sample"] = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, params).result()
    out["sample_plp"] = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, params, include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
    ).result()  # fmt: skip
    out["logprobs"] = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()

    state = tc.save_state("conf-state").result()
    weights = tc.save_weights_for_sampler("conf-sampler").result()
    out["paths"] = (state.path.rsplit("/", 2)[1:], weights.path.rsplit("/", 2)[1:])
    from_path = service.create_sampling_client(model_path=weights.path).result()
    out["from_path"] = from_path.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    restored = service.create_training_client_from_state_with_optimizer(state.path).result()
    out["restored"] = restored.forward([ce_view(d) for d in BATCH], "cross_entropy").result()
    restored.optim_step(ADAM).result()  # restored Adam moments: same step as the original's
    tc.optim_step(ADAM).result()
    out["restored_step"] = restored.forward([ce_view(BATCH[0])], "cross_entropy").result()
    out["original_step"] = tc.forward([ce_view(BATCH[0])], "cross_entropy").result()
    base = service.create_sampling_client(base_model=base_model).result()
    out["base"] = base.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    return out


def assert_outputs_close(a: types.ForwardBackwardOutput, b: types.ForwardBackwardOutput):
    assert a.metrics.keys() == b.metrics.keys()
    for key in a.metrics:
        assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-4, abs=1e-4), key
    assert len(a.loss_fn_outputs) == len(b.loss_fn_outputs)
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(
            x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), rtol=1e-4, atol=1e-4
        )


@pytest.fixture(scope="module")
def results(live_server, tiny_model_dir, tmp_path_factory):
    local = LocalServiceClient(
        BackendConfig(
            storage_dir=str(tmp_path_factory.mktemp("local_storage")),
            training=TrainingConfig(dtype="float32", device="cpu"),
            sampling=SamplingConfig(engine="torch", dtype="float32", device="cpu"),
        )
    )
    remote = live_server.service_client()
    try:
        yield scenario(remote, str(tiny_model_dir)), scenario(local, str(tiny_model_dir))
    finally:
        local.core.shutdown()


@pytest.mark.parametrize(
    "key", ["fwd", "ce", "is", "ppo", "custom", "after", "restored", "restored_step"]
)
def test_training_results_equal_in_process(results, key):
    remote, local = results
    assert isinstance(remote[key], types.ForwardBackwardOutput)
    assert_outputs_close(remote[key], local[key])


def test_training_results_are_real(results):
    remote, _ = results
    assert remote["is_lora"] and remote["lora_rank"] == LORA["rank"]
    assert set(remote["custom"].metrics) == {"squares:sum", "loss:sum", "surrogate_loss:sum"}
    assert remote["optim"].metrics["grad_norm:mean"] > 0
    # the two optimizer steps moved the weights
    assert remote["after"].metrics["loss:sum"] != pytest.approx(remote["fwd"].metrics["loss:sum"])
    # restored with optimizer: one more identical step lands on identical weights
    assert_outputs_close(remote["restored_step"], remote["original_step"])


def test_sampling_results_equal_in_process(results):
    remote, local = results
    r, s = remote["sample"], local["sample"]
    assert [q.tokens for q in r.sequences] == [q.tokens for q in s.sequences]
    assert [q.stop_reason for q in r.sequences] == [q.stop_reason for q in s.sequences]
    for x, y in zip(r.sequences, s.sequences, strict=True):
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-4, atol=1e-4)
    assert all(q.sequence_id for q in r.sequences)
    plp_r, plp_l = remote["sample_plp"], local["sample_plp"]
    assert plp_r.prompt_logprobs[0] is None
    np.testing.assert_allclose(plp_r.prompt_logprobs[1:], plp_l.prompt_logprobs[1:], rtol=1e-4)
    top_r, top_l = plp_r.topk_prompt_logprobs[1], plp_l.topk_prompt_logprobs[1]
    assert [t for t, _ in top_r] == [t for t, _ in top_l] and len(top_r) == 2
    np.testing.assert_allclose([x for _, x in top_r], [x for _, x in top_l], rtol=1e-4)
    for key in ("logprobs", "from_path", "base"):
        assert remote[key][0] is None
        np.testing.assert_allclose(remote[key][1:], local[key][1:], rtol=1e-4, atol=1e-5)
    # the snapshot and the saved sampler weights are the same trained weights, not the base's
    np.testing.assert_allclose(remote["from_path"][1:], remote["logprobs"][1:], rtol=1e-5)
    assert not np.allclose(remote["base"][1:], remote["logprobs"][1:], rtol=1e-4)


def test_checkpoint_paths_have_the_tinker_form(results):
    remote, local = results
    assert remote["paths"] == local["paths"]
    assert remote["paths"] == (["weights", "conf-state"], ["sampler_weights", "conf-sampler"])


def test_async_forms_and_pickled_sampling_client(live_server, tiny_model_dir, monkeypatch):
    service = live_server.service_client()

    async def run():
        tc = await service.create_lora_training_client_async(str(tiny_model_dir), rank=4, seed=1)
        fb = await (await tc.forward_backward_async([ce_view(BATCH[0])], "cross_entropy"))
        step = await (await tc.optim_step_async(ADAM))
        sampler = await tc.save_weights_and_get_sampling_client_async()
        response = await sampler.sample_async(
            types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4, seed=3)
        )
        return tc, fb, step, sampler, response

    tc, fb, step, sampler, response = asyncio.run(run())
    assert fb.metrics["loss:sum"] > 0 and step.metrics["grad_norm:mean"] > 0
    assert [len(s.tokens) for s in response.sequences] == [4, 4]
    # a pickled sampling client (another process would do this) samples the same weights
    clone = pickle.loads(pickle.dumps(sampler))
    again = clone.sample(
        types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4, seed=3)
    ).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in response.sequences]
    # The server names the model, never its path: the SDK loads the tokenizer by that name,
    # here a folder of that name beside the current directory.
    assert clone.get_base_model() == sampler.get_base_model() == tiny_model_dir.name
    monkeypatch.chdir(tiny_model_dir.parent)
    assert tc.get_tokenizer().encode("hello") == sampler.get_tokenizer().encode("hello")


def test_legacy_load_state(live_server, tiny_model_dir):
    service = live_server.service_client()
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=2).result()
    before = tc.forward([ce_view(BATCH[1])], "cross_entropy").result().metrics["loss:sum"]
    path = tc.save_state("legacy").result().path
    tc.forward_backward([ce_view(BATCH[1])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    moved = tc.forward([ce_view(BATCH[1])], "cross_entropy").result().metrics["loss:sum"]
    assert moved != pytest.approx(before)
    tc.load_state(path).result()
    assert tc.forward([ce_view(BATCH[1])], "cross_entropy").result().metrics[
        "loss:sum"
    ] == pytest.approx(before, rel=1e-6)
    tc.load_state_with_optimizer(path).result()
    restored = service.create_training_client_from_state(path).result()
    assert restored.forward([ce_view(BATCH[1])], "cross_entropy").result().metrics[
        "loss:sum"
    ] == pytest.approx(before, rel=1e-6)


def test_large_forward_backward_is_chunked_and_ordered(live_server, tiny_model_dir):
    """150 datums with a 64-datum server limit: the SDK sends 3 chunks concurrently (lowest
    seq_id last); the server runs them in order and the sums equal one in-process call."""
    service = live_server.service_client()
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=3).result()
    data = [ce_view(make_datum(4 + i % 5, i)) for i in range(150)]
    fb = tc.forward_backward(data, "cross_entropy").result()
    assert len(fb.loss_fn_outputs) == 150
    step = tc.optim_step(ADAM).result()
    expected = sum(
        -float(np.sum(o["logprobs"].to_numpy())) for o in fb.loss_fn_outputs
    )  # weights are all 1
    assert fb.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    local = LocalServiceClient(
        BackendConfig(training=TrainingConfig(dtype="float32", device="cpu"))
    )
    try:
        ltc = local.create_lora_training_client(str(tiny_model_dir), rank=4, seed=3).result()
        lfb = ltc.forward_backward(data, "cross_entropy").result()
        lstep = ltc.optim_step(ADAM).result()
    finally:
        local.core.shutdown()
    assert fb.metrics["loss:sum"] == pytest.approx(lfb.metrics["loss:sum"], rel=1e-5)
    assert step.metrics["grad_norm:mean"] == pytest.approx(
        lstep.metrics["grad_norm:mean"], rel=1e-4
    )


def test_rest_client(live_server, tiny_model_dir):
    service = live_server.service_client()
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=4).result()
    state = tc.save_state("rest-a").result().path
    sampler_path = tc.save_weights_for_sampler("rest-b").result().path
    rest = service.create_rest_client()
    caps = rest.get_server_capabilities().result()
    assert caps.supported_models[0].model_name == tiny_model_dir.name
    run = rest.get_training_run(tc.model_id).result()
    assert (run.training_run_id, run.is_lora, run.lora_rank) == (tc.model_id, True, 4)
    assert run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint.tinker_path == sampler_path
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == tc.model_id
    runs = rest.list_training_runs(limit=100).result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count >= len(runs.training_runs)
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.checkpoint_id for c in listed] == ["weights/rest-a", "sampler_weights/rest-b"]
    assert all(c.size_bytes and c.size_bytes > 0 for c in listed)
    mine = rest.list_user_checkpoints(limit=100).result().checkpoints
    assert {state, sampler_path} <= {c.tinker_path for c in mine}
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (tiny_model_dir.name, True, 4)
    rest.publish_checkpoint_from_tinker_path(state).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints[0].public
    rest.unpublish_checkpoint_from_tinker_path(state).result()
    rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints[0].expires_at is not None
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [
        "weights/rest-a"
    ]
    with pytest.raises(tinker.APIStatusError, match="no checkpoint"):
        service.create_sampling_client(model_path=sampler_path).result()
    session = rest.get_session(service.holder.get_session_id()).result()
    assert tc.model_id in session.training_run_ids
    assert service.holder.get_session_id() in rest.list_sessions(limit=100).result().sessions
    sampler = tc.save_weights_and_get_sampling_client().result()
    got = rest.get_sampler(sampler._sampling_session_id).result()
    assert got.base_model == tiny_model_dir.name


def test_unsupported_calls_say_so(live_server, tiny_model_dir):
    service = live_server.service_client()
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=5).result()
    with pytest.raises(tinker.APIStatusError, match="not supported"):
        tc.optim_step(types.DimuonParams(learning_rate=1e-3)).result()
    with pytest.raises(tinker.RequestFailedError, match="stable_reinforce.*not supported"):
        tc.forward_backward([rl_view(BATCH[0])], "stable_reinforce").result()
    with pytest.raises(Exception, match="not supported"):
        service.create_lora_training_client(
            str(tiny_model_dir), rank=4, optimizer=types.DimuonOptimizerConfig()
        ).result()
    # The SDK's sampling options (topk_sample_logprobs, ...) are served now:
    # tests/server/test_sdk_sampling_options.py.
    with pytest.raises(tinker.APIStatusError, match="not supported"):
        service.create_rest_client().copy_weights(
            "tinker://x:train:0/weights/a", destination_project_id="p"
        ).result()


def test_close_ends_the_session(live_server, tiny_model_dir):
    service = live_server.service_client()
    session_id = service.holder.get_session_id()
    service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=6).result()
    service.close("success").result()
    # the server has recorded the end: the session creates no more models
    response = httpx.post(
        f"{live_server.base_url}/api/v1/create_model",
        headers={"X-API-Key": API_KEY},
        json={"session_id": session_id, "model_seq_id": 5, "base_model": str(tiny_model_dir),
              "lora_config": {"rank": 4}},
    )  # fmt: skip
    future = response.json()
    result = httpx.post(
        f"{live_server.base_url}/api/v1/retrieve_future",
        headers={"X-API-Key": API_KEY},
        json={"request_id": future["request_id"]},
    ).json()
    assert result["category"] == "user" and "was closed" in result["error"]
