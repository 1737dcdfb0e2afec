"""Server-side custom losses: rebuild a traced loss graph from an explicit allowlist.

The Tinker SDK's `ServiceClient.create_custom_loss(fn, input_ranks)` traces a per-datum loss
`fn(logprobs, *inputs) -> (scalar loss, {"custom/<name>:sum|mean": tensor})` with torch.fx and,
when the server says `custom_loss_server_side`, uploads the graph as plain data
(`tinker.types.CustomLossGraph`: nodes in execution order, arguments encoded as JSON). Then
`forward_backward(data, "custom", {"loss_id": ...})` runs it on the learner's log-probs in ONE
pass: the learner computes log-probs, the rebuilt graph computes each datum's loss from them
and the datum's `loss_fn_inputs`, and autograd backpropagates through both.

Nothing in an uploaded graph is imported, evaluated or looked up by name outside this module's
tables (`custom_loss_ops`): a `call_function` target is a key of `FUNCTIONS` (built from function objects this
module names, keyed the way the SDK names them), a `call_method` target a key of `METHODS`
(looked up on a tensor only after the check), a `getattr` an attribute of `ATTRIBUTES`.
`get_attr` (captured tensors) and `call_module` nodes are refused, so are unknown targets,
wrong arities, unknown keyword arguments, forward references, malformed argument encodings and
graphs past the size limits. Every refusal is an `InvalidRequestError` naming the node and
what was refused.

Limits: `MAX_NODES` nodes, `MAX_LITERALS` literal values in all arguments, `MAX_ARG_DEPTH`
nesting, `MAX_INPUTS` inputs (logprobs included), `MAX_METRICS` metrics. At run time every
tensor an operation makes may hold at most `MAX_ELEMENTS` values (checked before an elementwise
or matmul-like operation runs, from its operands' shapes, and after every operation), and
arithmetic on plain Python numbers is bounded (no huge integers, no string repetition).

Device constants in the graph (`{"device": "cpu"}`) mean the learner's device here: the
client's device names nothing on the server.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tinker import types

from skyrl_trainer.backend.custom_loss_ops import (
    ATTRIBUTES,
    DTYPES,
    FUNCTIONS,
    LAYOUTS,
    MEMORY_FORMATS,
    METHODS,
    Op,
)
from skyrl_trainer.backend.datums import (
    SPARSE_KEYS,
    TrainingExample,
    tensor_data_to_numpy,
    to_training_example,
)
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.losses import LossSpec

__all__ = [
    "ATTRIBUTES",
    "FUNCTIONS",
    "METHODS",
    "CustomLossProgram",
    "rebuild",
]

MAX_NODES = 1024
MAX_LITERALS = 65_536
MAX_ARG_DEPTH = 8
MAX_STRING = 256
MAX_INPUTS = 16  # the SDK's limit too, logprobs included
MAX_METRICS = 32
MAX_LOSSES_PER_SESSION = 256
MAX_ELEMENTS = 1 << 24
MAX_INT = 1 << 62
MAX_INT_EXPONENT = 64

_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")


# ---------------------------------------------------------------------------------------------
# Decoding and validation


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Device:
    """A device constant: the learner's device at run time."""


@dataclass(frozen=True)
class Node:
    op: str  # placeholder | call_function | call_method | output
    name: str
    target: str
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class CustomLossProgram:
    """A validated custom loss: plain data (picklable for Ray workers); `run` evaluates it
    with the allowlisted operations only."""

    name: str
    inputs: tuple[tuple[str, int], ...]  # (name, rank), logprobs first
    nodes: tuple[Node, ...]
    loss_ref: str
    metric_refs: tuple[tuple[str, str], ...]  # (metric key, node name)

    @property
    def input_names(self) -> tuple[str, ...]:
        """The `loss_fn_inputs` keys the loss reads, in order (logprobs excluded)."""
        return tuple(name for name, _ in self.inputs[1:])

    @property
    def logprobs_rank(self) -> int:
        return self.inputs[0][1]

    def run(
        self, logprobs: torch.Tensor, inputs: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics) of one datum; refusals name the node that failed."""
        return _run(self, logprobs, list(inputs))


def _refuse(where: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(where, problem)


class _Decoder:
    def __init__(self, where: str, known: set[str]):
        self.where = where
        self.known = known  # node names defined so far
        self.literals = 0

    def decode(self, value: Any, depth: int = 0) -> Any:
        if depth > MAX_ARG_DEPTH:
            raise _refuse(self.where, f"arguments nest deeper than {MAX_ARG_DEPTH} levels")
        self.literals += 1
        if self.literals > MAX_LITERALS:
            raise _refuse(self.where, f"the graph has more than {MAX_LITERALS} argument values")
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            if abs(value) > MAX_INT:
                raise _refuse(self.where, f"integer {value} is out of range (|x| <= 2**62)")
            return value
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _refuse(self.where, "a non-finite float must be encoded as {'float': ...}")
            return value
        if isinstance(value, str):
            if len(value) > MAX_STRING:
                raise _refuse(self.where, f"a string argument is over {MAX_STRING} characters")
            return value
        if isinstance(value, list):
            return [self.decode(v, depth + 1) for v in value]
        if not isinstance(value, dict) or len(value) != 1:
            raise _refuse(
                self.where,
                f"argument {_short(value)} is not an encoded value (a JSON scalar, a list, or a "
                "one-key object: ref, tuple, dict, slice, ellipsis, float, dtype, device, "
                "layout, memory_format)",
            )
        ((kind, payload),) = value.items()
        if kind == "ref":
            if not isinstance(payload, str) or payload not in self.known:
                raise _refuse(
                    self.where,
                    f"refers to {_short(payload)}, which is not an earlier node of the graph",
                )
            return _Ref(payload)
        if kind == "tuple" and isinstance(payload, list):
            return tuple(self.decode(v, depth + 1) for v in payload)
        if kind == "dict" and isinstance(payload, dict):
            out = {}
            for key, v in payload.items():
                if len(key) > MAX_STRING:
                    raise _refuse(self.where, f"a dict key is over {MAX_STRING} characters")
                out[key] = self.decode(v, depth + 1)
            return out
        if kind == "slice" and isinstance(payload, list) and len(payload) == 3:
            parts = [self.decode(v, depth + 1) for v in payload]
            for part in parts:
                if not (part is None or isinstance(part, (int, _Ref))) or isinstance(part, bool):
                    raise _refuse(self.where, f"slice bound {_short(part)} is not an int or None")
            return slice(*parts)
        if kind == "ellipsis" and payload is True:
            return Ellipsis
        if kind == "float" and payload in ("inf", "-inf", "nan"):
            return float(payload)
        if kind == "dtype" and payload in DTYPES:
            return DTYPES[payload]
        if kind == "device" and isinstance(payload, str) and len(payload) <= 32:
            return _Device()
        if kind == "layout" and payload in LAYOUTS:
            return LAYOUTS[payload]
        if kind == "memory_format" and payload in MEMORY_FORMATS:
            return MEMORY_FORMATS[payload]
        raise _refuse(self.where, f"argument {_short(value)} is not an allowed encoded value")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _field(value: Any, name: str) -> Any:
    """A node field, from the SDK's pydantic model or a plain dict."""
    if isinstance(value, Mapping):
        return value.get(name)
    return getattr(value, name, None)


def rebuild(
    name: str,
    inputs: Sequence[Any],
    graph: Any,
) -> CustomLossProgram:
    """Validate an uploaded custom loss (`CreateCustomLossRequest`'s name, inputs and graph,
    as SDK models or plain dicts) into a `CustomLossProgram`, or refuse it naming what."""
    if not isinstance(name, str) or not 0 < len(name) <= 128:
        raise _refuse("name", "must be a string of 1 to 128 characters")
    # ----- inputs
    if not isinstance(inputs, Sequence) or not 0 < len(inputs) <= MAX_INPUTS:
        raise _refuse("inputs", f"must list 1 to {MAX_INPUTS} inputs, logprobs first")
    declared: list[tuple[str, int]] = []
    for i, item in enumerate(inputs):
        input_name, rank = _field(item, "name"), _field(item, "rank")
        if not isinstance(input_name, str) or not _INPUT_NAME.fullmatch(input_name):
            raise _refuse(
                f"inputs[{i}].name", f"{_short(input_name)} is not a lowercase identifier"
            )
        if isinstance(rank, bool) or rank not in (0, 1, 2):
            raise _refuse(f"inputs[{i}].rank", f"is {_short(rank)}; a rank is 0, 1 or 2")
        if any(input_name == seen for seen, _ in declared):
            raise _refuse(f"inputs[{i}].name", f"{input_name!r} is declared twice")
        declared.append((input_name, int(rank)))
    if declared[0][0] != "logprobs" or declared[0][1] not in (1, 2):
        raise _refuse("inputs[0]", "must be logprobs, of rank 1 ([T]) or 2 ([T, K])")
    if any(n == "logprobs" for n, _ in declared[1:]):
        raise _refuse("inputs", "logprobs can only be the first input")
    # ----- graph
    fmt = _field(graph, "format")
    if fmt not in (None, 1):
        raise _refuse("graph.format", f"is {_short(fmt)}; this server reads format 1")
    raw_nodes = _field(graph, "nodes")
    if not isinstance(raw_nodes, Sequence) or isinstance(raw_nodes, str | bytes):
        raise _refuse("graph.nodes", "must be a list of nodes")
    if len(raw_nodes) > MAX_NODES:
        raise _refuse(
            "graph.nodes", f"has {len(raw_nodes)} nodes; a custom loss may have at most {MAX_NODES}"
        )
    if len(raw_nodes) < len(declared) + 1:
        raise _refuse("graph.nodes", "needs one placeholder per input and an output node")
    known: set[str] = set()
    nodes: list[Node] = []
    decoder_literals = 0
    output: tuple | None = None
    for i, raw in enumerate(raw_nodes):
        op, node_name, target = _field(raw, "op"), _field(raw, "name"), _field(raw, "target")
        raw_args, raw_kwargs = _field(raw, "args") or [], _field(raw, "kwargs") or {}
        where = f"graph.nodes[{i}]"
        if not isinstance(node_name, str) or not _NODE_NAME.fullmatch(node_name):
            raise _refuse(f"{where}.name", f"{_short(node_name)} is not a valid node name")
        where = f"graph.nodes[{i}] ({node_name})"
        if node_name in known:
            raise _refuse(where, f"node name {node_name!r} is used twice")
        if not isinstance(target, str) or len(target) > MAX_STRING:
            raise _refuse(where, f"target {_short(target)} is not a string")
        if not isinstance(raw_args, list) or not isinstance(raw_kwargs, dict):
            raise _refuse(where, "args must be a list and kwargs an object")
        decoder = _Decoder(where, known)
        decoder.literals = decoder_literals
        if op == "placeholder":
            if i >= len(declared):
                raise _refuse(
                    where,
                    f"is placeholder {target!r}, but the loss declares {len(declared)} inputs",
                )
            if target != declared[i][0]:
                raise _refuse(where, f"placeholder {i} is {target!r}; expected {declared[i][0]!r}")
            if raw_args or raw_kwargs:
                raise _refuse(where, "a placeholder takes no arguments (no default values)")
            nodes.append(Node("placeholder", node_name, target, (), {}))
        elif i < len(declared):
            raise _refuse(
                where, f"is a {op} node, but the first {len(declared)} nodes must be the inputs"
            )
        elif op in ("call_function", "call_method"):
            table = FUNCTIONS if op == "call_function" else METHODS
            spec = table.get(target)
            if spec is None:
                kind = "function" if op == "call_function" else "tensor method"
                raise _refuse(
                    where,
                    f"{kind} {target!r} is not allowed in a custom loss (not on this server's "
                    "allowlist of torch, math and operator functions)",
                )
            args = tuple(decoder.decode(a, 1) for a in raw_args)
            kwargs = {}
            for key, value in raw_kwargs.items():
                if key not in spec.kwargs:
                    accepted = ", ".join(sorted(spec.kwargs)) or "none"
                    raise _refuse(
                        where,
                        f"{target!r} does not take keyword argument {key!r} here "
                        f"(accepted: {accepted})",
                    )
                kwargs[key] = decoder.decode(value, 1)
            if not spec.min_args <= len(args) <= spec.max_args:
                count = (
                    f"{spec.min_args}"
                    if spec.min_args == spec.max_args
                    else f"{spec.min_args} to {spec.max_args}"
                )
                extra = " (self included)" if op == "call_method" else ""
                raise _refuse(
                    where,
                    f"{target!r} takes {count} positional arguments{extra}, got {len(args)}",
                )
            if op == "call_method" and not isinstance(args[0], _Ref):
                raise _refuse(where, f"method {target!r} must be called on a graph value")
            if op == "call_function" and target == "getattr":
                obj, attr = args
                if not isinstance(obj, _Ref):
                    raise _refuse(where, "getattr may only read attributes of graph values")
                if attr not in ATTRIBUTES:
                    raise _refuse(
                        where,
                        f"getattr of attribute {_short(attr)} is not allowed (allowed: "
                        f"{', '.join(sorted(ATTRIBUTES))})",
                    )
            nodes.append(Node(op, node_name, target, args, kwargs))
        elif op == "output":
            if i != len(raw_nodes) - 1:
                raise _refuse(where, "the output node must be the last node")
            if raw_kwargs or len(raw_args) != 1:
                raise _refuse(where, "the output node takes one argument, (loss, metrics)")
            output = _output(where, decoder.decode(raw_args[0], 1))
        elif op in ("get_attr", "call_module"):
            what = "captured tensors (get_attr)" if op == "get_attr" else "torch.nn modules"
            raise _refuse(where, f"{op} {target!r} is refused: a custom loss cannot use {what}")
        else:
            raise _refuse(where, f"node op {_short(op)} is not allowed")
        decoder_literals = decoder.literals
        known.add(node_name)
    if output is None:
        raise _refuse("graph.nodes", "the graph has no output node")
    loss_ref, metric_refs = output
    return CustomLossProgram(name, tuple(declared), tuple(nodes), loss_ref, metric_refs)


def _output(where: str, value: Any) -> tuple[str, tuple[tuple[str, str], ...]]:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise _refuse(where, "a custom loss must return (loss, metrics)")
    loss, metrics = value
    if not isinstance(loss, _Ref):
        raise _refuse(where, "the loss must be a tensor computed by the graph")
    if not isinstance(metrics, dict):
        raise _refuse(where, "the metrics must be a dict")
    if len(metrics) > MAX_METRICS:
        raise _refuse(where, f"{len(metrics)} metrics; at most {MAX_METRICS}")
    refs = []
    for key, ref in metrics.items():
        if not _METRIC_KEY.fullmatch(key):
            raise _refuse(
                where, f"metric {key!r} must be named custom/<name>:sum or custom/<name>:mean"
            )
        if not isinstance(ref, _Ref):
            raise _refuse(where, f"metric {key!r} must be a tensor computed by the graph")
        refs.append((key, ref.name))
    return loss.name, tuple(refs)


# ---------------------------------------------------------------------------------------------
# Running


def _materialize(value: Any, env: dict[str, Any], device: torch.device) -> Any:
    if isinstance(value, _Ref):
        return env[value.name]
    if isinstance(value, _Device):
        return device
    if isinstance(value, list):
        return [_materialize(v, env, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_materialize(v, env, device) for v in value)
    if isinstance(value, dict):
        return {k: _materialize(v, env, device) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(*(_materialize(v, env, device) for v in (value.start, value.stop, value.step)))
    return value


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def _check_bound(where: str, op: Op, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if op.numeric_only:
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                continue
            if isinstance(a, bool | float) or (isinstance(a, int) and abs(a) <= MAX_INT):
                continue
            raise _refuse(where, f"operand {_short(a)} is not a tensor or a bounded number")
        if op.fn is operator.pow and not tensors:
            base, exponent = args
            if isinstance(exponent, int) and not isinstance(base, float) and exponent > 64:
                raise _refuse(where, f"integer power {exponent} is over {MAX_INT_EXPONENT}")
    if op.bound == "broadcast" and len(tensors) > 1:
        try:
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        except RuntimeError:
            return  # the operation itself reports the mismatch
        if _numel(shape) > MAX_ELEMENTS:
            raise _refuse(
                where, f"would make a tensor of shape {list(shape)}, over {MAX_ELEMENTS} values"
            )
    elif op.bound == "matmul" and len(tensors) == 2:
        a, b = tensors
        if a.dim() >= 1 and b.dim() >= 1:
            rows = a.shape[-2] if a.dim() >= 2 else 1
            cols = b.shape[-1] if b.dim() >= 2 else 1
            try:
                batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            except RuntimeError:
                return
            if _numel(batch) * rows * cols > MAX_ELEMENTS:
                raise _refuse(where, f"a matrix product would hold over {MAX_ELEMENTS} values")


def _check_result(where: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() > MAX_ELEMENTS:
            raise _refuse(where, f"made a tensor of {value.numel()} values, over {MAX_ELEMENTS}")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise _refuse(where, "made an integer out of range (|x| <= 2**62)")
    elif isinstance(value, tuple | list):
        for v in value:
            _check_result(where, v)


def _run(
    program: CustomLossProgram, logprobs: torch.Tensor, inputs: list[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if len(inputs) != len(program.inputs) - 1:
        raise _refuse(
            f"custom loss {program.name!r}",
            f"takes {len(program.inputs) - 1} inputs besides logprobs, got {len(inputs)}",
        )
    values = [logprobs, *inputs]
    device = logprobs.device
    env: dict[str, Any] = {}
    for index, node in enumerate(program.nodes):
        if node.op == "placeholder":
            env[node.name] = values[index]
            continue
        where = f"custom loss {program.name!r}, node {node.name} ({node.target})"
        args = [_materialize(a, env, device) for a in node.args]
        kwargs = {k: _materialize(v, env, device) for k, v in node.kwargs.items()}
        if node.op == "call_method":
            op = METHODS[node.target]
            self_value = args[0]
            if not isinstance(self_value, torch.Tensor):
                raise _refuse(where, f"method {node.target!r} called on a non-tensor value")
            if node.target == "to":
                for a in (*args[1:], kwargs.get("dtype")):
                    if a is not None and not isinstance(
                        a, torch.dtype | torch.device | torch.Tensor
                    ):
                        raise _refuse(where, "to() takes a dtype, a tensor or the learner's device")
            _check_bound(where, op, args, kwargs)
            fn = getattr(self_value, node.target)  # allowed by METHODS
            call_args = args[1:]
        else:
            op = FUNCTIONS[node.target]
            if op.fn is getattr:
                obj = args[0]
                if not isinstance(obj, torch.Tensor):
                    raise _refuse(where, "getattr may only read attributes of tensors")
                env[node.name] = getattr(obj, args[1])  # allowed by ATTRIBUTES
                continue
            if op.fn is operator.getitem and not isinstance(
                args[0], torch.Tensor | tuple | list | torch.Size
            ):
                raise _refuse(where, f"cannot index a {type(args[0]).__name__}")
            _check_bound(where, op, args, kwargs)
            fn, call_args = op.fn, args
        try:
            result = fn(*call_args, **kwargs)
        except InvalidRequestError:
            raise
        except Exception as exc:
            raise _refuse(where, f"{type(exc).__name__}: {exc}") from None
        _check_result(where, result)
        env[node.name] = result
    where = f"custom loss {program.name!r}"
    loss = env[program.loss_ref]
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise _refuse(where, f"must return a scalar loss tensor, got {shape}")
    if not loss.is_floating_point():
        raise _refuse(where, f"returned a {loss.dtype} loss; it must be floating point")
    metrics = {}
    for key, ref in program.metric_refs:
        value = env[ref]
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise _refuse(where, f"metric {key!r} must be a one-value tensor")
        metrics[key] = value
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# The backend's side: datums, the loss spec the workers run, metrics


class _GraphLoss:
    """The `LossSpec.fn` of a custom loss: its program on one datum (picklable)."""

    def __init__(self, program: CustomLossProgram):
        self.program = program

    def __call__(
        self, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
    ) -> torch.Tensor:
        loss, _ = self.program.run(lp, [inputs[name] for name in self.program.input_names])
        if torch.is_grad_enabled() and lp.requires_grad and not loss.requires_grad:
            raise _refuse(
                f"custom loss {self.program.name!r}", "the loss does not depend on its logprobs"
            )
        return loss.to(torch.float64)


def loss_spec(program: CustomLossProgram) -> LossSpec:
    """The spec the workers run: target_tokens only (1-D or 2-D), the graph as the loss."""
    return LossSpec(name="custom", fn=_GraphLoss(program), required_inputs=(), multi_target=True)


def to_examples(
    data: Sequence[types.Datum],
    program: CustomLossProgram,
    vocab_size: int,
    max_length: int,
) -> list[TrainingExample]:
    """Validate and convert a request for `program`: `target_tokens` as for every loss (its
    rank is logprobs' declared rank), each input the loss reads at its declared rank
    (float32 or int64, as sent; finite), and no `loss_fn_inputs` key the loss does not read."""
    if not isinstance(data, Sequence) or isinstance(data, str | bytes) or not data:
        raise _refuse("data", "must be a non-empty list of Datum")
    spec = loss_spec(program)
    reads = ("target_tokens", *program.input_names)
    examples = []
    for i, datum in enumerate(data):
        field = f"data[{i}]"
        if not isinstance(datum, types.Datum):
            raise _refuse(field, f"expected a tinker.types.Datum, got {type(datum).__name__}")
        for key in datum.loss_fn_inputs:
            if key not in reads:
                raise _refuse(
                    f"{field}.loss_fn_inputs.{key}",
                    f"is not read by custom loss {program.name!r}; it reads: {', '.join(reads)}",
                )
        targets = datum.loss_fn_inputs.get("target_tokens")
        if targets is None:
            raise _refuse(f"{field}.loss_fn_inputs.target_tokens", "is missing")
        view = types.Datum(model_input=datum.model_input, loss_fn_inputs={"target_tokens": targets})
        example = to_training_example(view, spec, vocab_size, max_length, field)
        target_rank = example.loss_inputs["target_tokens"].dim()
        if target_rank != program.logprobs_rank:
            raise _refuse(
                f"{field}.loss_fn_inputs.target_tokens",
                f"has rank {target_rank}, but custom loss {program.name!r} declared logprobs "
                f"with rank {program.logprobs_rank} (logprobs have target_tokens' shape)",
            )
        for name, rank in program.inputs[1:]:
            key_field = f"{field}.loss_fn_inputs.{name}"
            if name == "target_tokens":
                if rank != target_rank:
                    raise _refuse(key_field, f"has rank {target_rank}; the loss declared {rank}")
                continue
            if name not in datum.loss_fn_inputs:
                raise _refuse(key_field, f"is missing; custom loss {program.name!r} reads it")
            td = datum.loss_fn_inputs[name]
            array = tensor_data_to_numpy(
                td, key_field, pad_value=0 if name in SPARSE_KEYS else None
            )
            if rank == 0 and array.shape == (1,):
                # The wire carries no shape for a 0-d tensor, which then reads as 1-D: a
                # one-value tensor is the scalar (the SDK has checked the rank client-side).
                array = array.reshape(())
            if array.ndim != rank:
                raise _refuse(
                    key_field,
                    f"has rank {array.ndim} (shape {list(array.shape)}), but custom loss "
                    f"{program.name!r} declared rank {rank}",
                )
            if array.size > MAX_ELEMENTS:
                raise _refuse(key_field, f"has {array.size} values, over {MAX_ELEMENTS}")
            if array.dtype.kind == "f":
                array = array.astype(np.float32)
                if not np.isfinite(array).all():
                    raise _refuse(key_field, "contains NaN or infinite values")
            elif array.dtype.kind in "iu":
                array = array.astype(np.int64)
            else:
                raise _refuse(key_field, f"must be float32 or int64, got {array.dtype}")
            # a copy, not np.ascontiguousarray (which makes a 0-d array 1-D)
            example.loss_inputs[name] = torch.from_numpy(array.copy(order="C"))
        examples.append(example)
    return examples


def metrics(
    program: CustomLossProgram,
    logprobs: Sequence[torch.Tensor],
    examples: Sequence[TrainingExample],
) -> dict[str, float]:
    """The loss's metrics over a request, as the SDK combines them (`run_loss_handle`): each
    `:sum` metric summed over datums, each `:mean` averaged. Evaluated on the log-probs the
    pass returned (detached), without gradients."""
    if not program.metric_refs:
        return {}
    sums: dict[str, float] = {}
    with torch.no_grad():
        for lp, example in zip(logprobs, examples, strict=True):
            inputs = [example.loss_inputs[name] for name in program.input_names]
            _, values = program.run(lp, inputs)
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + float(value.detach().reshape(()).item())
    return {k: v / len(examples) if k.endswith(":mean") else v for k, v in sums.items()}
