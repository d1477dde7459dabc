"""The Tinker wire format read and written by the server, with the SDK's own schema and converters.

`forward_backward` (and `forward`, the same endpoint with `forward_only`) arrives as the SDK's protobuf
ForwardBackwardRequest (tinker/proto/tinker_public_pb2.py), zstd-compressed where the client config asks for it; it
is read into the SDK's own request type (tinker.types.ForwardBackwardRequest), its tensors with the SDK's decoder
(tinker/proto/response_conv.py's, the inverse of the encoder request_conv.py uses), then checked into a `Batch` of
torch tensors. The result goes back as the SDK's protobuf ForwardBackwardOutput, which the SDK demands for this type
(there is no JSON form): one ArrayRecord whose BatchedTensor fields hold every datum's values back to back, with
the byte offset where each datum's begins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as public_pb
from tinker.proto.response_conv import _tensor_data_from_proto

from reinforce.training_api.losses import LOSSES, REFUSED, config_of

PROTOBUF = "application/x-protobuf"


def parse_forward_backward(body: bytes, content_encoding: str | None) -> public_pb.ForwardBackwardRequest:
    """The protobuf message of a forward_backward body; ValueError where it does not parse."""
    if content_encoding == "zstd":
        try:
            body = zstandard.ZstdDecompressor().decompress(body)
        except zstandard.ZstdError as err:
            raise ValueError(f"the body is not valid zstd ({err})") from None
    elif content_encoding not in (None, "identity"):
        raise ValueError(f"Content-Encoding {content_encoding!r}: only zstd is understood")
    message = public_pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as err:  # protobuf's DecodeError; its module differs between implementations
        raise ValueError(f"the body is not a ForwardBackwardRequest message ({err})") from None
    return message


def to_request(message: public_pb.ForwardBackwardRequest) -> types.ForwardBackwardRequest:
    """The SDK's request type of a parsed message; ValueError naming the datum and the chunk the SDK's public types
    cannot carry here (only token chunks: this server trains text models)."""
    data = []
    for index, datum in enumerate(message.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise ValueError(f"data[{index}].model_input: a {kind} chunk; this server takes token chunks only")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {name: _tensor_data_from_proto(tensor) for name, tensor in datum.loss_fn_inputs.items()}
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs))
    # the SDK writes every value to loss_fn_config_v2 (strings only there) and floats to the legacy map as well
    config: dict[str, float | str] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    loss_input = types.ForwardBackwardInput(data=data, loss_fn=message.loss_fn, loss_fn_config=config or None)
    return types.ForwardBackwardRequest(
        forward_backward_input=loss_input, model_id=message.model_id, seq_id=message.seq_id
    )


@dataclass(frozen=True)
class Batch:
    """One forward_backward request, checked: each datum's input tokens, its loss inputs as tensors of the same
    length (target_tokens int64, the others float32; each loss_fn_config value too, as that value at every token),
    and the loss."""

    loss_fn: str
    tokens: list[list[int]]
    inputs: list[dict[str, torch.Tensor]]
    forward_only: bool


def batch_of(request: types.ForwardBackwardRequest, forward_only: bool, vocab_size: int) -> Batch:
    """ValueError naming the field (and the datum) that this server cannot compute."""
    loss_input = request.forward_backward_input
    if loss_input.loss_fn not in LOSSES:
        why = f": {REFUSED[loss_input.loss_fn]}" if loss_input.loss_fn in REFUSED else ""
        raise ValueError(
            f"loss_fn {loss_input.loss_fn!r} is not supported in this version{why} (supported: {', '.join(LOSSES)})"
        )
    config = config_of(loss_input.loss_fn, loss_input.loss_fn_config or {})
    if not loss_input.data:
        raise ValueError("data: no datum")
    _, needed = LOSSES[loss_input.loss_fn]
    tokens, inputs = [], []
    for index, datum in enumerate(loss_input.data):
        ids = datum.model_input.to_ints()
        if not ids:
            raise ValueError(f"data[{index}].model_input: no tokens")
        if (bad := [t for t in ids if not 0 <= t < vocab_size]) != []:
            raise ValueError(
                f"data[{index}].model_input: token {bad[0]} is outside the vocabulary (0..{vocab_size - 1})"
            )
        tensors = {}
        for name in ("target_tokens", *needed):
            if name not in datum.loss_fn_inputs:
                raise ValueError(f"data[{index}].loss_fn_inputs: {loss_input.loss_fn} needs {name!r}")
            tensor = datum.loss_fn_inputs[name].to_torch().reshape(-1)
            if tensor.shape != (len(ids),):
                raise ValueError(
                    f"data[{index}].loss_fn_inputs[{name!r}]: {tuple(tensor.shape)} values for {len(ids)} input tokens"
                )
            tensors[name] = tensor.to(torch.int64 if name == "target_tokens" else torch.float32)
        targets = tensors["target_tokens"]
        if not bool(((targets >= 0) & (targets < vocab_size)).all()):
            raise ValueError(f"data[{index}].loss_fn_inputs['target_tokens']: a token outside 0..{vocab_size - 1}")
        if extra := sorted(set(datum.loss_fn_inputs) - set(tensors)):
            raise ValueError(f"data[{index}].loss_fn_inputs: {loss_input.loss_fn} reads no {extra}")
        # each loss_fn_config value as the loss reads it: that one value at every token
        tensors.update({key: torch.full((len(ids),), value) for key, value in config.items()})
        tokens.append(ids)
        inputs.append(tensors)
    return Batch(loss_input.loss_fn, tokens, inputs, forward_only)


def encode_output(logprobs: list[torch.Tensor], loss: float) -> bytes:
    """The protobuf ForwardBackwardOutput of one request: each datum's `logprobs` (of its target tokens) and the
    metric `loss:sum` (the SDK combines chunks' metrics by the reduction after the colon)."""
    values = [lp.detach().to(torch.float32).numpy() for lp in logprobs]
    offsets = np.cumsum([0] + [v.nbytes for v in values], dtype=np.int64)
    field = public_pb.BatchedTensor(
        data=np.concatenate(values).tobytes(), offsets=offsets.tobytes(), dtype=public_pb.DTYPE_FLOAT32
    )
    record = public_pb.ArrayRecord(type_tag="ArrayRecord", fields={"logprobs": field}, num_datums=len(values))
    output = public_pb.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics={"loss:sum": loss}
    )
    return output.SerializeToString()
