"""One live supervisor per run folder: an exclusive flock on RUN_DIR/supervisor.lock, which holds its PID.

The kernel releases a flock when its holder dies, however it dies, so a lock file left by a dead supervisor is
simply taken over; its PID is there only to name the holder in the refusal.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class RunFolderBusy(RuntimeError):
    """Another live supervisor holds the run folder; the message names its PID."""


class RunLock:
    def __init__(self, path: Path) -> None:
        """Take the lock at `path` (creating it) or raise RunFolderBusy naming the holder's PID."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            self.release()
            raise RunFolderBusy(
                f"run folder {path.parent} is in use by a live supervisor (PID {holder}, lock {path}); "
                "stop it first (Ctrl-C or kill), then --resume or --overwrite"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None


def live_holder(path: Path) -> int | None:
    """The PID holding the lock at `path`, read from the kernel's lock table (asking takes no lock, so it cannot
    turn away a supervisor starting at that moment); None when no live process holds it."""
    try:
        stat = path.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    for line in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" (a waiter's line has "->" after the number)
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        major, minor, inode = fields[5].rsplit(":", 2)
        if (int(inode), int(major, 16), int(minor, 16)) == (stat.st_ino, os.major(stat.st_dev), os.minor(stat.st_dev)):
            return int(fields[4])
    return None
