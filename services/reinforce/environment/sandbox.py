"""The local sandbox: one confined child process per Python tool call.

Each call runs `python -I jail.py` (see jail.py for what it does, in order) with:
  - an empty environment apart from PATH, LANG and HOME (the scratch folder): never the control token, the Redis
    URL or any other variable of the service;
  - its own empty scratch folder as working directory, removed afterwards;
  - limits: CPU seconds (RLIMIT_CPU, the time limit rounded up plus one), address space (RLIMIT_AS), file size
    (RLIMIT_FSIZE), processes (RLIMIT_NPROC), 64 open files, no core files; and the wall-clock time limit, past
    which the call's whole process tree is killed;
  - the strongest isolation the kernel allows, found once at start (`detect_isolation`):
      namespaces       (root) `unshare --net --pid --mount --ipc`: no network (only a loopback that is down), no
                       other process visible, every mount read-only but its own tmpfs folders, the run folder
                       hidden, System V IPC objects and POSIX message queues of its own that end with it (a shared
                       memory segment would otherwise keep its pages after the call, outside every limit); and a
                       uid of its own per concurrent call (claim_uids: from SANDBOX_UID_BASE up, none that another
                       environment service on the machine holds), so it owns nothing outside its scratch folder and
                       RLIMIT_NPROC counts that call's processes only;
      user_namespaces  (not root, unprivileged user namespaces allowed) the same namespaces in a user namespace
                       of its own (`--map-root-user`), but the process keeps the service's uid: RLIMIT_NPROC
                       counts every process and thread of that uid, so the calls have max_processes
                       each together, over the service's own threads (Sandbox._process_limit);
      none             rlimits, the empty environment and the scratch folder only: the code can open network
                       connections, read what the service's uid can read and write where it can write; a
                       process that leaves the call's process group escapes the call's kill but not the sweep
                       after it: the service (`python -m reinforce.environment`) is a child subreaper, so what a
                       call leaves behind is reparented to it, and once a call ends it kills every child that is
                       no live call (`kill_strays`); until then such a process runs beside the other calls. Calls
                       share the service's IPC namespace: a System V shared memory segment outlives its call unless
                       the namespace has kernel.shm_rmid_forced=1, which the operator's environment pod and
                       docker-compose's environment container set (the segment then ends with its last user). The
                       service makes itself non-dumpable, so its own /proc/PID/environ stays unreadable to them.
In namespaces, killing `unshare` (its child is PID 1 of the new PID namespace, with --kill-child) ends every
process the code started, detached or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import functools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from reinforce.core.spec import EnvironmentSpec

log = logging.getLogger("reinforce.environment")

Isolation = Literal["namespaces", "user_namespaces", "none"]
JAIL = Path(__file__).with_name("jail.py")
NAMESPACE_FLAGS = ("--net", "--pid", "--mount", "--ipc", "--fork", "--kill-child")
SANDBOX_UID_BASE = 61000  # root only: the lowest uid/gid a call runs as (claim_uids)
UID_LOCKS = Path("/run/reinforce-sandbox-uids")  # root only: a lock file per sandbox uid, held by the service using it
PATH = "/usr/local/bin:/usr/bin:/bin"
EXIT_POLL_S = 0.01  # how often a call's process is looked at for its exit
MEMORY_POLL_S = 0.1  # how often a call's processes' memory is summed (and what left a call's tree is killed)
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
DRAIN_AFTER_EXIT_S = 0.5  # after the program's exit, how long its output may take to be read
DRAIN_AFTER_KILL_S = 2.0  # after the kill, how long the output pipes may take to close
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
MAX_SWEEPS = 64  # a stray's children reparent here when it is killed: each sweep takes one generation
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")  # where any call can write without a mount namespace of its own
# Imports a module of the standard library's compiled extensions, which the jail has not loaded yet.
PROBE = b"import _socket, json\nprint('ok')\n"


@dataclass(frozen=True)
class Limits:
    time_limit_s: float
    memory_bytes: int
    file_bytes: int
    max_processes: int
    output_bytes: int  # of stdout and of stderr kept (the rest is read and dropped)

    @classmethod
    def from_spec(cls, spec: EnvironmentSpec) -> Limits:
        mb = 2**20
        # 4 bytes per character: the most a UTF-8 character takes, so the text cut later is never short of bytes
        output_bytes = 4 * spec.output_limit_chars
        return cls(
            spec.time_limit_s, spec.memory_limit_mb * mb, spec.file_limit_mb * mb, spec.max_processes, output_bytes
        )


@dataclass(frozen=True)
class RunResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when the call was stopped at its time limit
    timed_out: bool
    signal: str | None  # the signal that ended the process (SIGKILL after a timeout, SIGXCPU, ...), if one did
    output_bytes: int  # stdout and stderr as written, before anything was dropped
    memory_exceeded: bool = False  # killed: its processes together held more than the memory limit


def _unshare_prefix(isolation: Isolation) -> list[str]:
    if isolation == "none":
        return []
    unshare = shutil.which("unshare") or "unshare"
    extra = ["--map-root-user"] if isolation == "user_namespaces" else []
    return [unshare, *extra, *NAMESPACE_FLAGS, "--"]


def claim_uids(count: int, locks: Path = UID_LOCKS) -> tuple[list[int], list[int]]:
    """`count` uids for the calls of this service (root only), from SANDBOX_UID_BASE up, skipping those another
    environment service on the machine holds: the kernel counts RLIMIT_NPROC per uid, so two services sharing a
    uid would count each other's calls. Each uid is held by an exclusive flock on its own file in `locks`, which the
    kernel drops when the holder's process ends (a killed service frees its uids). Returns (the uids, the lock
    files' descriptors: keep them open while the uids are in use)."""
    locks.mkdir(mode=0o700, parents=True, exist_ok=True)
    uids: list[int] = []
    held: list[int] = []
    uid = SANDBOX_UID_BASE
    while len(uids) < count:
        fd = os.open(locks / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
        else:
            uids.append(uid)
            held.append(fd)
        uid += 1
    return uids, held


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def detect_isolation() -> Isolation:
    """The strongest isolation this kernel and user allow, found by trying it."""
    candidates: list[Isolation] = ["namespaces"] if os.getuid() == 0 else []
    for isolation in [*candidates, "user_namespaces"]:
        if shutil.which("unshare") is None:
            break
        try:
            probe = subprocess.run([*_unshare_prefix(isolation), "true"], capture_output=True, timeout=30, env={})
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return isolation
        log.info("isolation %s unavailable: %s", isolation, probe.stderr.decode(errors="replace").strip())
    return "none"


def _entries(folder: str) -> set[str]:
    try:
        return set(os.listdir(folder))
    except OSError:
        return set()


def _prctl(option: int, value: int, name: str) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({name}, {value})")


def make_undumpable() -> None:
    """Keep this process's /proc/PID/environ (the control token) from processes of the same uid."""
    _prctl(PR_SET_DUMPABLE, 0, "PR_SET_DUMPABLE")


def become_subreaper() -> None:
    """Have orphaned descendants reparented to this process rather than to init: what a call leaves behind, detached
    from its process group (setsid, a double fork), becomes this process's child, where kill_strays finds it."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1, "PR_SET_CHILD_SUBREAPER")


def _children() -> list[int]:
    """The pids whose parent is this process (from /proc: a reparented orphan is listed under no thread of ours)."""
    me = os.getpid()
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _parent(int(entry)) == me]


SHUTDOWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
# A sender already gone is taken for a call's while calls run or for this long after one ended.
GONE_SENDER_WINDOW_S = 2.0


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the third (state) on, or None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[1])


def tree_memory_bytes(root: int) -> int:
    """Resident memory of process `root` and of every process that descends from it, summed."""
    children: dict[int, list[int]] = {}
    resident: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
            resident[int(entry)] = int(fields[21]) * PAGE_BYTES  # rss, in pages
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        total += resident.get(pid, 0)
        pending += children.get(pid, [])
    return total


def _descends_from_me(pid: int) -> bool | None:
    """Whether process `pid` is a descendant of this one (None: it is gone). A call's processes all are: a call is
    this process's child, and what leaves its tree is reparented here (become_subreaper)."""
    me, parent = os.getpid(), _parent(pid)
    if parent is None:
        return None
    while parent not in (me, 0, 1):
        parent = _parent(parent)
        if parent is None:
            return False  # an ancestor ended meanwhile: what it left was reparented, here or to init
    return parent == me


def guard_shutdown_signals(stop: Callable[[signal.Signals], None], sandbox_busy: Callable[[], bool]) -> None:
    """SIGTERM and SIGINT stop the service unless a tool call sent them. Isolation none runs calls as the service's
    uid, so any call may signal it (`os.kill(os.getppid(), SIGTERM)`); the container's PID 1 ignores only the
    signals it has no handler for. Blocks both in this thread (call it before any other thread starts: threads
    inherit the mask; jail.py unblocks them in each call) and waits for them in a thread of its own, which calls
    `stop` for one sent from outside this PID namespace (the container runtime's) or by a process that does not
    descend from this one; a call's (a descendant, or a sender already gone while `sandbox_busy()`) is logged and
    dropped."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SHUTDOWN_SIGNALS)

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo(SHUTDOWN_SIGNALS)
            name = signal.Signals(info.si_signo)
            descends = _descends_from_me(info.si_pid) if info.si_pid else False
            if descends or (descends is None and sandbox_busy()):
                log.warning("ignored %s from process %d: a tool call's", name.name, info.si_pid)
                continue
            stop(name)

    threading.Thread(target=wait, name="shutdown-signals", daemon=True).start()


def kill_strays(live: set[int]) -> int:
    """SIGKILL and reap every child of this process that is not in `live`, and then the children those leave
    (reparented here: see become_subreaper). For a process that starts no children but its calls. Returns how many."""
    killed = 0
    for _ in range(MAX_SWEEPS):
        strays = [pid for pid in _children() if pid not in live]
        if not strays:
            break
        for pid in strays:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in strays:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        killed += len(strays)
    return killed


@dataclass
class _Output:
    """What a pipe gave so far: its first `keep` bytes (a 100 MB print costs reading, not memory) and its length."""

    keep: int
    kept: bytearray = field(default_factory=bytearray)
    total: int = 0


async def _exited(
    proc: asyncio.subprocess.Process, timeout_s: float, over_memory: Callable[[], bool] | None = None
) -> bool:
    """Whether `proc` exited (and was reaped) within `timeout_s`; False too as soon as `over_memory()` says so (asked
    every MEMORY_POLL_S). Not `proc.wait()`: before Python 3.12 it also waits for the process's pipes to close,
    which a process it left behind holds open."""
    deadline = time.monotonic() + timeout_s
    next_look = time.monotonic() + MEMORY_POLL_S
    while proc.returncode is None:
        now = time.monotonic()
        if now >= deadline:
            return False
        if over_memory is not None and now >= next_look:
            if over_memory():
                return False
            next_look = now + MEMORY_POLL_S
        await asyncio.sleep(EXIT_POLL_S)
    return True


async def _drain(stream: asyncio.StreamReader, output: _Output) -> None:
    """Read a pipe to its end into `output`, which keeps what was read if the reading is cancelled."""
    while chunk := await stream.read(1 << 16):
        output.total += len(chunk)
        if len(output.kept) < output.keep:
            output.kept += chunk[: output.keep - len(output.kept)]


class Sandbox:
    """Runs code in confined child processes, at most `slots` at once (each slot has its own uid as root).

    With `reap_strays` (the service: a process whose only children are its calls) it becomes a child subreaper and,
    when a call ends and no other is starting, kills and reaps what calls left behind (kill_strays). In namespaces
    that is the namespace's PID 1, orphaned when `unshare` exits: reaping it waits for the namespace's last process
    to end, and leaves no zombie to a host PID 1 that may never reap it (a container's, a sandbox VM's)."""

    def __init__(
        self,
        limits: Limits,
        slots: int,
        hidden: list[Path],
        isolation: Isolation | None = None,
        reap_strays: bool = False,
        shared_uid_concurrency: bool = False,
    ) -> None:
        self.limits = limits
        self.hidden = [str(p.resolve()) for p in hidden]
        self.isolation: Isolation = isolation or detect_isolation()
        self.prefix = _unshare_prefix(self.isolation)
        # Without namespaces or a uid per call, calls at once could read and change each other's files, /proc/PID/cwd
        # included, and signal each other's processes: one at a time, unless asked for by name.
        self.shares_uid = self.isolation == "none" and os.getuid() != 0
        self.slots = 1 if self.shares_uid and not shared_uid_concurrency else slots
        self.uids: list[int] = []
        if os.getuid() == 0:
            self.uids, locks = claim_uids(self.slots)
            weakref.finalize(self, _close_all, locks)
        self.python = self._choose_python()
        self.free_slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(self.slots):
            self.free_slots.put_nowait(slot)
        self.reap_strays = reap_strays
        self.live: set[int] = set()  # the calls' own processes
        self.starting = 0  # calls between fork and being added to `live`: a sweep now could take one for a stray
        self.last_end = -math.inf  # time.monotonic() when the last call ended
        self.over_memory: set[int] = set()  # calls being stopped for their memory
        if self.reap_strays:
            become_subreaper()
        # What the shared folders held before any call: a call's leftovers are what is new (clear_shared_folders).
        # Only as a container's PID 1 (the operator's pod, the compose container), whose folders are its own: on a
        # machine, other programs of the same user write there too.
        self.shared_before: dict[str, set[str]] = {}
        if self.isolation == "none" and os.getpid() == 1:
            self.shared_before = {folder: _entries(folder) for folder in SHARED_FOLDERS}

    def _uid(self, slot: int) -> int:
        if self.uids:
            return self.uids[slot]
        return 0 if self.isolation == "user_namespaces" else os.getuid()  # root of its own user namespace

    def _choose_python(self) -> str:
        """This interpreter, or the system's when this one cannot run confined (as root, a Python under /root is
        unreadable to the call's own uid): the first that runs a probe through the sandbox."""
        candidates = dict.fromkeys([sys.executable, *SYSTEM_PYTHONS])
        for python in candidates:
            if not os.access(python, os.X_OK):
                continue
            with tempfile.TemporaryDirectory(prefix="reinforce-sandbox-") as scratch:
                uid = self._uid(0)
                if os.getuid() == 0 and self.isolation == "none":
                    os.chown(scratch, uid, uid)
                argv = self._argv(python, Path(scratch), uid)
                env = self._env(Path(scratch))
                probe = subprocess.run(argv, input=PROBE, capture_output=True, env=env, cwd=scratch, timeout=60)
            if probe.returncode == 0 and probe.stdout.strip() == b"ok":
                return python
            log.info("python %s cannot run in the sandbox: %s", python, probe.stderr.decode(errors="replace")[-500:])
        raise RuntimeError(f"no Python runs in the sandbox (tried {', '.join(candidates)})")

    def _argv(self, python: str, scratch: Path, uid: int) -> list[str]:
        return [*self.prefix, python, "-I", str(JAIL), self._config(scratch, uid)]

    def _env(self, scratch: Path) -> dict[str, str]:
        return {"PATH": PATH, "LANG": "C.UTF-8", "HOME": str(scratch)}

    def _config(self, scratch: Path, uid: int) -> str:
        lim = self.limits
        return json.dumps(
            {
                "scratch": str(scratch),
                "uid": uid,
                "mount_namespace": self.isolation != "none",
                "hidden": self.hidden,
                "cpu_seconds": math.ceil(lim.time_limit_s) + 1,
                "memory_bytes": lim.memory_bytes,
                "file_bytes": lim.file_bytes,
                "max_processes": self._process_limit(),
            }
        )

    def _process_limit(self) -> int:
        """A call's RLIMIT_NPROC, which the kernel counts over every process and thread of the call's uid. As root
        each call slot has a uid of its own: max_processes. Otherwise every call runs as the service's uid, where the
        service's threads and the other calls' processes count too: the calls then have max_processes each
        together (slots x max_processes), over the service's threads when the call starts (before Python 3.12,
        asyncio watches each child with a thread of its own, one per call more)."""
        if self.uids:
            return self.limits.max_processes
        return len(os.listdir("/proc/self/task")) + self.slots * (self.limits.max_processes + 1)

    async def run(self, code: str) -> RunResult:
        slot = await self.free_slots.get()
        scratch = Path(tempfile.mkdtemp(prefix="reinforce-sandbox-"))
        try:
            uid = self._uid(slot)
            if os.getuid() == 0 and self.isolation == "none":
                os.chown(scratch, uid, uid)  # namespaced calls get a tmpfs owned by their uid instead
            return await self._run(code, scratch, uid)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            if not self.live and not self.starting:  # nobody's files but the calls' left behind
                self.clear_shared_folders()
            self.free_slots.put_nowait(slot)
            self.last_end = time.monotonic()

    def clear_shared_folders(self) -> None:
        """Remove what calls left in the folders every call can write without namespaces (/tmp, /var/tmp,
        /dev/shm), as a container's PID 1: files there would outlive their call and be read by the next one."""
        for folder, before in self.shared_before.items():
            for name in _entries(folder) - before:
                path = os.path.join(folder, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(path)

    def busy(self) -> bool:
        """Whether a call runs, or one ended within GONE_SENDER_WINDOW_S (guard_shutdown_signals)."""
        return bool(self.live or self.starting) or time.monotonic() - self.last_end < GONE_SENDER_WINDOW_S

    async def _run(self, code: str, scratch: Path, uid: int) -> RunResult:
        self.starting += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv(self.python, scratch, uid),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._env(scratch),
                cwd=scratch,
                start_new_session=True,  # one process group to kill (all of it, in namespaces)
            )
            self.live.add(proc.pid)
        finally:
            self.starting -= 1
        assert proc.stdin and proc.stdout and proc.stderr
        outputs = _Output(self.limits.output_bytes), _Output(self.limits.output_bytes)
        pipes = (proc.stdout, proc.stderr)
        drains = {asyncio.ensure_future(_drain(pipe, output)) for pipe, output in zip(pipes, outputs, strict=True)}
        try:
            proc.stdin.write(code.encode())
            with contextlib.suppress(ConnectionError):  # the process may be gone before it read its code
                await proc.stdin.drain()
            proc.stdin.close()
            # The call ends when its program does. What the program wrote is then in the pipes, read within a
            # moment; a process it left behind (a daemon, which the sweep ends) may hold a copy of a pipe open.
            over_memory = functools.partial(self._over_memory, proc.pid)
            done = await _exited(proc, self.limits.time_limit_s, over_memory)
            if done:
                await asyncio.wait(drains, timeout=DRAIN_AFTER_EXIT_S)
        finally:
            _kill_group(proc.pid)  # what is left: the whole tree in namespaces, the process group without
            await _exited(proc, math.inf)
            self.live.discard(proc.pid)
            self._sweep()
            # Pipes close once every writer is gone; a detached writer (isolation none) must not hold us here.
            _, stuck = await asyncio.wait(drains, timeout=DRAIN_AFTER_KILL_S)
            for task in stuck:
                task.cancel()
        stdout, stderr = (bytes(o.kept).decode(errors="replace") for o in outputs)
        returncode = proc.returncode
        memory_exceeded = proc.pid in self.over_memory
        self.over_memory.discard(proc.pid)
        return RunResult(
            stdout,
            stderr,
            returncode if done or memory_exceeded else None,
            not done and not memory_exceeded,
            signal.Signals(-returncode).name if returncode < 0 else None,
            sum(o.total for o in outputs),
            memory_exceeded,
        )

    def _over_memory(self, pid: int) -> bool:
        """Whether call `pid`'s processes together hold more than the memory limit (then remembered in
        `over_memory`). RLIMIT_AS bounds each process only: a call of 8 processes held 8 times the limit. Also
        kills what left a call's tree meanwhile, whose memory no call's sum would count (isolation none)."""
        self._sweep()
        if tree_memory_bytes(pid) <= self.limits.memory_bytes:
            return False
        self.over_memory.add(pid)
        return True

    def _sweep(self) -> None:
        if self.reap_strays and not self.starting and (killed := kill_strays(self.live)):
            log.warning("killed %d processes that tool calls left behind", killed)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
