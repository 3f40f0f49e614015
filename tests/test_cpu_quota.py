"""The CPU quota of a container's cgroup, read from fake cgroup trees (v2 and v1), and the worker's thread count."""

from pathlib import Path

import pytest

from services.common.cpu_quota import cpu_quota_cores, default_threads


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def quota(tmp_path: Path, self_cgroup: str, files: dict[str, str]) -> float | None:
    root = tree(tmp_path / "cgroup", files)
    (tmp_path / "self").write_text(self_cgroup)
    return cpu_quota_cores(root, tmp_path / "self")


def test_v2_takes_the_smallest_limit_from_the_process_s_cgroup_up_to_the_root(tmp_path):
    files = {
        "cpu.stat": "",
        "kubepods/cpu.max": "max 100000\n",
        "kubepods/pod1/cpu.max": "250000 100000\n",  # the pod's limit: 2.5 cores
        "kubepods/pod1/ctr/cpu.max": "max 100000\n",
    }
    assert quota(tmp_path, "0::/kubepods/pod1/ctr\n", files) == 2.5
    files["kubepods/pod1/ctr/cpu.max"] = "50000 50000\n"  # the container's own, tighter
    assert quota(tmp_path, "0::/kubepods/pod1/ctr\n", files) == 1.0


def test_v2_inside_a_cgroup_namespace_reads_the_mount_s_root(tmp_path):
    assert quota(tmp_path, "0::/\n", {"cpu.max": "150000 100000\n"}) == 1.5


def test_v2_path_missing_under_the_mount_is_walked_up_to_what_exists(tmp_path):
    # a container without a cgroup namespace: /proc/self/cgroup names the host's path, the mount is the container's
    assert quota(tmp_path, "0::/system.slice/docker-abc.scope\n", {"cpu.max": "200000 100000\n"}) == 2.0


def test_v1_reads_the_cpu_controller_s_hierarchy(tmp_path):
    self_cgroup = "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    files = {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    }
    assert quota(tmp_path, self_cgroup, files) == 3.0
    files["cpu,cpuacct/docker/abc/cpu.cfs_quota_us"] = "-1\n"  # no limit
    assert quota(tmp_path, self_cgroup, files) is None


@pytest.mark.parametrize(
    "self_cgroup, files",
    [
        ("0::/\n", {"cpu.max": "max 100000\n"}),  # v2, no limit
        ("0::/\n", {}),  # v2, no cpu controller enabled
        ("0::/\n", {"cpu.max": "garbage\n"}),
        ("0::/\n", {"cpu.max": "100000 0\n"}),
        ("4:cpu,cpuacct:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}),
    ],
)
def test_no_limit_is_none(tmp_path, self_cgroup, files):
    assert quota(tmp_path, self_cgroup, files) is None


def test_no_cgroup_file_is_none(tmp_path):
    assert cpu_quota_cores(tmp_path, tmp_path / "missing") is None


def test_default_threads_are_whole_cores_of_quota_never_more_than_torch_s_never_none():
    assert default_threads(8, None) == 8
    assert default_threads(8, 2.5) == 2
    assert default_threads(8, 0.5) == 1
    assert default_threads(2, 16.0) == 2


def test_the_worker_takes_whole_cores_of_quota_unless_threads_are_asked_for(monkeypatch, caplog):
    import torch

    from services.worker.setup import threads

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "cpu_quota_cores", lambda: 1.5)
    try:
        torch.set_num_threads(2)
        with caplog.at_level("INFO", logger=threads.__name__):
            assert threads.set_math_threads(0) == 1
        assert torch.get_num_threads() == 1
        assert "the cgroup's CPU quota is 1.50 cores (of 2)" in caplog.text
        assert threads.set_math_threads(2) == 2 and torch.get_num_threads() == 2  # asked for: the quota is theirs
    finally:
        torch.set_num_threads(before)
