"""The HTTP server under load, dropped connections, bad requests, other callers, restarts and
checkpoint expiry: live server processes driven by the official tinker SDK, and by raw httpx
where the SDK cannot express the request."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from skyrl_trainer.backend.checkpoints import METADATA_FILE
from skyrl_trainer.server.auth import owner_of_key
from skyrl_trainer.server.database import ServerDatabase
from tests.server.conftest import API_KEY, LiveServer, free_port

KEY_A, KEY_B = "tml-alpha", "tml-beta"
PROTOBUF = {"Content-Type": "application/x-protobuf"}
NEW_SESSION = {"tags": [], "user_metadata": None, "sdk_version": "0.38.0", "type": "create_session"}

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


# ------------------------------------------------------------------------------- helpers


def datum(tokens: list[int] | None = None) -> types.Datum:
    tokens = tokens or [11, 12, 13, 14, 15, 16, 17]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def fb_body(
    model_id: str, seq_id: int, data: list[types.Datum], forward_only: bool = True
) -> bytes:
    """A /forward_backward body exactly as the SDK builds it (training_client.py)."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def http(server: LiveServer, key: str = API_KEY, timeout: float = 30) -> httpx.Client:
    return httpx.Client(
        base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": key}, timeout=timeout
    )


def assert_error(response: httpx.Response, status: int, field: str | None = None, says: str = ""):
    """A refused request: the status, and a JSON body naming the problem (never a bare 4xx)."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.content, "error without a body"
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert isinstance(body.get("error"), str) and body["error"], body
    if field is not None:
        assert body.get("field") == field, body
    assert says.lower() in body["error"].lower(), body
    return body


def retrieve(client: httpx.Client, request_id: str, deadline_s: float = 60) -> httpx.Response:
    """Poll retrieve_future (as the SDK does) until the answer is not `try_again`."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        r = client.post(
            "/retrieve_future",
            json={"request_id": request_id, "allow_metadata_only": False},
            headers={"Accept": "application/x-protobuf"},
        )
        if not r.headers["content-type"].startswith("application/json"):
            return r
        if r.json().get("type") != "try_again":
            return r
    raise AssertionError(f"request {request_id} did not finish in {deadline_s} s")


def logprobs(output: types.ForwardBackwardOutput) -> np.ndarray:
    return np.asarray(output.loss_fn_outputs[0]["logprobs"].data, dtype=np.float32)


def assert_serving(server: LiveServer, tiny_model_dir: Path, key: str = API_KEY) -> None:
    """The server is alive and an SDK round trip still works."""
    assert server.process is not None and server.process.poll() is None
    sampler = server.service_client(key).create_sampling_client(base_model=str(tiny_model_dir))
    out = sampler.result().sample(
        types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=3, seed=0)
    )
    assert len(out.result(timeout=60).sequences[0].tokens) <= 3


# -------------------------------------------------------------------------- module servers


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir, tmp_path_factory):
    """The second server (one process start saved per test group): two accepted keys, a
    100 kB body limit, housekeeping (TTL removal) every 0.3 s; the restart test restarts it."""
    server = LiveServer(
        tiny_model_dir,
        tmp_path_factory.mktemp("keyed") / "storage",
        [
            "--api-key",
            KEY_A,
            "--api-key",
            KEY_B,
            "--max-request-bytes",
            "100000",
            "--housekeeping-interval",
            "0.3",
        ],
    ).start()
    yield server
    server.stop()


# ------------------------------------------------------------------------------------ load


def test_256_concurrent_samples_from_four_clients(live_server, tiny_model_dir):
    """256 sample requests from 4 SDK clients, all submitted before any is awaited: every one
    completes with its own answer (same prompt + seed + shape gives the same tokens whichever
    client sent it; different requests differ), so no future is lost or mixed up."""
    samplers = [
        live_server.service_client().create_sampling_client(base_model=str(tiny_model_dir)).result()
        for _ in range(4)
    ]

    def request(group: int) -> tuple[list[int], int, types.SamplingParams]:
        prompt = [100 + group, 7, 200 + 3 * group]
        params = types.SamplingParams(max_tokens=2 + group % 4, seed=1000 + group, stop=[])
        return prompt, 1 + group % 2, params

    submitted = []
    for i in range(256):
        group = (i // 4) % 16  # each group is sent 16 times, 4 times by every client
        prompt, n, params = request(group)
        future = samplers[i % 4].sample(types.ModelInput.from_ints(prompt), n, params)
        submitted.append((group, future))

    answers: dict[int, list] = defaultdict(list)
    sequence_ids = set()
    for group, future in submitted:
        response = future.result(timeout=120)
        _, n, params = request(group)
        assert len(response.sequences) == n
        for seq in response.sequences:
            assert len(seq.tokens) == params.max_tokens and seq.stop_reason == "length"
            assert seq.logprobs is not None and len(seq.logprobs) == params.max_tokens
            sequence_ids.add(seq.sequence_id)
        answers[group].append([seq.tokens for seq in response.sequences])

    assert len(sequence_ids) == sum(request((i // 4) % 16)[1] for i in range(256))
    for group, results in answers.items():
        assert len(results) == 16
        assert all(r == results[0] for r in results), f"group {group} answers differ"
    firsts = {tuple(results[0][0]) for results in answers.values()}
    assert len(firsts) == 16  # every group got its own tokens


# ------------------------------------------------------------------------ dropped clients


def test_client_disconnects_mid_request(live_server, tiny_model_dir):
    """A poller that hangs up while the server holds its retrieve_future, and a body cut off
    mid-upload: the server keeps serving, and the request's result can still be collected."""
    sc = live_server.service_client()
    tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    with http(live_server) as client:
        # seq_id 2 before the client's first request (seq 1): held by the sequencer, so it
        # stays unfinished while we poll and hang up.
        r = client.post(
            "/forward_backward", content=fb_body(tc.model_id, 2, [datum()]), headers=PROTOBUF
        )
        assert r.status_code == 200, r.text
        request_id = r.json()["request_id"]

        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{live_server.base_url}/api/v1/retrieve_future",
                json={"request_id": request_id, "allow_metadata_only": True},
                headers={"X-API-Key": API_KEY},
                timeout=httpx.Timeout(10, read=0.5),
            )

        log_start = live_server.log_path.stat().st_size
        with socket.create_connection(("127.0.0.1", live_server.port), timeout=5) as raw:
            raw.sendall(
                b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                + f"X-API-Key: {API_KEY}\r\n".encode()
                + b"Content-Type: application/x-protobuf\r\nContent-Length: 50000\r\n\r\n"
                + fb_body(tc.model_id, 3, [datum()])[:20]
            )
        time.sleep(0.2)

        # The SDK's first request (seq 1) runs, and releases the held seq 2 behind it.
        expected = logprobs(tc.forward([datum()], "cross_entropy").result(timeout=60))
        for _ in range(2):  # and a second poll gets the same stored answer
            r = retrieve(client, request_id)
            assert r.status_code == 200 and "protobuf" in r.headers["content-type"], r.text
            got = deserialize_forward_backward_output(r.content)
            np.testing.assert_array_equal(logprobs(got), expected)
        assert got.metrics["loss:sum"] == pytest.approx(-float(expected.sum()), rel=1e-5)
    with live_server.log_path.open() as log:  # a hang-up is not logged as a server error
        log.seek(log_start)
        new_log = log.read()
    assert "Traceback" not in new_log and "unhandled error" not in new_log, new_log[-3000:]
    assert_serving(live_server, tiny_model_dir)


# ---------------------------------------------------------------------------- bad requests


def test_malformed_and_unknown_requests_answer_4xx_with_json(live_server, tiny_model_dir):
    with http(live_server) as client:
        r = client.post(
            "/forward_backward", content=b"\xff\xfe\x00 not a protobuf", headers=PROTOBUF
        )
        body = assert_error(r, 400)
        assert body.get("field")

        r = client.post(
            "/forward_backward", content=fb_body("nosuch:train:0", 1, [datum()]), headers=PROTOBUF
        )
        assert_error(r, 404, "model_id", "nosuch:train:0")
        assert_error(
            client.post("/get_info", json={"model_id": "nosuch:train:0"}),
            404,
            "model_id",
            "unknown model",
        )
        assert_error(client.post("/get_info", content=b"{not json"), 400, "body", "JSON")
        assert_error(client.post("/get_info", json={"type": "get_info"}), 400, "model_id")
        assert_error(
            client.post("/retrieve_future", json={"request_id": "nope"}), 404, "request_id"
        )
        assert_error(client.post("/no_such_endpoint", json={}), 404, says="not supported")

        # Limits of the shared server: 64 samples, 256 tokens, 64 datums per request.
        sample = {
            "base_model": str(tiny_model_dir),
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "num_samples": 1,
            "sampling_params": {"max_tokens": 4},
        }
        assert_error(
            client.post("/asample", json={**sample, "num_samples": 65}), 400, "num_samples", "64"
        )
        assert_error(client.post("/asample", json={**sample, "num_samples": 0}), 400, "num_samples")
        too_long = {**sample, "sampling_params": {"max_tokens": 257}}
        assert_error(
            client.post("/asample", json=too_long), 400, "sampling_params.max_tokens", "257"
        )
        assert_error(
            client.post("/asample", json={**sample, "num_samples": "many"}), 400, "num_samples"
        )

        sc = live_server.service_client()
        tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
        r = client.post(
            "/forward_backward", content=fb_body(tc.model_id, 1, [datum()] * 65), headers=PROTOBUF
        )
        assert_error(r, 400, "data", "65 datums")
    # The SDK sees the same refusal as an error that names the problem.
    sampler = sc.create_sampling_client(base_model=str(tiny_model_dir)).result()
    with pytest.raises(Exception, match="num_samples"):
        sampler.sample(
            types.ModelInput.from_ints([5]), 65, types.SamplingParams(max_tokens=2)
        ).result(timeout=60)
    # The training client was not disturbed by the refused requests.
    assert tc.forward([datum()], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    assert_serving(live_server, tiny_model_dir)


def test_oversized_requests_are_refused_with_413(keyed_server, tiny_model_dir):
    """--max-request-bytes 100000: a declared, a streamed (chunked) and a zstd-bombed body."""
    with http(keyed_server, KEY_A) as client:
        big = b"\x00" * 200_000
        assert_error(
            client.post("/forward_backward", content=big, headers=PROTOBUF), 413, "body", "100000"
        )
        streamed = client.post(
            "/asample",
            content=iter([b" " * 40_000] * 5),
            headers={"Content-Type": "application/json"},
        )
        assert "content-length" not in streamed.request.headers
        assert_error(streamed, 413, "body", "100000")
        bomb = zstandard.ZstdCompressor().compress(b"\x00" * 5_000_000)
        assert len(bomb) < 1000
        r = client.post(
            "/forward_backward", content=bomb, headers={**PROTOBUF, "Content-Encoding": "zstd"}
        )
        assert r.status_code in (400, 413)
        assert_error(r, r.status_code, "body", "100000")
    assert_serving(keyed_server, tiny_model_dir, KEY_A)


# -------------------------------------------------------------------------------- security


def test_missing_or_wrong_key_is_401(keyed_server):
    url = f"{keyed_server.base_url}/api/v1"
    assert_error(httpx.post(f"{url}/create_session", json={}), 401, "X-API-Key", "missing")
    for key in ("tml-gamma", "tml-alph", "not-a-tml-key"):
        r = httpx.post(f"{url}/create_session", json={}, headers={"X-API-Key": key})
        assert_error(r, 401, "X-API-Key", "not an accepted")
    r = httpx.get(f"{url}/training_runs", headers={"X-API-Key": "tml-gamma"})
    assert_error(r, 401, "X-API-Key")
    with pytest.raises(Exception, match="401|not an accepted"):
        tinker.RestClient(
            base_url=keyed_server.base_url, api_key="tml-gamma"
        ).list_training_runs().result(timeout=60)
    # Health needs no key; the right key works.
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    r = httpx.post(f"{url}/create_session", json=NEW_SESSION, headers={"X-API-Key": KEY_A})
    assert r.status_code == 200 and r.json()["session_id"]


def test_one_key_cannot_reach_anothers_model(keyed_server, tiny_model_dir):
    tc = (
        keyed_server.service_client(KEY_A)
        .create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0)
        .result()
    )
    saved = tc.save_state("mine").result().path
    with http(keyed_server, KEY_B) as b:
        r = b.post(
            "/forward_backward", content=fb_body(tc.model_id, 1, [datum()]), headers=PROTOBUF
        )
        assert_error(r, 404, "model_id", "unknown model")
        assert_error(b.post("/get_info", json={"model_id": tc.model_id}), 404, "model_id")
        save = {"model_id": tc.model_id, "path": "stolen", "seq_id": 5, "type": "save_weights"}
        assert_error(b.post("/save_weights", json=save), 404, "model_id")
        assert_error(b.get(f"/training_runs/{tc.model_id}"), 404)
        assert_error(b.get(f"/training_runs/{tc.model_id}/checkpoints"), 404)
        assert_error(b.delete(f"/training_runs/{tc.model_id}/checkpoints/weights/mine"), 404)
        assert_error(b.post("/weights_info", json={"tinker_path": saved}), 404)
    rest_b = tinker.RestClient(base_url=keyed_server.base_url, api_key=KEY_B)
    runs_b = rest_b.list_training_runs().result(timeout=60)
    assert tc.model_id not in [run.training_run_id for run in runs_b.training_runs]
    assert saved not in [
        c.tinker_path for c in rest_b.list_user_checkpoints().result(60).checkpoints
    ]
    sc_b = keyed_server.service_client(KEY_B)
    with pytest.raises(Exception, match="no checkpoint"):
        sc_b.create_training_client_from_state(saved).result(timeout=60)
    # Key A still sees, and can use, all of it: nothing of B's attempts changed anything.
    rest_a = tinker.RestClient(base_url=keyed_server.base_url, api_key=KEY_A)
    assert tc.model_id in [
        run.training_run_id for run in rest_a.list_training_runs().result(60).training_runs
    ]
    assert [c.tinker_path for c in rest_a.list_checkpoints(tc.model_id).result(60).checkpoints] == [
        saved
    ]
    assert tc.forward([datum()], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0


def test_checkpoint_path_traversal_is_refused(keyed_server, tiny_model_dir):
    """Paths and names that would leave the storage folder are refused, and a checkpoint-like
    folder planted outside storage (where `..` would lead) is neither read nor deleted."""
    storage = keyed_server.storage_dir
    sc = keyed_server.service_client(KEY_A)
    tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    run = tc.model_id
    real = tc.save_state("real").result(timeout=60).path
    victim = storage.parent / "weights" / "victim"  # what tinker://../weights/victim would name
    victim.mkdir(parents=True)
    metadata = (storage / run / "weights" / "real" / METADATA_FILE).read_text()
    (victim / METADATA_FILE).write_text(metadata)  # it looks like a checkpoint
    sentinel = victim / "keep.txt"
    sentinel.write_text("not yours")
    bad_paths = [
        f"tinker://{run}/weights/../../etc",
        f"tinker://{run}/weights/..",
        "tinker://../weights/victim",
        "tinker://%2E%2E/weights/victim",
        f"/{storage.parent}/weights/victim",
    ]
    with http(keyed_server, KEY_A) as a:
        session = a.post("/create_session", json=NEW_SESSION).json()["session_id"]
        for path in bad_paths:
            load = {
                "session_id": session,
                "model_seq_id": 0,
                "path": path,
                "optimizer": False,
                "type": "load_weights",
            }
            r = a.post("/load_weights", json=load)
            assert r.status_code in (400, 404)
            assert_error(r, r.status_code, "path")
            r = a.post("/weights_info", json={"tinker_path": path})
            assert r.status_code in (400, 404)
            assert_error(r, r.status_code)
            r = a.post(
                "/create_sampling_session",
                json={"session_id": session, "sampling_session_seq_id": 0, "model_path": path},
            )
            assert r.status_code in (400, 404)
            assert_error(r, r.status_code, "model_path")
        # Even with a database row for the outside path (planted, as a bug elsewhere might),
        # the checkpoint store refuses it: REST paths with encoded dot segments (httpx would
        # normalise literal ones away) are 400s, and loading fails.
        planted = ServerDatabase(storage / "server.sqlite3")
        planted.add_checkpoint(
            "tinker://../weights/victim",
            run,
            owner_of_key(KEY_A),
            "training",
            "victim",
            None,
            1,
            None,
        )
        try:
            for run_id, ckpt in [
                ("%2E%2E", "weights/victim"),
                (run, "weights/%2E%2E"),
                (run, "weights/%2E%2E%2F%2E%2E%2Fetc"),
            ]:
                url = f"/training_runs/{run_id}/checkpoints/{ckpt}"
                for r in (
                    a.delete(url),
                    a.put(f"{url}/ttl", json={"ttl_seconds": 3600}),
                    a.post(f"{url}/publish"),
                ):
                    assert_error(r, 400, "checkpoint_id")
            with pytest.raises(tinker.RequestFailedError, match="invalid run id"):
                sc.create_training_client_from_state("tinker://../weights/victim").result(60)
        finally:
            planted.delete_checkpoint("tinker://../weights/victim")
    for name in ("../escape", "a/b", "..", ".hidden"):
        with pytest.raises(tinker.RequestFailedError, match="not a valid checkpoint name"):
            tc.save_state(name).result(timeout=60)
        with pytest.raises(tinker.RequestFailedError, match="not a valid checkpoint name"):
            tc.save_weights_for_sampler(name).result(timeout=60)
    assert sentinel.read_text() == "not yours"
    assert sorted(p.name for p in victim.iterdir()) == sorted(["keep.txt", METADATA_FILE])
    assert (victim / METADATA_FILE).read_text() == metadata
    assert real.endswith("/weights/real")
    assert not (storage.parent / "escape").exists() and not (storage / "escape").exists()
    assert tc.forward([datum()], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0


def test_remote_bind_without_keys_refuses_to_start(tiny_model_dir, tmp_path):
    command = [
        sys.executable,
        "-m",
        "skyrl_trainer.server",
        "--host",
        "0.0.0.0",
        "--port",
        str(free_port()),
        "--base-model",
        str(tiny_model_dir),
        "--storage-dir",
        str(tmp_path / "storage"),
        "--device",
        "cpu",
    ]
    env = {k: v for k, v in os.environ.items() if k != "SKYRL_SERVER_API_KEYS"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "API key" in output and "0.0.0.0" in output, output
    assert "Traceback" not in output
    assert not (tmp_path / "storage" / "server.sqlite3").exists()


# ------------------------------------------------------------------------- restart and TTL


def test_restart_keeps_checkpoints_and_explains_lost_models(keyed_server, tiny_model_dir):
    server = keyed_server
    sc = server.service_client(KEY_A)
    tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    tc.forward_backward([datum()], "cross_entropy").result(timeout=60)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    path = tc.save_state("ckpt").result(timeout=60).path
    at_checkpoint = logprobs(tc.forward([datum()], "cross_entropy").result(timeout=60))
    # One more step from the checkpoint, before the restart: the reference for the optimizer.
    tc.forward_backward([datum()], "cross_entropy").result(timeout=60)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    after_step = logprobs(tc.forward([datum()], "cross_entropy").result(timeout=60))
    assert not np.allclose(after_step, at_checkpoint)
    old_model = tc.model_id
    with http(server, KEY_A) as client:  # a request still waiting (seq gap) at the stop
        r = client.post(
            "/forward_backward", content=fb_body(old_model, 50, [datum()]), headers=PROTOBUF
        )
        orphan = r.json()["request_id"]

    server.stop()
    server.start()

    sc2 = server.service_client(KEY_A)
    tc2 = sc2.create_training_client_from_state_with_optimizer(path).result(timeout=60)
    assert tc2.model_id != old_model
    np.testing.assert_allclose(
        logprobs(tc2.forward([datum()], "cross_entropy").result(timeout=60)),
        at_checkpoint,
        rtol=0,
        atol=1e-6,
    )
    tc2.forward_backward([datum()], "cross_entropy").result(timeout=60)
    tc2.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    np.testing.assert_allclose(  # the Adam moments came back too
        logprobs(tc2.forward([datum()], "cross_entropy").result(timeout=60)),
        after_step,
        rtol=0,
        atol=1e-5,
    )

    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    assert path in [c.tinker_path for c in rest.list_checkpoints(old_model).result(60).checkpoints]
    runs = [
        run.training_run_id for run in rest.list_training_runs(limit=100).result(60).training_runs
    ]
    assert old_model in runs and tc2.model_id in runs

    with http(server, KEY_A) as client:
        r = client.post("/get_info", json={"model_id": old_model})
        assert_error(r, 404, "model_id", "no longer loaded")
        assert "restarted" in r.json()["error"]
        r = client.post(
            "/forward_backward", content=fb_body(old_model, 60, [datum()]), headers=PROTOBUF
        )
        assert_error(r, 404, "model_id", "restarted")
        r = retrieve(client, orphan)  # the request the stop cut off failed, and says why
        assert r.status_code == 200 and r.json()["category"] == "server"
        assert "restarted" in r.json()["error"]
    with pytest.raises(Exception, match="restarted"):  # the old SDK client hears it too
        tc.forward([datum()], "cross_entropy").result(timeout=60)


def test_ttl_expiry_and_rest_ttl_and_delete(keyed_server, tiny_model_dir):
    server = keyed_server
    sc = server.service_client(KEY_A)
    tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    keep = tc.save_state("keep").result(timeout=60).path
    later = tc.save_state("later").result(timeout=60).path
    gone = tc.save_state("gone").result(timeout=60).path
    short = tc.save_state("short", ttl_seconds=3).result(timeout=60).path
    sampler_short = tc.save_weights_for_sampler("short-s", ttl_seconds=3).result(timeout=60).path
    rescued = tc.save_state("rescued", ttl_seconds=3).result(timeout=60).path
    rest.set_checkpoint_ttl_from_tinker_path(rescued, None).result(timeout=60)  # no expiry now
    storage = server.storage_dir

    def folder(path: str) -> Path:
        run, kind, name = path.removeprefix("tinker://").split("/")
        return storage / run / kind / name

    def listed() -> dict[str, types.Checkpoint]:
        return {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result(60).checkpoints}

    first = listed()
    assert set(first) == {short, sampler_short, rescued, keep, later, gone}
    assert first[rescued].expires_at is None
    assert 0 < first[short].expires_at.timestamp() - time.time() <= 3
    assert first[keep].expires_at is None
    assert folder(short).is_dir() and folder(sampler_short).is_dir()

    deadline = time.monotonic() + 20
    while (short in listed() or sampler_short in listed()) and time.monotonic() < deadline:
        time.sleep(0.2)
    now = listed()
    assert short not in now and sampler_short not in now and keep in now
    assert not folder(short).exists() and not folder(sampler_short).exists()
    assert folder(keep).is_dir()
    assert rescued in now and folder(rescued).is_dir()  # its original TTL no longer applies
    assert sc.create_training_client_from_state(rescued).result(timeout=60).model_id
    with pytest.raises(Exception, match="no checkpoint"):
        sc.create_training_client_from_state(short).result(timeout=60)
    with pytest.raises(Exception, match="no checkpoint"):
        sc.create_sampling_client(model_path=sampler_short).result(timeout=60)
    assert short not in [c.tinker_path for c in rest.list_user_checkpoints().result(60).checkpoints]

    # set_checkpoint_ttl: set, clear, and set short (then housekeeping removes it).
    rest.set_checkpoint_ttl_from_tinker_path(later, 7200).result(timeout=60)
    expires = listed()[later].expires_at
    assert expires is not None and 7000 < expires.timestamp() - time.time() <= 7200
    rest.set_checkpoint_ttl_from_tinker_path(later, None).result(timeout=60)
    assert listed()[later].expires_at is None
    rest.set_checkpoint_ttl_from_tinker_path(keep, 1).result(timeout=60)
    deadline = time.monotonic() + 20
    while keep in listed() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert keep not in listed() and not folder(keep).exists()
    assert later in listed() and folder(later).is_dir()  # its TTL was cleared: it stays

    # delete_checkpoint
    rest.delete_checkpoint_from_tinker_path(gone).result(timeout=60)
    assert gone not in listed() and not folder(gone).exists()
    with pytest.raises(Exception, match="no checkpoint"):
        sc.create_training_client_from_state(gone).result(timeout=60)
    with pytest.raises(Exception, match="404|no checkpoint"):
        rest.delete_checkpoint_from_tinker_path(gone).result(timeout=60)
    # what is left still loads
    assert sc.create_training_client_from_state(later).result(timeout=60).model_id
