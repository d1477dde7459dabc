"""The training API's side of the Tinker wire format, against the SDK's own encoder and decoder
(services/reinforce/training_api/wire.py and checkpoint.py's paths)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from reinforce.training_api.checkpoint import folder_of
from reinforce.training_api.wire import batch_of, encode_output, parse_forward_backward, to_request

VOCAB = 40


def sdk_request(
    loss_fn: str = "cross_entropy", config: dict[str, float | str] | None = None, **inputs: list
) -> types.ForwardBackwardRequest:
    inputs = inputs or {"target_tokens": [2, 3, 4], "weights": [1.0, 0.0, 1.0]}
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=inputs)
    loss_input = types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn, loss_fn_config=config)
    return types.ForwardBackwardRequest(forward_backward_input=loss_input, model_id="m", seq_id=3)


RL = {"target_tokens": [1, 2, 3], "logprobs": [-1.0] * 3, "advantages": [1.0, 0.0, -1.0]}


def as_sent(request: types.ForwardBackwardRequest, compress: bool = False) -> bytes:
    body = forward_backward_request_to_proto(request).SerializeToString()
    return zstandard.ZstdCompressor().compress(body) if compress else body


@pytest.mark.parametrize("compress", [False, True])
def test_a_request_the_sdk_encodes_reads_back(compress: bool):
    message = parse_forward_backward(as_sent(sdk_request(), compress), "zstd" if compress else None)
    batch = batch_of(to_request(message), message.forward_only, VOCAB)
    assert (message.model_id, message.seq_id, batch.loss_fn) == ("m", 3, "cross_entropy")
    assert batch.tokens == [[1, 2, 3]]
    assert batch.inputs[0]["target_tokens"].tolist() == [2, 3, 4]
    assert batch.inputs[0]["weights"].tolist() == [1.0, 0.0, 1.0]
    assert batch.inputs[0]["target_tokens"].dtype == torch.int64


@pytest.mark.parametrize(
    ("request_", "named"),
    [
        (sdk_request("stable_reinforce", **RL), "'stable_reinforce' is not supported in this version: it needs"),
        (sdk_request("ppo", {"clip_low": 0.9}, **RL), "ppo takes clip_low_threshold, clip_high_threshold, not"),
        (sdk_request("importance_sampling", {"beta": 0.1}, **RL), "importance_sampling takes no keys"),
        (sdk_request("dro", **RL), "dro needs 'beta'"),
        (sdk_request("dro", {"beta": "high"}, **RL), "a number, not the string 'high'"),
        (sdk_request("ppo", **RL, clip_low_threshold=[0.9] * 3), "ppo reads no ['clip_low_threshold']"),
        (sdk_request("gspo", **RL), "needs 'sequence_ratio_mask'"),
        (sdk_request(target_tokens=[2, 3, 4]), "needs 'weights'"),
        (sdk_request(target_tokens=[2, 3], weights=[1.0, 1.0]), "loss_fn_inputs['target_tokens']: (2,) values for 3"),
        (sdk_request(target_tokens=[2, 3, 99], weights=[1.0] * 3), "outside 0..39"),
        (sdk_request("importance_sampling", target_tokens=[1, 2, 3], logprobs=[0.0] * 3), "needs 'advantages'"),
    ],
)
def test_what_cannot_be_computed_is_refused_naming_the_field(request_: types.ForwardBackwardRequest, named: str):
    message = parse_forward_backward(as_sent(request_), None)
    with pytest.raises(ValueError, match=r"data\[0\]|loss_fn") as refused:
        batch_of(to_request(message), False, VOCAB)
    assert named in str(refused.value)


def test_loss_fn_config_reaches_the_loss_as_one_value_at_every_token():
    """The SDK writes loss_fn_config to the protobuf's v2 map (and floats to the legacy one); a key the client
    leaves out takes the loss's default."""
    message = parse_forward_backward(as_sent(sdk_request("ppo", {"clip_high_threshold": 1.5}, **RL)), None)
    inputs = batch_of(to_request(message), False, VOCAB).inputs[0]
    assert inputs["clip_high_threshold"].tolist() == [1.5] * 3
    assert inputs["clip_low_threshold"].tolist() == pytest.approx([0.8] * 3)  # the default, 1 - 0.2
    assert inputs["clip_low_threshold"].dtype == torch.float32


def test_payloads_compare_parsed_not_as_bytes():
    """Map order is not canonical in protobuf: two encodings of one request parse equal."""
    first = forward_backward_request_to_proto(sdk_request(target_tokens=[2, 3, 4], weights=[1.0] * 3))
    second = forward_backward_request_to_proto(sdk_request(weights=[1.0] * 3, target_tokens=[2, 3, 4]))
    assert parse_forward_backward(first.SerializeToString(), None) == parse_forward_backward(
        second.SerializeToString(), None
    )
    third = forward_backward_request_to_proto(sdk_request(target_tokens=[2, 3, 4], weights=[1.0, 1.0, 0.5]))
    assert parse_forward_backward(third.SerializeToString(), None) != first


def test_the_sdk_decodes_the_output():
    logprobs = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -0.25, -4.0])]
    output = deserialize_forward_backward_output(encode_output(logprobs, 7.75))
    assert output.metrics == {"loss:sum": 7.75}
    assert [o["logprobs"].tolist() for o in output.loss_fn_outputs] == [[-1.0, -2.0], [-0.5, -0.25, -4.0]]
    assert output.loss_fn_outputs[1]["logprobs"].to_numpy().dtype == np.float32


@pytest.mark.parametrize(
    "path", ["tinker://m/weights/../x", "tinker://../weights/x", "tinker://m/sampler_weights/x", "file:///etc"]
)
def test_a_checkpoint_path_stays_in_its_folder(path: str, tmp_path: Path):
    with pytest.raises(ValueError, match="path"):
        folder_of(tmp_path, path)


def test_a_checkpoint_path_names_its_folder(tmp_path: Path):
    assert folder_of(tmp_path, "tinker://s:train:0/weights/ck-1") == tmp_path / "s:train:0" / "weights" / "ck-1"
