"""The slow FUSE file system (tools.bench.slowfs), and hpcdl on a read-only data set behind it:
training, stage-only and the dry run work; staged bytes equal the source; on 2 ranks one
process opens the images to build the index, once each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import make_folder, mpi_env, mpirun_cmd, run_train, wait_until
from slowfs import slow_mount

from hpcdl.staging.ownership import data_key
from tools.bench.slowfs import is_mounted


def test_opens_pay_the_latency_concurrently_reads_share_the_cap_and_writes_fail(tmp_path):
    (tmp_path / "src" / "d").mkdir(parents=True)
    blob = os.urandom(400_000)
    (tmp_path / "src" / "d" / "big").write_bytes(blob)
    for i in range(16):
        (tmp_path / "src" / "d" / f"{i}").write_bytes(b"x")
    mnt = tmp_path / "pfs"
    with slow_mount(tmp_path / "src", mnt, latency_ms=100, mbps=2) as pfs:
        t0 = time.perf_counter()
        assert (mnt / "d" / "big").read_bytes() == blob
        assert time.perf_counter() - t0 >= 0.1 + 0.2 * 0.95  # open + 400 kB at 2 MB/s
        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: (mnt / "d" / f"{i}").read_bytes(), range(16)))
        assert 0.1 <= time.perf_counter() - t0 < 16 * 0.1 / 2  # opens overlap
        with pytest.raises(OSError, match="Read-only file system"):
            (mnt / "d" / "new").write_bytes(b"")
        with pytest.raises(OSError, match="Read-only file system"):
            os.open(mnt / "d" / "big", os.O_RDWR)
        assert sorted(os.listdir(mnt / "d")) == sorted(["big", *map(str, range(16))])
    assert not is_mounted(mnt)
    stats = pfs.stats()
    assert stats["opens"] == 17 and stats["files_opened"] == 17
    assert stats["bytes_read"] >= len(blob)
    assert list(stats["opens_by_process"]) == [str(os.getpid())]


def test_the_mount_goes_when_its_owner_is_killed(tmp_path):
    (tmp_path / "src").mkdir()
    code = (
        "import sys, time; from pathlib import Path; sys.path.insert(0, 'tests');"
        "from slowfs import slow_mount\n"
        "with slow_mount(Path(sys.argv[1]), Path(sys.argv[2])):\n"
        "    print('up', flush=True); time.sleep(60)"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code, tmp_path / "src", tmp_path / "pfs"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = owner.stdout.readline().strip()
        if line != "up":
            pytest.skip("FUSE is unavailable (see test_opens_pay_the_latency...)")
        assert is_mounted(tmp_path / "pfs")
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
    wait_until(lambda: not is_mounted(tmp_path / "pfs"), 10, "the slow file system unmounted")


# --- hpcdl on a read-only data set behind the slow file system ---------------------------------

FILES = 32  # 2 classes x 16 PNGs of 12 x 10 pixels


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # index cache: not on the PFS
    make_folder(tmp_path / "src", per_class=FILES // 2, size=(12, 10))
    return tmp_path / "src"


def files_of(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.png"))


def test_stage_only_and_dry_run_on_a_read_only_slow_data_set(source, tmp_path):
    stage = tmp_path / "stage"
    with slow_mount(source, tmp_path / "pfs") as pfs:
        data = pfs.mountpoint
        dry = subprocess.run(
            [sys.executable, "-m", "hpcdl.stage", "--dry-run", "--data", data, "--nodes", "2",
             "--batch-size", "4", "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert dry.returncode == 0, dry.stderr
        nodes = json.loads(dry.stdout.splitlines()[-1])["nodes"]
        assert sum(n["files"] for n in nodes) == FILES
        indexed = pfs.stats(settle=True)["opens"]
        staged = subprocess.run(
            [sys.executable, "-m", "hpcdl.stage", "--data", data, "--stage-dir", stage,
             "--batch-size", "4", "--json", "--quiet"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert staged.returncode == 0, staged.stderr
        summary = json.loads(staged.stdout.splitlines()[-1])
        assert summary["files"] == FILES and summary["failures"] == 0, summary
        copies = stage / data_key(data)
    stats = pfs.stats()
    assert indexed == FILES  # the dry run built the index: one open per image
    assert stats["opens"] == 2 * FILES  # stage-only loaded it from the cache, then copied
    assert files_of(copies) == files_of(source)
    for rel in files_of(source):
        assert (copies / rel).read_bytes() == (source / rel).read_bytes(), rel
    assert not list(copies.rglob("*tmp*"))  # no partial file is visible


@pytest.mark.parametrize("staging", [False, True], ids=["pfs", "staged"])
def test_training_on_a_read_only_slow_data_set(source, tmp_path, staging):
    with slow_mount(source, tmp_path / "pfs") as pfs:
        extra = ["--stage-dir", tmp_path / "stage"] if staging else []
        proc = run_train(
            1, "--data", pfs.mountpoint, "--model", "mlp", "--epochs", 2, "--batch-size", 8,
            "--workers", 1, "--checkpoint-dir", tmp_path / "ckpt", "--quiet", *extra,
            env=dict(mpi_env(), XDG_CACHE_HOME=str(tmp_path / "cache")), timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    stats = pfs.stats()
    # the index opens each file once; then staging copies it once, or each epoch reads it
    assert stats["opens"] == FILES * (2 if staging else 3), stats
    assert not (source / ".hpcdl-index.npz").exists()


def test_the_index_reads_headers_in_parallel_opening_each_image_once(source, tmp_path):
    from hpcdl.data.imagefolder import ImageFolderDataset  # noqa: PLC0415

    latency = 0.05
    with slow_mount(source, tmp_path / "pfs", latency_ms=latency * 1000) as pfs:
        ds = ImageFolderDataset(pfs.mountpoint)
        again = ImageFolderDataset(pfs.mountpoint)
    assert ds.index_source == "built" and again.index_source == "cache"
    assert ds.sample_shape == (3, 10, 12) and len(ds) == FILES
    assert ds.index_seconds < FILES * latency / 4  # one after another: FILES x latency
    stats = pfs.stats()
    assert stats["opens"] == FILES and stats["max_opens_of_one_file"] == 1, stats


OPEN_ONLY = """
import json, sys
from hpcdl.comm.world import init_world
from hpcdl.config import TrainConfig
from hpcdl.startup import open_datasets
world = init_world()
train, _ = open_datasets(TrainConfig(data=sys.argv[1], batch_size=4), world)
print(json.dumps(dict(rank=world.rank, n=len(train), shape=list(train.sample_shape),
                      files=[f.relpath for f in train.files], source=train.index_source)))
"""


def test_two_ranks_open_each_image_once_in_one_process(source, tmp_path):
    with slow_mount(source, tmp_path / "pfs", latency_ms=5) as pfs:
        proc = subprocess.run(
            [*mpirun_cmd(2), sys.executable, "-c", OPEN_ONLY, pfs.mountpoint],
            capture_output=True, text=True, timeout=120,
            env=dict(mpi_env(), XDG_CACHE_HOME=str(tmp_path / "cache")),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda r: r["rank"])
    assert [r["source"] for r in ranks] == ["built", "given"]
    assert ranks[0]["files"] == ranks[1]["files"] and ranks[0]["n"] == FILES
    assert ranks[0]["shape"] == ranks[1]["shape"] == [3, 10, 12]
    stats = pfs.stats()
    assert stats["opens"] == FILES and stats["max_opens_of_one_file"] == 1, stats
    assert len(stats["opens_by_process"]) == 1, stats  # one process built the index
