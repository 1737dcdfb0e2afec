"""Refused requests free their place in a model's order, retries with an X-Idempotency-Key get
the original future, the per-key cap answers 429 (the SDK backs off), published checkpoints
are shared across keys, and only the served base models can be used, with no server path in
any answer. A live server process driven by the official tinker SDK and raw httpx."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time

import pytest
import tinker
from tinker import types

from tests.server.conftest import LiveServer
from tests.server.test_server_load_and_faults import (
    NEW_SESSION,
    PROTOBUF,
    assert_error,
    datum,
    fb_body,
    http,
    retrieve,
)

KEY_A, KEY_B = "tml-owner", "tml-other"
MAX_PENDING = 3
GAP_TIMEOUT_S = 4.0

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """Two keys, at most 3 unfinished requests per key, a 4 s seq_id gap timeout; serves the
    tiny model folder only."""
    live = LiveServer(
        tiny_model_dir,
        tmp_path_factory.mktemp("access") / "storage",
        [
            "--api-key", KEY_A, "--api-key", KEY_B,
            "--max-pending-futures", str(MAX_PENDING),
            "--sequencer-gap-timeout", str(GAP_TIMEOUT_S),
        ],
    ).start()  # fmt: skip
    yield live
    live.stop()


def lora_client(server: LiveServer, key: str, tiny_model_dir) -> tinker.TrainingClient:
    service = server.service_client(key)
    return service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0)


# ------------------------------------------------------------------- refusals and ordering


def test_refused_request_does_not_hold_up_the_next(server, tiny_model_dir):
    """The SDK numbers every request of a model; one the server refuses before it reaches the
    backend (an optimizer or a sampling-client kind it does not support) must not leave a gap
    that the model's next request waits on for the gap timeout."""
    tc = lora_client(server, KEY_A, tiny_model_dir).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="optimizer_params"):
        tc.optim_step(types.DimuonParams(learning_rate=1e-3)).result(timeout=60)  # seq 1
    start = time.monotonic()
    assert tc.forward([datum()], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    # Waiting for seq 1 would take the whole gap timeout; half of it leaves room for a loaded CPU.
    assert time.monotonic() - start < GAP_TIMEOUT_S / 2  # seq 2 did not wait for seq 1

    with pytest.raises(tinker.BadRequestError, match="kind"):
        tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=60)  # seq 3
    start = time.monotonic()
    tc.forward([datum()], "cross_entropy").result(timeout=60)
    assert time.monotonic() - start < GAP_TIMEOUT_S / 2


def _status(server: LiveServer, request_id: str) -> str:
    with sqlite3.connect(server.storage_dir / "server.sqlite3") as db:
        query = "SELECT status FROM futures WHERE request_id = ?"
        return db.execute(query, (request_id,)).fetchone()[0]


def test_another_key_cannot_free_a_models_place(server, tiny_model_dir):
    """Only the model's owner gives a seq_id back: another key's refused request naming the
    model (and its seq_id) changes nothing in the model's order."""
    tc = lora_client(server, KEY_A, tiny_model_dir).result(timeout=60)
    with http(server, KEY_A) as a, http(server, KEY_B) as b:
        held = a.post(
            "/forward_backward", content=fb_body(tc.model_id, 2, [datum()]), headers=PROTOBUF
        ).json()["request_id"]
        r = b.post(
            "/forward_backward", content=fb_body(tc.model_id, 1, [datum()]), headers=PROTOBUF
        )
        assert_error(r, 404, "model_id")
        time.sleep(0.5)
        assert _status(server, held) == "pending"  # still waiting for seq 1
        tc.forward([datum()], "cross_entropy").result(timeout=60)  # seq 1 releases it
        assert retrieve(a, held).status_code == 200


# --------------------------------------------------------------------------- idempotency


def _futures_of(server: LiveServer, model_id: str) -> int:
    with sqlite3.connect(server.storage_dir / "server.sqlite3") as db:
        query = "SELECT COUNT(*) FROM futures WHERE model_id = ?"
        return db.execute(query, (model_id,)).fetchone()[0]


def test_idempotency_key_retry_returns_the_original_future(server, tiny_model_dir):
    """A resent request (the SDK's retry after a lost response) with the same
    X-Idempotency-Key answers with the first request's future and runs nothing again, also
    when the resend arrives while the first is still being answered; another key is a new
    request."""
    tc = lora_client(server, KEY_A, tiny_model_dir).result(timeout=60)
    before = _futures_of(server, tc.model_id)
    body = fb_body(tc.model_id, 1, [datum()], forward_only=False)
    headers = {**PROTOBUF, "X-Idempotency-Key": "stainless-python-retry-one"}
    with http(server, KEY_A) as client:
        first = client.post("/forward_backward", content=body, headers=headers)
        again = client.post("/forward_backward", content=body, headers=headers)
        assert first.status_code == again.status_code == 200, (first.text, again.text)
        assert again.json() == first.json()
        assert _futures_of(server, tc.model_id) == before + 1
        assert retrieve(client, first.json()["request_id"]).status_code == 200

        # Concurrent resends of a sample request: one future for all of them.
        sample = {
            "base_model": str(tiny_model_dir),
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "num_samples": 1,
            "sampling_params": {"max_tokens": 2, "seed": 0},
        }
        answers: list[dict] = []

        def send() -> None:
            r = client.post(
                "/asample", json=sample, headers={"X-Idempotency-Key": "stainless-sample"}
            )
            answers.append(r.json())

        threads = [threading.Thread(target=send) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({a["request_id"] for a in answers}) == 1, answers
        other = client.post("/asample", json=sample, headers={"X-Idempotency-Key": "other"})
        assert other.json()["request_id"] != answers[0]["request_id"]
        for request_id in (answers[0]["request_id"], other.json()["request_id"]):
            assert retrieve(client, request_id).status_code == 200


# ---------------------------------------------------------------------------- capacity


def test_pending_cap_answers_429_and_the_sdk_backs_off(server, tiny_model_dir):
    """With the key's 3 unfinished requests held (waiting for a seq_id gap), a 4th is
    answered 429 with retry-after; the SDK's request backs off, retries, and succeeds once the
    gap times out and the held requests finish."""
    tc = lora_client(server, KEY_A, tiny_model_dir).result(timeout=60)
    sampler = server.service_client(KEY_A).create_sampling_client(base_model=str(tiny_model_dir))
    sampler = sampler.result(timeout=60)
    with http(server, KEY_A) as client:
        held = [
            client.post(
                "/forward_backward", content=fb_body(tc.model_id, s, [datum()]), headers=PROTOBUF
            )
            for s in range(2, 2 + MAX_PENDING)  # seq 1 never comes
        ]
        assert all(r.status_code == 200 for r in held), [r.text for r in held]
        held_at = time.monotonic()
        r = client.post(
            "/forward_backward", content=fb_body(tc.model_id, 9, [datum()]), headers=PROTOBUF
        )
        body = assert_error(r, 429, "requests", f"{MAX_PENDING} requests already in flight")
        assert r.headers["retry-after"] == "1", body
        # Another key has its own cap.
        other = server.service_client(KEY_B).create_sampling_client(base_model=str(tiny_model_dir))
        other.result(timeout=60).sample(
            types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)
        ).result(timeout=60)

        out = sampler.sample(
            types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=3, seed=0)
        ).result(timeout=120)
        assert len(out.sequences[0].tokens) == 3
        assert time.monotonic() - held_at >= GAP_TIMEOUT_S * 0.9  # it waited for capacity
        for r in held:
            assert retrieve(client, r.json()["request_id"]).status_code == 200


# ------------------------------------------------------------------- published checkpoints


def test_published_checkpoint_is_loadable_by_another_key(server, tiny_model_dir):
    tc = lora_client(server, KEY_A, tiny_model_dir).result(timeout=60)
    tc.forward_backward([datum()], "cross_entropy").result(timeout=60)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    state = tc.save_state("shared").result(timeout=60).path
    weights = tc.save_weights_for_sampler("shared-s").result(timeout=60).path
    rest_a = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    rest_b = tinker.RestClient(base_url=server.base_url, api_key=KEY_B)
    sc_b = server.service_client(KEY_B)

    def b_can_load() -> bool:
        try:
            sc_b.create_training_client_from_state(state).result(timeout=60)
        except Exception as exc:
            assert "no checkpoint" in str(exc), exc
            with pytest.raises(Exception, match="no checkpoint"):
                sc_b.create_sampling_client(model_path=weights).result(timeout=60)
            return False
        sc_b.create_sampling_client(model_path=weights).result(timeout=60)
        return True

    assert not b_can_load()
    for path in (state, weights):
        rest_a.publish_checkpoint_from_tinker_path(path).result(timeout=60)
    assert b_can_load()
    tc_b = sc_b.create_training_client_from_state(state).result(timeout=60)
    expected = tc.forward([datum()], "cross_entropy").result(timeout=60)
    got = tc_b.forward([datum()], "cross_entropy").result(timeout=60)
    assert got.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-5)
    info = rest_b.get_weights_info_by_tinker_path(state).result(timeout=60)
    assert info.is_lora and info.lora_rank == 4
    # Published is loadable, not changeable: B can neither unpublish nor delete it.
    with pytest.raises(Exception, match="404|no checkpoint"):
        rest_b.unpublish_checkpoint_from_tinker_path(state).result(timeout=60)
    with pytest.raises(Exception, match="404|no checkpoint"):
        rest_b.delete_checkpoint_from_tinker_path(state).result(timeout=60)
    for path in (state, weights):
        rest_a.unpublish_checkpoint_from_tinker_path(path).result(timeout=60)
    assert not b_can_load()


# ---------------------------------------------------------------------- served models


def _no_paths(text: str, *paths) -> None:
    for path in paths:
        assert str(path) not in text, text
    assert "/tmp" not in text and "/home" not in text and "/root" not in text, text


def test_only_served_base_models_and_no_server_paths(server, tiny_model_dir, tmp_path):
    """A loadable model folder the server was not started with is refused with the served
    list (before anything is loaded), as are hub ids and other names, for training and
    sampling; the served model answers under its name, and no answer holds a server path."""
    other = tmp_path / "other_model"
    shutil.copytree(tiny_model_dir, other)
    served = tiny_model_dir.name
    sc = server.service_client(KEY_A)
    for name in (str(other), "HuggingFaceTB/SmolLM2-135M-Instruct", "../../etc", "gpt2"):
        with pytest.raises(Exception, match="not served here") as info:
            sc.create_lora_training_client(base_model=name, rank=4).result(timeout=60)
        assert f"this server serves: {served!r}" in str(info.value)
        with pytest.raises(Exception, match="not served here") as info:
            sc.create_sampling_client(base_model=name).result(timeout=60)
        assert f"this server serves: {served!r}" in str(info.value)
    with http(server, KEY_A) as client:
        r = client.post("/asample", json={
            "base_model": str(other), "num_samples": 1, "sampling_params": {"max_tokens": 2},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}]},
        })  # fmt: skip
        assert_error(r, 400, "base_model", f"this server serves: {served!r}")

    # By its name, or as the operator wrote it: the same served model, named by its name.
    tc = sc.create_lora_training_client(base_model=served, rank=4).result(timeout=60)
    tc2 = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result(60)
    info = tc.get_info()
    assert info.model_data.model_name == served == tc2.get_info().model_data.model_name
    assert info.model_data.tokenizer_id == served
    path = tc.save_state("named").result(timeout=60).path
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=60)
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    with http(server, KEY_A) as client:
        answers = [
            client.post("/get_info", json={"model_id": tc.model_id}).text,
            client.get("/get_server_capabilities").text,
            client.get(f"/training_runs/{tc.model_id}").text,
            client.get(f"/training_runs/{tc.model_id}/checkpoints").text,
            client.post("/weights_info", json={"tinker_path": path}).text,
            client.get(f"/samplers/{sampler._sampling_session_id}").text,
        ]
    for text in answers:
        _no_paths(text, tiny_model_dir, server.storage_dir)
    capabilities = json.loads(answers[1])
    assert [m["model_name"] for m in capabilities["supported_models"]] == [served]
    assert rest.get_weights_info_by_tinker_path(path).result(timeout=60).base_model == served
    assert json.loads(answers[5])["base_model"] == served


def test_raw_create_model_with_an_unserved_base_model_fails_by_name(server):
    with http(server, KEY_A) as client:
        session = client.post("/create_session", json=NEW_SESSION).json()["session_id"]
        r = client.post("/create_model", json={
            "session_id": session, "model_seq_id": 0, "base_model": "/etc",
            "lora_config": {"rank": 4}, "type": "create_model",
        })  # fmt: skip
        request_id = r.json()["request_id"]
        answer = retrieve(client, request_id).json()
        assert answer["category"] == "user" and "not served here" in answer["error"]


def test_errors_do_not_reveal_server_paths(server, tiny_model_dir):
    """A backend error about a folder (a damaged checkpoint: its adapter config removed on the
    server's disk) reaches the caller without the folder's path."""
    tc = lora_client(server, KEY_A, tiny_model_dir).result(timeout=60)
    path = tc.save_weights_for_sampler("damaged").result(timeout=60).path
    run, kind, name = path.removeprefix("tinker://").split("/")
    (server.storage_dir / run / kind / name / "adapter_config.json").unlink()
    with pytest.raises(Exception, match="adapter_config.json") as info:
        server.service_client(KEY_A).create_sampling_client(model_path=path).result(timeout=60)
    assert "<server path>" in str(info.value)
    _no_paths(str(info.value), server.storage_dir, tiny_model_dir)
