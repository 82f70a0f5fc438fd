"""Stage-only's copy threads from the source's kind of file system and the cores (issue 35,
"Also"): a local source is bound by the cores and the disk, a network or parallel one by each
open's latency, which more threads hide."""

from __future__ import annotations

from pathlib import Path

from helpers import make_tree, stage_cli

from hpcdl.config import STAGE_THREADS
from hpcdl.data.worker_cores import job_cores
from hpcdl.staging.fskind import copy_threads, path_kind, source_kind

REPO = Path(__file__).resolve().parents[1]


def test_a_local_source_gets_threads_by_the_cores_a_network_one_the_default():
    assert copy_threads("network", 2) == STAGE_THREADS == 32
    assert copy_threads("network", 128) == 32
    assert copy_threads("local", 2) == 8  # 0.94x cp -r on 2 cores, where 32 took 1.2-1.9x
    assert copy_threads("memory", 1) == 4
    assert copy_threads("local", 64) == 32


def test_a_fuse_source_counts_as_network_unless_it_is_a_local_block_device():
    assert [source_kind(t) for t in ("lustre", "nfs4", "fuse", "fuse.sshfs", "fuse.slowfs")] == [
        "network"
    ] * 5
    assert [source_kind(t) for t in ("ext4", "xfs", "fuseblk", "tmpfs")] == [
        "local", "local", "local", "memory"
    ]  # fmt: skip


def test_the_kind_of_a_path_comes_from_the_mount_table(tmp_path):
    kind, fstype = path_kind(tmp_path)
    assert kind in ("local", "memory") and fstype  # a test's tmp dir is never NFS here
    kind, fstype = path_kind(tmp_path / "not" / "there")  # its deepest existing directory
    assert kind in ("local", "memory")


def test_stage_only_says_the_threads_it_chose_and_why(tmp_path):
    make_tree(tmp_path / "data", 12, 100)
    proc = stage_cli("--data", str(tmp_path / "data"), "--stage-dir", str(tmp_path / "s"),
                     "--files-only", "--batch-size", "4", cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    kind, fstype = path_kind(tmp_path / "data")
    cores = len(job_cores())  # the stager runs on the job's cores (NOTE [worker cores])
    threads = copy_threads(kind, cores)
    start = [line for line in proc.stderr.splitlines() if "copy threads" in line]
    assert start == [
        f"node 0: staging 12 files from {tmp_path / 'data'} ({fstype}, a {kind} file system) "
        f"with {threads} copy threads ({cores} cores; --stage-threads to choose)"
    ], proc.stderr
    flags = ["--files-only", "--batch-size", "4", "--stage-threads", "3"]
    given = stage_cli("--data", tmp_path / "data", "--stage-dir", tmp_path / "t", *flags, cwd=REPO)
    assert given.returncode == 0, given.stderr
    assert "with 3 copy threads (--stage-threads)" in given.stderr
