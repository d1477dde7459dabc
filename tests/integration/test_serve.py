"""`reinforce serve SPEC.yaml` (supervisor/serve.py) on examples/tiny.yaml's model, driven by the real `tinker` SDK:
it prints the URL and the API key as the SDK reads them, keeps the key private in the run folder and the same for the
next serve; a training API killed with -9 is restarted and answers again; Ctrl-C stops it and its Redis."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from runs import service_pids, write_spec

from reinforce.core.names import TRAINING_API_KEY_PREFIX
from reinforce.core.run_dir import RunPaths
from reinforce.supervisor.serve import api_key

tinker = pytest.importorskip("tinker", reason="the `api` extra (tinker==0.38.0) is not installed")

pytestmark = pytest.mark.slow
EXPORTS = re.compile(r"^export TINKER_BASE_URL=(?P<url>\S+)\nexport TINKER_API_KEY=(?P<key>\S+)$", re.MULTILINE)


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Served:
    """A `reinforce serve` started as a shell starts a background job (SIGINT ignored, which Python keeps unless the
    program sets its own handler), its stdout and stderr read as they come (a full pipe would block it)."""

    def __init__(self, spec: Path) -> None:
        argv = [sys.executable, "-m", "reinforce", "serve", str(spec)]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignore_sigint
        )
        self.stdout, self.stderr, self.exports = "", "", threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self.stderr_reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.stdout += line
            if EXPORTS.search(self.stdout):
                self.exports.set()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr += line

    def wait_for_exports(self) -> tuple[str, str]:
        assert self.exports.wait(180), f"no exports printed:\n{self.stdout}\n{self.stderr[-3000:]}"
        found = EXPORTS.search(self.stdout)
        return found["url"], found["key"]

    def interrupt(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(60)
        self.stderr_reader.join(10)
        return code, self.stderr


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    served = Served(write_spec(tmp_path))
    yield served
    if served.proc.poll() is None:  # the test failed before its Ctrl-C: stop the server and its children
        served.interrupt()


def test_serve_prints_the_sdks_settings_restarts_a_killed_api_and_stops_on_ctrl_c(tmp_path: Path, served: Served):
    run_dir = tmp_path / "run"
    url, key = served.wait_for_exports()
    key_file = run_dir / "training_api" / "api_key"
    assert key.startswith(TRAINING_API_KEY_PREFIX) and key_file.read_text() == key
    assert key_file.stat().st_mode & 0o777 == 0o600  # the key is the only credential: private to this user

    capabilities = tinker.RestClient(base_url=url, api_key=key).get_server_capabilities().result()
    assert [m.model_name for m in capabilities.supported_models] == ["random_init"]  # examples/tiny.yaml's policy

    [api] = service_pids(run_dir, "reinforce.training_api")
    os.kill(api, signal.SIGKILL)
    service = tinker.ServiceClient(base_url=url, api_key=key)  # the SDK retries while the API restarts
    # tiny's output layer is tied to its embeddings: an adapter on lm_head is refused
    training = service.create_lora_training_client(
        base_model="random_init", rank=2, seed=1, train_unembed=False
    ).result()
    assert training.get_info().lora_rank == 2
    service.close("success").result()
    [restarted] = service_pids(run_dir, "reinforce.training_api")
    assert restarted != api

    children = psutil.Process(served.proc.pid).children(recursive=True)
    code, stderr = served.interrupt()
    assert code == 130 and "component training-api exited with code -9; restart" in stderr, stderr
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]  # Redis too
    assert api_key(RunPaths(run_dir)) == key  # what the next serve prints: clients keep their key
