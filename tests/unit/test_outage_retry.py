"""Redis clients ride out an outage for queue.max_outage_s, but not once their process was told to stop."""

import copy
import threading
import time

import pytest
import redis

from reinforce.core.queue import OutageRetry


def failing() -> None:
    raise redis.ConnectionError("Connection refused")


def test_a_stopping_process_does_not_wait_out_an_outage():
    stopping = threading.Event()
    retry = OutageRetry(max_outage_s=60.0, stopping=stopping)
    threading.Timer(0.3, stopping.set).start()
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        retry.call_with_retry(failing, lambda _error: None)
    assert time.monotonic() - start < 5  # not the 60 s budget: SIGTERM during a Redis outage ends the process


def test_the_outage_budget_is_time_not_attempts():
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        OutageRetry(max_outage_s=1.0).call_with_retry(failing, lambda _error: None)
    assert 1.0 <= time.monotonic() - start < 4


def test_copies_share_the_stop_signal():
    """redis-py deep-copies its retry into each connection."""
    stopping = threading.Event()
    copied = copy.deepcopy(OutageRetry(max_outage_s=60.0, stopping=stopping))
    assert copied.stopping is stopping and copied.max_outage_s == 60.0
