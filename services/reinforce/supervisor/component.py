"""One child process of a local run: started in its own process group with its own credentials, its log rotated,
waited for until ready, restarted with back-off like a pod's restart policy, and stopped with its process group."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from tqdm import tqdm

from reinforce.core.spec import RestartSpec
from reinforce.core.threads import THREADS_ENV

log = logging.getLogger("reinforce")
READY_TIMEOUT_S = 300


class RunFailed(RuntimeError):
    """A component died or never became ready; the message names it."""


@dataclass
class Component:
    name: str
    argv: list[str]
    log_path: Path
    threads: int | None = None  # its CPU threads ($REINFORCE_NUM_THREADS; None: the service decides)
    process: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float | None = None  # monotonic time of a scheduled restart
    started_at: float = 0.0  # monotonic time of the last (re)start
    credentials: dict[str, str] = field(default_factory=dict)  # its secrets' environment variables, no one else's

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**env, **self.credentials}
        if self.threads is not None:
            env = {**env, THREADS_ENV: str(self.threads)}
        # O_APPEND: every write lands at the end, also after rotate_log truncated the file under the process
        with self.log_path.open("ab") as out:
            # own process group: Ctrl-C reaches the supervisor only, which then stops children in order
            self.process = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.started_at = time.monotonic()

    def wait_until(self, ready: Callable[[], bool]) -> None:
        """Until `ready()`; a RunFailed if the process exits first or READY_TIMEOUT_S pass."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            code = self.exit_code()
            if code is not None:
                raise self.failure(code)
            if time.monotonic() > deadline:
                raise RunFailed(f"component {self.name} not ready after {READY_TIMEOUT_S}s; log {self.log_path}")
            time.sleep(0.2)

    def rotate_log(self, max_bytes: int) -> None:
        """Past `max_bytes`, the log is copied to NAME.log.1 (replacing the older copy) and emptied: the process
        keeps its descriptor, so the file is truncated in place (logrotate's copytruncate; output written during
        the copy can be lost)."""
        try:
            if self.log_path.stat().st_size <= max_bytes:
                return
            shutil.copyfile(self.log_path, self.log_path.with_name(self.log_path.name + ".1"))
            os.truncate(self.log_path, 0)
        except OSError as err:  # a full disk: the run goes on, its log unrotated
            log.warning("rotating %s failed: %s", self.log_path, err)

    def exit_code(self) -> int | None:
        return self.process.poll() if self.process else None

    def supervise(self, policy: RestartSpec, env: dict[str, str]) -> None:
        """Restart the process if it exited, with exponential back-off, like a pod's restart policy; a RunFailed
        once it has exited `policy.max_restarts` times in a row."""
        if self.restart_at is not None:
            if time.monotonic() >= self.restart_at:
                self.restart_at = None
                self.start(env)
            return
        code = self.exit_code()
        if code is None:
            return
        if self.restarts and time.monotonic() - self.started_at >= policy.reset_after_s:
            self._reset_restarts()
        if self.restarts >= policy.max_restarts:
            raise self.failure(code)
        self._schedule_restart(code, policy)

    def _reset_restarts(self) -> None:
        # like the kubelet's back-off reset: faults hours apart do not add up to a crash loop
        tqdm.write(
            f"component {self.name} ran {time.monotonic() - self.started_at:.0f}s since its last restart: "
            f"its restart count ({self.restarts}) is reset",
            file=sys.stderr,
        )
        self.restarts = 0

    def _schedule_restart(self, code: int, policy: RestartSpec) -> None:
        self.stop()  # reap what is left of its process group (Triton runs as a grandchild and holds the ports)
        delay = min(policy.backoff_s * 2**self.restarts, policy.max_backoff_s)
        self.restarts += 1
        self.restart_at = time.monotonic() + delay
        tqdm.write(
            f"component {self.name} exited with code {code}; restart {self.restarts} of {policy.max_restarts} "
            f"in {delay:.1f}s (log {self.log_path})",
            file=sys.stderr,
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then after `grace_s` SIGKILL to the whole process group (Triton runs as a grandchild).

        Idempotent: a stopped component has no process (and no process group) left to signal.
        """
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def failure(self, code: int) -> RunFailed:
        restarted = f" after {self.restarts} restarts" if self.restarts else ""
        return RunFailed(
            f"component {self.name} exited with code {code}{restarted}; giving up. "
            f"Log {self.log_path}, last lines:\n{self.log_tail()}"
        )


def redis_pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
