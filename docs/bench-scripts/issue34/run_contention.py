"""The contention test behind PERFORMANCE.md's "Tried and not kept" (issue 34): on 2 emulated
nodes at 1 Gbit/s, 1 rank each, a 25 MiB allreduce while the rank's other thread multiplies
matrices, blocking (flat) against non-blocking and polled every 0.2 ms with libnbc's ring.

    python docs/bench-scripts/issue34/run_contention.py    # root, from the repository root
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from hpcdl.bench.launch import child_env  # noqa: E402
from tools.bench.cluster import Cluster  # noqa: E402

HERE = Path(__file__).resolve().parent
YIELD = ("--mca", "mpi_yield_when_idle", "1")
CASES = [("flat", ()), ("nb", ("--mca", "coll_libnbc_iallreduce_algorithm", "1"))]

with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp), nodes=2) as cluster:
    cluster.limit_links("1gbit")
    for mode, extra in CASES:
        program = (sys.executable, str(HERE / "contention.py"), mode)
        cmd = cluster.mpirun([1, 1], *program, extra=(*YIELD, *extra))
        done = cluster.run(1, cmd, timeout=600, env=child_env(2, "cpu"))
        print(done.stdout.strip() or done.stderr[-1000:], flush=True)
