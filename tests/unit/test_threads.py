"""CPU threads from the affinity, a fake cgroup's quota and the explicit setting; the supervisor's shares and how
its children's OpenMP threads wait."""

from pathlib import Path

import pytest

from reinforce.core.spec import parse_spec
from reinforce.core.threads import THREADS_ENV, cgroup_cpu_quota, thread_count, usable_cpus
from reinforce.supervisor.children import Children, ThreadShares, thread_shares

MINIMAL = {"name": "t", "policy": {"random_init": {}}, "data": {"prompts": "p.txt"}}


def _cgroup_v2(root: Path, text: str) -> Path:
    (root / "cpu.max").write_text(text)
    return root


def _cgroup_v1(root: Path, quota: int, period: int) -> Path:
    (root / "cpu").mkdir()
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return root


def test_cgroup_v2_quota(tmp_path: Path):
    assert cgroup_cpu_quota(_cgroup_v2(tmp_path, "150000 100000\n")) == 1.5


def test_cgroup_v2_without_limit(tmp_path: Path):
    assert cgroup_cpu_quota(_cgroup_v2(tmp_path, "max 100000\n")) is None


def test_cgroup_v1_quota(tmp_path: Path):
    assert cgroup_cpu_quota(_cgroup_v1(tmp_path, 300000, 100000)) == 3.0


def test_cgroup_v1_unlimited_and_no_cgroup(tmp_path: Path):
    assert cgroup_cpu_quota(tmp_path) is None
    assert cgroup_cpu_quota(_cgroup_v1(tmp_path, -1, 100000)) is None


def test_quota_caps_the_affinity_rounded_up(tmp_path: Path):
    root = _cgroup_v2(tmp_path, "250000 100000")  # a pod limit of 2.5 CPUs on a 16-core node
    assert usable_cpus(set(range(16)), root) == 3
    assert usable_cpus({0, 1}, root) == 2  # pinned to two cores: the affinity is smaller
    assert usable_cpus({0}, _cgroup_v2(tmp_path, "10000 100000")) == 1  # 0.1 CPU: still one thread


def test_explicit_setting_wins(tmp_path: Path):
    root = _cgroup_v2(tmp_path, "100000 100000")
    assert thread_count({THREADS_ENV: "6"}, root) == 6
    assert thread_count({}, root) == 1
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match=THREADS_ENV):
            thread_count({THREADS_ENV: bad}, root)


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({}, ThreadShares(trainer=8, generator=8, reward=8, critic=8)),  # on-policy: turns, every core each
        ({"generation": {"num_generators": 2}}, ThreadShares(8, 4, 8, 8)),  # generators sample together
        ({"algorithm": {"max_policy_lag": 1}}, ThreadShares(4, 4, 8, 4)),  # asynchronous: trainer beside generators
        ({"training": {"num_ranks": 2}}, ThreadShares(4, 8, 8, 4)),
        ({"algorithm": {"name": "ppo"}}, ThreadShares(4, 8, 8, 4)),  # the critic trains beside the actor
    ],
)
def test_supervisor_shares_cores_between_processes_busy_together(sections: dict, expected: ThreadShares):
    spec = parse_spec({**MINIMAL, **sections})
    assert thread_shares(spec, 8) == expected


def test_one_core_is_never_zero_threads():
    spec = parse_spec({**MINIMAL, "algorithm": {"max_policy_lag": 1}, "generation": {"num_generators": 3}})
    assert thread_shares(spec, 1) == ThreadShares(1, 1, 1, 1)


@pytest.mark.parametrize(
    "sections",
    [
        {"algorithm": {"max_policy_lag": 1}},
        {"generation": {"num_generators": 2}},
        {"training": {"num_ranks": 2}},
        {"algorithm": {"name": "ppo"}},
        {"reward": {"type": "hf_classifier", "path": "rm"}},
        {"environment": {"enabled": True}},
    ],
)
def test_children_wait_passively_where_processes_compute_together(sections: dict, monkeypatch, tmp_path: Path):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    spec = parse_spec({**MINIMAL, "run_dir": str(tmp_path), **sections})
    assert Children(spec).env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_children_spin_before_sleeping_where_processes_take_turns(monkeypatch, tmp_path: Path):
    """libgomp's default (no OMP_WAIT_POLICY): waiting threads spin a while, then sleep. A user's own setting wins."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    spec = parse_spec({**MINIMAL, "run_dir": str(tmp_path)})
    assert "OMP_WAIT_POLICY" not in Children(spec).env
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert Children(spec).env["OMP_WAIT_POLICY"] == "PASSIVE"
