"""The server's protobuf codec against the tinker SDK's own encoder and decoders (no server, no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as public_pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)
from tinker.types.topk_logprobs import TopkLogprobs

from skyrl_trainer.backend.datums import to_training_example
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.losses import get_loss
from skyrl_trainer.backend.sample_requests import to_sample_response
from skyrl_trainer.backend.sampling.engine import GeneratedSequence, GenerationResult
from skyrl_trainer.server.codec import (
    decode_body,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)

# ---------------------------------------------------------------- forward_backward requests


def sdk_body(
    data: list[types.Datum],
    loss_fn: str = "cross_entropy",
    loss_fn_config: dict[str, float | str] | None = None,
    seq_id: int | None = 1,
    forward_only: bool = False,
) -> bytes:
    """The body the SDK sends (training_client.py builds the request, resources/training.py encodes it)."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config
        ),
        model_id="session-1:train:0",
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def assert_same_tensor(got: types.TensorData, want: types.TensorData) -> None:
    assert got.sparse_crow_indices is None  # the backend takes dense tensors only
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.to_numpy(), want.to_numpy())
    assert list(got.to_numpy().shape) == list(want.to_numpy().shape)
    if want.shape is not None:
        assert got.shape == want.shape


def test_forward_backward_request_round_trip_lists_numpy_and_multi_chunk():
    multi_chunk = types.Datum(
        model_input=types.ModelInput(
            chunks=[
                types.EncodedTextChunk(tokens=[1, 2]),
                types.EncodedTextChunk(tokens=[3, 150000]),
            ]
        ),
        loss_fn_inputs={
            "target_tokens": np.array([2, 3, 150000, 7], dtype=np.int64),
            "logprobs": np.array([-0.5, -1.25, -3.0, -0.125], dtype=np.float32),
            "advantages": torch.tensor([1.0, 1.0, -2.0, 0.5]),
        },
    )
    sent = [
        datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[0.0, 1.0, 1.0]),
        multi_chunk,
    ]
    call = decode_forward_backward_request(
        sdk_body(sent, "ppo", {"clip_low_threshold": 0.75}, seq_id=7, forward_only=True)
    )

    assert call.model_id == "session-1:train:0"
    assert call.seq_id == 7
    assert call.loss_fn == "ppo"
    assert call.loss_fn_config == {"clip_low_threshold": 0.75}
    assert call.forward_only is True
    assert len(call.data) == 2
    got = call.data[1]
    assert [c.tokens for c in got.model_input.chunks] == [[1, 2], [3, 150000]]
    assert all(isinstance(c, types.EncodedTextChunk) for c in got.model_input.chunks)
    assert call.data[0].model_input.to_ints() == [5, 6, 7]
    for want_datum, got_datum in zip(sent, call.data, strict=True):
        assert set(got_datum.loss_fn_inputs) == set(want_datum.loss_fn_inputs)
        for name, want in want_datum.loss_fn_inputs.items():
            assert_same_tensor(got_datum.loss_fn_inputs[name], want)


def test_decoded_datums_are_accepted_by_the_backend():
    sent = datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[0.0, 1.0, 1.0])
    call = decode_forward_backward_request(sdk_body([sent]))
    example = to_training_example(
        call.data[0], get_loss("cross_entropy"), vocab_size=100, max_length=16, field="data[0]"
    )
    assert example.input_ids_N.tolist() == [5, 6, 7]
    assert example.loss_inputs["target_tokens"].tolist() == [6, 7, 8]
    assert example.loss_inputs["weights"].tolist() == [0.0, 1.0, 1.0]


def test_2d_torch_inputs_sent_as_sparse_csr_decode_dense():
    targets = torch.zeros((4, 6), dtype=torch.int64)
    targets[0, 1], targets[2, 5], targets[3, 0] = 11, 12, 13
    weights = torch.zeros((4, 6), dtype=torch.float32)
    weights[1, 2], weights[3, 3] = 0.5, 2.0
    sent = datum([1, 2, 3, 4], target_tokens=targets, weights=weights)
    # The SDK turns these 2-D tensors into CSR on the wire.
    assert sent.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    assert sent.loss_fn_inputs["weights"].sparse_crow_indices is not None

    got = decode_forward_backward_request(sdk_body([sent])).data[0].loss_fn_inputs
    for name, want in (("target_tokens", targets), ("weights", weights)):
        assert got[name].sparse_crow_indices is None
        assert got[name].shape == [4, 6]
        assert got[name].dtype == ("int64" if name == "target_tokens" else "float32")
        np.testing.assert_array_equal(got[name].to_numpy(), want.numpy())


def test_loss_fn_config_v2_strings_legacy_map_and_none():
    sent = [datum([1, 2], target_tokens=[2, 3])]
    both = decode_forward_backward_request(sdk_body(sent, "dro", {"beta": 0.05, "mode": "seq"}))
    assert both.loss_fn_config == {"beta": 0.05, "mode": "seq"}
    assert decode_forward_backward_request(sdk_body(sent)).loss_fn_config is None

    # An older client writes only the legacy float map.
    legacy = public_pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="ppo")
    legacy.loss_fn_config["clip_high_threshold"] = 1.5
    call = decode_forward_backward_request(legacy.SerializeToString())
    assert call.loss_fn_config == {"clip_high_threshold": 1.5}


def test_seq_id_zero_means_unset():
    sent = [datum([1, 2], target_tokens=[2, 3])]
    assert decode_forward_backward_request(sdk_body(sent, seq_id=None)).seq_id is None
    assert decode_forward_backward_request(sdk_body(sent, seq_id=1)).seq_id == 1


# ---------------------------------------------------------------- refused requests


def request_with_tensor(tensor: public_pb.Tensor, name: str = "weights") -> bytes:
    msg = public_pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    for i in range(4):
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.array([1, 2], np.int32).tobytes()
        if i == 3:
            d.loss_fn_inputs[name].CopyFrom(tensor)
    return msg.SerializeToString()


def refusal(body: bytes) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        decode_forward_backward_request(body)
    return info.value


def test_malformed_protobuf_is_refused():
    err = refusal(b"\xff\xff\xff\xff")
    assert err.field == "body"
    assert "body" in str(err)


def test_image_chunk_is_refused_naming_the_chunk():
    image = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=[1, 2]),
            types.ImageChunk(data=b"\x89PNG", format="png"),
        ]
    )
    ok = datum([1], target_tokens=[2])
    body = sdk_body([ok, types.Datum(model_input=image, loss_fn_inputs={"target_tokens": [1]})])
    err = refusal(body)
    assert err.field == "data[1].model_input.chunks[1]"
    assert "encoded_text" in str(err) and "image" in str(err)


def test_bad_tensor_byte_length_is_refused_naming_the_field():
    bad = public_pb.Tensor(dense=b"\0" * 7, dtype=public_pb.DTYPE_FLOAT32, shape=[2])
    err = refusal(request_with_tensor(bad))
    assert err.field == "data[3].loss_fn_inputs.weights"
    assert "data[3].loss_fn_inputs.weights" in str(err)


def test_bad_token_byte_length_is_refused():
    msg = public_pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    msg.data.add().model_input.add().encoded_text.tokens = b"\0" * 6
    assert refusal(msg.SerializeToString()).field == "data[0].model_input.chunks[0]"


@pytest.mark.parametrize(
    ("tensor", "field"),
    [
        (
            public_pb.Tensor(dense=b"\0" * 12, dtype=public_pb.DTYPE_FLOAT32, shape=[2]),
            "data[3].loss_fn_inputs.weights.shape",
        ),
        (
            public_pb.Tensor(dense=b"\0" * 8, dtype=public_pb.DTYPE_BFLOAT16, shape=[4]),
            "data[3].loss_fn_inputs.weights.dtype",
        ),
        (
            public_pb.Tensor(dense=b"\0" * 8, shape=[2]),  # DTYPE_UNSPECIFIED
            "data[3].loss_fn_inputs.weights.dtype",
        ),
        (
            public_pb.Tensor(
                sparse_csr=public_pb.SparseCsr(
                    values=np.array([1.0], np.float32).tobytes(),
                    crow_indices=np.array([0, 1, 1], np.int64).tobytes(),
                    col_indices=np.array([9], np.int64).tobytes(),  # column out of range
                ),
                dtype=public_pb.DTYPE_FLOAT32,
                shape=[2, 3],
            ),
            "data[3].loss_fn_inputs.weights.sparse_csr",
        ),
        (
            public_pb.Tensor(
                sparse_csr=public_pb.SparseCsr(),
                dtype=public_pb.DTYPE_FLOAT32,
                shape=[1 << 20, 1 << 20],  # a tiny body that would densify to 4 TiB
            ),
            "data[3].loss_fn_inputs.weights.shape",
        ),
    ],
)
def test_inconsistent_tensors_are_refused(tensor: public_pb.Tensor, field: str):
    err = refusal(request_with_tensor(tensor))
    assert err.field == field


def test_empty_loss_config_value_is_refused():
    msg = public_pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    msg.loss_fn_config_v2["beta"].SetInParent()
    assert refusal(msg.SerializeToString()).field == "loss_fn_config_v2.beta"


# ---------------------------------------------------------------- forward_backward outputs


def test_forward_backward_output_round_trips_through_the_sdk():
    outputs = []
    for n in (3, 5, 1):
        outputs.append(
            {
                "logprobs": types.TensorData.from_torch(-torch.arange(n, dtype=torch.float32)),
                "elementwise_loss": types.TensorData.from_numpy(np.full(n, 0.25, np.float32)),
                "token_ids": types.TensorData.from_numpy(np.arange(n, dtype=np.int64) + 10**10),
                "pairs": types.TensorData.from_numpy(np.ones((n, 2), np.float32) * n),
            }
        )
    sent = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=outputs,
        metrics={"loss:sum": 1.5, "num_tokens:sum": 9.0, "clip_frac:mean": 0.125},
    )
    got = deserialize_forward_backward_output(encode_forward_backward_output(sent))
    assert got.loss_fn_output_type == "ArrayRecord"
    assert got.metrics == sent.metrics
    assert len(got.loss_fn_outputs) == 3
    for got_datum, want_datum in zip(got.loss_fn_outputs, outputs, strict=True):
        assert set(got_datum) == set(want_datum)
        for name, want in want_datum.items():
            assert_same_tensor(got_datum[name], want)


def test_forward_backward_output_empty_and_field_less():
    empty = types.ForwardBackwardOutput("ArrayRecord", [], {"loss:sum": 0.0})
    got = deserialize_forward_backward_output(encode_forward_backward_output(empty))
    assert got.loss_fn_outputs == [] and got.metrics == {"loss:sum": 0.0}
    assert got.loss_fn_output_type == "ArrayRecord"

    no_fields = types.ForwardBackwardOutput("ArrayRecord", [{}, {}], {})
    got = deserialize_forward_backward_output(encode_forward_backward_output(no_fields))
    assert got.loss_fn_outputs == [{}, {}]


def test_forward_backward_output_with_mismatched_fields_is_a_value_error():
    a = {"logprobs": types.TensorData.from_numpy(np.zeros(2, np.float32))}
    b = {"loss": types.TensorData.from_numpy(np.zeros(2, np.float32))}
    with pytest.raises(ValueError, match="loss_fn_outputs\\[1\\]"):
        encode_forward_backward_output(types.ForwardBackwardOutput("ArrayRecord", [a, b], {}))


# ---------------------------------------------------------------- sample responses


def backend_response() -> types.SampleResponse:
    """A response as the backend builds it (`to_sample_response`) from an engine result."""
    result = GenerationResult(
        sequences=[
            GeneratedSequence(tokens=[5, 9, 2], logprobs=[-0.5, -1.5, -0.25], stop_reason="stop"),
            GeneratedSequence(tokens=[7, 7], logprobs=[-2.0, -0.125], stop_reason="length"),
        ],
        prompt_logprobs=[None, -1.0, -2.5, -0.75],
        topk_prompt_logprobs=[None, [(5, -0.5), (8, -1.0)], [(3, -0.25)], [(1, -2.0), (2, -3.0)]],
    )
    return to_sample_response(result, "sampler-1:0", topk_prompt_logprobs=2)


def test_sample_response_round_trips_through_the_sdk():
    sent = backend_response()
    got = deserialize_sample_response(encode_sample_response(sent))

    assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
    assert [s.tokens for s in got.sequences] == [[5, 9, 2], [7, 7]]
    assert [s.logprobs for s in got.sequences] == [[-0.5, -1.5, -0.25], [-2.0, -0.125]]
    assert got.prompt_logprobs == [None, -1.0, -2.5, -0.75]
    assert got.topk_prompt_logprobs == [
        None,
        [(5, -0.5), (8, -1.0)],
        [(3, -0.25)],
        [(1, -2.0), (2, -3.0)],
    ]
    assert got.prompt_cache_hit_tokens == 0


def test_sample_response_without_logprobs_and_with_sampled_topk():
    topk = TopkLogprobs(
        token_ids=np.array([[4, 6], [1, 0]], np.int32),
        logprobs=np.array([[-0.5, -1.0], [-0.25, -99999.0]], np.float32),
    )
    sent = types.SampleResponse(
        sequences=[
            types.SampledSequence(
                stop_reason="length", sequence_id="s:0", tokens_np=np.array([3, 4], np.int32)
            ),
            types.SampledSequence(
                stop_reason="stop",
                sequence_id="s:1",
                tokens_np=np.array([4, 1], np.int32),
                logprobs_np=np.array([-0.5, -0.25], np.float32),
                topk_logprobs_np=topk,
            ),
        ],
        prompt_cache_hit_tokens=12,
    )
    got = deserialize_sample_response(encode_sample_response(sent))
    assert got.sequences[0].tokens == [3, 4]
    assert got.sequences[0].logprobs is None
    assert got.sequences[0].topk_logprobs is None
    assert got.sequences[1].logprobs == [-0.5, -0.25]
    assert got.sequences[1].topk_logprobs == [[(4, -0.5), (6, -1.0)], [(1, -0.25)]]
    assert got.prompt_logprobs is None and got.topk_prompt_logprobs is None
    assert got.prompt_cache_hit_tokens == 12


def test_sample_response_built_from_lists():
    sent = types.SampleResponse(
        sequences=[
            types.SampledSequence("stop", "s:0", _tokens_list=[1, 2], _logprobs_list=[-1.0, -2.0])
        ],
        _prompt_logprobs_list=[None, -0.5],
        _topk_prompt_logprobs_list=[None, [(9, -0.5), (4, -1.5), (2, -4.0)]],
    )
    got = deserialize_sample_response(encode_sample_response(sent))
    assert got.sequences[0].tokens == [1, 2] and got.sequences[0].logprobs == [-1.0, -2.0]
    assert got.prompt_logprobs == [None, -0.5]
    assert math.isnan(got.prompt_logprobs_np[0])
    assert got.topk_prompt_logprobs == [None, [(9, -0.5), (4, -1.5), (2, -4.0)]]


# ---------------------------------------------------------------- body encodings


def test_identity_and_zstd_bodies_decode():
    body = sdk_body([datum([1, 2, 3], target_tokens=[2, 3, 4])])
    assert decode_body(body, None, 1 << 20) == body
    assert decode_body(body, "identity", 1 << 20) == body
    compressed = zstandard.ZstdCompressor().compress(body)  # what resources/training.py sends
    assert decode_body(compressed, "zstd", 1 << 20) == body
    assert decode_body(compressed, " ZSTD ", len(body)) == body
    # Several frames, and a frame without a declared content size (streaming compressor).
    two = zstandard.ZstdCompressor().compress(b"abc") + zstandard.ZstdCompressor().compress(b"de")
    assert decode_body(two, "zstd", 100) == b"abcde"
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(body * 50)
    assert decode_body(streamed, "zstd", 1 << 20) == body * 50


@pytest.mark.parametrize("write_content_size", [True, False])
def test_zstd_bomb_is_refused(write_content_size: bool):
    bomb = zstandard.ZstdCompressor(write_content_size=write_content_size).compress(
        b"\0" * (64 << 20)
    )
    assert len(bomb) < 10_000
    with pytest.raises(InvalidRequestError) as info:
        decode_body(bomb, "zstd", 1 << 20)
    assert info.value.field == "body"


@pytest.mark.parametrize(
    ("body", "encoding", "field"),
    [
        (b"x" * 101, None, "body"),  # identity body over the limit
        (b"abc", "gzip", "Content-Encoding"),
        (b"not zstd at all", "zstd", "body"),
        (zstandard.ZstdCompressor().compress(b"hello world" * 20)[:-4], "zstd", "body"),
        (zstandard.ZstdCompressor().compress(b"hello") + b"junk", "zstd", "body"),
    ],
)
def test_bad_bodies_are_refused(body: bytes, encoding: str | None, field: str):
    with pytest.raises(InvalidRequestError) as info:
        decode_body(body, encoding, 100)
    assert info.value.field == field
    assert field in str(info.value)
