"""Issue 62 end to end: hpcdl.train, hpcdl.stage and hpcdl.torch on WebDataset tar shards.

Shards written in an image folder's sample order give the folder's sample numbers, so the
same seed trains to bitwise the same parameters, staged or not, killed and resumed or not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    make_folder,
    mpi_env,
    read_events,
    run_train,
    stage_cli,
    train_cmd,
    wait_until,
)
from tarshards_helpers import jpeg_bytes, shards_of_folder, write_tar

from hpcdl import checkpoint

CLASSES = ("a", "b", "c", "d")
COMMON = ["--model", "mlp", "--augment", "rrc16+flip", "--batch-size", 4, "--seed", 3, "--quiet"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """folder/: 4 classes x 8 JPEGs (28 x 24, some 30 x 26); tar/: the same in 5 shards."""
    root = tmp_path_factory.mktemp("tarshards")
    make_folder(root / "folder", per_class=6, size=(28, 24), classes=CLASSES, fmt="jpg")
    make_folder(root / "folder", per_class=2, size=(30, 26), classes=CLASSES, fmt="jpeg", seed=1)
    shards_of_folder(root / "folder", root / "tar", per_shard=7)
    return root


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def final_params(ckpt_dir: Path) -> np.ndarray:
    return checkpoint.load(checkpoint.latest(ckpt_dir)).params


def train(tmp_path: Path, name: str, data: Path, *args, env=None):
    proc = run_train(2, "--data", data, *COMMON, "--checkpoint-dir", tmp_path / name, *args,
                     env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_folder_and_its_shards_train_to_bitwise_the_same_parameters(data, tmp_path):
    epochs = ("--epochs", 2, "--workers", 1)
    train(tmp_path, "folder", data / "folder", *epochs)
    loud = [a for a in COMMON if a != "--quiet"]  # the start lines: rank 0's, on stdout
    proc = run_train(2, "--data", data / "tar", *loud, *epochs, "--checkpoint-dir",
                     tmp_path / "tar", timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_array_equal(final_params(tmp_path / "folder"), final_params(tmp_path / "tar"))
    said = [line for line in proc.stdout.splitlines() if "tar shard(s)" in line]
    assert said == [f"hpcdl: data: 5 tar shard(s) in {data / 'tar'}, 32 samples, 4 classes "
                    "from the labels' integers"], proc.stdout  # fmt: skip
    (cached,) = (tmp_path / "cache" / "hpcdl").glob("tar-index-*")
    assert cached.stat().st_size > 0  # built once, by rank 0, outside the data root


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_a_staged_two_rank_run_on_shards_stages_whole_shards_and_matches(data, tmp_path):
    """Staged, through a brace pattern, with --index-in-data-root (which a tar index ignores):
    the parameters of the plain run, and the data directory left as it was."""
    before = snapshot(data / "tar")
    args = ("--epochs", 2, "--workers", 1)
    train(tmp_path, "plain", data / "tar", *args)
    metrics, stage = tmp_path / "m.jsonl", tmp_path / "stage"
    pattern = data / "tar" / "shard-{000000..000004}.tar"
    train(tmp_path, "staged", pattern, *args, "--stage-dir", stage, "--metrics", metrics,
          "--keep-staged", "--index-in-data-root")  # fmt: skip
    np.testing.assert_array_equal(
        final_params(tmp_path / "plain"), final_params(tmp_path / "staged")
    )
    staging = read_events(metrics, "summary")[0]["staging"]
    assert staging["files_staged"] > 0 and staging["hits"] > 0, staging
    staged = {p.name for p in stage.rglob("*") if p.is_file() and p.suffix == ".tar"}
    assert staged and staged <= {p.name for p in (data / "tar").iterdir()}
    assert snapshot(data / "tar") == before


def test_kill_and_resume_auto_on_shards_is_bitwise_the_uninterrupted_run(data, tmp_path):
    args = ["--data", data / "tar", *COMMON, "--epochs", 4, "--workers", 1]
    train(tmp_path, "ref", data / "tar", *args[2:])
    ckpt = tmp_path / "killed"
    job = subprocess.Popen(
        train_cmd(2, *args, "--checkpoint-dir", ckpt, "--checkpoint-every", 3),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(),
        start_new_session=True,
    )  # fmt: skip

    def at_step_6_or_ended() -> bool:
        latest = checkpoint.latest(ckpt)
        return job.poll() is not None or (
            latest is not None and checkpoint.load(latest).global_step >= 6
        )

    wait_until(at_step_6_or_ended, timeout=240, what="a checkpoint at step 6 or more")
    assert job.poll() is None, "the run ended before it could be killed"
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate(timeout=60)
    stopped = checkpoint.load(checkpoint.latest(ckpt)).global_step
    assert 6 <= stopped < 16
    proc = run_train(2, *args, "--checkpoint-dir", ckpt, "--resume", "auto", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = checkpoint.load(checkpoint.latest(ckpt))
    assert resumed.global_step == 16
    np.testing.assert_array_equal(resumed.params, final_params(tmp_path / "ref"))


@pytest.mark.multinode
def test_a_node_that_cannot_see_rank_0s_tar_index_caches_its_own_copy(data, cluster, tmp_path):
    """Two emulated nodes, each index cache on its own /local: node 2 gets rank 0's index as
    bytes and writes it to its cache (hpcdl.startup.share_index); training is as on one node."""
    from tools.bench.cluster import LOCAL  # noqa: PLC0415

    args = ["--data", data / "tar", *COMMON, "--epochs", 1, "--workers", 1]
    train(tmp_path, "one", data / "tar", *args[2:])
    program = [sys.executable, "-m", "hpcdl.train", *map(str, args)]
    program += ["--checkpoint-dir", str(tmp_path / "two")]
    extra = ("-x", f"XDG_CACHE_HOME={LOCAL / 'cache'}", "--mca", "coll", "^han")
    proc = cluster.run(1, cluster.mpirun([1, 1], *program, extra=extra), env=mpi_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    copies = [list((n.local / "cache" / "hpcdl").glob("tar-index-*")) for n in cluster.nodes]
    assert [len(c) for c in copies] == [1, 1], copies
    assert copies[0][0].read_bytes() == copies[1][0].read_bytes()
    np.testing.assert_array_equal(final_params(tmp_path / "one"), final_params(tmp_path / "two"))


def test_behind_a_slow_read_only_file_system_each_reader_opens_each_shard_once(data, tmp_path):
    """FUSE, 5 ms per open, read-only: the index (rank 0) and the two loader workers each open
    a shard once over two epochs; the run trains as on the local disk."""
    from slowfs import slow_mount  # noqa: PLC0415

    args = ("--epochs", 2, "--workers", 1)
    train(tmp_path, "local", data / "tar", *args)
    with slow_mount(data / "tar", tmp_path / "pfs", latency_ms=5) as pfs:
        train(tmp_path, "slow", pfs.mountpoint, *args)
        stats = pfs.stats()
    assert stats["files_opened"] == 5 and stats["max_opens_of_one_file"] <= 3, stats
    np.testing.assert_array_equal(final_params(tmp_path / "local"), final_params(tmp_path / "slow"))


def bad_member_shards(root: Path) -> Path:
    """root/bad/: 2 shards of 8 good samples each; the second also holds 'nolabel.jpg'."""
    for s in range(2):
        members = []
        for i in range(8):
            members += [
                (f"k{s}{i}.jpg", jpeg_bytes(10 * s + i, (20, 20))),
                (f"k{s}{i}.cls", b"%d" % (i % 2)),
            ]
        if s == 1:
            members.insert(6, ("nolabel.jpg", jpeg_bytes(99, (20, 20))))
        write_tar(root / "bad" / f"s-{s}.tar", members)
    return root / "bad"


@pytest.mark.parametrize("skip", [False, True])
def test_a_sample_without_a_label_stops_the_run_in_one_line_or_is_skipped(skip, tmp_path):
    data = bad_member_shards(tmp_path)
    args = ["--data", data, "--model", "mlp", "--augment", "rcrop16", "--epochs", 1]
    args += ["--batch-size", 4, "--workers", 1, "--quiet"]
    proc = run_train(2, *args, *(["--skip-bad-samples"] if skip else []), timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "nolabel.jpg" in line]
    if skip:
        assert proc.returncode == 0 and lines == [], proc.stderr[-3000:]
        return
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert f"{data / 's-1.tar'} (member nolabel.jpg)" in lines[0]
    assert "no label member" in lines[0] and "--skip-bad-samples" in lines[0]


def test_stage_dry_run_plans_the_shards(data, tmp_path):
    dry = stage_cli("--dry-run", "--data", data / "tar", "--batch-size", 4, "--epochs", 2, "--json")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout.splitlines()[-1])
    assert sum(n["run_files"] for n in report["nodes"]) == 5, report["nodes"]
    two = stage_cli("--dry-run", "--data", data / "tar", "--batch-size", 4, "--nodes", 2)
    assert two.returncode == 0, two.stderr
    # the peer copies are whole shards' figures; a training job may fetch pieces instead
    assert "counted as whole shards" in two.stdout and "--peer-ranges" in two.stdout, two.stdout


def test_stage_only_copies_whole_shards_byte_for_byte(data, tmp_path):
    stage = tmp_path / "stage"
    args = ("--data", data / "tar", "--batch-size", 4, "--epochs", 1, "--stage-dir", stage)
    proc = stage_cli(*args, env=mpi_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    copies = [p for p in stage.rglob("*.tar") if p.is_file()]
    assert len(copies) == 5, copies
    assert all(p.read_bytes() == (data / "tar" / p.name).read_bytes() for p in copies)


def test_hpcdl_torch_loader_reads_the_shards_as_the_folder(data):
    torch = pytest.importorskip("torch")
    from hpcdl.torch import Loader  # noqa: PLC0415

    got = {}
    for kind in ("folder", "tar"):
        with Loader(data / kind, 8, epochs=1, workers=1, seed=2, augment="rcrop16") as loader:
            got[kind] = [(x.clone(), y.clone()) for x, y in loader]
    assert len(got["tar"]) == 4
    for (a, la), (b, lb) in zip(got["folder"], got["tar"], strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    from hpcdl.torch import HpcdlSamples  # noqa: PLC0415

    folder, tar = (HpcdlSamples(str(data / k), "rrc16+flip", seed=4) for k in ("folder", "tar"))
    for item in ((0, 0), (1, 13), (2, 31)):
        (a, la), (b, lb) = folder[item], tar[item]
        assert torch.equal(a, b) and la == lb


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
