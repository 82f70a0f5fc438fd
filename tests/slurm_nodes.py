"""Slurm across the emulated nodes of tools/bench/cluster.py: one slurmd per node.

- **munge.** One munged per node, all with the same key, as on a real cluster: a credential
  that two nodes decode would look replayed to a single munged. They run on the host; a Unix
  socket path reaches across network namespaces. slurm.conf names one socket path, and inside
  node K that path's directory is a bind mount of node K's munged directory.
- **slurmctld** runs inside node 1: `SlurmctldHost=vnode1(10.78.0.1)`, reachable on the bridge.
- **slurmd** runs inside each node, through the cluster's agent, so it has the node's hostname
  (= NodeName), /local, /etc/hosts and address (NodeAddr=10.78.0.K). The jobs it starts inherit
  all of that. Spool, pid and log files are per node (`%n` in slurm.conf), and so is the
  base directory of `srun --mpi=pmix` (mpi.conf, under the node's /local).
- **Clients** (sbatch, scontrol, scancel) run inside node 1 too: the host has no route to the
  bridge, by design.

Tear-down: stop the daemons (SlurmCluster.stop), then the cluster's tear-down kills whatever
is left inside the nodes. Ports are Slurm's defaults: each node has a network stack of its own.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from slurm_cluster import SlurmCluster, binary

from tools.bench.cluster import LOCAL, Cluster

# `ip netns exec` mounts a fresh /sys without /sys/fs/cgroup, and slurmd refuses to start
# without a cgroup file system to detect, even with proctrack/linuxproc and task/none. On a
# cgroup v1 host (tested) a tmpfs with the named systemd hierarchy reads as v1, which needs
# nothing more for these plugins; on a cgroup v2 host, the cgroup2 file system. The mounts
# are private to slurmd's mount namespace and go with it.
CGROUP_V1 = (
    "mount -t tmpfs cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && "
    "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd && "
)
CGROUP_V2 = "mount -t cgroup2 cgroup2 /sys/fs/cgroup && "
PMIX_TMP = LOCAL / ".slurm-pmix"
CPUS_PER_NODE = 2  # what each slurmd offers: 2 ranks of 1 CPU (the machine may have just 2)


class SlurmOnNodes(SlurmCluster):
    def __init__(self, cluster: Cluster) -> None:
        super().__init__()
        self.cluster = cluster
        self.node = cluster.node(1).hostname  # the controller's node

    def _topology(self) -> tuple[str, str]:
        controller = self.cluster.node(1)
        r = self.root
        places = f"""\
SlurmctldHost={controller.hostname}({controller.ip})
SlurmctldPort=6817
SlurmdPort=6818
SlurmdSpoolDir={r}/spool/%n
SlurmdPidFile={r}/slurmd-%n.pid
SlurmdLogFile={r}/log/slurmd-%n.log"""
        names = ",".join(n.hostname for n in self.cluster.nodes)
        nodes = "\n".join(
            f"NodeName={n.hostname} NodeAddr={n.ip} CPUs={CPUS_PER_NODE} RealMemory=256"
            " State=UNKNOWN"
            for n in self.cluster.nodes
        )
        nodes += f"\nPartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP"
        return places, nodes

    def _start_munge(self, timeout: float) -> None:
        munge = self._create_munge_key()
        for node in self.cluster.nodes:
            own = munge / node.hostname
            own.mkdir(mode=0o711)
            shutil.chown(own, "munge", "munge")
            self._spawn_munged(f"munged-{node.hostname}", own, timeout)
        # Inside node K, munge/node is a bind mount of munge/vnodeK (see _in_node).
        (munge / "node").mkdir(mode=0o711)
        self.munge_socket = munge / "node" / "munge.socket"

    def _start_slurm(self, timeout: float) -> None:
        conf = str(self.conf)
        # srun --mpi=pmix: each slurmstepd makes a directory for its ranks under this base,
        # named after the step only; /tmp is shared by all nodes here, /local is not.
        (self.conf.parent / "mpi.conf").write_text(f"PMIxCliTmpDirBase={PMIX_TMP}\n")
        for node in self.cluster.nodes:
            (node.local / PMIX_TMP.relative_to(LOCAL)).mkdir(exist_ok=True)
        self._spawn("slurmctld", self._in_node(1, [binary("slurmctld"), "-D", "-f", conf]))
        self._wait(self._controller_up, timeout, "slurmctld up")
        for node in self.cluster.nodes:
            (self.root / "spool" / node.hostname).mkdir(parents=True)
            argv = [binary("slurmd"), "-D", "-f", conf, "-N", node.hostname]
            self._spawn(f"slurmd-{node.hostname}", self._in_node(node.index, argv, _cgroup_fs()))
        for node in self.cluster.nodes:
            idle = node.hostname
            self._wait(lambda n=idle: self._node_idle(n), timeout, f"node {idle} idle")

    def _in_node(self, index: int, argv: list[str], before: str = "") -> list[str]:
        """argv that runs `argv` inside node `index`, talking to that node's munged."""
        munge = self.root / "munge"
        own = shlex.join(["mount", "--bind", str(munge / self.cluster.node(index).hostname),
                          str(munge / "node")])  # fmt: skip
        # exec: the agent's shells become the program, so terminate() reaches the daemon itself
        return self.cluster.argv(index, f"{own} && {before}exec {shlex.join(argv)}")

    def client(self, argv: list[str]) -> list[str]:
        return self._in_node(1, argv)


def _cgroup_fs() -> str:
    """Shell words that mount what slurmd needs on /sys/fs/cgroup, as the host has it."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        if line.split()[1] == "/sys/fs/cgroup":
            return CGROUP_V2 if line.split()[2] == "cgroup2" else CGROUP_V1
    return CGROUP_V1
