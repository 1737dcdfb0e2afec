"""Issue 17, the server part: what the official SDK 0.38 sends is either honoured or refused by
name, never silently ignored.

- create_sampling_client(model_path=..., base_model=...) with both (the SDK sends both);
- get_tokenizer() from a machine that has neither the server's folders nor the Hub, and no
  server path in any response;
- the SDK's sampling cancellation (dynamic config + cancel_future) frees the engine, and so does
  a client's death (its session's heartbeat stops);
- record_stability_info and access_scope; provenance spans checked (only stable_reinforce reads them);
- every unsupported route answers with a JSON refusal (no bare 405); search_sessions works.

One server runs inside this process (uvicorn on a thread, tiny model, PyTorch engine), so the
tests can look at its engine; it serves the tiny model folder twice, as its folder name and as
"other", so that a checkpoint's base model and another served model can disagree.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import tinker
import uvicorn
from tinker import types

from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig
from skyrl_trainer.backend.core import BackendCore
from skyrl_trainer.connect import install_tokenizer
from skyrl_trainer.server.app import create_app
from skyrl_trainer.server.config import ServerConfig
from tests.server.conftest import API_KEY, free_port
from tests.waiting import wait_until

PROMPT = [1, 504, 3300, 314, 253, 1789, 30]

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]


class InProcessServer:
    def __init__(self, tiny_model_dir: Path, storage: Path):
        backend = BackendConfig(
            base_models=[str(tiny_model_dir), f"other={tiny_model_dir}"],
            storage_dir=str(storage),
            training=TrainingConfig(dtype="float32", device="cpu"),
            # One row at a time: a request waits until the one before leaves the engine.
            sampling=SamplingConfig(engine="torch", dtype="float32", device="cpu",
                                    max_batch_size=1, prefix_cache_tokens=0),
        )  # fmt: skip
        self.model_dir = tiny_model_dir
        self.storage = storage
        self.core = BackendCore(backend, served_only=True)
        self.port = free_port()
        self.app = create_app(ServerConfig(port=self.port, backend=backend), self.core)
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self):
        return self.app.state.server

    def start(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "the in-process server did not start"
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.core.shutdown()

    def service_client(self) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.base_url, api_key=API_KEY)

    def http(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {"X-API-Key": API_KEY}
        return httpx.request(method, f"{self.base_url}/api/v1{path}", headers=headers, **kwargs)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    live = InProcessServer(tiny_model_dir, tmp_path_factory.mktemp("coverage") / "storage")
    yield live.start()
    live.stop()


@pytest.fixture(scope="module")
def trained(server):
    """A LoRA model with a sampler checkpoint, shared by the tests below."""
    service = server.service_client()
    tc = service.create_lora_training_client(str(server.model_dir), rank=4, seed=7).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_weights_for_sampler("coverage").result().path
    return service, tc, path, datum


# ------------------------------------------------------------ 1. model_path and base_model


def test_sampling_client_with_model_path_and_its_base_model(server, trained):
    service, tc, path, _ = trained
    alone = service.create_sampling_client(model_path=path).result()
    both = service.create_sampling_client(model_path=path, base_model=server.model_dir.name)
    both = both.result()
    prompt = types.ModelInput.from_ints(PROMPT)
    expected = alone.compute_logprobs(prompt).result()
    assert both.compute_logprobs(prompt).result() == expected  # the checkpoint's weights
    base = service.create_sampling_client(base_model=server.model_dir.name).result()
    assert base.compute_logprobs(prompt).result() != expected
    # the checkpoint's base named by another of its aliases (the folder path) also agrees
    service.create_sampling_client(model_path=path, base_model=str(server.model_dir)).result()


def test_sampling_client_with_a_base_model_the_checkpoint_is_not_of(server, trained):
    service, _, path, _ = trained
    with pytest.raises(tinker.APIStatusError) as caught:
        service.create_sampling_client(model_path=path, base_model="other").result()
    message = str(caught.value)
    assert caught.value.status_code == 400
    assert "base_model" in message and "model_path" in message and "'other'" in message
    assert server.model_dir.name in message  # what the checkpoint was trained on


# ------------------------------------------------------------------------ 3. tokenizer


@pytest.fixture
def recorded_responses(monkeypatch):
    """Every HTTP response the SDK receives in this test (its transports all go through
    httpx.AsyncClient.send), body read in full."""
    seen: list[tuple[str, bytes]] = []
    send = httpx.AsyncClient.send

    async def recording_send(self, request, *args, **kwargs):
        response = await send(self, request, *args, **kwargs)
        await response.aread()
        seen.append((str(request.url), response.content))
        return response

    monkeypatch.setattr(httpx.AsyncClient, "send", recording_send)
    return seen


def test_no_response_names_a_server_path(server, tiny_model_dir, recorded_responses):
    service = server.service_client()
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=1).result()
    info = tc.get_info()
    path = tc.save_state("no-paths").result().path
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2))
    rest = service.create_rest_client()
    rest.get_server_capabilities().result()
    rest.get_training_run(tc.model_id).result()
    rest.list_checkpoints(tc.model_id).result()
    rest.get_weights_info_by_tinker_path(path).result()
    rest.get_sampler(sampler._sampling_session_id).result()
    rest.get_session(service.holder.get_session_id()).result()
    with pytest.raises(tinker.APIStatusError):  # an error that involves the folder
        service.create_sampling_client(base_model=str(tiny_model_dir / "nope")).result()
    tokenizer_answer = server.http("GET", "/tokenizer", params={"base_model": info.model_name})
    assert tokenizer_answer.status_code == 200
    files = tokenizer_answer.json()["files"]
    bodies = [body for _, body in recorded_responses] + [tokenizer_answer.content]
    bodies += [base64.b64decode(data) for data in files.values()]
    assert len(recorded_responses) > 10
    forbidden = {str(tiny_model_dir), str(tiny_model_dir.parent), str(server.storage)}
    for body in bodies:
        for text in forbidden:
            assert text.encode() not in body, f"a response names {text}"
    # the model is named by its public name, and so is its tokenizer
    assert info.model_data.tokenizer_id == info.model_name == tiny_model_dir.name


def test_remote_client_builds_the_tokenizer(server, tiny_model_dir, tmp_path, monkeypatch):
    """A client on another machine: no model folder, an empty hub cache, no network."""
    from huggingface_hub import constants
    from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info

    from skyrl_trainer.backend.model_loading import load_tokenizer

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no folder named like the model here
    _load_tokenizer_from_model_info.cache_clear()
    service = server.service_client()
    tc = service.create_lora_training_client(tiny_model_dir.name, rank=4, seed=2).result()
    sampler = service.create_sampling_client(base_model=tiny_model_dir.name).result()
    with pytest.raises((OSError, ValueError)):
        tc.get_tokenizer()  # nothing to load it from yet
    _load_tokenizer_from_model_info.cache_clear()

    tokenizer_id = install_tokenizer(server.base_url, API_KEY, tc.get_info().model_name)

    assert tokenizer_id == tc.get_info().model_data.tokenizer_id
    expected = load_tokenizer(tiny_model_dir)
    text = "Hello world, <|im_start|>user"
    for client in (tc, sampler):
        tokenizer = client.get_tokenizer()
        assert tokenizer.encode(text) == expected.encode(text)
        assert tokenizer.eos_token_id == expected.eos_token_id
        messages = [{"role": "user", "content": "hi"}]
        assert tokenizer.apply_chat_template(messages, tokenize=False) == (
            expected.apply_chat_template(messages, tokenize=False)
        )
    again = install_tokenizer(server.base_url, API_KEY, tiny_model_dir.name)  # idempotent
    assert again == tokenizer_id
    _load_tokenizer_from_model_info.cache_clear()


def test_tokenizer_of_an_unserved_model_is_refused(server):
    answer = server.http("GET", "/tokenizer", params={"base_model": "/etc"})
    assert answer.status_code == 400
    assert answer.json()["field"] == "base_model" and "not served" in answer.json()["error"]


# ---------------------------------------------------------------------- 6. cancellation


def test_dynamic_config_enables_cancellation(server):
    answer = server.http("POST", "/client/dynamic_config", json={"sdk_version": "0.38.0"})
    assert answer.status_code == 200
    config = types.ClientDynamicConfigResponse.model_validate(answer.json())
    assert config.sample_cancel_enabled
    service = server.service_client()
    service.create_rest_client()  # constructing the holder fetches it
    assert service.holder.get_client_dynamic_config().sample_cancel_enabled


def slow_sampler(server, monkeypatch):
    """A sampling client of "other" whose engine decodes a step per 20 ms (a 500-token request
    takes ~10 s), the engine, and the prompt."""
    sampler = server.service_client().create_sampling_client(base_model="other").result()
    prompt = types.ModelInput.from_ints(PROMPT)
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1)).result()  # engine up
    engine = server.core.samplers.engine(sampler._sampling_session_id)
    decode = engine.runner.decode
    monkeypatch.setattr(engine.runner, "decode", lambda group: (time.sleep(0.02), decode(group)))
    return sampler, engine, prompt


def test_abandoned_sample_frees_the_engine(server, monkeypatch):
    """A long sample abandoned through the SDK (result_async timeout) is cancelled on the
    server: its row leaves the engine, and the next request (which, with one row at a time,
    would otherwise wait for it) completes at once."""
    sampler, engine, prompt = slow_sampler(server, monkeypatch)
    before = engine.stats.generated_tokens
    long_params = types.SamplingParams(max_tokens=500, stop=[], seed=1)

    async def abandon():
        future = sampler.sample(prompt, 1, long_params)
        with pytest.raises(TimeoutError):
            await future.result_async(timeout=1.5)

    asyncio.run(abandon())
    started = time.monotonic()
    quick = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3, stop=[]))
    assert len(quick.result(timeout=30).sequences[0].tokens) == 3
    waited = time.monotonic() - started
    assert waited < 5, f"the next request waited {waited:.1f} s: the abandoned one kept running"
    # the abandoned request generated far fewer than its 500 tokens, and left no rows behind
    assert engine.stats.generated_tokens - before < 300
    assert wait_until(lambda: engine._num_rows() == 0)
    failed = [
        r
        for r in server.state.db._all("SELECT * FROM futures WHERE request_type = 'Sample'")
        if r["status"] == "failed"
    ]
    assert any(b"cancelled" in r["payload"] for r in failed)


def test_sampling_of_a_session_without_heartbeats_is_cancelled(server, monkeypatch):
    """A client killed mid-request cancels nothing itself: once its session's heartbeat is
    older than session_expiry_s, housekeeping cancels its running samples (engine rows freed,
    future failed 'cancelled'); a session that still beats keeps its requests."""
    from skyrl_trainer.server.app import housekeeping

    sampler, engine, prompt = slow_sampler(server, monkeypatch)
    session_id = server.state.db.sampler(sampler._sampling_session_id)["session_id"]
    long_request = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=500, stop=[]))
    assert wait_until(lambda: engine._num_rows() == 1)

    housekeeping(server.state)  # the session is alive: nothing is cancelled
    assert engine._num_rows() == 1 and session_id in server.state.tracker.running_sessions()

    expiry = server.state.config.session_expiry_s
    with server.state.db._writing() as db:  # the client died expiry + 1 s ago
        db.execute(
            "UPDATE sessions SET last_heartbeat = ? WHERE session_id = ?",
            (time.time() - expiry - 1, session_id),
        )
    housekeeping(server.state)
    assert wait_until(lambda: engine._num_rows() == 0), "the silent session's rows stayed"
    with pytest.raises(tinker.RequestFailedError, match="cancelled.*no heartbeat"):
        long_request.result(timeout=30)
    assert session_id not in server.state.tracker.running_sessions()


def test_engine_cancel_of_queued_and_running_requests(tiny_model_dir):
    """The PyTorch engine's cancel hook: a queued request leaves the queue, a running one's
    rows leave the batch; the other requests are unaffected."""
    from concurrent.futures import CancelledError

    from skyrl_trainer.backend.sampling.engine import GenerationParams, GenerationRequest
    from skyrl_trainer.backend.sampling.torch_engine import TorchSamplingEngine

    engine = TorchSamplingEngine(
        tiny_model_dir, dtype="float32", device="cpu", max_batch_size=1, prefix_cache_tokens=0
    )
    try:
        decode = engine.runner.decode
        engine.runner.decode = lambda group: (time.sleep(0.01), decode(group))
        long = GenerationRequest(tuple(PROMPT), 1, GenerationParams(max_tokens=400, seed=1))
        short = GenerationRequest(tuple(PROMPT), 1, GenerationParams(max_tokens=4, seed=2))
        running = engine.generate(long)
        queued = engine.generate(long)
        after = engine.generate(short)
        deadline = time.monotonic() + 30
        while not running.running():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.cancel(queued) and queued.cancelled()
        assert engine.cancel(running)
        with pytest.raises(CancelledError):
            running.result(timeout=30)
        assert len(after.result(timeout=30).sequences[0].tokens) == 4
        assert wait_until(lambda: engine._num_rows() == 0) and not engine._queue
        assert engine.stats.generated_tokens < 400
        assert not engine.cancel(after)  # finished: nothing to cancel
    finally:
        engine.shutdown()


def test_cancel_future_route(server):
    missing = server.http("POST", "/cancel_future", json={"request_id": "nope"})
    assert missing.status_code == 404 and missing.json()["field"] == "request_id"


# ------------------------------------------------------ 7. silently ignored fields


def test_record_stability_info_is_refused_by_name(server, trained):
    service, tc, path, _ = trained
    prompt = types.ModelInput.from_ints(PROMPT)
    sampler = service.create_sampling_client(model_path=path, record_stability_info=True)
    with pytest.raises(tinker.APIStatusError, match="record_stability_info.*stable_reinforce"):
        sampler.result().sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    snapshot = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    with pytest.raises(tinker.APIStatusError, match="record_stability_info"):
        snapshot.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()


def test_in_process_clients_refuse_and_accept_alike(server, trained):
    """The in-process clients (same core) behave as the server does."""
    from skyrl_trainer.backend.clients import ServiceClient as LocalServiceClient
    from skyrl_trainer.backend.errors import InvalidRequestError

    _, _, path, datum = trained
    local = LocalServiceClient(core=server.core)
    name = server.model_dir.name
    with pytest.raises(InvalidRequestError, match="record_stability_info"):
        local.create_sampling_client(base_model=name, record_stability_info=True).result()
    assert local.create_sampling_client(model_path=path, base_model=name).result()
    with pytest.raises(InvalidRequestError, match="model_path.*base_model='tiny"):
        local.create_sampling_client(model_path=path, base_model="other").result()
    tc = local.create_lora_training_client(name, rank=4, seed=3).result()
    with pytest.raises(InvalidRequestError, match="record_stability_info"):
        tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    n = len(PROMPT) - 1
    miscounted = replace(
        datum,
        model_input_spans=[types.PromptProvenanceSpan(sequence_id="s:0", length=n + 1)],
        loss_fn_input_spans=[types.PromptProvenanceSpan(sequence_id="s:0", length=n)],
    )
    with pytest.raises(InvalidRequestError, match="model_input_spans"):
        tc.forward_backward([miscounted], "cross_entropy").result()


def test_provenance_spans_are_checked_and_change_nothing(server, trained):
    """Well-formed spans (the cookbook's RL framework attaches them to every datum) give the
    same result as none: only stable_reinforce reads them, and it is refused by name. Spans
    that do not tile their field, or only one of the pair, are refused naming the field."""
    _, tc, _, datum = trained
    n = len(PROMPT) - 1
    spanned = datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="s:0", length=3),
            types.SampledProvenanceSpan(sequence_id="s:0", length=n - 3),
        ],
        loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="s:0", length=n)],
    )
    plain = tc.forward([datum], "cross_entropy").result()
    with_spans = tc.forward([spanned], "cross_entropy").result()
    assert with_spans.metrics["loss:sum"] == plain.metrics["loss:sum"] > 0
    assert (
        with_spans.loss_fn_outputs[0]["logprobs"].data == plain.loss_fn_outputs[0]["logprobs"].data
    )

    short = replace(
        spanned, loss_fn_input_spans=[types.SampledProvenanceSpan(sequence_id="s:0", length=n - 1)]
    )
    with pytest.raises(tinker.RequestFailedError, match=r"data\[1\]\.loss_fn_input_spans.*tile"):
        tc.forward_backward([datum, short], "cross_entropy").result()
    # one list without the other (the SDK's Datum refuses that; a hand-made request need not)
    from skyrl_trainer.backend.core import check_provenance
    from skyrl_trainer.backend.errors import InvalidRequestError

    one_sided = replace(datum)
    object.__setattr__(one_sided, "model_input_spans", spanned.model_input_spans)
    with pytest.raises(InvalidRequestError, match=r"data\[0\]\.loss_fn_input_spans.*pair"):
        check_provenance([one_sided])
    # refused before any work: the model's next request runs normally
    assert tc.forward([datum], "cross_entropy").result().metrics["loss:sum"] > 0


def test_access_scope(server, trained, tiny_model_dir):
    service, tc, path, _ = trained
    other = tinker.ServiceClient(base_url=server.base_url, api_key="tml-someone-else")
    theirs = other.create_rest_client()
    mine = service.create_rest_client()
    assert mine.get_training_run(tc.model_id, access_scope="accessible").result()
    with pytest.raises(tinker.NotFoundError):
        theirs.get_training_run(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        theirs.get_training_run(tc.model_id, access_scope="accessible").result()
    runs = theirs.list_training_runs(access_scope="accessible").result().training_runs
    assert tc.model_id not in [r.training_run_id for r in runs]
    mine.publish_checkpoint_from_tinker_path(path).result()
    try:
        run = theirs.get_training_run(tc.model_id, access_scope="accessible").result()
        assert run.last_sampler_checkpoint.tinker_path == path
        assert run.last_checkpoint is None  # only what was published
        with pytest.raises(tinker.NotFoundError):  # "owned" still means owned
            theirs.get_training_run(tc.model_id).result()
        listed = theirs.list_training_runs(access_scope="accessible").result()
        assert tc.model_id in [r.training_run_id for r in listed.training_runs]
        owned = theirs.list_training_runs().result()
        assert tc.model_id not in [r.training_run_id for r in owned.training_runs]
    finally:
        mine.unpublish_checkpoint_from_tinker_path(path).result()
    session_id = service.holder.get_session_id()
    assert mine.get_session(session_id, access_scope="accessible").result()
    assert session_id in mine.list_sessions(access_scope="accessible").result().sessions
    bad = server.http("GET", f"/training_runs/{tc.model_id}", params={"access_scope": "all"})
    assert bad.status_code == 400 and bad.json()["field"] == "access_scope"
    bad = server.http("GET", "/sessions", params={"access_scope": "everyone"})
    assert bad.status_code == 400 and bad.json()["field"] == "access_scope"


# ---------------------------------------------------------------- 8. unsupported routes


def test_unsupported_routes_answer_a_json_refusal(server, trained):
    service, tc, path, _ = trained
    rest = service.create_rest_client()
    with pytest.raises(tinker.BadRequestError, match="external weights.*not supported"):
        rest.get_external_weights_urls(f"tinker://{tc.model_id}/external_weights/x").result()
    # any method a route does not take: the same refusal as an unknown route
    for method, route in [
        ("PUT", "/sessions/search"),
        ("POST", "/training_runs/x/checkpoints/weights/y"),
        ("DELETE", "/get_server_capabilities"),
        ("GET", "/no_such_route"),
    ]:
        answer = server.http(method, route)
        assert answer.status_code in (404, 405), (method, route)
        body = answer.json()
        assert body["error"] == f"{method} /api/v1{route} is not supported by this server"
        assert body["category"] == "user"


def test_search_sessions(server, trained):
    service, tc, _, _ = trained
    named = tinker.ServiceClient(
        base_url=server.base_url,
        api_key=API_KEY,
        display_name="Nightly RL run",
        user_metadata={"team": "blue"},
    )
    named_id = named.holder.get_session_id()
    rest = service.create_rest_client()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        search = rest.search_sessions

        found = search(types.SessionSearchRequest(display_name="rl nightly")).result()
        assert [s.session_id for s in found.sessions] == [named_id]
        summary = found.sessions[0]
        assert summary.display_name == "Nightly RL run"
        assert summary.user_metadata == {"team": "blue"} and summary.project_id == "default"
        assert summary.status is not None and summary.status.type == "active"

        by_meta = search(types.SessionSearchRequest(user_metadata={"team": "blue"})).result()
        assert [s.session_id for s in by_meta.sessions] == [named_id]
        own_id = service.holder.get_session_id()
        mine = search(types.SessionSearchRequest(session_id=own_id)).result().sessions
        assert [s.session_id for s in mine] == [own_id] and mine[0].checkpoints_count >= 1

        everything = search(types.SessionSearchRequest(limit=200)).result().sessions
        assert len(everything) >= 2
        created = [s.created_at for s in everything]
        assert created == sorted(created, reverse=True)
        pages, request = [], types.SessionSearchRequest(limit=1)
        while True:
            page = search(request).result()
            pages += [s.session_id for s in page.sessions]
            if page.next_cursor is None:
                break
            request = request.model_copy(update={"cursor": page.next_cursor})
        assert pages == [s.session_id for s in everything]

        named.close("success").result()
        finished = types.ClientFinishedSessionStatusQuery(reasons=["success"])
        done = search(types.SessionSearchRequest(statuses=[finished])).result().sessions
        assert named_id in [s.session_id for s in done]
        active = search(types.SessionSearchRequest(statuses=[types.ActiveSessionStatusQuery()]))
        assert named_id not in [s.session_id for s in active.result().sessions]
        with pytest.raises(tinker.BadRequestError, match="project"):
            search(types.SessionSearchRequest(project_ids=["elsewhere"])).result()
        nobody = types.UserSearchOwner(owner_urns=["someone"])
        assert search(types.SessionSearchRequest(owner=nobody)).result().sessions == []
    # raw JSON check: the answer is the SDK's own type
    answer = server.http("POST", "/sessions/search", json={"limit": 1})
    assert answer.status_code == 200
    types.SessionSearchResponse.model_validate(json.loads(answer.content))


def test_a_session_in_another_project_is_refused(server):
    """ServiceClient(project_id=...) / TINKER_PROJECT_ID: there is one project here, 'default';
    another is refused by name rather than silently filed under 'default'."""
    elsewhere = tinker.ServiceClient(
        base_url=server.base_url, api_key=API_KEY, project_id="elsewhere"
    )
    with pytest.raises(tinker.BadRequestError, match="project_id.*'elsewhere'.*TINKER_PROJECT_ID"):
        elsewhere.create_sampling_client(base_model="other")  # makes the session first
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY, project_id="default")
    assert client.create_sampling_client(base_model="other").result()
