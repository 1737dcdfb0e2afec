"""The operations an uploaded custom loss graph may use (`custom_loss_graph`): functions keyed
the way torch.fx / the Tinker SDK names them (`FUNCTIONS`), tensor methods (`METHODS`), the
attributes `getattr` may read (`ATTRIBUTES`), and the dtype / layout / memory-format constants
an argument may name. Nothing outside these tables is ever imported or evaluated."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.node import _get_qualified_name

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
LAYOUTS = {"strided": torch.strided}
MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "preserve_format": torch.preserve_format,
}


@dataclass(frozen=True)
class Op:
    """One allowed operation: how many positional arguments it takes (a method's `self`
    included), the keyword arguments it accepts, and how its output size is bounded before
    it runs (`"broadcast"`: the broadcast of its tensor operands; `"matmul"`; None: checked
    after it runs only)."""

    fn: Any
    min_args: int
    max_args: int
    kwargs: frozenset[str] = frozenset()
    bound: str | None = None
    numeric_only: bool = False  # operator.* on plain values: numbers and tensors only


def _op(fn, lo, hi, kwargs=(), bound=None, numeric_only=False) -> Op:
    return Op(fn, lo, hi, frozenset(kwargs), bound, numeric_only)


_RED = ("dim", "keepdim", "dtype")
_DIM = ("dim",)


def _functions() -> dict[str, Op]:
    table: dict[str, Any] = {}
    # Elementwise, one tensor.
    for fn in (
        torch.exp, torch.log, torch.log1p, torch.expm1, torch.log2, torch.log10, torch.exp2,
        torch.sigmoid, torch.tanh, torch.abs, torch.neg, torch.sqrt, torch.rsqrt, torch.square,
        torch.sign, torch.relu, torch.floor, torch.ceil, torch.round, torch.trunc,
        torch.isfinite, torch.isnan, torch.isinf, torch.logical_not, torch.reciprocal,
        torch.erf, torch.erfc, torch.detach, torch.zeros_like, torch.ones_like,
        F.logsigmoid, F.relu, F.silu, F.gelu,
    ):  # fmt: skip
        table[fn] = _op(fn, 1, 1, ("dtype",) if fn in (torch.zeros_like, torch.ones_like) else ())
    # Elementwise, two or more operands (broadcasting).
    for fn in (
        torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div,
        torch.true_divide, torch.pow, torch.minimum, torch.maximum, torch.fmin, torch.fmax,
        torch.logaddexp, torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge,
        torch.logical_and, torch.logical_or, torch.logical_xor, torch.xlogy, torch.atan2,
        torch.remainder, torch.fmod, torch.floor_divide,
    ):  # fmt: skip
        kwargs = ("alpha",) if fn in (torch.add, torch.sub, torch.subtract) else ()
        kwargs += ("rounding_mode",) if fn is torch.div else ()
        table[fn] = _op(fn, 2, 2, kwargs, "broadcast")
    table[torch.where] = _op(torch.where, 3, 3, (), "broadcast")
    table[torch.lerp] = _op(torch.lerp, 3, 3, (), "broadcast")
    table[torch.full_like] = _op(torch.full_like, 2, 2, ("dtype",))
    for fn in (torch.clamp, torch.clip):
        table[fn] = _op(fn, 1, 3, ("min", "max"), "broadcast")
    table[torch.clamp_min] = _op(torch.clamp_min, 2, 2, (), "broadcast")
    table[torch.clamp_max] = _op(torch.clamp_max, 2, 2, (), "broadcast")
    table[torch.nan_to_num] = _op(torch.nan_to_num, 1, 4, ("nan", "posinf", "neginf"))
    # Reductions.
    for fn in (torch.sum, torch.mean, torch.prod, torch.nansum, torch.nanmean):
        table[fn] = _op(fn, 1, 3, _RED)
    for fn in (torch.amax, torch.amin, torch.logsumexp, torch.all, torch.any):
        table[fn] = _op(fn, 1, 3, ("dim", "keepdim"))
    for fn in (torch.max, torch.min, torch.argmax, torch.argmin):
        table[fn] = _op(fn, 1, 3, ("dim", "keepdim"), "broadcast")
    for fn in (torch.std, torch.var):
        table[fn] = _op(fn, 1, 4, ("dim", "keepdim", "unbiased", "correction"))
    table[torch.count_nonzero] = _op(torch.count_nonzero, 1, 2, _DIM)
    table[torch.norm] = _op(torch.norm, 1, 4, ("p", "dim", "keepdim", "dtype"))
    for fn in (torch.cumsum, torch.cumprod):
        table[fn] = _op(fn, 2, 2, ("dtype",))
    for fn in (torch.softmax, torch.log_softmax, F.softmax, F.log_softmax):
        table[fn] = _op(fn, 1, 3, ("dim", "dtype"))
    for fn in (F.softplus,):
        table[fn] = _op(fn, 1, 3, ("beta", "threshold"))
    for fn in (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss):
        table[fn] = _op(fn, 2, 2, ("reduction", "beta", "delta"), "broadcast")
    table[F.kl_div] = _op(F.kl_div, 2, 2, ("reduction", "log_target"), "broadcast")
    table[F.binary_cross_entropy_with_logits] = _op(
        F.binary_cross_entropy_with_logits, 2, 2, ("weight", "reduction", "pos_weight"),
        "broadcast",
    )  # fmt: skip
    # Shapes, selection and assembly (outputs bounded by their inputs; checked after).
    table[torch.unsqueeze] = _op(torch.unsqueeze, 2, 2)
    table[torch.squeeze] = _op(torch.squeeze, 1, 2, _DIM)
    table[torch.reshape] = _op(torch.reshape, 2, 2)
    table[torch.flatten] = _op(torch.flatten, 1, 3, ("start_dim", "end_dim"))
    table[torch.transpose] = _op(torch.transpose, 3, 3)
    table[torch.gather] = _op(torch.gather, 3, 3, ())
    table[torch.index_select] = _op(torch.index_select, 3, 3)
    table[torch.masked_fill] = _op(torch.masked_fill, 3, 3, (), "broadcast")
    table[torch.stack] = _op(torch.stack, 1, 2, _DIM)
    table[torch.cat] = _op(torch.cat, 1, 2, _DIM)
    table[torch.diff] = _op(torch.diff, 1, 2, ("n", "dim"))
    table[torch.topk] = _op(torch.topk, 2, 3, ("dim", "largest", "sorted"))
    table[torch.sort] = _op(torch.sort, 1, 3, ("dim", "descending", "stable"))
    table[torch.dot] = _op(torch.dot, 2, 2)
    table[torch.matmul] = _op(torch.matmul, 2, 2, (), "matmul")
    table[torch.tensor] = _op(torch.tensor, 1, 1, ("dtype", "device", "requires_grad"))
    table[torch.as_tensor] = _op(torch.as_tensor, 1, 1, ("dtype", "device"))
    # Python numbers only (size arithmetic): math.
    for fn in (math.sqrt, math.log, math.exp, math.log1p, math.floor, math.ceil):
        table[fn] = _op(fn, 1, 1)
    # Python operators, as fx records arithmetic and indexing.
    for fn in (
        operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
        operator.mod, operator.pow, operator.eq, operator.ne, operator.lt, operator.le,
        operator.gt, operator.ge, operator.and_, operator.or_, operator.xor,
    ):  # fmt: skip
        table[fn] = _op(fn, 2, 2, (), "broadcast", numeric_only=True)
    table[operator.matmul] = _op(operator.matmul, 2, 2, (), "matmul", numeric_only=True)
    for fn in (operator.neg, operator.pos, operator.abs, operator.invert):
        table[fn] = _op(fn, 1, 1, (), None, numeric_only=True)
    table[operator.getitem] = _op(operator.getitem, 2, 2)
    # Attribute reads, checked against ATTRIBUTES.
    table[getattr] = _op(getattr, 2, 2)
    out: dict[str, Op] = {}
    for fn, op in table.items():
        try:
            name = _get_qualified_name(fn)
        except Exception:  # torch.fx cannot name it, so the SDK cannot send it either
            continue
        if name.startswith("_operator."):  # as the SDK writes them (custom_loss.encode_graph)
            name = "operator." + name.removeprefix("_operator.")
        out[name] = op
    return out


FUNCTIONS: dict[str, Op] = _functions()
"""`call_function` targets, by the qualified name the SDK sends (`torch.exp`,
`operator.mul`, `getattr`, `torch._C._nn.log_sigmoid`...)."""

_M1 = (1, 1, ())
_METHOD_SPECS: dict[str, tuple[int, int, tuple[str, ...], str | None]] = {
    # Elementwise, one tensor: (min args, max args incl. self, kwargs, bound).
    **{
        m: (*_M1, None)
        for m in (
            "exp",
            "log",
            "log1p",
            "expm1",
            "log2",
            "log10",
            "sigmoid",
            "tanh",
            "abs",
            "neg",
            "sqrt",
            "rsqrt",
            "square",
            "sign",
            "relu",
            "floor",
            "ceil",
            "round",
            "trunc",
            "isfinite",
            "isnan",
            "isinf",
            "logical_not",
            "reciprocal",
            "erf",
            "detach",
            "float",
            "double",
            "half",
            "bfloat16",
            "long",
            "int",
            "bool",
            "contiguous",
            "clone",
            "t",
            "dim",
            "numel",
            "nelement",
            "exp2",
            "erfc",
        )
    },  # fmt: skip
    **{
        m: (2, 2, ("alpha",) if m in ("add", "sub") else (), "broadcast")
        for m in (
            "add",
            "sub",
            "mul",
            "div",
            "true_divide",
            "pow",
            "minimum",
            "maximum",
            "logaddexp",
            "eq",
            "ne",
            "lt",
            "le",
            "gt",
            "ge",
            "logical_and",
            "logical_or",
            "logical_xor",
            "xlogy",
            "remainder",
            "fmod",
            "type_as",
            "expand_as",
        )
    },  # fmt: skip
    "clamp": (1, 3, ("min", "max"), "broadcast"),
    "clip": (1, 3, ("min", "max"), "broadcast"),
    "clamp_min": (2, 2, (), "broadcast"),
    "clamp_max": (2, 2, (), "broadcast"),
    "masked_fill": (3, 3, (), "broadcast"),
    "where": (3, 3, (), "broadcast"),
    "lerp": (3, 3, (), "broadcast"),
    "nan_to_num": (1, 4, ("nan", "posinf", "neginf"), None),
    "sum": (1, 3, _RED, None),
    "mean": (1, 3, _RED, None),
    "prod": (1, 3, _RED, None),
    "nansum": (1, 3, _RED, None),
    "amax": (1, 3, ("dim", "keepdim"), None),
    "amin": (1, 3, ("dim", "keepdim"), None),
    "max": (1, 3, ("dim", "keepdim"), "broadcast"),
    "min": (1, 3, ("dim", "keepdim"), "broadcast"),
    "argmax": (1, 3, ("dim", "keepdim"), None),
    "argmin": (1, 3, ("dim", "keepdim"), None),
    "logsumexp": (2, 3, ("dim", "keepdim"), None),
    "all": (1, 3, ("dim", "keepdim"), None),
    "any": (1, 3, ("dim", "keepdim"), None),
    "std": (1, 4, ("dim", "keepdim", "unbiased", "correction"), None),
    "var": (1, 4, ("dim", "keepdim", "unbiased", "correction"), None),
    "norm": (1, 4, ("p", "dim", "keepdim", "dtype"), None),
    "count_nonzero": (1, 2, _DIM, None),
    "cumsum": (2, 2, ("dtype",), None),
    "softmax": (2, 2, ("dtype",), None),
    "log_softmax": (2, 2, ("dtype",), None),
    "size": (1, 2, _DIM, None),
    "unsqueeze": (2, 2, (), None),
    "squeeze": (1, 2, _DIM, None),
    "flatten": (1, 3, ("start_dim", "end_dim"), None),
    "transpose": (3, 3, (), None),
    "permute": (1, 9, ("dims",), None),
    "reshape": (1, 9, ("shape",), None),
    "view": (1, 9, ("size",), None),
    "gather": (3, 3, (), None),
    "index_select": (3, 3, (), None),
    "topk": (2, 4, ("dim", "largest", "sorted"), None),
    "sort": (1, 3, ("dim", "descending", "stable"), None),
    "diff": (1, 2, ("n", "dim"), None),
    "dot": (2, 2, (), None),
    "matmul": (2, 2, (), "matmul"),
    "to": (2, 2, ("dtype", "copy", "non_blocking"), None),
}
METHODS: dict[str, Op] = {
    name: Op(name, lo, hi, frozenset(kw), bound)
    for name, (lo, hi, kw, bound) in _METHOD_SPECS.items()
    if hasattr(torch.Tensor, name)
}
"""`call_method` targets: tensor methods, looked up on the tensor only once allowed here."""

ATTRIBUTES = frozenset({"shape", "dtype", "ndim", "device", "T", "mT"})
"""What `getattr(x, name)` may read, and only from a tensor (or torch.Size / a result tuple)."""
