"""Our protobuf messages against the real SDK's: a request the SDK encodes decodes here (dense and sparse
tensors, config values of both kinds), and what we encode the SDK's own decoders read back."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from relax_tinker.wire import decode_forward_backward, encode_forward_output, encode_sample  # noqa: E402


def _sdk_request() -> bytes:
    import torch

    top_k = torch.zeros(3, 4, dtype=torch.int64)
    top_k[1, 2] = 7  # mostly zeros: the SDK sends it as sparse CSR
    datums = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={
                "target_tokens": [2, 3, 4],
                "advantages": [0.0, 0.5, -1.5],
                "logprobs": [0.0, -1.0, -2.0],
            },
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": types.TensorData.from_torch(top_k)},
        ),
    ]
    fwd = types.ForwardBackwardInput(data=datums, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7})
    req = types.ForwardBackwardRequest(forward_backward_input=fwd, model_id="s:train:0", seq_id=3)
    return forward_backward_request_to_proto(req).SerializeToString()


def test_a_request_the_sdk_encodes_decodes_here():
    call = decode_forward_backward(_sdk_request())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 3, "ppo", False)
    assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    first, second = call.data
    assert first.tokens == [1, 2, 3] and first.inputs["target_tokens"].tolist() == [2, 3, 4]
    assert first.inputs["advantages"].dtype == np.float32 and first.inputs["advantages"].tolist() == [
        0,
        0.5,
        -1.5,
    ]
    dense = second.inputs["target_tokens"]
    assert dense.shape == (3, 4) and dense[1, 2] == 7 and dense.sum() == 7


def test_what_we_encode_the_sdk_reads():
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    got = deserialize_forward_backward_output(
        encode_forward_output(
            [{"logprobs": np.array([-1.0, -2.0])}, {"logprobs": np.array([-0.5])}], {"loss:sum": 2.5}
        )
    )
    assert [o["logprobs"].tolist() for o in got.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert got.metrics == {"loss:sum": 2.5}
    seqs = deserialize_sample_response(
        encode_sample([([5, 6], [-0.25, -0.5], "stop"), ([7], [-1.0], "length")], [None, -3.0])
    )
    assert [s.tokens for s in seqs.sequences] == [[5, 6], [7]]
    assert [s.stop_reason for s in seqs.sequences] == ["stop", "length"]
    assert seqs.sequences[0].logprobs == [-0.25, -0.5] and seqs.prompt_logprobs == [None, -3.0]


def test_an_image_chunk_is_refused_naming_the_datum():
    req = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    req.data.add().model_input.add().image.data = b"\x89PNG"
    with pytest.raises(ValueError, match="datum 0: a image chunk"):
        decode_forward_backward(req.SerializeToString())
