"""The server-side rebuild of traced custom losses (`backend.custom_loss_graph`).

Losses are traced and encoded with the official SDK's own `trace_loss` / `encode_graph`, sent
through JSON as on the wire, rebuilt from the allowlist, and run on random float64 tensors:
the loss, the metrics and the gradient wrt logprobs equal those of the traced function. Then
hostile graphs (hand-written node lists) are refused, each naming what was refused.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from skyrl_trainer.backend import custom_loss_graph as clg
from skyrl_trainer.backend.errors import InvalidRequestError


def dpo(logprobs, ref_logprobs, chosen_mask, rejected_mask, beta):
    delta = logprobs - ref_logprobs
    margin = (delta * chosen_mask).sum() - (delta * rejected_mask).sum()
    loss = -F.logsigmoid(beta * margin)
    return loss, {
        "custom/margin:mean": margin.detach(),
        "custom/accuracy:mean": (margin > 0).float(),
    }


def clipped_pg(logprobs, logprobs_old, advantages):
    ratio = torch.exp(logprobs - logprobs_old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    n = logprobs.shape[0]
    loss = per_token.sum() / n + 0.01 * (logprobs[1:] - logprobs[:-1]).pow(2).mean()
    tail = torch.where(advantages > 0, logprobs, torch.full_like(logprobs, -math.inf))
    return loss, {"custom/ratio_max:sum": ratio.max(), "custom/best:sum": tail.amax()}


def topk_distill(logprobs, target_probs):
    # logprobs [T, K]: K candidate targets per position.
    normalised = logprobs - torch.logsumexp(logprobs, dim=-1, keepdim=True)
    loss = -(target_probs * normalised).sum() + 0.1 * F.softplus(-logprobs.mean())
    return loss, {"custom/entropy:mean": -(normalised.exp() * normalised).sum(dim=-1).mean()}


def shapes_and_methods(logprobs, weights, scale):
    x = logprobs.unsqueeze(0).reshape(1, -1).squeeze(0).to(torch.float64)
    y = x.view(-1)[: x.size(0) // 2 + 1]
    z = torch.cat([y, x[-1:]]).sigmoid().log().neg()
    w = weights.double().clamp(min=0.0) * scale
    loss = (z.sum() + (x * w).sum()) * 0.5 - x.mean() ** 2
    return loss, {}


CASES = {
    "dpo": (dpo, {"logprobs": 1, "ref_logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "beta": 0}),
    "clipped_pg": (clipped_pg, {"logprobs": 1, "logprobs_old": 1, "advantages": 1}),
    "topk_distill": (topk_distill, {"logprobs": 2, "target_probs": 2}),
    "shapes_and_methods": (shapes_and_methods, {"logprobs": 1, "weights": 1, "scale": 0}),
}  # fmt: skip


def upload(fn, ranks):
    """Trace and encode as the SDK does; what the server receives (through JSON)."""
    handle = trace_loss(fn, ranks, "session")
    request = types.CreateCustomLossRequest(
        session_id="session",
        custom_loss_seq_id=0,
        name=handle.name,
        inputs=list(handle.inputs),
        graph=encode_graph(handle),
    )
    wire = json.loads(json.dumps(request.model_dump(mode="json", exclude_none=True)))
    return handle, types.CreateCustomLossRequest.model_validate(wire)


def random_inputs(ranks, generator, t=9, k=4):
    values = []
    for name, rank in ranks.items():
        shape = [(), (t,), (t, k)][rank]
        if name == "logprobs":
            values.append(-torch.rand(shape, generator=generator, dtype=torch.float64) * 5)
        elif "mask" in name:
            values.append((torch.rand(shape, generator=generator) > 0.5).double())
        else:
            values.append(torch.randn(shape, generator=generator, dtype=torch.float64))
    return values


@pytest.mark.parametrize("case", sorted(CASES))
def test_rebuild_matches_the_traced_function(case):
    fn, ranks = CASES[case]
    handle, request = upload(fn, ranks)
    program = clg.rebuild(request.name, request.inputs, request.graph)
    assert program.input_names == tuple(list(ranks)[1:])
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        values = random_inputs(ranks, generator)
        results = []
        for runner in (fn, handle.graph, lambda *v: program.run(v[0], list(v[1:]))):
            lp = values[0].clone().requires_grad_(True)
            loss, metrics = runner(lp, *values[1:])
            loss.backward()
            results.append((loss.detach(), {k: v.detach() for k, v in metrics.items()}, lp.grad))
        (ref_loss, ref_metrics, ref_grad), *others = results
        for loss, metrics, grad in others:
            assert loss.dtype == torch.float64
            torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
            assert metrics.keys() == ref_metrics.keys()
            for key in metrics:
                torch.testing.assert_close(metrics[key], ref_metrics[key], rtol=1e-12, atol=0)


def test_rebuilt_program_pickles():
    import pickle

    _, request = upload(*CASES["dpo"])
    program = clg.rebuild(request.name, request.inputs, request.graph)
    assert pickle.loads(pickle.dumps(clg.loss_spec(program).fn)).program == program


# ---------------------------------------------------------------------------------------------
# Hostile graphs


def ph(name):
    return {"op": "placeholder", "name": name, "target": name, "args": [], "kwargs": {}}


def call(name, target, args, kwargs=None, op="call_function"):
    return {"op": op, "name": name, "target": target, "args": args, "kwargs": kwargs or {}}


def out(loss="loss", metrics=None):
    value = {"tuple": [{"ref": loss}, {"dict": metrics or {}}]}
    return {"op": "output", "name": "output", "target": "output", "args": [value], "kwargs": {}}


INPUTS = [{"name": "logprobs", "rank": 1}]


def good_nodes():
    return [ph("logprobs"), call("loss", "torch.sum", [{"ref": "logprobs"}]), out()]


def refused(nodes, *needles, inputs=INPUTS):
    with pytest.raises(InvalidRequestError) as info:
        clg.rebuild("hostile", inputs, {"format": 1, "nodes": nodes})
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    return str(info.value)


def test_a_minimal_graph_is_accepted():
    program = clg.rebuild("ok", INPUTS, {"format": 1, "nodes": good_nodes()})
    loss, metrics = program.run(torch.ones(3, dtype=torch.float64), [])
    assert float(loss) == 3.0 and metrics == {}


def test_unknown_function_is_refused_without_being_imported():
    module = "skyrl_never_imported_probe"
    assert module not in sys.modules
    nodes = good_nodes()
    nodes[1] = call("loss", f"{module}.boom", [{"ref": "logprobs"}])
    refused(nodes, f"'{module}.boom' is not allowed", "graph.nodes[1] (loss)")
    assert module not in sys.modules
    for target in ("os.system", "builtins.eval", "eval", "torch.load", "torch.save",
                   "subprocess.run", "torch.Tensor.backward", "importlib.import_module"):  # fmt: skip
        nodes[1] = call("loss", target, [{"ref": "logprobs"}])
        refused(nodes, f"function {target!r} is not allowed")


@pytest.mark.parametrize(
    "node, needles",
    [
        (call("loss", "backward", [{"ref": "logprobs"}], op="call_method"), ["tensor method 'backward'"]),
        (call("loss", "__reduce_ex__", [{"ref": "logprobs"}, 2], op="call_method"), ["'__reduce_ex__'"]),
        (call("loss", "add_", [{"ref": "logprobs"}, 1.0], op="call_method"), ["'add_' is not allowed"]),
        (call("loss", "item", [{"ref": "logprobs"}], op="call_method"), ["'item' is not allowed"]),
        ({"op": "get_attr", "name": "loss", "target": "weight", "args": [], "kwargs": {}}, ["get_attr 'weight' is refused"]),
        ({"op": "call_module", "name": "loss", "target": "linear", "args": [], "kwargs": {}}, ["call_module 'linear' is refused"]),
        ({"op": "exec", "name": "loss", "target": "x", "args": [], "kwargs": {}}, ["node op 'exec'"]),
        (call("loss", "getattr", [{"ref": "logprobs"}, "__class__"]), ["getattr of attribute '__class__'"]),
        (call("loss", "getattr", [{"ref": "logprobs"}, "grad_fn"]), ["getattr of attribute 'grad_fn'"]),
        (call("loss", "getattr", ["torch", "load"]), ["getattr may only read attributes of graph values"]),
        (call("loss", "torch.sum", []), ["'torch.sum' takes 1 to 3 positional arguments, got 0"]),
        (call("loss", "torch.exp", [{"ref": "logprobs"}, 1, 2]), ["'torch.exp' takes 1 positional"]),
        (call("loss", "torch.sum", [{"ref": "logprobs"}], {"out": {"ref": "logprobs"}}), ["keyword argument 'out'"]),
        (call("loss", "sum", [1.0], op="call_method"), ["must be called on a graph value"]),
        (call("loss", "torch.sum", [{"ref": "later"}]), ["refers to 'later', which is not an earlier node"]),
        (call("loss", "torch.sum", [{"ref": "loss"}]), ["refers to 'loss'"]),
        (call("loss", "torch.sum", [{"code": "import os"}]), ["is not an allowed encoded value"]),
        (call("loss", "torch.sum", [{"ref": "logprobs", "x": 1}]), ["is not an encoded value"]),
        (call("loss", "torch.sum", [{"dtype": "object"}]), ["is not an allowed encoded value"]),
        (call("loss", "torch.sum", [{"ref": "logprobs"}, 2**80]), ["out of range"]),
        (call("loss", "torch.sum", [[[[[[[[[[[1]]]]]]]]]]]), ["nest deeper"]),
        (call("bad name!", "torch.sum", [{"ref": "logprobs"}]), ["not a valid node name"]),
    ],
)  # fmt: skip
def test_hostile_nodes_are_refused(node, needles):
    nodes = good_nodes()
    nodes[1] = node
    refused(nodes, *needles)


def test_hostile_graph_shapes_are_refused():
    huge = [ph("logprobs")] + [
        call(f"n{i}", "torch.exp", [{"ref": "logprobs"}]) for i in range(clg.MAX_NODES)
    ]
    refused([*huge, out("n0")], f"has {clg.MAX_NODES + 2} nodes", f"at most {clg.MAX_NODES}")
    refused(good_nodes()[:2], "no output node")
    refused([ph("other"), *good_nodes()[1:]], "placeholder 0 is 'other'; expected 'logprobs'")
    refused([call("x", "torch.sum", [1]), *good_nodes()], "the first 1 nodes must be the inputs")
    dup = good_nodes()
    dup.insert(2, call("loss", "torch.sum", [{"ref": "logprobs"}]))
    refused(dup, "used twice")
    early = good_nodes()
    early.insert(1, out())
    refused(early, "must be the last node")
    refused([*good_nodes()[:2], out(metrics={"loss": {"ref": "loss"}})], "metric 'loss'")
    refused([*good_nodes()[:2], out(metrics={"custom/x:sum": 1.0})], "must be a tensor computed")
    bad_output = {"op": "output", "name": "output", "target": "output", "args": [{"ref": "loss"}]}
    refused([*good_nodes()[:2], bad_output], "must return (loss, metrics)")
    with pytest.raises(InvalidRequestError, match="format 1"):
        clg.rebuild("x", INPUTS, {"format": 2, "nodes": good_nodes()})


def test_hostile_inputs_are_refused():
    for inputs, needle in [
        ([{"name": "ref", "rank": 1}], "must be logprobs"),
        ([{"name": "logprobs", "rank": 0}], "must be logprobs, of rank 1"),
        ([{"name": "logprobs", "rank": 3}], "a rank is 0, 1 or 2"),
        ([{"name": "logprobs", "rank": 1}, {"name": "Bad-Name", "rank": 1}], "lowercase"),
        ([{"name": "logprobs", "rank": 1}, {"name": "x", "rank": 1}, {"name": "x", "rank": 1}], "declared twice"),
        ([{"name": "logprobs", "rank": 1}] + [{"name": f"x{i}", "rank": 1} for i in range(16)], "1 to 16"),
    ]:  # fmt: skip
        with pytest.raises(InvalidRequestError, match=needle):
            clg.rebuild("x", inputs, {"format": 1, "nodes": good_nodes()})


def run(nodes, *inputs, lp=None):
    declared = [{"name": "logprobs", "rank": 1}] + [
        {"name": f"x{i}", "rank": 1} for i in range(len(inputs))
    ]
    program = clg.rebuild("runtime", declared, {"format": 1, "nodes": nodes})
    return program.run(torch.zeros(4) if lp is None else lp, list(inputs))


def test_runtime_bombs_are_refused_before_they_allocate():
    lp = {"ref": "logprobs"}
    nodes = [
        ph("logprobs"),
        call("a", "torch.unsqueeze", [lp, 0]),
        call("b", "torch.unsqueeze", [lp, 1]),
        call("c", "operator.mul", [{"ref": "a"}, {"ref": "b"}]),  # T x T
        call("d", "torch.unsqueeze", [{"ref": "c"}, 2]),
        call("e", "operator.mul", [{"ref": "d"}, {"ref": "a"}]),  # T x T x T
        call("loss", "torch.sum", [{"ref": "e"}]),
        out(),
    ]
    with pytest.raises(InvalidRequestError, match="node e .*over 16777216 values"):
        run(nodes, lp=torch.zeros(2048))
    assert float(run(nodes, lp=torch.ones(8))[0]) == 512.0  # small is fine
    powers = [ph("logprobs"), call("p", "operator.pow", [2, 10**6]), out("p")]
    with pytest.raises(InvalidRequestError, match="integer power 1000000"):
        run(powers)
    squares = [ph("logprobs"), call("s", "operator.mul", [2**40, 2**40]), out("s")]
    with pytest.raises(InvalidRequestError, match="integer out of range"):
        run(squares)
    strings = [ph("logprobs"), call("s", "operator.mul", ["x", 10**9]), out("s")]
    with pytest.raises(InvalidRequestError, match="not a tensor or a bounded number"):
        run(strings)
    to_device = [ph("logprobs"), call("loss", "to", [lp, "meta"], op="call_method"), out()]
    with pytest.raises(InvalidRequestError, match=r"to\(\) takes a dtype"):
        run(to_device)
    on_int = [
        ph("logprobs"),
        call("n", "size", [lp, 0], op="call_method"),
        call("loss", "sum", [{"ref": "n"}], op="call_method"),
        out(),
    ]
    with pytest.raises(InvalidRequestError, match="called on a non-tensor"):
        run(on_int)


def test_runtime_errors_name_the_node_and_bad_results_are_refused():
    lp = {"ref": "logprobs"}
    mismatch = [ph("logprobs"), ph("x0"), call("loss", "operator.add", [lp, {"ref": "x0"}]), out()]
    with pytest.raises(InvalidRequestError, match=r"node loss \(operator.add\): RuntimeError"):
        run(mismatch, torch.zeros(3))
    vector = [ph("logprobs"), call("loss", "torch.exp", [lp]), out()]
    with pytest.raises(InvalidRequestError, match="must return a scalar loss tensor"):
        run(vector)
    not_scalar_metric = [
        ph("logprobs"),
        call("loss", "torch.sum", [lp]),
        out(metrics={"custom/all:sum": lp}),
    ]
    with pytest.raises(InvalidRequestError, match="metric 'custom/all:sum' must be a one-value"):
        run(not_scalar_metric)
