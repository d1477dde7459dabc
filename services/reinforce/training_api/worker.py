"""The worker: one thread that takes accepted requests from Redis in the order they were accepted and applies each
to its model (tenants.py), then stores its result or its failure in Redis for retrieve_future.

The SDK sends a training client's requests one after another in seq_id order (a request is sent only once the one
before it was accepted), except the chunks of one large forward_backward, which it sends together: their gradients
add up in whatever order they arrive. So acceptance order is each model's seq_id order between barriers. One
thread computes everything: the base model is shared, and on CPU a second computing thread would only contend for
the cores.
"""

from __future__ import annotations

import logging
import threading

from tinker import types

from reinforce.training_api.sampling import KINDS as SAMPLING_KINDS
from reinforce.training_api.sampling import Sampler
from reinforce.training_api.store import Stored, WorkQueue
from reinforce.training_api.tenants import Tenants
from reinforce.training_api.wire import batch_of, encode_output, parse_forward_backward, to_request

log = logging.getLogger(__name__)


def apply(tenants: Tenants, sampler: Sampler, request: Stored) -> tuple[bytes, str]:
    """(result, result_type) of one accepted request; ValueError where the client's request cannot be applied."""
    if request.kind in SAMPLING_KINDS:
        return sampler.apply(request)
    if request.kind == "forward_backward":
        message = parse_forward_backward(request.body, request.encoding or None)
        batch = batch_of(to_request(message), message.forward_only, tenants.vocab_size)
        logprobs, loss = tenants.forward_backward(request.model_id, batch)
        return encode_output(logprobs, loss), "proto"
    if request.kind == "optim_step":
        params = types.OptimStepRequest.model_validate_json(request.body).optim_params
        assert isinstance(params, types.AdamParams)  # the server accepts no other
        result: types.BaseModel = types.OptimStepResponse(metrics=tenants.optim_step(request.model_id, params))
    elif request.kind == "create_model":
        create = types.CreateModelRequest.model_validate_json(request.body)
        assert create.lora_config is not None  # the server accepts no full fine-tuning
        tenants.create(request.model_id, create.lora_config)
        result = types.CreateModelResponse(model_id=request.model_id)
    elif request.kind == "save_weights":
        save = types.SaveWeightsRequest.model_validate_json(request.body)
        assert save.path is not None  # the server names one where the client gives none
        path = tenants.save(request.model_id, save.path, save.overwrite)
        result = types.SaveWeightsResponse(path=path, type="save_weights")
    elif request.kind == "load_weights":
        load = types.LoadWeightsRequest.model_validate_json(request.body)
        tenants.load(request.model_id, load.path, load.optimizer, create=load.session_id is not None)
        result = types.LoadWeightsResponse(path=load.path, model_id=request.model_id, type="load_weights")
    else:
        raise AssertionError(f"the server accepted a request of kind {request.kind!r}")
    return result.model_dump_json().encode(), "json"


class Worker(threading.Thread):
    def __init__(self, tenants: Tenants, queue: WorkQueue) -> None:
        super().__init__(name="training-api-worker", daemon=True)
        self.tenants = tenants
        self.sampler = Sampler(tenants)  # shares the tenants' model, so it runs on this thread only
        self.queue = queue
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            request = self.queue.next(timeout_s=1.0)
            if request is None:
                continue
            try:
                result, result_type = apply(self.tenants, self.sampler, request)
            except ValueError as err:
                self.queue.fail(request.request_id, str(err), "user")
            except Exception as err:  # a bug or a broken machine: the client hears of it, the log has the trace
                log.exception("%s %s of model %s failed", request.kind, request.request_id, request.model_id)
                self.queue.fail(request.request_id, f"{type(err).__name__}: {err}", "server")
            else:
                self.queue.finish(request.request_id, result, result_type)
