"""Sandbox uids (root's per-call uids): each environment service on a machine claims uids no other one holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from reinforce.environment.sandbox import SANDBOX_UID_BASE, claim_uids

# Another service: claims 3 uids in the folder given, prints them, holds them until its stdin closes.
OTHER_SERVICE = (
    "import sys\nfrom pathlib import Path\nfrom reinforce.environment.sandbox import claim_uids\n"
    "print(*claim_uids(3, Path(sys.argv[1]))[0], flush=True)\nsys.stdin.read()"
)


def test_a_service_skips_the_uids_another_holds_until_it_ends(tmp_path: Path) -> None:
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_SERVICE, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None
        held = [int(uid) for uid in other.stdout.readline().split()]
        assert held == [SANDBOX_UID_BASE, SANDBOX_UID_BASE + 1, SANDBOX_UID_BASE + 2]
        uids, locks = claim_uids(2, tmp_path)
        assert uids == [SANDBOX_UID_BASE + 3, SANDBOX_UID_BASE + 4]
    finally:
        other.communicate(timeout=30)
    # the other service has ended: the kernel dropped its locks, so its uids are free again; ours are still held
    again, more = claim_uids(3, tmp_path)
    assert again == [SANDBOX_UID_BASE, SANDBOX_UID_BASE + 1, SANDBOX_UID_BASE + 2]
    for fd in (*locks, *more):
        os.close(fd)
