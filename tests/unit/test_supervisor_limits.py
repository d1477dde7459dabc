"""Issue #30: the local supervisor on a long run (R3-11: the restart budget resets after a healthy period; R3-17:
component logs rotate by size) and on a full disk (R3-14: it stops cleanly and leaves no partial files). Real child
processes; a full disk is /dev/full, where every write fails with ENOSPC."""

import errno
import sys
import time
from pathlib import Path

import pytest
import torch

from reinforce.core.spec import parse_spec
from reinforce.core.weights import publish
from reinforce.supervisor.children import PROMETHEUS_TARGETS
from reinforce.supervisor.component import RunFailed
from reinforce.supervisor.run_loop import Supervisor


def supervisor(tmp_path: Path, **sections: dict) -> Supervisor:
    spec = {"name": "t", "policy": {"random_init": {}}, "data": {"prompts": "p.txt"}, "run_dir": str(tmp_path)}
    return Supervisor(parse_spec({**spec, **sections}))


def exits_after(seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds}); raise SystemExit(3)"]


def supervise_for(sup: Supervisor, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sup.supervise_once()
        time.sleep(0.05)


def test_the_restart_count_resets_after_a_healthy_period(tmp_path):
    """R3-11: max_restarts 1; a component that exits every 2 s after running healthily for longer than
    reset_after_s is restarted every time, one that crash-loops still ends the run."""
    sup = supervisor(tmp_path, restart={"max_restarts": 1, "backoff_s": 0.05, "reset_after_s": 1.5})
    try:
        steady = sup.children.component("steady", exits_after(2.0))
        supervise_for(sup, 7.0)  # three exits, each after 2 s of running
        assert steady.restarts == 1 and steady.exit_code() is None

        sup.children.component("crashing", exits_after(0.1))
        with pytest.raises(RunFailed, match="component crashing exited with code 3 after 1 restarts"):
            supervise_for(sup, 5.0)
    finally:
        sup.stop()


def test_component_logs_rotate_by_size(tmp_path):
    """R3-17: a component writing 4 MB leaves at most its cap (256 KiB) and one older copy, plus what it wrote
    between two of the supervisor's checks, and its last line survives."""
    sup = supervisor(tmp_path, logging={"max_component_log_mb": 0.25})
    program = "import time\nfor i in range(4000):\n print(f'{i:06d}' + 'x' * 1000)\n time.sleep(0.0005)"
    try:
        c = sup.children.component("chatty", [sys.executable, "-c", program])
        while c.exit_code() is None:
            c.rotate_log(sup.max_log_bytes)
            time.sleep(0.05)
    finally:
        sup.stop()
    older = c.log_path.with_name("chatty.log.1")
    assert older.exists()
    for path in (c.log_path, older):
        assert path.stat().st_size < 2 * sup.max_log_bytes, path
    # The newest output is kept: in NAME.log, or in NAME.log.1 when a check ran between the program's last write
    # and its exit (its interpreter's shutdown takes a while on a loaded machine) and left NAME.log empty.
    newest = c.log_path.read_text() or older.read_text()
    assert newest.splitlines()[-1].startswith("003999")


def test_a_full_disk_stops_the_supervisor_cleanly(tmp_path):
    """R3-14: stopping on a full disk is no second error: the scrape targets (which would list dead processes)
    and the partial copy are gone."""
    sup = supervisor(tmp_path)
    sup.children.add_scrape_target("trainer", "trainer", 1234)
    targets = tmp_path / PROMETHEUS_TARGETS
    partial = tmp_path / f".{PROMETHEUS_TARGETS}.tmp"
    partial.symlink_to("/dev/full")
    sup.stop()
    assert not targets.exists() and not partial.is_symlink()


def test_a_weight_version_that_does_not_fit_on_the_disk_leaves_no_partial_file(tmp_path):
    (tmp_path / "v000001.tmp").symlink_to("/dev/full")
    with pytest.raises(OSError) as err:
        publish({"w": torch.ones(1000)}, tmp_path, version=1)
    assert err.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
