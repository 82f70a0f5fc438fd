"""Where a peers job's fetches fall: the 4 emulated nodes of `tools.bench peer-staging` behind
the slow FS (LATENCY ms per open, default 20), one `bench calibrate`, then the `--shuffle node`
job and the global job with peers, ROUNDS times in turn (default 2). For each job: its epochs
against the model's, rank 0's mean step, and at the end of every epoch each node's cumulative
files staged, peer fetches and PFS opens (the epoch records' staging_nodes); then the dry run's
peer fetches per epoch, for comparison (a fetch for epoch e + 1 is made during epoch e). Needs
root and FUSE. Usage: epoch_fetches.py [LATENCY [ROUNDS]]"""

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2])]  # the repository root

import numpy as np  # noqa: E402

from hpcdl import stage  # noqa: E402
from tools.bench.peer_staging import JOBS, predicted_epochs, run_job  # noqa: E402
from tools.bench.validate import Setup, calibrate_args, run_mpi, slow_pfs_cluster  # noqa: E402


def report(name: str, job: dict, model: list[float], out: Path) -> None:
    print(f"{name}: epochs {np.round(job['epochs_s'], 2)} model {np.round(model, 2)} "
          f"rank 0's mean step, ms {np.round(np.array(job['step_mean_s']) * 1e3, 1)}")  # fmt: skip
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "epoch":
            nodes = record.get("staging_nodes") or []
            print(f"  end of epoch {record['epoch'] + 1}, per node: staged "
                  f"{[n['files_staged'] for n in nodes]}, peer fetches "
                  f"{[n['peer_files'] for n in nodes]}, PFS opens "
                  f"{[n['pfs_opens'] for n in nodes]}")  # fmt: skip


def main() -> None:
    latency = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    setup = Setup(4, 1, 960, latency, "", epochs=4, stage_threads=8, runs=1)
    with tempfile.TemporaryDirectory(prefix="hpcdl-epoch-fetches-") as scratch:
        work = Path(scratch)
        with slow_pfs_cluster(setup, work) as (pfs, cluster, mount):  # as the bench sets it up
            calib = work / "calibration.toml"
            run_mpi(cluster, setup, calibrate_args(setup, mount, calib))
            for r in range(rounds):
                for name in ("node", "global, peers"):
                    out = work / f"job{r}-{name.replace(', ', '-')}"
                    job = run_job(cluster, pfs, setup, mount, out, JOBS[name])
                    model, _ = predicted_epochs(setup, mount, calib, JOBS[name])
                    report(f"round {r + 1}, {name}", job, model, out)
            argv = ["--dry-run", "--data", str(mount), "--calibration", str(calib), "--nodes",
                    "4", "--ranks-per-node", "1", "--seed", "0", "--batch-size",
                    str(setup.batch_size), "--epochs", str(setup.epochs), "--stage-threads",
                    str(setup.stage_threads), "--workers", "0", "--json",
                    *JOBS["global, peers"]]  # fmt: skip
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                stage.main(argv)
            (predicted,) = json.loads(text.getvalue().strip().splitlines()[-1])["predictions"]
            print(f"dry run, global with peers: peer fetches per epoch, all nodes "
                  f"{predicted['peer_files_per_epoch']}")  # fmt: skip


if __name__ == "__main__":
    main()
