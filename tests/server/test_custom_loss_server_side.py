"""Server-side custom losses through the official SDK against a live server.

The server says `custom_loss_server_side`, so `ServiceClient.create_custom_loss` uploads the
traced loss and `forward_backward_custom(data, handle)` runs it in ONE server-side pass. A
DPO-style loss (a chosen and a rejected completion per datum, reference logprobs as inputs)
gives the same loss, metrics, logprobs and updated weights as the SDK's client-side two-pass
path (the same handle without its loss id: forward, loss and gradient on the client,
cross_entropy backward with the gradient as weights), and as the in-process clients. Hostile
graphs are refused at upload, naming what was refused.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import numpy as np
import pytest
import tinker
import torch
import torch.nn.functional as F
from tinker import types
from tinker.lib.api_future_impl import _APIFuture

from skyrl_trainer.backend.clients import ServiceClient as LocalServiceClient
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig

warnings.filterwarnings("ignore", category=FutureWarning)

ADAM = types.AdamParams(learning_rate=1e-2)
LORA = dict(rank=8, seed=3)


def dpo_loss(logprobs, ref_logprobs, chosen_mask, rejected_mask, beta):
    """DPO on one packed pair: -log sigmoid(beta * (chosen log-ratio - rejected log-ratio))."""
    delta = logprobs - ref_logprobs
    margin = (delta * chosen_mask).sum() - (delta * rejected_mask).sum()
    loss = -F.logsigmoid(beta * margin)
    return loss, {
        "custom/margin:mean": margin.detach(),
        "custom/accuracy:mean": (margin > 0).float(),
        "custom/chosen_logprob:sum": (logprobs * chosen_mask).sum().detach(),
    }


RANKS = {"logprobs": 1, "ref_logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "beta": 0}


def pairs(n: int = 6, seed: int = 0) -> list[tuple[list[int], list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(10, 4000, size=int(rng.integers(4, 9))).tolist()
        chosen = rng.integers(10, 4000, size=int(rng.integers(3, 7))).tolist()
        rejected = rng.integers(10, 4000, size=int(rng.integers(3, 7))).tolist()
        out.append((prompt, chosen, rejected))
    return out


def packed(prompt, chosen, rejected):
    """prompt + chosen + prompt + rejected as one datum; the masks select the target positions
    of the two completions."""
    tokens = prompt + chosen + prompt + rejected
    n = len(tokens) - 1
    chosen_mask = np.zeros(n, np.float32)
    rejected_mask = np.zeros(n, np.float32)
    p, c = len(prompt), len(chosen)
    chosen_mask[p - 1 : p - 1 + c] = 1
    rejected_mask[2 * p + c - 1 :] = 1
    return tokens, chosen_mask, rejected_mask


def reference_data(batch) -> list[types.Datum]:
    """Datums for a forward pass that gives the reference logprobs."""
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)},
        )
        for tokens, _, _ in (packed(*pair) for pair in batch)
    ]


def dpo_data(batch, reference: types.ForwardBackwardOutput, beta=0.5) -> list[types.Datum]:
    data = []
    for pair, ref in zip(batch, reference.loss_fn_outputs, strict=True):
        tokens, chosen_mask, rejected_mask = packed(*pair)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "ref_logprobs": ref["logprobs"].to_numpy().astype(np.float32),
                    "chosen_mask": chosen_mask,
                    "rejected_mask": rejected_mask,
                    "beta": np.array(beta, dtype=np.float32),
                },
            )
        )
    return data


def train(service, base_model: str, handle, steps: int = 3) -> dict:
    """DPO steps with `handle` from the same LoRA init; what comes out of each."""
    batch = pairs()
    tc = service.create_lora_training_client(base_model=base_model, **LORA).result()
    reference = tc.forward(reference_data(batch), "cross_entropy").result()
    data = dpo_data(batch, reference)
    out = {"reference": reference, "steps": []}
    for _ in range(steps):
        start = time.perf_counter()
        result = tc.forward_backward_custom(data, handle).result()
        out["steps"].append((result, time.perf_counter() - start))
        tc.optim_step(ADAM).result()
    out["after"] = tc.forward(reference_data(batch), "cross_entropy").result()
    return out


def logprobs(output: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in output.loss_fn_outputs]


def assert_same_run(a: dict, b: dict, *, rel=1e-4):
    for (x, _), (y, _) in zip(a["steps"], b["steps"], strict=True):
        for key in ("loss:sum", "custom/margin:mean", "custom/accuracy:mean",
                    "custom/chosen_logprob:sum"):  # fmt: skip
            assert x.metrics[key] == pytest.approx(y.metrics[key], rel=rel, abs=1e-5), key
        for p, q in zip(logprobs(x), logprobs(y), strict=True):
            np.testing.assert_allclose(p, q, rtol=rel, atol=1e-5)
    for p, q in zip(logprobs(a["after"]), logprobs(b["after"]), strict=True):
        np.testing.assert_allclose(p, q, rtol=rel, atol=1e-5)


@pytest.fixture(scope="module")
def service(live_server):
    return live_server.service_client()


@pytest.fixture(scope="module")
def runs(service, tiny_model_dir, tmp_path_factory):
    handle = service.create_custom_loss(dpo_loss, RANKS).result()
    client_side = dataclasses.replace(handle, loss_id=None)
    local = LocalServiceClient(
        BackendConfig(
            storage_dir=str(tmp_path_factory.mktemp("custom_loss_local")),
            training=TrainingConfig(dtype="float32", device="cpu"),
            sampling=SamplingConfig(engine="torch", dtype="float32", device="cpu"),
        )
    )
    try:
        local_handle = local.create_custom_loss(dpo_loss, RANKS).result()
        base = str(tiny_model_dir)
        yield {
            "handle": handle,
            "local_handle": local_handle,
            "server_side": train(service, base, handle),
            "client_side": train(service, base, client_side),
            "in_process": train(local, base, local_handle),
        }
    finally:
        local.core.shutdown()


def test_server_advertises_server_side_custom_losses(service):
    assert service.holder.get_client_config().custom_loss_server_side is True


def test_dpo_server_side_equals_the_sdk_client_side_two_pass_path(runs):
    server, client = runs["server_side"], runs["client_side"]
    assert runs["handle"].loss_id and runs["handle"].loss_id.split(":")[-2] == "loss"
    assert_same_run(server, client)
    # one pass: no surrogate; the client-side path reports its cross_entropy surrogate
    first_server, first_client = server["steps"][0][0], client["steps"][0][0]
    assert "surrogate_loss:sum" not in first_server.metrics
    assert "surrogate_loss:sum" in first_client.metrics
    # the policy starts at the reference: margin 0, loss 6 * log 2; then DPO moves it
    assert first_server.metrics["loss:sum"] == pytest.approx(6 * np.log(2), rel=1e-5)
    last = server["steps"][-1][0]
    assert last.metrics["custom/margin:mean"] > 0.01
    assert last.metrics["loss:sum"] < first_server.metrics["loss:sum"]
    moved = [
        np.abs(p - q).max()
        for p, q in zip(logprobs(server["after"]), logprobs(server["reference"]))
    ]
    assert max(moved) > 1e-3


def test_in_process_clients_run_the_same_loss_server_side(runs):
    assert runs["local_handle"].loss_id is not None
    assert_same_run(runs["in_process"], runs["server_side"])


def test_forward_backward_custom_refusals(live_server, service, tiny_model_dir, runs):
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), **LORA).result()
    batch = pairs(2)
    data = dpo_data(batch, tc.forward(reference_data(batch), "cross_entropy").result())
    with pytest.raises(tinker.RequestFailedError, match="unknown custom loss 'nope'"):
        tc.forward_backward(data, "custom", {"loss_id": "nope"}).result()
    with pytest.raises(tinker.RequestFailedError, match="pass \\{'loss_id'"):
        tc.forward_backward(data, "custom").result()
    # a loss of another session is not usable
    other = live_server.service_client()
    foreign = other.create_custom_loss(dpo_loss, RANKS).result()
    with pytest.raises(tinker.RequestFailedError, match="unknown custom loss"):
        tc.forward_backward(data, "custom", {"loss_id": foreign.loss_id}).result()
    # inputs checked on the server too (the SDK checks before sending: bypass it)
    handle = runs["handle"]
    extra = [
        types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "junk": np.zeros(3, np.float32)})
        for d in data
    ]  # fmt: skip
    with pytest.raises(tinker.RequestFailedError, match=r"loss_fn_inputs.junk: is not read"):
        tc.forward_backward(extra, "custom", {"loss_id": handle.loss_id}).result()
    wrong_rank = [
        types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "beta": np.ones(2, np.float32)})
        for d in data
    ]  # fmt: skip
    with pytest.raises(tinker.RequestFailedError, match=r"beta: has rank 1 .* declared rank 0"):
        tc.forward_backward(wrong_rank, "custom", {"loss_id": handle.loss_id}).result()
    # the model still trains after the refusals
    assert tc.forward_backward_custom(data, handle).result().metrics["loss:sum"] > 0


# ---------------------------------------------------------------------------------------------
# Hostile uploads: graphs the SDK would not produce, sent through its own upload call


def upload(service, nodes, inputs=(("logprobs", 1),), name="hostile") -> str:
    holder = service.holder
    graph = types.CustomLossGraph(nodes=[types.CustomLossNode(**node) for node in nodes])
    loss_inputs = [types.CustomLossInput(name=n, rank=r) for n, r in inputs]

    async def go():
        future = await holder._create_custom_loss(name, loss_inputs, graph)
        response = await _APIFuture(
            types.CreateCustomLossResponse, holder, future, time.time(), "CreateCustomLoss"
        ).result_async()
        return response.loss_id

    return holder.run_coroutine_threadsafe(go()).result()


def ph(name):
    return {"op": "placeholder", "name": name, "target": name}


def call(name, target, args, kwargs=None, op="call_function"):
    return {"op": op, "name": name, "target": target, "args": args, "kwargs": kwargs or {}}


OUT = {"op": "output", "name": "output", "target": "output", "args": [{"tuple": [{"ref": "loss"}, {"dict": {}}]}]}  # fmt: skip
LP = {"ref": "logprobs"}


@pytest.mark.parametrize(
    "node, message",
    [
        (call("loss", "skyrl_evil_probe.run", [LP]), "function 'skyrl_evil_probe.run' is not allowed"),
        (call("loss", "os.system", ["echo pwned"]), "function 'os.system' is not allowed"),
        (call("loss", "builtins.eval", ["1"]), "function 'builtins.eval' is not allowed"),
        (call("loss", "getattr", [LP, "__class__"]), "getattr of attribute '__class__' is not allowed"),
        ({"op": "get_attr", "name": "loss", "target": "weight"}, "get_attr 'weight' is refused"),
        ({"op": "call_module", "name": "loss", "target": "lin", "args": [LP]}, "call_module 'lin' is refused"),
        (call("loss", "torch.exp", [LP, LP]), "'torch.exp' takes 1 positional arguments, got 2"),
        (call("loss", "register_hook", [LP, 1], op="call_method"), "tensor method 'register_hook' is not allowed"),
        (call("loss", "torch.sum", [{"ref": "nowhere"}]), "refers to 'nowhere', which is not an earlier node"),
    ],
)  # fmt: skip
def test_hostile_graphs_are_refused_with_a_clear_error(service, node, message):
    with pytest.raises(tinker.RequestFailedError) as info:
        upload(service, [ph("logprobs"), node, OUT])
    assert message in str(info.value)
    assert "graph.nodes[1] (loss)" in str(info.value)


def test_huge_graph_and_bad_inputs_are_refused(service):
    nodes = [ph("logprobs")] + [call(f"n{i}", "torch.exp", [LP]) for i in range(2000)]
    nodes.append(call("loss", "torch.sum", [LP]))
    with pytest.raises(
        tinker.RequestFailedError, match="has 2003 nodes; a custom loss may have at most 1024"
    ):
        upload(service, [*nodes, OUT])
    with pytest.raises(tinker.RequestFailedError, match="inputs\\[0\\]: must be logprobs"):
        upload(
            service, [ph("x"), call("loss", "torch.sum", [{"ref": "x"}]), OUT], inputs=[("x", 1)]
        )
    with pytest.raises(tinker.RequestFailedError, match="placeholder 1 is 'b'; expected 'a'"):
        upload(
            service,
            [ph("logprobs"), ph("b"), call("loss", "torch.sum", [LP]), OUT],
            inputs=[("logprobs", 1), ("a", 1)],
        )
    # a good upload on the same session still works
    assert upload(service, [ph("logprobs"), call("loss", "torch.sum", [LP]), OUT], name="ok")


def test_client_side_tracing_refusals_stay_client_side(service):
    def captures_module(logprobs):
        return torch.nn.Linear(1, 1)(logprobs[:, None]).sum(), {}

    with pytest.raises(ValueError, match="create_custom_loss"):
        service.create_custom_loss(captures_module, {"logprobs": 1})
