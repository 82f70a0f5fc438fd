"""An emulated cluster on one machine: the `multinode` tests and `bench interconnect` use it.

A node is a network namespace with its own hostname (UTS namespace), its own `/local` (a bind
mount of a per-node directory inside a private mount namespace; with `disk_bytes`, that
directory is the node's own ext4 file system, see below), an /etc/hosts that names the
nodes (so `vnode2` resolves inside every node, as a cluster's DNS would) and the address
10.78.0.K on a bridge. The bridge lives in a "switch" namespace of its own, so nothing here
touches the host's network: traffic goes only among the namespaces this harness creates.
Everything else (the repository, the data sets, /tmp, /dev/shm) is shared, standing in for the
parallel file system.

Open MPI reaches the other nodes through an rsh agent (`--mca plm_rsh_agent`): it is called as
`AGENT HOST CMDSTRING` and runs the command string through `sh -c` inside that node, so the
launcher's daemons and the ranks it starts there see the node's hostname, /local and address.

Node disks (`disk_bytes`): by default every node's /local directory lies on the host's file
system, so the nodes share one journal and one writeback: files one node's stager creates can
hold up another node's ranks, which nodes with disks of their own never do. With disk_bytes,
each node's directory is its own ext4 file system in a sparse image file of that size in the
workdir, loop-mounted before the node starts, unmounted and deleted at tear-down (the
benchmarks use it; docs/PERFORMANCE.md, issue 35).

Tear-down kills every process left in the node namespaces, then deletes them; a killed
namespace takes its mounts, veth pairs and the bridge with it. It runs even when a test fails.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.78.0"  # /24 on the cluster's own bridge, never routed anywhere
LOCAL = Path("/local")  # the node-local mount point every node sees
NETNS_DIR = Path("/run/netns")
VENV_BIN = Path(sys.executable).parent


def harness_can_start(prog: str, *also: Callable[[], str | None]) -> bool:
    """For a harness's main: a cluster built from here is torn down on Ctrl-C and on kill as
    well (also when started in the background); False, with the reason printed, when this
    machine cannot build one or one of `also` (more checks, e.g. the slow FS's) says why not."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    reason = unavailable() or next((r for r in (check() for check in also) if r), None)
    if reason:
        print(f"{prog}: {reason}", file=sys.stderr)
    return reason is None


def unavailable() -> str | None:
    """Why this machine cannot host an emulated cluster, or None when it can."""
    if os.geteuid() != 0:
        return "an emulated cluster needs root (network, UTS and mount namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"an emulated cluster needs the `{tool}` command (iproute2, util-linux)"
    probe = f"hpcdlprobe{os.getpid()}"
    netns_dir_mounted = _is_mount(NETNS_DIR)
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace for an emulated cluster: {made.stderr.strip()}"
    try:
        inner = subprocess.run(
            ["ip", "netns", "exec", probe, "unshare", "--uts", "--mount", "true"],
            capture_output=True,
            text=True,
        )
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        if not netns_dir_mounted:  # busy (stays) while anyone else has a namespace there
            subprocess.run(["umount", str(NETNS_DIR)], capture_output=True)
    if inner.returncode != 0:
        return f"cannot create UTS/mount namespaces for an emulated cluster: {inner.stderr.strip()}"
    return None


@dataclass(frozen=True)
class Node:
    """One emulated node: hostname, namespace, address and the host directory behind /local."""

    index: int  # 1-based, as in the hostname and the address
    hostname: str
    netns: str
    ip: str
    local: Path


class Cluster:
    """K emulated nodes on a private bridge; `up()` builds them, `down()` removes everything."""

    def __init__(self, workdir: Path, nodes: int = 2, resolve: bool = True, disk_bytes: int = 0):
        """resolve=False: the nodes reach each other by address only, their names do not
        resolve (some sites; a management network's names). disk_bytes > 0: each node's
        /local is an ext4 file system of its own of that size (the module docstring)."""
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be in 1..250, got {nodes}")
        self.workdir = Path(workdir)
        tag = f"hpcdl{os.getpid()}{os.urandom(2).hex()}"  # unique per process and cluster
        self.switch = f"{tag}sw"
        self.nodes = [
            Node(k, f"vnode{k}", f"{tag}n{k}", f"{SUBNET}.{k}", self.workdir / f"vnode{k}")
            for k in range(1, nodes + 1)
        ]
        self.agent = self.workdir / "rsh-agent"
        self.hosts = self.workdir / "hosts"  # the nodes' /etc/hosts: names resolve inside nodes
        self.resolve = resolve
        self._made: list[str] = []  # namespaces created so far, for down()
        self.disk_bytes = disk_bytes
        self._disks: list[Path] = []  # node directories with a file system mounted, for down()
        self._netns_dir_mounted = _is_mount(NETNS_DIR)  # iproute2 mounts it at the first add

    # ------------------------------------------------------------------ life cycle

    def up(self) -> Cluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        LOCAL.mkdir(exist_ok=True)  # mount point only; each node binds its own directory on it
        self._add_netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            node.local.mkdir(exist_ok=True)
            if self.disk_bytes:
                self._mount_disk(node)
            self._add_netns(node.netns)
            port = f"p{node.index}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", node.netns)  # fmt: skip
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        names = "".join(f"{n.ip} {n.hostname}\n" for n in self.nodes) if self.resolve else ""
        self.hosts.write_text("127.0.0.1 localhost\n" + names)
        self._write_agent()
        return self

    def down(self) -> None:
        """Kill what still runs in the nodes, then delete the namespaces (idempotent)."""
        for netns in reversed(self._made):
            for _ in range(50):
                pids = _netns_pids(netns)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        if self._made and not self._netns_dir_mounted:
            subprocess.run(["umount", str(NETNS_DIR)], capture_output=True)
        self._made.clear()
        for local in reversed(self._disks):  # the nodes' bind mounts went with their namespaces
            subprocess.run(["umount", str(local)], capture_output=True)
            _disk_image(local).unlink(missing_ok=True)
        self._disks.clear()

    def __enter__(self) -> Cluster:
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()

    # ------------------------------------------------------------------ running things

    def node(self, index: int) -> Node:
        return self.nodes[index - 1]

    def limit_links(self, rate: str) -> None:
        """Limit every node's link to `rate` (tc syntax, e.g. 1gbit) with a token bucket (tbf).

        Each node's egress is shaped, so traffic in both directions is; replaces an earlier
        limit. The qdiscs go with the namespaces at tear-down."""
        for node in self.nodes:
            _ip_netns_tc(node.netns, "replace", rate)

    def pids(self, index: int) -> list[int]:
        """Processes running inside node `index` (1-based)."""
        return _netns_pids(self.node(index).netns)

    def argv(self, index: int, command: str) -> list[str]:
        """argv that runs a shell command inside node `index` (1-based), as the agent does."""
        return [str(self.agent), self.node(index).ip, command]

    def run(
        self, index: int, command: str, timeout: float = 300, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        """Run a shell command inside one node; output captured as text."""
        return subprocess.run(
            self.argv(index, command),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )

    def mpirun(self, slots: list[int], *args: str, extra: tuple[str, ...] = ()) -> str:
        """`mpirun` command line (for node 1) with slots[k-1] ranks allowed on node k.

        extra: more mpirun options (for example `--map-by node`); args: the program."""
        hosts = ",".join(f"{n.ip}:{s}" for n, s in zip(self.nodes, slots) if s)
        cmd = [
            str(VENV_BIN / "mpirun"),
            "--mca", "plm_rsh_agent", str(self.agent),
            "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24",
            "--mca", "oob_tcp_if_include", f"{SUBNET}.0/24",
            "--host", hosts,
            "--bind-to", "none",  # the emulated nodes share this machine's cores
            "-np", str(sum(slots)),
            *extra,
            *args,
        ]  # fmt: skip
        return shlex.join(cmd)

    # ------------------------------------------------------------------ internals

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _mount_disk(self, node: Node) -> None:
        image = _disk_image(node.local)
        with image.open("wb") as f:
            f.truncate(self.disk_bytes)  # sparse: blocks are taken as the node writes
        for argv in (["mkfs.ext4", "-q", "-F", str(image)],
                     ["mount", "-o", "loop", str(image), str(node.local)]):  # fmt: skip
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                image.unlink(missing_ok=True)
                raise RuntimeError(f"node disk of {node.hostname}: {' '.join(argv)}: "
                                   f"{proc.stderr.strip()}")  # fmt: skip
        self._disks.append(node.local)

    def _write_agent(self) -> None:
        cases = "\n".join(
            f"  {n.ip}|{n.hostname}) ns={n.netns}; name={n.hostname};"
            f" dir={shlex.quote(str(n.local))} ;;"
            for n in self.nodes
        )
        self.agent.write_text(
            "#!/bin/sh\n"
            "# rsh agent of an emulated cluster (tools/bench/cluster.py): AGENT HOST CMDSTRING\n"
            "host=$1; shift\n"
            'case "$host" in\n'
            f"{cases}\n"
            '  *) echo "rsh-agent: unknown host $host" >&2; exit 255 ;;\n'
            "esac\n"
            'exec ip netns exec "$ns" unshare --uts --mount --propagation private sh -c \\\n'
            """  'hostname "$1" && mount --bind "$2" /local && mount --bind "$3" /etc/hosts \\\n"""
            """   && shift 3 && exec sh -c "$*"' \\\n"""
            f'  node "$name" "$dir" {shlex.quote(str(self.hosts))} "$@"\n'
        )
        self.agent.chmod(0o755)


def _disk_image(local: Path) -> Path:
    return local.with_name(local.name + ".ext4")


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _ip_netns_tc(netns: str, verb: str, rate: str) -> None:
    # burst: a 1 ms burst at 10gbit (1.25 MB), enough for the timer granularity of any kernel
    argv = ["ip", "netns", "exec", netns, "tc", "qdisc", verb, "dev", "eth0", "root", "tbf",
            "rate", rate, "burst", "1250kb", "latency", "50ms"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")


def _netns_pids(netns: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _is_mount(path: Path) -> bool:
    return any(
        line.split()[1] == str(path) for line in Path("/proc/self/mounts").read_text().splitlines()
    )


def leftovers() -> list[str]:
    """Namespaces and mounts an emulated cluster of this process could have left behind."""
    tag = f"hpcdl{os.getpid()}"
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mounts = Path("/proc/self/mounts").read_text()
    return [line for line in (names + mounts).splitlines() if tag in line]
