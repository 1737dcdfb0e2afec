"""Protobuf bodies of the Tinker HTTP API, server side: the exact inverse of the SDK's codec.

The `tinker` SDK (0.38.0) sends `/api/v1/forward_backward` as a protobuf `ForwardBackwardRequest`
(`tinker/proto/request_conv.py`), optionally zstd-compressed, and reads forward_backward and
sample results as protobuf `ForwardBackwardOutput` / `SampleResponse` (`tinker/proto/
response_conv.py`). Raw tensors on the wire are little-endian numpy `tobytes()`. Anything the
client got wrong raises `InvalidRequestError` naming the field, e.g.
`data[3].loss_fn_inputs.weights`; a result this server cannot encode raises `ValueError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker import types
from tinker.proto import tinker_public_pb2 as public_pb
from tinker.types.provenance_spans import PromptProvenanceSpan, SampledProvenanceSpan
from tinker.types.topk_logprobs import MASK_LOGPROB, TopkLogprobs

from skyrl_trainer.backend.errors import InvalidRequestError

# Wire dtype <-> (TensorData dtype, little-endian numpy dtype). The SDK sends only these two.
_WIRE_DTYPES: dict[int, tuple[str, np.dtype]] = {
    public_pb.DTYPE_FLOAT32: ("float32", np.dtype("<f4")),
    public_pb.DTYPE_INT64: ("int64", np.dtype("<i8")),
}
_TO_WIRE: dict[str, tuple[int, np.dtype]] = {v[0]: (k, v[1]) for k, v in _WIRE_DTYPES.items()}
_STOP_REASONS = {"stop": public_pb.STOP_REASON_STOP, "length": public_pb.STOP_REASON_LENGTH}
# A sparse (CSR) input is densified; refuse shapes whose dense form would exceed this many cells.
MAX_DENSE_ELEMENTS = 1 << 24
# zstd input is fed in slices this big: zstd expands at most ~32768x, so one slice can overshoot
# `max_bytes` by at most ~32 MiB before the bound is checked.
_ZSTD_SLICE = 1024


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded `/forward_backward` request. `seq_id` is None when the client sent 0 (unset)."""

    model_id: str
    seq_id: int | None
    data: list[types.Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool


def decode_body(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """The request body after undoing `Content-Encoding` (absent/"identity" or "zstd").

    Never returns, nor holds for long, more than `max_bytes` decoded bytes: a larger body (or a
    zstd bomb) raises `InvalidRequestError("body", ...)`, as does corrupt or truncated zstd data;
    any other encoding raises `InvalidRequestError("Content-Encoding", ...)`.
    """
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        out = body
    elif encoding == "zstd":
        out = _zstd_decompress(body, max_bytes)
    else:
        raise InvalidRequestError(
            "Content-Encoding", f"'{content_encoding}' is not supported; send identity or zstd"
        )
    if len(out) > max_bytes:
        raise InvalidRequestError("body", f"is larger than the limit of {max_bytes} bytes")
    return out


def _zstd_decompress(body: bytes, max_bytes: int) -> bytes:
    # Not `ZstdDecompressor.decompress(max_output_size=...)`: it trusts a frame's declared size
    # and ignores trailing frames; `stream_reader` silently accepts truncated frames.
    out = bytearray()
    view, pos, frame = memoryview(body), 0, None
    try:
        while pos < len(body):
            if frame is None:
                frame = zstandard.ZstdDecompressor().decompressobj()
            piece = view[pos : pos + _ZSTD_SLICE]
            pos += len(piece)
            out += frame.decompress(piece)
            if len(out) > max_bytes:
                raise InvalidRequestError("body", f"decompresses to over {max_bytes} bytes")
            if frame.eof:  # a next frame (or trailing garbage) starts in the unused input
                pos, frame = pos - len(frame.unused_data), None
    except zstandard.ZstdError as exc:
        raise InvalidRequestError("body", f"is not valid zstd data: {exc}") from exc
    if frame is not None and not frame.eof:
        raise InvalidRequestError("body", "is truncated zstd data (the last frame is incomplete)")
    return bytes(out)


def decode_forward_backward_request(body: bytes) -> ForwardBackwardCall:
    """Parse a protobuf `ForwardBackwardRequest` (already decompressed) into Tinker types.

    Datums hold one `EncodedTextChunk` per wire chunk and dense `TensorData` (float32/int64;
    sparse CSR tensors are densified with 0 in unlisted cells). Provenance spans are decoded
    (the backend refuses them, naming the field).
    `loss_fn_config` comes from `loss_fn_config_v2` when set, else the legacy float map, else
    None. Malformed input raises `InvalidRequestError` naming the field.
    """
    msg = public_pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise InvalidRequestError("body", f"is not a ForwardBackwardRequest: {exc}") from exc
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=msg.seq_id or None,
        data=[_datum(d, f"data[{i}]") for i, d in enumerate(msg.data)],
        loss_fn=msg.loss_fn,
        loss_fn_config=_loss_fn_config(msg),
        forward_only=msg.forward_only,
    )


def _loss_fn_config(msg: public_pb.ForwardBackwardRequest) -> dict[str, float | str] | None:
    if msg.loss_fn_config_v2:
        config: dict[str, float | str] = {}
        for key, value in msg.loss_fn_config_v2.items():
            arm = value.WhichOneof("value")
            if arm is None:
                raise InvalidRequestError(f"loss_fn_config_v2.{key}", "has neither number nor text")
            config[key] = value.number if arm == "number" else value.text
        return config
    return dict(msg.loss_fn_config) or None


def _datum(msg: public_pb.Datum, field: str) -> types.Datum:
    chunks = []
    for i, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequestError(
                f"{field}.model_input.chunks[{i}]",
                f"chunk type '{kind}' is not supported; this server takes only encoded_text chunks",
            )
        tokens = _array(
            chunk.encoded_text.tokens, np.dtype("<i4"), f"{field}.model_input.chunks[{i}]"
        )
        chunks.append(types.EncodedTextChunk(tokens=tokens.tolist()))
    inputs = {
        name: _tensor(t, f"{field}.loss_fn_inputs.{name}") for name, t in msg.loss_fn_inputs.items()
    }
    datum = types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=inputs)
    if len(msg.model_input_spans) or len(msg.loss_fn_input_spans):
        # Decoded, not dropped: the backend checks that they tile their fields (core.check_provenance).
        datum = replace(
            datum,
            model_input_spans=_spans(msg.model_input_spans, f"{field}.model_input_spans"),
            loss_fn_input_spans=_spans(msg.loss_fn_input_spans, f"{field}.loss_fn_input_spans"),
        )
    return datum


def _spans(msgs, field: str) -> list[PromptProvenanceSpan | SampledProvenanceSpan]:
    spans = []
    for i, msg in enumerate(msgs):
        arm = msg.WhichOneof("span")
        if arm is None:
            raise InvalidRequestError(f"{field}[{i}]", "names neither prompt nor sampled tokens")
        kind = PromptProvenanceSpan if arm == "prompt_tokens" else SampledProvenanceSpan
        run = getattr(msg, arm)
        try:
            spans.append(kind(sequence_id=run.sequence_id, offset=run.offset, length=run.length))
        except ValueError as exc:
            raise InvalidRequestError(f"{field}[{i}]", str(exc)) from None
    return spans


def _array(raw: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise InvalidRequestError(
            field, f"has {len(raw)} bytes, not a multiple of {dtype.itemsize} ({dtype.name})"
        )
    return np.frombuffer(raw, dtype=dtype)


def _tensor(msg: public_pb.Tensor, field: str) -> types.TensorData:
    if msg.dtype not in _WIRE_DTYPES:
        raise InvalidRequestError(f"{field}.dtype", f"is {msg.dtype}; send float32 or int64")
    dtype, np_dtype = _WIRE_DTYPES[msg.dtype]
    shape = list(msg.shape)
    if any(s < 0 for s in shape):
        raise InvalidRequestError(f"{field}.shape", f"{shape} has a negative dimension")
    if msg.WhichOneof("encoding") == "sparse_csr":
        dense = _densify(msg.sparse_csr, np_dtype, shape, field)
        return types.TensorData(data=dense, dtype=dtype, shape=shape)
    values = _array(msg.dense, np_dtype, field)
    if not shape:  # the SDK sends no shape for a TensorData without one: 1-D
        return types.TensorData(data=values, dtype=dtype)
    if math.prod(shape) != values.size:
        raise InvalidRequestError(f"{field}.shape", f"{shape} does not fit {values.size} values")
    return types.TensorData(data=values.reshape(shape), dtype=dtype, shape=shape)


def _densify(
    csr: public_pb.SparseCsr, np_dtype: np.dtype, shape: list[int], field: str
) -> np.ndarray:
    if len(shape) != 2:
        raise InvalidRequestError(f"{field}.shape", f"is {shape}; a sparse CSR tensor must be 2-D")
    if math.prod(shape) > MAX_DENSE_ELEMENTS:
        raise InvalidRequestError(f"{field}.shape", f"{shape} exceeds {MAX_DENSE_ELEMENTS} cells")
    values = _array(csr.values, np_dtype, f"{field}.sparse_csr.values")
    crow = _array(csr.crow_indices, np.dtype("<i8"), f"{field}.sparse_csr.crow_indices")
    col = _array(csr.col_indices, np.dtype("<i8"), f"{field}.sparse_csr.col_indices")
    rows, cols = shape
    if (
        crow.size != rows + 1
        or crow[0] != 0
        or np.any(np.diff(crow) < 0)
        or crow[-1] != values.size
        or col.size != values.size
        or np.any((col < 0) | (col >= cols))
    ):
        raise InvalidRequestError(
            f"{field}.sparse_csr", f"indices are not a valid CSR layout for shape {shape}"
        )
    dense = np.zeros(shape, dtype=np_dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


def encode_forward_backward_output(output: types.ForwardBackwardOutput) -> bytes:
    """Serialize a result as the protobuf `ForwardBackwardOutput` the SDK decodes.

    Datums go into `ArrayRecord`s, one `BatchedTensor` per field: one record per run of
    consecutive datums whose fields have the same dtypes and trailing shapes (the SDK decodes
    several records in order: "ragged outputs (e.g. variable-K loss fields) arrive as multiple
    internally-rectangular chunks"), so 1-D logprobs and [T, K] logprobs of different K can
    share a response. Every datum must have the same field names (else `ValueError`). A 0-d
    per-datum tensor comes back to the client as shape [1].
    """
    msg = public_pb.ForwardBackwardOutput(
        loss_fn_output_type=output.loss_fn_output_type,
        metrics={k: float(v) for k, v in output.metrics.items()},
    )
    outputs = output.loss_fn_outputs
    if not outputs:
        return msg.SerializeToString()
    names = sorted(outputs[0])
    for i, datum in enumerate(outputs):
        if sorted(datum) != names:
            raise ValueError(f"loss_fn_outputs[{i}] has fields {sorted(datum)}, not {names}")
    # Per datum: {name: (wire dtype, little-endian array)}, and its layout key.
    encoded = []
    for datum in outputs:
        fields = {}
        for name in names:
            wire_dtype, np_dtype = _TO_WIRE[datum[name].dtype]
            fields[name] = (wire_dtype, np.asarray(datum[name].to_numpy(), dtype=np_dtype))
        layout = tuple((name, dtype, a.shape[1:]) for name, (dtype, a) in fields.items())
        encoded.append((layout, fields))
    start = 0
    while start < len(encoded):
        layout = encoded[start][0]
        stop = start + 1
        while stop < len(encoded) and encoded[stop][0] == layout:
            stop += 1
        run = [datum_fields for _, datum_fields in encoded[start:stop]]
        record = msg.loss_fn_outputs.add(num_datums=len(run))
        for name, wire_dtype, trailing in layout:
            arrays = [datum_fields[name][1] for datum_fields in run]
            offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
            record.fields[name].CopyFrom(
                public_pb.BatchedTensor(
                    data=b"".join(a.tobytes() for a in arrays),
                    offsets=offsets.astype("<i8").tobytes(),
                    dtype=wire_dtype,
                    trailing_shape=list(trailing),
                )
            )
        start = stop
    return msg.SerializeToString()


def encode_sample_response(response: types.SampleResponse) -> bytes:
    """Serialize a `SampleResponse` as the protobuf the SDK decodes.

    Reads the numpy fields (`tokens_np`, `prompt_logprobs_np`, ...) or, when a response was built
    from lists, the list properties. A None prompt logprob travels as NaN and comes back as None;
    top-k lists become dense (length, k) matrices padded with (0, -99999). An empty `logprobs`
    array comes back to the client as None (the SDK reads empty bytes as absent).
    `target_prompt_logprobs` and the two `prompt_alt_tokens` tensors travel as proto `Tensor`s
    with their shape, a sparse CSR tensor staying sparse (the SDK decodes it as sent).
    """
    msg = public_pb.SampleResponse(prompt_cache_hit_tokens=response.prompt_cache_hit_tokens)
    for seq in response.sequences:
        if seq.stop_reason not in _STOP_REASONS:
            raise ValueError(f"unknown stop_reason {seq.stop_reason!r}")
        out = msg.sequences.add(
            stop_reason=_STOP_REASONS[seq.stop_reason],
            tokens=np.asarray(
                seq.tokens if seq.tokens_np is None else seq.tokens_np, dtype="<i4"
            ).tobytes(),
        )
        logprobs = seq.logprobs if seq.logprobs_np is None else seq.logprobs_np
        if logprobs is not None:
            out.logprobs = np.asarray(logprobs, dtype="<f4").tobytes()
        topk = seq.topk_logprobs_np
        if topk is None:
            topk = _topk_from_lists(seq.topk_logprobs)
        if topk is not None:
            out.topk_sampled_logprobs.CopyFrom(_topk_proto(topk))
    prompt = response.prompt_logprobs_np
    if prompt is not None:
        msg.prompt_logprobs = np.asarray(prompt, dtype="<f4").tobytes()
    elif response.prompt_logprobs is not None:  # list form: None -> NaN
        lps = [math.nan if lp is None else lp for lp in response.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(lps, dtype="<f4").tobytes()
    topk = response.topk_prompt_logprobs_np
    if topk is None:
        topk = _topk_from_lists(response.topk_prompt_logprobs)
    if topk is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk_proto(topk))
    if response.target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(_tensor_proto(response.target_prompt_logprobs))
    if response.prompt_alt_tokens is not None:
        msg.prompt_alt_tokens.tokens.CopyFrom(_tensor_proto(response.prompt_alt_tokens.tokens))
        msg.prompt_alt_tokens.logprobs.CopyFrom(_tensor_proto(response.prompt_alt_tokens.logprobs))
    return msg.SerializeToString()


def _tensor_proto(td) -> public_pb.Tensor:
    """A `TensorData` (the SDK's dataclass or its pydantic model) as a proto `Tensor`, the
    inverse of the SDK's `response_conv._tensor_data_from_proto`: dense bytes, or sparse CSR
    values + int64 crow/col indices; the shape is always sent (the SDK reshapes to it)."""
    wire_dtype, np_dtype = _TO_WIRE[td.dtype]
    msg = public_pb.Tensor(dtype=wire_dtype)
    if td.sparse_crow_indices is not None:
        if td.sparse_col_indices is None or td.shape is None or len(td.shape) != 2:
            raise ValueError("a sparse CSR tensor needs sparse_col_indices and a 2-D shape")
        msg.shape.extend(int(n) for n in td.shape)
        msg.sparse_csr.values = np.asarray(td.data, dtype=np_dtype).tobytes()
        msg.sparse_csr.crow_indices = np.asarray(td.sparse_crow_indices, dtype="<i8").tobytes()
        msg.sparse_csr.col_indices = np.asarray(td.sparse_col_indices, dtype="<i8").tobytes()
        return msg
    values = td.to_numpy() if hasattr(td, "to_numpy") else td.data
    array = np.asarray(values, dtype=np_dtype)
    if td.shape is not None:
        array = array.reshape(td.shape)
    msg.shape.extend(array.shape)
    msg.dense = array.tobytes()
    return msg


def _topk_from_lists(cells: list[list[tuple[int, float]] | None] | None) -> TopkLogprobs | None:
    """Per-position lists of (token, logprob) as dense (length, k) matrices; empty = (0, -99999)."""
    if cells is None:
        return None
    k = max((len(c) for c in cells if c), default=0)
    token_ids = np.zeros((len(cells), k), dtype=np.int32)
    logprobs = np.full((len(cells), k), MASK_LOGPROB, dtype=np.float32)
    for pos, cell in enumerate(cells):
        for j, (token, lp) in enumerate(cell or []):
            token_ids[pos, j], logprobs[pos, j] = token, lp
    return TopkLogprobs(token_ids=token_ids, logprobs=logprobs)


def _topk_proto(topk: TopkLogprobs) -> public_pb.TopkLogprobs:
    length, k = np.shape(topk.token_ids)
    return public_pb.TopkLogprobs(
        token_ids=np.asarray(topk.token_ids, dtype="<i4").tobytes(),
        logprobs=np.asarray(topk.logprobs, dtype="<f4").tobytes(),
        k=k,
        length=length,
    )
