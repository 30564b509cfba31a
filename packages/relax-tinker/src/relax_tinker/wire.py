"""The Tinker API's protobuf messages, declared here from the protocol's field numbers.

Why protobuf at all: the ``tinker`` SDK sends ``forward_backward`` bodies as protobuf and accepts the results
of ``forward_backward`` and ``asample`` only as protobuf (``Content-Type: application/x-protobuf``); the other
routes are JSON. Why declared here rather than imported from the SDK: the server must not depend on the
client (the SDK is a test dependency), so the messages are built at import from a descriptor written below
— the field numbers and types are the wire protocol, the code is ours.

:func:`decode_forward_backward` gives typed :class:`Datum` rows (tokens, loss inputs as numpy arrays);
:func:`encode_forward_output` and :func:`encode_sample` write the two protobuf results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PROTO_TYPE = "application/x-protobuf"
_F = descriptor_pb2.FieldDescriptorProto
_SCALAR = {
    "bytes": _F.TYPE_BYTES,
    "string": _F.TYPE_STRING,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "double": _F.TYPE_DOUBLE,
    "bool": _F.TYPE_BOOL,
}
_ENUMS = {
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
}
# message -> fields (name, number, type, label): "rep" repeated, "map:<V>" a map from string, "oneof:<name>"
_MESSAGES: dict[str, list[tuple[str, int, str, str]]] = {
    "SampleResponse": [
        ("sequences", 1, "SampledSequence", "rep"),
        ("prompt_logprobs", 2, "bytes", ""),
        ("prompt_cache_hit_tokens", 4, "int32", ""),
    ],
    "SampledSequence": [
        ("stop_reason", 1, "StopReason", ""),
        ("tokens", 2, "bytes", ""),
        ("logprobs", 3, "bytes", ""),
        ("topk_sampled_logprobs", 4, "TopkLogprobs", ""),
    ],
    "TopkLogprobs": [
        ("token_ids", 1, "bytes", ""),
        ("logprobs", 2, "bytes", ""),
        ("k", 3, "uint32", ""),
        ("length", 4, "uint32", ""),
    ],
    "SparseCsr": [
        ("nonzero", 1, "bytes", ""),  # (the name is ours: on the wire a field is its number)
        ("crow_indices", 2, "bytes", ""),
        ("col_indices", 3, "bytes", ""),
    ],
    "Tensor": [
        ("dense", 1, "bytes", "oneof:encoding"),
        ("sparse_csr", 2, "SparseCsr", "oneof:encoding"),
        ("dtype", 3, "DType", ""),
        ("shape", 4, "int64", "rep"),
    ],
    "BatchedTensor": [
        ("data", 1, "bytes", ""),
        ("offsets", 2, "bytes", ""),
        ("dtype", 3, "DType", ""),
        ("trailing_shape", 4, "int64", "rep"),
    ],
    "ArrayRecord": [
        ("type_tag", 1, "string", ""),
        ("fields", 2, "BatchedTensor", "map"),
        ("num_datums", 3, "int64", ""),
    ],
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, "string", ""),
        ("loss_fn_outputs", 2, "ArrayRecord", "rep"),
        ("metrics", 3, "double", "map"),
    ],
    "ForwardBackwardRequest": [
        ("model_id", 1, "string", ""),
        ("seq_id", 2, "int32", ""),
        ("data", 3, "Datum", "rep"),
        ("loss_fn", 4, "string", ""),
        ("loss_fn_config", 5, "double", "map"),
        ("forward_only", 6, "bool", ""),
        ("loss_fn_config_v2", 7, "LossConfigValue", "map"),
    ],
    "LossConfigValue": [("number", 1, "double", "oneof:value"), ("text", 2, "string", "oneof:value")],
    "Datum": [
        ("model_input", 1, "Chunk", "rep"),
        ("loss_fn_inputs", 2, "Tensor", "map"),
    ],
    "Chunk": [
        ("encoded_text", 1, "EncodedTextChunk", "oneof:chunk"),
        ("image", 2, "ImageChunk", "oneof:chunk"),
        ("dmel", 3, "DmelChunk", "oneof:chunk"),
    ],
    "EncodedTextChunk": [("tokens", 1, "bytes", "")],
    "ImageChunk": [("data", 1, "bytes", ""), ("format", 2, "string", "")],
    "DmelChunk": [("dmel", 1, "bytes", "")],
}
_PACKAGE = "tinker_public"


def _field(msg: Any, name: str, number: int, kind: str, label: str) -> None:
    f = msg.field.add(name=name, number=number, json_name=name)
    f.label = _F.LABEL_REPEATED if label in ("rep", "map") else _F.LABEL_OPTIONAL
    if label == "map":  # a map is a repeated nested entry message (key = 1, value = 2)
        entry = msg.nested_type.add(name="".join(p.title() for p in name.split("_")) + "Entry")
        entry.options.map_entry = True
        _field(entry, "key", 1, "string", "")
        _field(entry, "value", 2, kind, "")
        f.type, f.type_name = _F.TYPE_MESSAGE, f".{_PACKAGE}.{msg.name}.{entry.name}"
    elif kind in _SCALAR:
        f.type = _SCALAR[kind]
    elif kind in _ENUMS:
        f.type, f.type_name = _F.TYPE_ENUM, f".{_PACKAGE}.{kind}"
    else:
        f.type, f.type_name = _F.TYPE_MESSAGE, f".{_PACKAGE}.{kind}"
    if label.startswith("oneof:"):
        names = [o.name for o in msg.oneof_decl]
        group = label.split(":", 1)[1]
        if group not in names:
            msg.oneof_decl.add(name=group)
            names.append(group)
        f.oneof_index = names.index(group)


def _build() -> dict[str, Any]:
    fd = descriptor_pb2.FileDescriptorProto(name="relax_tinker_wire.proto", package=_PACKAGE, syntax="proto3")
    for name, values in _ENUMS.items():
        enum = fd.enum_type.add(name=name)
        for i, v in enumerate(values):
            enum.value.add(name=v, number=i)
    for name, fields in _MESSAGES.items():
        msg = fd.message_type.add(name=name)
        for f in fields:
            _field(msg, *f)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {
        n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{n}")) for n in _MESSAGES
    }


MESSAGES = _build()
_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32, 4: np.float32}


@dataclass
class Datum:
    """One row of a ``forward`` / ``forward_backward`` call: the model's input tokens and the loss inputs
    (``target_tokens``, ``weights``, ``logprobs``, ``advantages``, ...), each an array of its own dtype."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool


def _tensor(t: Any, key: str) -> np.ndarray:
    """A protobuf ``Tensor`` as a dense array (sparse CSR rows filled with zeros)."""
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise ValueError(f"loss_fn_inputs[{key!r}]: dtype {t.dtype} is not float32 or int64")
    shape = list(t.shape)
    if t.WhichOneof("encoding") == "sparse_csr":
        csr = t.sparse_csr
        values = np.frombuffer(csr.nonzero, dtype=dtype)
        crow, col = np.frombuffer(csr.crow_indices, np.int64), np.frombuffer(csr.col_indices, np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise ValueError(
                f"loss_fn_inputs[{key!r}]: a sparse tensor of shape {shape} with inconsistent indices"
            )
        out = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        out[rows, col] = values
        return out
    out = np.frombuffer(t.dense, dtype=dtype).copy()
    return out.reshape(shape) if shape else out


def _tokens(chunks: Any, i: int) -> list[int]:
    tokens: list[int] = []
    for c in chunks:
        kind = c.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ValueError(
                f"datum {i}: a {kind} chunk; this server trains on text chunks only (images and audio are "
                "refused: see the compatibility table in relax-tinker's README)"
            )
        tokens += np.frombuffer(c.encoded_text.tokens, dtype="<i4").tolist()
    return tokens


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A ``POST /api/v1/forward_backward`` body; a malformed one raises ValueError naming the datum."""
    req = MESSAGES["ForwardBackwardRequest"]()
    req.ParseFromString(body)
    config: dict[str, float | str] = dict(req.loss_fn_config)
    for k, v in req.loss_fn_config_v2.items():
        config[k] = v.number if v.WhichOneof("value") == "number" else v.text
    data = [
        Datum(_tokens(d.model_input, i), {k: _tensor(t, k) for k, t in d.loss_fn_inputs.items()})
        for i, d in enumerate(req.data)
    ]
    return ForwardBackwardCall(req.model_id, req.seq_id, data, req.loss_fn, config, req.forward_only)


def encode_forward_output(per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput``: one ``ArrayRecord`` whose fields hold every datum's arrays back to back
    (byte offsets per datum), and the metrics (``name:reduction`` keys)."""
    out = MESSAGES["ForwardBackwardOutput"](loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(per_datum))
    for key in per_datum[0] if per_datum else []:
        arrays = [np.ascontiguousarray(d[key], dtype=np.float32) for d in per_datum]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        batched = record.fields[key]
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = offsets.tobytes()
        batched.dtype = 1
        batched.trailing_shape.extend(arrays[0].shape[1:])
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


def encode_sample(
    sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float | None] | None = None
) -> bytes:
    """``SampleResponse``: per sequence (tokens, log-probs, "stop" | "length"); with ``prompt_logprobs`` the
    prompt's (NaN where none, as the first token's)."""
    out = MESSAGES["SampleResponse"]()
    for tokens, logprobs, reason in sequences:
        seq = out.sequences.add(stop_reason=0 if reason == "stop" else 1)
        seq.tokens = np.asarray(tokens, dtype="<i4").tobytes()
        seq.logprobs = np.asarray(logprobs, dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        lp = [np.nan if x is None else x for x in prompt_logprobs]
        out.prompt_logprobs = np.asarray(lp, dtype="<f4").tobytes()
    return out.SerializeToString()
