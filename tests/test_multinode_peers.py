"""The peer tier across emulated nodes (hpcdl/bench/cluster.py): with --shuffle global each file
is opened on the PFS by one stager per job, not one per node, and training's result does not
depend on where the bytes came from (docs/staging.md, "Peer tier")."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import mpi_env
from PIL import Image

from hpcdl import checkpoint
from hpcdl.bench.cluster import LOCAL, Cluster
from hpcdl.data import open_dataset
from hpcdl.staging.status import StatusView

pytestmark = pytest.mark.multinode

FILES, BATCH, EPOCHS = 160, 8, 3
SAME_SUM_ORDER = ("--mca", "coll", "^han")  # bitwise-comparable sums (test_multinode.py)
STAGE = LOCAL / "stage"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """160 PNG images of 8x8 pixels in 4 classes."""
    root = tmp_path_factory.mktemp("pfs") / "images"
    rng = np.random.default_rng(1)
    for c in range(4):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(FILES // 4):
            pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i:03d}.png")
    open_dataset(root)
    return root


def train(cluster: Cluster, folder: Path, out: Path, peers: str) -> list[dict[str, int]]:
    """2 nodes x 2 ranks, --shuffle global; returns each node's stager counters."""
    args = [
        "--data", folder, "--model", "mlp", "--epochs", EPOCHS, "--batch-size", BATCH,
        "--workers", 0, "--seed", 3, "--quiet", "--checkpoint-dir", out / "ckpt",
        "--shuffle", "global", "--stage-dir", STAGE, "--keep-staged", "--peer-staging", peers,
    ]  # fmt: skip
    program = [sys.executable, "-m", "hpcdl.train", *map(str, args)]
    proc = cluster.run(1, cluster.mpirun([2, 2], *program, extra=SAME_SUM_ORDER), env=mpi_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    counters = []
    for node in cluster.nodes:
        (path,) = (node.local / STAGE.relative_to(LOCAL)).glob(".hpcdl/sessions/*/status")
        view = StatusView(path)
        assert view.open()
        names = ("pfs_opens", "peer_files", "peer_fallbacks", "files_served", "files_staged")
        counters.append({name: int(view.field(name)) for name in names})
        view.close()
        shutil.rmtree(node.local / STAGE.relative_to(LOCAL))  # the next job stages afresh
    return counters


def test_global_shuffle_opens_each_file_once_and_trains_the_same(cluster, folder, tmp_path):
    with_peers = train(cluster, folder, tmp_path / "on", "on")
    without = train(cluster, folder, tmp_path / "off", "off")
    on = checkpoint.load(checkpoint.latest(tmp_path / "on" / "ckpt")).params
    off = checkpoint.load(checkpoint.latest(tmp_path / "off" / "ckpt")).params
    assert on.tobytes() == off.tobytes()  # bitwise: where the bytes came from changes nothing

    pfs_opens = sum(c["pfs_opens"] for c in with_peers)
    assert pfs_opens <= 1.05 * FILES, with_peers
    assert sum(c["peer_files"] for c in with_peers) > 0, with_peers
    assert sum(c["peer_files"] for c in with_peers) == sum(c["files_served"] for c in with_peers)
    assert all(c["peer_files"] == 0 for c in without), without
    assert sum(c["pfs_opens"] for c in without) > pfs_opens, (without, with_peers)
