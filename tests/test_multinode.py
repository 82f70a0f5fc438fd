"""Per-node behaviour across emulated nodes (tools/bench/cluster.py): placement, staging, training.

Every test here launches Open MPI across two network namespaces joined by a bridge, so the
node communicator sees two nodes and ranks talk over TCP. Three placements are exercised:
block (mpirun's default), round robin (`--map-by node`) and uneven ranks per node.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import mpi_env, read_events, run_train, wait_for_status
from PIL import Image

from hpcdl import checkpoint
from hpcdl.data import open_dataset
from hpcdl.data.sampler import DistributedSampler
from hpcdl.staging.ownership import data_key
from hpcdl.staging.status import StatusView
from tools.bench.cluster import LOCAL, Cluster, leftovers, unavailable

pytestmark = pytest.mark.multinode

BATCH, SEED = 8, 1
BLOCK, ROUND_ROBIN, UNEVEN = ((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 1, 2), (3,))
# name -> (ranks allowed on node 1 and 2, extra mpirun options, world ranks on each node)
PLACEMENTS = {
    "block": ([2, 2], (), BLOCK),
    "round-robin": ([2, 2], ("--map-by", "node"), ROUND_ROBIN),
    "uneven": ([3, 1], (), UNEVEN),
}
# Open MPI's hierarchical collectives (coll_han, chosen for communicators that span nodes) sum
# node by node, so the bits of an average depend on placement; without it the sum order
# depends only on the rank numbers, as on one node (docs/multinode.md).
SAME_SUM_ORDER = ("--mca", "coll", "^han")
STAGE = LOCAL / "stage"

# Prints this rank's placement facts as one JSON line.
FACTS = (
    "import json, socket; from hpcdl.comm.world import init_world; w = init_world(); "
    "print(json.dumps(dict(rank=w.rank, host=socket.gethostname(), node=w.node_index, "
    "nodes=w.num_nodes, node_ranks=w.node_ranks, ranks_by_node=w.ranks_by_node)), flush=True)"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """160 PNG images of 8x8 pixels in 4 classes: one file per sample, ~20 KB in all."""
    root = tmp_path_factory.mktemp("pfs") / "images"
    rng = np.random.default_rng(0)
    for c in range(4):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(40):
            pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i:03d}.png")
    open_dataset(root)  # writes the index once, before several ranks want it
    return root


def train_args(data: Path, out: Path) -> list[str]:
    return [
        "--data", data, "--model", "mlp", "--epochs", 1, "--batch-size", BATCH,
        "--workers", 0, "--seed", SEED, "--quiet", "--checkpoint-dir", out / "ckpt",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def one_node_params(folder, tmp_path_factory) -> np.ndarray:
    """Final parameters of the same training on one node with 4 ranks (no staging)."""
    out = tmp_path_factory.mktemp("one-node")
    proc = run_train(4, *train_args(folder, out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return checkpoint.load(checkpoint.latest(out / "ckpt")).params


def files_read(data: Path, ranks, world: int, epochs=(0,)) -> set[str]:
    """Relative paths of the files that these world ranks read in these epochs."""
    ds = open_dataset(data)
    out = set()
    for r in ranks:
        sampler = DistributedSampler(len(ds), world, r, SEED, "global")
        for epoch in epochs:
            for batch in sampler.batches(epoch, BATCH):
                out.update(ds.files[int(i)].relpath for i in ds.file_ids(batch))
    return out


def staged_files(node_local: Path, data: Path) -> set[str]:
    """Data files in one node's stage dir, relative to the data set root; checks nothing else
    but the stager's metadata lies beside them."""
    stage = node_local / STAGE.relative_to(LOCAL)
    assert sorted(p.name for p in stage.iterdir()) == [".hpcdl", data_key(data)]
    tree = stage / data_key(data)
    return {str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file()}


def run_in(cluster: Cluster, command: str, timeout: float = 300):
    proc = cluster.run(1, command, env=mpi_env(), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_world_reports_the_ranks_each_node_holds(cluster, placement):
    slots, extra, layout = PLACEMENTS[placement]
    proc = run_in(cluster, cluster.mpirun(slots, sys.executable, "-c", FACTS, extra=extra))
    facts = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda f: f["rank"])
    assert [f["ranks_by_node"] for f in facts] == [[list(r) for r in layout]] * 4
    for f in facts:
        node_ranks = layout[f["node"]]
        assert f["rank"] in node_ranks and f["node_ranks"] == list(node_ranks)
        assert f["host"] == f"vnode{f['node'] + 1}" and f["nodes"] == 2


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_training_across_nodes_stages_each_nodes_own_files(
    cluster, placement, folder, one_node_params, tmp_path
):
    slots, extra, layout = PLACEMENTS[placement]
    metrics = tmp_path / "metrics.jsonl"
    args = [*train_args(folder, tmp_path), "--metrics", metrics]
    args += ["--stage-dir", STAGE, "--keep-staged"]
    program = [sys.executable, "-m", "hpcdl.train", *map(str, args)]
    run_in(cluster, cluster.mpirun(slots, *program, extra=(*extra, *SAME_SUM_ORDER)))

    params = checkpoint.load(checkpoint.latest(tmp_path / "ckpt")).params
    assert params.tobytes() == one_node_params.tobytes()  # bitwise, whatever the placement
    nodes = read_events(metrics, "summary")[0]["staging_nodes"]
    assert [n["node"] for n in nodes] == ["vnode1", "vnode2"]
    for node, ranks, entry in zip(cluster.nodes, layout, nodes, strict=True):
        expected = files_read(folder, ranks, world=4)
        assert staged_files(node.local, folder) == expected, f"{node.hostname} ranks {ranks}"
        assert entry["files_staged"] == len(expected)
        assert entry["hits"] + entry["misses"] == len(ranks) * (40 // BATCH) * BATCH
    assert read_events(metrics, "epoch")[0]["staging_nodes"] == nodes


# name -> (processes on node 1 and 2, extra mpirun options, hpcdl.stage flags, expected layout)
STAGE_JOBS = {
    "one-per-node-block": ([1, 1], ("--map-by", "ppr:1:node"), ("--ranks-per-node", "2"), BLOCK),
    "one-per-node-cyclic": (
        [1, 1],
        ("--map-by", "ppr:1:node"),
        ("--ranks-per-node", "2", "--placement", "cyclic"),
        ROUND_ROBIN,
    ),
    "like-the-training-job": ([2, 2], ("--map-by", "node"), (), ROUND_ROBIN),
}


@pytest.mark.parametrize("job", sorted(STAGE_JOBS))
def test_stage_only_fills_each_nodes_local_with_its_own_plan(cluster, job, folder):
    slots, extra, flags, layout = STAGE_JOBS[job]
    program = [sys.executable, "-m", "hpcdl.stage", "--data", str(folder)]
    program += ["--stage-dir", str(STAGE), *flags]
    program += ["--batch-size", str(BATCH), "--seed", str(SEED), "--quiet"]
    proc = run_in(cluster, cluster.mpirun(slots, *program, extra=extra))
    for node, ranks in zip(cluster.nodes, layout, strict=True):
        assert staged_files(node.local, folder) == files_read(folder, ranks, world=4)
    assert "node 0: staged 80 files" in proc.stdout and "node 1: staged 80 files" in proc.stdout


def test_round_robin_training_after_stage_only_reads_node_local_copies(cluster, folder, tmp_path):
    # The measurement: --map-by node, 4 ranks. Stage-only first, so staging has caught
    # up before the first read; then every node reads (almost) only its own SSD.
    stage = [sys.executable, "-m", "hpcdl.stage", "--data", str(folder), "--stage-dir"]
    stage += [str(STAGE), "--ranks-per-node", "2", "--placement", "cyclic", "--quiet"]
    stage += ["--batch-size", str(BATCH), "--seed", str(SEED)]
    run_in(cluster, cluster.mpirun([1, 1], *stage, extra=("--map-by", "ppr:1:node")))
    metrics = tmp_path / "metrics.jsonl"
    args = [*train_args(folder, tmp_path), "--metrics", metrics, "--stage-dir", STAGE]
    program = [sys.executable, "-m", "hpcdl.train", *map(str, args)]
    run_in(cluster, cluster.mpirun([2, 2], *program, extra=("--map-by", "node")))
    for entry in read_events(metrics, "summary")[0]["staging_nodes"]:
        assert entry["hits"] / (entry["hits"] + entry["misses"]) >= 0.95, entry
        assert entry["files_staged"] == 80, entry


def test_a_stager_killed_on_one_node_leaves_that_node_on_the_pfs_with_the_same_result(
    cluster, folder, one_node_params, tmp_path
):
    slots, extra, _ = PLACEMENTS["round-robin"]
    env = mpi_env()
    env["HPCDL_STAGE_EMULATE_PFS"] = "latency_ms=30,mbps=100"  # every PFS open waits 30 ms
    metrics = tmp_path / "metrics.jsonl"
    args = [*train_args(folder, tmp_path), "--metrics", metrics, "--stage-dir", STAGE]
    args += ["--keep-staged", "--stage-threads", 1]
    program = [sys.executable, "-m", "hpcdl.train", *map(str, args)]
    extra = (*extra, *SAME_SUM_ORDER, "-x", "HPCDL_STAGE_EMULATE_PFS")
    command = cluster.argv(1, cluster.mpirun(slots, *program, extra=extra))
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as job:  # fmt: skip
        status = StatusView(wait_for_status(cluster.node(2).local / "stage", job))
        while job.poll() is None and status.field("plan_ready") < 1:
            time.sleep(0.005)
        os.kill(status.field("pid"), signal.SIGKILL)  # node 2's stager, mid-plan
        ready_at_kill = status.field("plan_ready")
        killed_mid_run = job.poll() is None and ready_at_kill < 80
        status.close()
        _, err = job.communicate(timeout=300)
    assert killed_mid_run
    assert job.returncode == 0, err[-3000:]
    assert "hpcdl staging on node 1: the staging process stopped" in err, err[-3000:]
    params = checkpoint.load(checkpoint.latest(tmp_path / "ckpt")).params
    assert params.tobytes() == one_node_params.tobytes()
    first, second = read_events(metrics, "summary")[0]["staging_nodes"]
    assert second["node"] == "vnode2" and second["misses"] > 0, second
    assert second["files_staged"] == ready_at_kill, (ready_at_kill, second)  # no more copies
    assert first["node"] == "vnode1" and first["hits"] > 0, first  # node 1 staged on


def rank_pid_on_node(cluster: Cluster, index: int, rank: int, marker: str) -> int:
    """pid of the hpcdl.train process of world `rank` running inside node `index` (1-based);
    marker: a string on its command line that singles out this job."""
    for pid in cluster.pids(index):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hpcdl.train" in cmdline and marker.encode() in cmdline:
            if f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
                return pid
    raise AssertionError(f"no hpcdl.train rank {rank} with {marker} on {cluster.node(index)}")


def test_sigterm_to_one_rank_on_node_2_stops_the_job_with_a_checkpoint_and_resume_matches(
    cluster, digits_dir, tmp_path
):
    # 2 nodes x 2 ranks, block placement: world rank 3 runs on node 2.
    common = [
        "--data", digits_dir / "train", "--model", "mlp", "--epochs", 3, "--batch-size", 16,
        "--lr", 0.05, "--workers", 0, "--seed", 7, "--quiet", "--stage-dir", STAGE,
    ]  # fmt: skip

    def job(*args) -> str:
        program = [sys.executable, "-m", "hpcdl.train", *map(str, (*common, *args))]
        return cluster.mpirun([2, 2], *program, extra=SAME_SUM_ORDER)

    run_in(cluster, job("--checkpoint-dir", tmp_path / "ref"))  # uninterrupted reference
    reference = checkpoint.load(checkpoint.latest(tmp_path / "ref"))

    stopped_dir, metrics = tmp_path / "stopped", tmp_path / "stopped.jsonl"
    command = job("--checkpoint-dir", stopped_dir, "--metrics", metrics, "--metrics-every", 1)
    with subprocess.Popen(cluster.argv(1, command), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=mpi_env()) as run:  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and run.poll() is None:
            if metrics.exists() and len(read_events(metrics, "step")) >= 20:
                break
            time.sleep(0.02)
        os.kill(rank_pid_on_node(cluster, 2, 3, str(stopped_dir)), signal.SIGTERM)
        signalled = time.monotonic()
        out, err = run.communicate(timeout=120)
    assert time.monotonic() - signalled < 60
    assert run.returncode != 0
    assert "stopped by signal SIGTERM, checkpoint at" in out, out + err[-3000:]
    stopped = checkpoint.load(checkpoint.latest(stopped_dir))
    assert 0 < stopped.global_step < reference.global_step
    summary = read_events(metrics, "summary")[0]
    assert summary["stopped_by_signal"] is True and summary["world_size"] == 4

    run_in(cluster, job("--checkpoint-dir", stopped_dir, "--resume", "auto"))
    resumed = checkpoint.load(checkpoint.latest(stopped_dir))
    assert resumed.global_step == reference.global_step
    assert resumed.params.tobytes() == reference.params.tobytes()


# Sums rank-dependent buffers with bench allreduce's two-level reduction; prints "ok" if right.
TWO_LEVEL = (
    "import numpy as np; from mpi4py import MPI; from hpcdl.bench.allreduce import TwoLevel; "
    "c = MPI.COMM_WORLD; t = TwoLevel(c); b = np.arange(1000, dtype=np.float64) * (c.rank + 1); "
    "t.allreduce(b); w = sum(range(1, c.size + 1)); "
    "assert t.nodes == 2 and np.array_equal(b, np.arange(1000) * w), (t.nodes, b[:3]); "
    "t.close(); print('ok', flush=True)"
)


@pytest.mark.parametrize("placement", ["round-robin", "uneven"])
def test_two_level_reduction_of_the_interconnect_benchmark_sums_across_nodes(cluster, placement):
    slots, extra, _ = PLACEMENTS[placement]
    proc = run_in(cluster, cluster.mpirun(slots, sys.executable, "-c", TWO_LEVEL, extra=extra))
    assert proc.stdout.split() == ["ok"] * 4, proc.stdout


def test_limit_links_puts_a_token_bucket_on_every_nodes_link(cluster):
    cluster.limit_links("1gbit")
    for node in cluster.nodes:
        shown = subprocess.run(["ip", "netns", "exec", node.netns, "tc", "qdisc", "show", "dev",
                                "eth0"], capture_output=True, text=True, check=True)  # fmt: skip
        assert "tbf" in shown.stdout and "rate 1Gbit" in shown.stdout, shown.stdout


def test_cluster_nodes_are_separate_and_torn_down(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    cluster = Cluster(tmp_path / "c", nodes=2)
    with pytest.raises(RuntimeError, match="inside"), cluster:
        for node in cluster.nodes:
            out = cluster.run(node.index, f"hostname; touch /local/{node.hostname}; ls /local")
            assert out.stdout.split() == [node.hostname, node.hostname], out.stderr
        # node 2 is reachable from node 1 over the bridge, by TCP
        probe = (
            "import socket, sys; s = socket.create_connection((sys.argv[1], 22222), timeout=5); "
            "s.sendall(b'ok')"
        )
        listen = (
            "import socket; s = socket.create_server(('0.0.0.0', 22222)); "
            "c, _ = s.accept(); print(c.recv(2).decode())"
        )
        server = cluster.argv(2, shlex.join([sys.executable, "-c", listen]))
        with subprocess.Popen(server, stdout=subprocess.PIPE, text=True) as srv:
            for _ in range(50):
                client = cluster.run(
                    1, shlex.join([sys.executable, "-c", probe, cluster.node(2).ip])
                )
                if client.returncode == 0:
                    break
            assert srv.communicate(timeout=30)[0].strip() == "ok"
        cluster.run(2, "sleep 600 >/dev/null 2>&1 &")  # left running: tear-down kills it
        raise RuntimeError("a test failing inside the cluster")
    assert not leftovers()
    assert not any((LOCAL / n.hostname).exists() for n in cluster.nodes)  # /local was private


def test_node_disks_give_each_node_a_file_system_of_its_own_and_go_at_tear_down(tmp_path):
    """Cluster(disk_bytes=...): each node's /local is its own ext4 (its own journal, as a
    node's local disk), not a directory on the host's file system shared by all nodes."""
    reason = unavailable() or (None if Path("/dev/loop-control").exists() else "no loop devices")
    if reason:
        pytest.skip(reason)
    cluster = Cluster(tmp_path / "c", nodes=2, disk_bytes=64 << 20)
    with cluster:
        seen = {}
        for node in cluster.nodes:
            out = cluster.run(node.index, f"echo {node.hostname} > /local/mine; stat -f -c %T "
                                          "/local; stat -c %d /local")  # fmt: skip
            kind, device = out.stdout.split()
            assert kind == "ext2/ext3", out.stdout + out.stderr
            seen[node.hostname] = int(device)
            assert (node.local / "mine").read_text().strip() == node.hostname
        assert len(set(seen.values())) == 2, seen
        assert os.stat(tmp_path).st_dev not in seen.values()
    mounts = Path("/proc/self/mounts").read_text()
    assert not any(str(n.local) in mounts for n in cluster.nodes), mounts
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["hosts", "rsh-agent",
                                                                  "vnode1", "vnode2"]  # fmt: skip
    assert not leftovers()


def test_bench_interconnect_measures_with_and_without_a_link_limit_and_cleans_up():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    cmd = [sys.executable, "-m", "tools.bench", "interconnect", "--models", "resnet20"]
    cmd += ["--repeats", "1", "--colls", "tuned", "--json"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=mpi_env()) as bench:  # fmt: skip
        out, err = bench.communicate(timeout=300)
    assert bench.returncode == 0, err[-3000:]
    rows = json.loads(out.splitlines()[-1])
    assert [(r["link"], r["coll"]) for r in rows] == [("none", "tuned"), ("1gbit", "tuned")]
    for row in rows:
        result = row["result"]["models"]["resnet20"]
        assert result["nodes"] == 2 and row["result"]["ranks"] == 4, row
        assert all(result[k] > 0 for k in ("flat_s", "reducer_s", "naive_s", "two_level_s"))
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"hpcdl{bench.pid}" not in names  # the benchmark tore its cluster down


def test_a_node_that_cannot_see_rank_0s_index_caches_its_own_copy(cluster, folder, tmp_path):
    """The index cache on /local: node 2 cannot map rank 0's index file, so rank 0 sends the
    bytes and node 2's first rank writes them into its own cache for its ranks and workers
    (hpcdl.startup.share_index); training is the same as on one node."""
    args = [*train_args(folder, tmp_path), "--workers", 1]
    program = [sys.executable, "-m", "hpcdl.train", *map(str, args)]
    cache = ("-x", f"XDG_CACHE_HOME={LOCAL / 'cache'}")
    run_in(cluster, cluster.mpirun([2, 2], *program, extra=(*cache, *SAME_SUM_ORDER)))
    copies = [list((n.local / "cache" / "hpcdl").glob("*.hpcdl-index")) for n in cluster.nodes]
    assert [len(c) for c in copies] == [1, 1], copies
    assert copies[0][0].read_bytes() == copies[1][0].read_bytes()
    assert all(c[0].stat().st_mode & 0o777 == 0o444 for c in copies)
    assert not any(p.name.startswith(".hpcdl-index") for p in folder.iterdir())
