"""Validate Tinker `Datum`s at the backend boundary and turn them into plain tensors.

Everything a worker computes on passes through `to_training_examples` first, so a bad
request is refused here, naming the offending field, before any model state is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tinker import types

from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.losses import LossSpec, check_loss_inputs


@dataclass
class TrainingExample:
    """One datum as tensors: `input_ids_N` predicts `loss_inputs["target_tokens"]` position by position."""

    input_ids_N: torch.Tensor  # int64 (N,)
    # Each (N,), or each (N, K) for several targets per position; target_tokens int64, the
    # rest float32.
    loss_inputs: dict[str, torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.input_ids_N.shape[0])


def model_input_tokens(model_input: types.ModelInput, field: str) -> list[int]:
    """The token ids of a text-only `ModelInput`; other chunk types are refused."""
    tokens: list[int] = []
    for i, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise InvalidRequestError(
                f"{field}.chunks[{i}]",
                f"chunk type '{getattr(chunk, 'type', type(chunk).__name__)}' is not supported "
                "by this backend (text-only models); send encoded_text chunks",
            )
        tokens.extend(chunk.tokens)
    return tokens


def check_token_ids(tokens: np.ndarray, vocab_size: int, field: str) -> None:
    """Refuse token ids outside `[0, vocab_size)`, naming the first bad position."""
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        pos = int(bad[0])
        raise InvalidRequestError(
            f"{field}[{pos}]",
            f"token id {int(tokens[pos])} is outside the vocabulary [0, {vocab_size})",
        )


# Keys the SDK sends as sparse CSR (`Datum` converts 2-D torch tensors of these keys with
# `TensorData.from_torch_sparse`, whose default pad value is 0).
SPARSE_KEYS = ("target_tokens", "weights")


def tensor_data_to_numpy(td, field: str, *, pad_value: int | None = None) -> np.ndarray:
    """A `TensorData` (the SDK's dataclass or its pydantic wire model) as a dense numpy array.

    A sparse CSR tensor is accepted only when `pad_value` is given (the value of unlisted
    cells) and is densified with it; otherwise it is refused, naming `field`.
    """
    sparse = td.sparse_crow_indices is not None or td.sparse_col_indices is not None
    if sparse and pad_value is None:
        raise InvalidRequestError(field, "sparse tensors are not supported here; send it dense")
    try:
        if sparse:
            array = _densify_csr(td, pad_value)
        elif hasattr(td, "to_numpy"):
            array = np.asarray(td.to_numpy())
        else:  # the pydantic wire model
            array = np.asarray(td.data, dtype=np.int64 if td.dtype == "int64" else np.float32)
            if td.shape is not None:
                array = array.reshape(td.shape)
    except InvalidRequestError:
        raise
    except Exception as exc:  # malformed shape/data pairs from the wire
        raise InvalidRequestError(field, f"could not read tensor data: {exc}") from exc
    return array


def _densify_csr(td, pad_value: int) -> np.ndarray:
    """Dense form of a 2-D CSR tensor, with `pad_value` in unlisted cells; checks the layout."""
    shape = list(td.shape or [])
    if len(shape) != 2:
        raise ValueError(f"a sparse CSR tensor must have a 2-D shape, got {td.shape}")
    rows, cols = shape
    crow = np.asarray(td.sparse_crow_indices or [], dtype=np.int64)
    col = np.asarray(td.sparse_col_indices or [], dtype=np.int64)
    values = np.asarray(td.data).reshape(-1)
    ok = (
        crow.shape == (rows + 1,)
        and (crow.size == 0 or (crow[0] == 0 and np.all(np.diff(crow) >= 0)))
        and int(crow[-1]) == col.size == values.size
        and (col.size == 0 or (col.min() >= 0 and col.max() < cols))
    )
    if not ok:
        raise ValueError(f"the CSR indices are not a valid layout for shape {shape}")
    dtype = np.int64 if td.dtype == "int64" else np.float32
    dense = np.full((rows, cols), pad_value, dtype=dtype)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of, col] = values
    return dense


def to_training_example(
    datum: types.Datum,
    spec: LossSpec,
    vocab_size: int,
    max_length: int,
    field: str,
) -> TrainingExample:
    """Validate one datum for the loss `spec` and convert it. Raises `InvalidRequestError`.

    Every `loss_fn_inputs` key must be one the loss reads: an unknown key (a misspelt
    `clip_low_threshold`, an input of another loss) is refused, naming the key, the loss and
    the keys it accepts, rather than silently dropped. `target_tokens` is (N,), or (N, K)
    (K candidate targets per position) for a `multi_target` loss; every other input has the
    shape of `target_tokens`. 2-D `target_tokens` / `weights` may be sparse CSR (the SDK sends
    them so), unlisted cells being 0.
    """
    if not isinstance(datum, types.Datum):
        raise InvalidRequestError(
            field, f"expected a tinker.types.Datum, got {type(datum).__name__}"
        )
    input_ids = np.asarray(model_input_tokens(datum.model_input, f"{field}.model_input"), np.int64)
    n = int(input_ids.shape[0])
    if n == 0:
        raise InvalidRequestError(f"{field}.model_input", "is empty; a datum needs >= 1 token")
    if n > max_length:
        raise InvalidRequestError(
            f"{field}.model_input",
            f"has {n} tokens, more than the model's context length {max_length}",
        )
    check_token_ids(input_ids, vocab_size, f"{field}.model_input")

    inputs = datum.loss_fn_inputs
    accepted = spec.accepted_inputs
    for key in inputs:
        if key not in accepted:
            raise InvalidRequestError(
                f"{field}.loss_fn_inputs.{key}",
                f"is not an input of loss '{spec.name}' (misspelt, or meant for another "
                f"loss?); loss '{spec.name}' accepts: {', '.join(accepted)}",
            )
    for key in ("target_tokens", *spec.required_inputs):
        if key not in inputs:
            needed = ["target_tokens", *spec.required_inputs]
            raise InvalidRequestError(
                f"{field}.loss_fn_inputs.{key}", f"is missing; loss '{spec.name}' needs {needed}"
            )
    tensors: dict[str, torch.Tensor] = {}
    target_shape: tuple[int, ...] = (n,)
    for key in [k for k in accepted if k in inputs]:
        key_field = f"{field}.loss_fn_inputs.{key}"
        pad = 0 if key in SPARSE_KEYS else None
        array = tensor_data_to_numpy(inputs[key], key_field, pad_value=pad)
        if key == "target_tokens":
            two_d = spec.multi_target and array.ndim == 2 and array.shape[0] == n
            if array.shape != (n,) and not (two_d and array.shape[1] >= 1):
                wanted = f"[{n}] or [{n}, K]" if spec.multi_target else f"[{n}]"
                raise InvalidRequestError(
                    key_field,
                    f"has shape {list(array.shape)} but must be {wanted} "
                    "(one row per model_input token)"
                    + (
                        f"; loss '{spec.name}' takes one target per position (2-D target_tokens "
                        "work with cross_entropy)"
                        if array.ndim == 2 and not spec.multi_target
                        else ""
                    ),
                )
            target_shape = tuple(array.shape)
            if array.dtype.kind not in "iu":
                raise InvalidRequestError(key_field, f"must be int64 token ids, got {array.dtype}")
            array = array.astype(np.int64)
            check_token_ids(array.reshape(-1), vocab_size, key_field)
        elif array.shape != target_shape:
            raise InvalidRequestError(
                key_field,
                f"has shape {list(array.shape)} but must be {list(target_shape)} "
                "like target_tokens",
            )
        elif array.dtype.kind not in "fiu":
            raise InvalidRequestError(key_field, f"must be numeric, got {array.dtype}")
        else:
            array = array.astype(np.float32)
        tensors[key] = torch.from_numpy(np.ascontiguousarray(array))
    check_loss_inputs(spec, tensors, prefix=f"{field}.loss_fn_inputs")
    return TrainingExample(torch.from_numpy(input_ids), tensors)


def to_training_examples(
    data: Sequence[types.Datum], spec: LossSpec, vocab_size: int, max_length: int
) -> list[TrainingExample]:
    """Validate and convert a whole request; the first bad datum refuses the request."""
    if not isinstance(data, Sequence) or isinstance(data, str | bytes):
        raise InvalidRequestError("data", f"must be a list of Datum, got {type(data).__name__}")
    if len(data) == 0:
        raise InvalidRequestError("data", "is empty; send at least one Datum")
    return [
        to_training_example(d, spec, vocab_size, max_length, f"data[{i}]")
        for i, d in enumerate(data)
    ]
