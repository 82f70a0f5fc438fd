"""The link measurements behind PERFORMANCE.md's "DistributedOptimizer vs DDP on a quiet VM"
(issue 34): 25 MiB over the emulated 1 Gbit/s link between 2 nodes, 1 rank each, by Open MPI
(one way, both ways, Allreduce), gloo (allreduce) and a plain TCP socket (one way, both ways).

    python docs/bench-scripts/issue34/run_link.py          # root, from the repository root

And, on one node: `mpirun -np 2 python docs/bench-scripts/issue34/float16_sum.py` (Open MPI's
float16 sum against a torch user op).
"""

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from hpcdl.bench.launch import child_env  # noqa: E402
from tools.bench.cluster import Cluster  # noqa: E402

HERE = Path(__file__).resolve().parent
YIELD = ("--mca", "mpi_yield_when_idle", "1")

with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp), nodes=2) as cluster:
    cluster.limit_links("1gbit")
    env = child_env(2, "cpu")
    env.update(GLOO_SOCKET_IFNAME="eth0", ADDR=cluster.node(1).ip)
    for script in ("mpi_link.py", "gloo_link.py"):
        cmd = cluster.mpirun([1, 1], sys.executable, str(HERE / script), extra=YIELD)
        done = cluster.run(1, cmd, timeout=600, env=env)
        print(done.stdout.strip() or done.stderr[-1000:], flush=True)
    ip = cluster.node(1).ip
    server = subprocess.Popen(
        cluster.argv(1, f"{sys.executable} {HERE / 'socket_link.py'} server {ip}"),
        stdout=subprocess.PIPE,
        text=True,
    )
    client = subprocess.run(
        cluster.argv(2, f"{sys.executable} {HERE / 'socket_link.py'} client {ip}"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(client.stdout.strip(), server.communicate(timeout=60)[0].strip(), sep="\n")
