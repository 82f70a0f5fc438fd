"""The three jobs of `tools.bench peer-staging` (20 ms per open, nodes with disks of their own)
with --timeline, ROUNDS times in turn; per job and later epoch: its seconds, the sum of rank
0's steps, and rank 0's end-of-epoch checkpoint, which the cluster model does not charge
(docs/PERFORMANCE.md, issue 35, "Node disks"). Needs root. Usage: epoch_parts.py [ROUNDS]"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2])]  # the repository root

from tools.bench.peer_staging import JOBS, train_args  # noqa: E402
from tools.bench.validate import Setup, run_mpi, slow_pfs_cluster  # noqa: E402


def parts(job: Path) -> list[str]:
    """'epoch s / steps s / checkpoint ms' of every later epoch, rank 0."""
    records = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    epochs = [r["seconds"] for r in records if r["event"] == "epoch"]
    steps = [sum(r["t_step"] for r in records if r["event"] == "step" and r["epoch"] == e)
             for e in range(len(epochs))]  # fmt: skip
    trace = json.loads((job / "trace.json").read_text())["traceEvents"]
    saved = [e["dur"] / 1e3 for e in trace
             if e.get("ph") == "X" and e.get("pid") == 0 and e["name"] == "checkpoint"]  # fmt: skip
    return [f"{epochs[e]:.2f} / {steps[e]:.2f} / {saved[e]:.0f}" for e in range(1, len(epochs))]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    setup = Setup(4, 1, 960, 20, "", epochs=4, stage_threads=8, runs=1, node_disks=True)
    print("| round | job | epochs 2, 3, 4: epoch s / steps s / checkpoint ms |\n|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="hpcdl-epoch-parts-") as scratch:
        scratch = Path(scratch)
        with slow_pfs_cluster(setup, scratch) as (_, cluster, mount):
            for r in range(rounds):
                for k, (name, flags) in enumerate(JOBS.items()):
                    for node in cluster.nodes:
                        shutil.rmtree(node.local / "stage", ignore_errors=True)
                    job = scratch / f"job{r}-{k}"
                    job.mkdir()
                    run_mpi(cluster, setup, [*train_args(setup, mount, job, flags),
                                             "--timeline", str(job / "trace.json")])  # fmt: skip
                    print(f"| {r + 1} | {name} | {' ; '.join(parts(job))} |", flush=True)


if __name__ == "__main__":
    main()
