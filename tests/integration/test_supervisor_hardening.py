"""A live `reinforce run` of the tiny example: it listens on loopback only, owns its run folder, and any number of
signals stop every process it started (issue #13, findings 4, 5 and 6)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from runs import assert_each_step_trained_once, flag, kill_run, reinforce, service_of, start, wait_for_step, write_spec

from reinforce.core.checkpoints import list_checkpoints
from reinforce.core.metrics import read_metrics
from reinforce.core.names import CONTROL_TOKEN_ENV, CRITIC_TOKEN_ENV, REDIS_URL_ENV, WEIGHTS_TOKEN_ENV
from reinforce.core.queue import RolloutQueue
from reinforce.core.run_dir import RunPaths
from reinforce.supervisor.children import PROMETHEUS_TARGETS
from reinforce.supervisor.lock import RunFolderBusy, RunLock

pytestmark = pytest.mark.slow
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}  # gRPC binds IPv4 loopback as mapped IPv6


def listening(processes: list[psutil.Process]) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of `processes`."""
    found = set()
    for p in processes:
        for conn in p.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.add((p.name(), conn.laddr.ip, conn.laddr.port))
    return found


def test_a_live_run_listens_on_loopback_owns_its_folder_and_two_signals_stop_everything(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, training={"steps": 200, "checkpoint_every": 100})
    proc = start("run", str(spec))
    run_dir = tmp_path / "run"
    try:
        wait_for_step(proc, run_dir, 1)
        children = psutil.Process(proc.pid).children(recursive=True)
        names = {p.name() for p in children}
        assert {"redis-server", "tritonserver"} <= names, names

        # finding 4: redis, Triton (HTTP, gRPC, metrics), generators and the trainer: loopback only
        sockets = listening(children)
        assert len(sockets) >= 6, sockets
        assert {addr for _, addr, _ in sockets} <= LOOPBACK, sockets

        # finding 6: a second supervisor on the same folder is refused, naming the live one, and deletes nothing
        for args in (["--resume", str(run_dir)], [str(spec), "--overwrite"]):
            refused = reinforce("run", *args, timeout=120)
            assert refused.returncode == 1 and f"PID {proc.pid}" in refused.stderr, refused.stderr[-2000:]
        assert RunPaths(run_dir).metrics.exists() and RunPaths(run_dir).initial_policy.is_dir()

        # finding 5: Ctrl-C, then Ctrl-C and SIGTERM again while the shutdown is under way
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 130 and "interrupted" in stderr, stderr[-2000:]
        _, alive = psutil.wait_procs(children, timeout=5)
        assert alive == [], f"still running after the supervisor exited: {alive}"
    finally:
        kill_run(proc)


def test_a_lock_left_by_a_dead_supervisor_is_taken_over(tmp_path: Path) -> None:
    lock_file = tmp_path / "run" / "supervisor.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from reinforce.supervisor.lock import RunLock; RunLock(__import__('pathlib').Path("
         f"{str(lock_file)!r})); print('held', flush=True); __import__('time').sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy, match=f"PID {holder.pid}"):
            RunLock(lock_file)
    finally:
        holder.kill()
        holder.wait()
    assert lock_file.read_text().strip() == str(holder.pid)  # the dead holder's PID is still written there
    lock = RunLock(lock_file)
    assert lock_file.read_text().strip() == str(psutil.Process().pid)
    lock.release()


def test_resume_sets_a_damaged_checkpoint_aside_and_refuses_another_runs(tmp_path: Path) -> None:
    """Issue #30, R3-13: the newest checkpoint's model file truncated, `--resume` names the file, sets the
    checkpoint aside and redoes the steps from the one before; checkpoints of another run are refused at once."""
    spec = write_spec(tmp_path, training={"steps": 4, "checkpoint_every": 2})
    first = reinforce("run", str(spec))
    assert first.returncode == 0, first.stderr[-2000:]
    run = RunPaths(tmp_path / "run")
    model = run.checkpoints / "step-000004" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:1000])

    resumed = reinforce("run", "--resume", str(run.root))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    trainer_log = (run.logs / "trainer.log").read_text()
    assert f"{model} holds 1000 bytes" in trainer_log and "set aside as" in trainer_log
    assert (run.checkpoints / "damaged-step-000004").is_dir()
    assert [p.name for p in list_checkpoints(run.checkpoints)] == ["step-000002", "step-000004"]  # redone
    assert_each_step_trained_once(run.root, 4)

    this_run = run.run_id.read_text().strip()
    run.run_id.write_text("another-run\n")  # as if the checkpoints had been copied in from elsewhere
    refused = reinforce("run", "--resume", str(run.root), timeout=120)
    assert refused.returncode == 1, refused.stderr[-2000:]
    assert f"belongs to run {this_run}, not to this run (another-run)" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_full_disk_ends_the_run_with_one_error_line_and_no_partial_files(tmp_path: Path) -> None:
    """Issue #30, R3-14: the run folder's spec.yaml on a full disk (/dev/full: every write fails with ENOSPC):
    one `error:` line, no traceback; partial files an earlier life left are deleted at the start."""
    spec = write_spec(tmp_path)
    run = RunPaths(tmp_path / "run")
    run.weights.mkdir(parents=True)
    partial = [run.weights / "v000003.tmp", run.root / f".{PROMETHEUS_TARGETS}.tmp"]
    for path in partial:
        path.write_text("half")
    run.spec.symlink_to("/dev/full")
    result = reinforce("run", str(spec), timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1].startswith("error: the disk is full: [Errno 28] No space left on device")
    assert "Traceback" not in result.stderr
    assert not any(path.exists() for path in partial)


CREDENTIALS = (REDIS_URL_ENV, CONTROL_TOKEN_ENV, WEIGHTS_TOKEN_ENV, CRITIC_TOKEN_ENV)


def held_credentials(process: psutil.Process) -> dict[str, str]:
    return {name: value for name, value in process.environ().items() if name in CREDENTIALS}


def test_each_service_holds_only_its_credentials_and_garbage_in_the_weights_key_is_ridden_out(tmp_path: Path) -> None:
    """Issue #30 on a live PPO run with weights over HTTP. R3-7: one control token opened the generators, the weight
    endpoint and the critic, and every process held it (a generator's could make the critic delete its checkpoints).
    R3-6: undecodable bytes in the run's weights key killed the generators and the supervisor."""
    spec = write_spec(
        tmp_path, "tiny-ppo", training={"steps": 200, "checkpoint_every": 100}, weights={"transport": "http"}
    )
    proc = start("run", str(spec))
    run_dir = tmp_path / "run"
    try:
        wait_for_step(proc, run_dir, 1)
        children = psutil.Process(proc.pid).children(recursive=True)
        held = {p.pid: held_credentials(p) for p in children}
        by_service = {service_of(p): p for p in children}
        expected = {
            "reinforce.generator": {REDIS_URL_ENV, CONTROL_TOKEN_ENV, WEIGHTS_TOKEN_ENV},
            "reinforce.trainer": {REDIS_URL_ENV, WEIGHTS_TOKEN_ENV, CRITIC_TOKEN_ENV},
            "reinforce.critic": {CRITIC_TOKEN_ENV},
        }
        assert set(expected) <= set(by_service) and {"redis-server", "tritonserver"} <= set(by_service), by_service
        for p in children:  # the reward server (Triton, its Python backend) and Redis hold none
            assert set(held[p.pid]) == expected.get(service_of(p), set()), service_of(p)
        generator, trainer, critic = (by_service[f"reinforce.{name}"] for name in ("generator", "trainer", "critic"))
        tokens = {name: held[generator.pid].get(name) or held[trainer.pid][name] for name in CREDENTIALS[1:]}
        assert len(set(tokens.values())) == 3, "one token per capability"

        # the tokens a generator holds open neither the critic nor anything but their own door
        restore = f"http://127.0.0.1:{flag(critic, '--port')}/v1/restore"
        weights = f"http://127.0.0.1:{flag(trainer, '--weights-port')}/v1/weights/v000000.safetensors"
        for token in (tokens[CONTROL_TOKEN_ENV], tokens[WEIGHTS_TOKEN_ENV]):
            answer = httpx.post(restore, json={"step": 0}, headers={"Authorization": f"Bearer {token}"})
            assert answer.status_code == 401, answer.text
        assert httpx.head(weights, headers={"Authorization": f"Bearer {tokens[CONTROL_TOKEN_ENV]}"}).status_code == 401
        assert httpx.head(weights, headers={"Authorization": f"Bearer {tokens[WEIGHTS_TOKEN_ENV]}"}).status_code != 401

        # R3-6: garbage in the weights key; the trainer puts its record back while it waits, and the run goes on
        client = redis.Redis.from_url(held[generator.pid][REDIS_URL_ENV])
        client.set("reinforce:tiny-ppo:weights", b"\xff\xff\xff\xff not a record")
        step = read_metrics(RunPaths(run_dir).metrics)[-1]["step"]
        wait_for_step(proc, run_dir, step + 2, timeout_s=120)
        alive = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert alive == {p.pid for p in children}, "a component restarted"
        assert RolloutQueue(client, "tiny-ppo").latest_weights() is not None
        client.close()

        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 130 and "interrupted" in stderr, stderr[-2000:]
    finally:
        kill_run(proc)
