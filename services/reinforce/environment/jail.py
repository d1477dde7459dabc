"""The sandboxed process's first (and only) program: confine itself, then run the model's code from stdin.

    python -I jail.py CONFIG_JSON < code.py

Run by sandbox.py as a fresh interpreter with an empty environment, inside `unshare` where the kernel allows (new
network, PID and mount namespaces). Standard library only, and no import of `reinforce`: it runs before any
confinement holds, so it must not run anything it does not need. In order:
  1. read the code (stdin, whole; the code's own stdin is then at EOF);
  2. with a mount namespace: every mount read-only, then a size-limited tmpfs on the scratch folder (the working
     directory), fresh tmpfs over /tmp, /var/tmp and /dev/shm, an empty one over every hidden folder (the run
     folder), the scratch tmpfs mounted back at its own path where /tmp covered it (so that the working
     directory's absolute path names it), and a /proc of the new PID namespace (no other process, so no other
     process's environment, is seen); nothing written outlives the call;
  3. as root: drop to the call's own uid/gid and no supplementary groups, so nothing outside the scratch folder
     that root owns is writable, and RLIMIT_NPROC counts this call's processes only (no other environment
     service on the machine holds that uid: sandbox.claim_uids);
  4. no new privileges (setuid binaries do not raise them), resource limits (CPU seconds, address space, file
     size, processes, open files, no core files);
  5. run the code as __main__; a traceback shows the code's frames only.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import sys
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
# A bind remount must repeat a mount's locked flags (a user namespace may add restrictions, never drop them).
_KEPT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": 0x400,
    "nodiratime": 0x800,
    "relatime": 0x200000,
}
PR_SET_NO_NEW_PRIVS = 38
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: bytes | None, target: str, fstype: bytes | None, flags: int, options: str | None) -> None:
    data = options.encode() if options is not None else None
    if _libc.mount(source, target.encode(), fstype, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or source} on {target}: {os.strerror(err)}")


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, flags to keep) of every mount that holds files, from /proc/self/mountinfo (octal escapes
    undone). Not a namespace file bound somewhere (nsfs: dockerd's /run/docker/netns/*), which holds none, and
    which a user namespace may not remount."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
        lines = mounts.read().splitlines()
    for line in lines:
        fields = line.split()
        if line.split(" - ", 1)[1].split()[0] == "nsfs":
            continue
        point = fields[4].encode().decode("unicode_escape")
        points.append((point, sum(_KEPT_FLAGS.get(option, 0) for option in fields[5].split(","))))
    return points


def _private_mounts(scratch: str, size_bytes: int, hidden: list[str], uid: int) -> None:
    _mount(b"none", "/", None, MS_REC | MS_PRIVATE, None)  # nothing mounted here reaches the host's namespace
    for point, kept in _mount_points():
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept, None)
        except PermissionError as err:
            if err.errno != errno.EACCES:
                raise
            # under a folder this (unprivileged) user cannot enter, as root's 0700 /run/...: nor can the code
    tmpfs = MS_NOSUID | MS_NODEV
    _mount(b"tmpfs", scratch, b"tmpfs", tmpfs, f"size={size_bytes},mode=0700,uid={uid},gid={uid}")
    os.chdir(scratch)  # the working directory keeps the scratch tmpfs even where a later mount covers its path
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(folder):
            _mount(b"tmpfs", folder, b"tmpfs", tmpfs, f"size={size_bytes},mode=1777")
    for folder in hidden:
        if os.path.isdir(folder):
            _mount(b"tmpfs", folder, b"tmpfs", tmpfs | MS_RDONLY, "size=4096,mode=0")
    if not os.path.isdir(scratch) or not os.path.samefile(scratch, "."):
        # the fresh /tmp covered the scratch folder's path: put the working directory's tmpfs back at that path, so
        # that os.path.join(os.getcwd(), name) is the same file as `name` (and its size limit holds there too)
        os.makedirs(scratch, exist_ok=True)
        _mount(b".", scratch, None, MS_BIND, None)
        _mount(None, scratch, None, MS_REMOUNT | MS_BIND | tmpfs, None)
        os.chdir(scratch)
    _mount(b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def _limit(kind: int, value: int) -> None:
    resource.setrlimit(kind, (value, value))


def confine(config: dict) -> None:
    # the service blocks these to take them from its calls' reach (sandbox.guard_shutdown_signals); not the calls
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    os.umask(0o077)  # what a call writes is its uid's alone
    if config["mount_namespace"]:
        _private_mounts(config["scratch"], config["file_bytes"], config["hidden"], config["uid"])
    else:
        os.chdir(config["scratch"])
    if os.getuid() == 0 and config["uid"] != 0:
        os.setgroups([])
        os.setgid(config["uid"])
        os.setuid(config["uid"])
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    _limit(resource.RLIMIT_CPU, config["cpu_seconds"])
    _limit(resource.RLIMIT_AS, config["memory_bytes"])
    _limit(resource.RLIMIT_FSIZE, config["file_bytes"])
    _limit(resource.RLIMIT_NPROC, config["max_processes"])
    _limit(resource.RLIMIT_NOFILE, 64)
    _limit(resource.RLIMIT_CORE, 0)


def main() -> None:
    config = json.loads(sys.argv[1])
    code = sys.stdin.read()
    confine(config)
    sys.argv = ["main.py"]
    try:
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as err:
        # the code's frames only: the first frame is this function
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
