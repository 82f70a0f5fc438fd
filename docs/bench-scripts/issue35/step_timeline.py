"""One `bench calibrate` and one `--shuffle node` job with --timeline, back to back on the 4
emulated nodes of `tools.bench peer-staging` (960 PNGs, batch 8, 4 epochs, --workers 0; the
data on the host, not behind the slow FS), then rank 0's training thread per step, in ms, for
calibrate's first quiet window and the job's later epochs (docs/PERFORMANCE.md, issue 35,
"Where the step goes"). Needs root (tools.bench.cluster). Usage: step_timeline.py OUTDIR"""

import json
import os
import shutil
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2])]  # the repository root

import numpy as np  # noqa: E402

from hpcdl.data import open_dataset  # noqa: E402
from tools.bench.cluster import Cluster  # noqa: E402
from tools.bench.peer_staging import JOBS, train_args  # noqa: E402
from tools.bench.validate import Setup, calibrate_args, make_images, run_mpi  # noqa: E402

NAMES = {3: "forward", 4: "backward", 6: "gradient allreduce wait", 7: "optimizer",
         8: "collective"}  # fmt: skip  (hpcdl.diag.events.Kind, as the trace labels them)


def per_step(events: list[tuple[str, float, float]], starts: list[float]) -> dict[str, float]:
    """Mean ms per step of each kind between consecutive forward starts, and the rest."""
    parts = defaultdict(list)
    for a, b in zip(starts, starts[1:]):
        spent = Counter()
        for name, t0, t1 in events:
            if a <= t0 < b:
                spent[name] += (t1 - t0) * 1e3
        spent["rest"] = (b - a) * 1e3 - sum(spent.values())
        spent["step"] = (b - a) * 1e3
        for name, ms in spent.items():
            parts[name].append(ms)
    return {name: float(np.mean(v)) for name, v in parts.items()}


def calibrate_parts(path: Path) -> dict[str, float]:
    raw = [e for e in json.loads(path.read_text()) if int(e[0]) in NAMES]
    events = sorted((NAMES[int(e[0])], e[1], e[2]) for e in raw)
    starts = sorted(t0 for name, t0, _ in events if name == "forward")[3:]  # after warm-up
    return per_step(events, starts)


def job_parts(path: Path, steps_per_epoch: int = 30) -> dict[str, float]:
    trace = json.loads(path.read_text())["traceEvents"]
    mine = [e for e in trace if e.get("ph") == "X" and e.get("pid") == 0 and e.get("tid") == 0]
    events = [(e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in mine]
    forward = {e["args"]["step"]: e["ts"] / 1e6 for e in mine if e["name"] == "forward"}
    parts = defaultdict(list)
    for k in sorted(forward):  # later epochs, without each epoch's last step (its checkpoint)
        last = k % steps_per_epoch == steps_per_epoch - 1
        if k >= steps_per_epoch and k + 1 in forward and not last:
            for name, ms in per_step(events, [forward[k], forward[k + 1]]).items():
                parts[name].append(ms)
    return {name: float(np.mean(v)) for name, v in parts.items()}


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    setup = Setup(4, 1, 960, 20, "", epochs=4, stage_threads=8, runs=1)
    with tempfile.TemporaryDirectory(prefix="hpcdl-step-timeline-") as scratch:
        scratch = Path(scratch)
        data = make_images(scratch / "pfs", setup.files)
        open_dataset(data)
        os.environ["HPCDL_STEP_EVENTS"] = str(out / "calibrate-events.json")
        with Cluster(scratch / "cluster", nodes=setup.nodes) as cluster:
            args = calibrate_args(setup, data, scratch / "cal.toml")[3:]  # after the module
            (out / "calibrate.txt").write_text(
                run_mpi(cluster, setup, [str(HERE / "calibrate_events.py"), *args]))
            job = scratch / "node"
            run_mpi(cluster, setup, [*train_args(setup, data, job, JOBS["node"]),
                                     "--timeline", str(job / "trace.json")])  # fmt: skip
            shutil.copy(job / "trace.json", out / "node.trace.json")
    columns = ("step", "forward", "backward", "gradient allreduce wait", "optimizer",
               "collective", "rest")  # fmt: skip
    print("| | " + " | ".join(columns) + " |")
    for name, parts in (("calibrate", calibrate_parts(out / "calibrate-events.json")),
                        ("the job", job_parts(out / "node.trace.json"))):  # fmt: skip
        print(f"| {name} | " + " | ".join(f"{parts.get(c, 0.0):.1f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
