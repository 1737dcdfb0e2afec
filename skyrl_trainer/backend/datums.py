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
    loss_inputs: dict[str, torch.Tensor]  # each (N,); target_tokens int64, the rest float32

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


def _tensor_data_to_numpy(td: types.TensorData, field: str) -> np.ndarray:
    if td.sparse_crow_indices is not None or td.sparse_col_indices is not None:
        raise InvalidRequestError(
            field, "sparse tensors are not supported; send a dense 1-D tensor"
        )
    try:
        array = td.to_numpy()
    except Exception as exc:  # malformed shape/data pairs from the wire
        raise InvalidRequestError(field, f"could not read tensor data: {exc}") from exc
    return array


def to_training_example(
    datum: types.Datum,
    spec: LossSpec,
    vocab_size: int,
    max_length: int,
    field: str,
) -> TrainingExample:
    """Validate one datum for the loss `spec` and convert it. Raises `InvalidRequestError`."""
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
    for key in ("target_tokens", *spec.required_inputs):
        if key not in inputs:
            needed = ["target_tokens", *spec.required_inputs]
            raise InvalidRequestError(
                f"{field}.loss_fn_inputs.{key}", f"is missing; loss '{spec.name}' needs {needed}"
            )
    # Keys the loss does not read are ignored (as Tinker does), not converted.
    read_keys = [
        k for k in ("target_tokens", *spec.required_inputs, *spec.optional_inputs) if k in inputs
    ]
    tensors: dict[str, torch.Tensor] = {}
    for key in read_keys:
        key_field = f"{field}.loss_fn_inputs.{key}"
        array = _tensor_data_to_numpy(inputs[key], key_field)
        if array.shape != (n,):
            raise InvalidRequestError(
                key_field,
                f"has shape {list(array.shape)} but must be [{n}] "
                "(one value per model_input token)",
            )
        if key == "target_tokens":
            if array.dtype.kind not in "iu":
                raise InvalidRequestError(key_field, f"must be int64 token ids, got {array.dtype}")
            array = array.astype(np.int64)
            check_token_ids(array, vocab_size, key_field)
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
