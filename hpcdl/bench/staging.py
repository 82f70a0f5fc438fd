"""`python -m hpcdl.bench staging`: hpcdl-stage vs `cp -r` vs shutil.copytree, and threads sweep.

All three copy the same generated tree in the same run; CPU seconds come from the rusage of the
child processes. The sweep runs hpcdl-stage against the emulated PFS (HPCDL_STAGE_EMULATE_PFS)
to show throughput growing with threads: the goal is >= 0.8 x threads / latency files/s until
the bandwidth cap binds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hpcdl.staging.binary import find_stager_binary
from hpcdl.staging.plan import FileTreeDataset, plan_for_node, write_plan
from hpcdl.staging.status import ProgressFile


def make_tree(root: Path, files: int, size: int, per_dir: int = 1000) -> None:
    rng = np.random.default_rng(0)
    blob = rng.integers(0, 256, size + files, dtype=np.uint8).tobytes()
    for i in range(files):
        d = root / f"dir{i // per_dir:04d}"
        if i % per_dir == 0:
            d.mkdir(parents=True)
        (d / f"img{i:07d}.jpg").write_bytes(blob[i : i + size])


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def stager_command(src: Path, dst: Path, threads: int) -> list[str]:
    """Write dst/.hpcdl/{plan,progress} for every file of src; return the stager command."""
    ds = FileTreeDataset(src)
    args = dict(num_samples=len(ds), world_size=1, seed=0, shuffle="none", ranks_per_node=1)
    plan = plan_for_node(ds, args, batch_size=1, epochs=(0, 1))
    (dst / ".hpcdl").mkdir(parents=True, mode=0o700)
    write_plan(dst / ".hpcdl" / "plan", plan, ds)
    ProgressFile.create(dst / ".hpcdl" / "progress", 1)
    return [
        str(find_stager_binary()),
        "--stage-dir",
        str(dst),
        "--threads",
        str(threads),
        "--once",
        "--quiet",
        "--capacity",
        str(1 << 50),
    ]


def row(tool: str, files: int, nbytes: int, wall: float, cpu: float) -> dict:
    return dict(
        tool=tool,
        seconds=round(wall, 3),
        files_per_s=round(files / wall, 1),
        mb_per_s=round(nbytes / 1e6 / wall, 1),
        cpu_s_per_1000_files=round(cpu * 1000 / files, 4),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcdl.bench staging")
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--size", type=int, default=20000, help="bytes per file")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--latency-ms", type=float, default=2.0, help="emulated PFS open latency")
    p.add_argument("--mbps", type=float, default=500.0, help="emulated PFS bandwidth cap")
    p.add_argument("--sweep-files", type=int, default=1000, help="files per sweep point")
    p.add_argument("--sweep-threads", default="1,2,4,8,16,32")
    p.add_argument("--dir", help="scratch directory (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    results: dict = {"files": a.files, "size": a.size, "copy": [], "sweep": []}
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="hpcdl-bench-staging-") as tmp:
        base = Path(tmp)
        src = base / "src"
        make_tree(src, a.files, a.size)
        nbytes = a.files * a.size
        env = {k: v for k, v in os.environ.items() if k != "HPCDL_STAGE_EMULATE_PFS"}
        subprocess.run(["cat", *map(str, src.glob("dir0000/*"))], stdout=subprocess.DEVNULL)
        wall, cpu = timed(["cp", "-r", str(src), str(base / "cp")])
        results["copy"].append(row("cp -r", a.files, nbytes, wall, cpu))
        code = f"import shutil; shutil.copytree({str(src)!r}, {str(base / 'py')!r})"
        wall, cpu = timed([sys.executable, "-c", code])
        results["copy"].append(row("shutil.copytree", a.files, nbytes, wall, cpu))
        wall, cpu = timed(stager_command(src, base / "stage", a.threads), env)
        results["copy"].append(
            row(f"hpcdl-stage ({a.threads} threads)", a.files, nbytes, wall, cpu)
        )
        for tree in ("cp", "py", "stage"):
            shutil.rmtree(base / tree)

        sweep_src = base / "sweep"
        make_tree(sweep_src, a.sweep_files, a.size)
        spec = f"latency_ms={a.latency_ms},mbps={a.mbps}"
        bound = a.mbps * 1e6 / a.size
        for threads in [int(t) for t in a.sweep_threads.split(",")]:
            dst = base / f"sweep-{threads}"
            cmd = stager_command(sweep_src, dst, threads)
            wall, _ = timed(cmd, dict(env, HPCDL_STAGE_EMULATE_PFS=spec))
            goal = min(0.8 * threads / (a.latency_ms / 1000), 0.8 * bound)
            results["sweep"].append(
                dict(
                    threads=threads,
                    files_per_s=round(a.sweep_files / wall, 1),
                    goal_files_per_s=round(goal, 1),
                    mb_per_s=round(a.sweep_files * a.size / 1e6 / wall, 1),
                )
            )
            shutil.rmtree(dst)
    print(f"copy of {a.files} files x {a.size} B:")
    for r in results["copy"]:
        print(
            f"  {r['tool']:<26} {r['seconds']:8.2f} s {r['files_per_s']:10.0f} files/s "
            f"{r['mb_per_s']:8.1f} MB/s {r['cpu_s_per_1000_files']:8.3f} CPU s/1000 files"
        )
    print(f"hpcdl-stage vs emulated PFS ({spec}), {a.sweep_files} files:")
    for r in results["sweep"]:
        print(
            f"  {r['threads']:3d} threads {r['files_per_s']:9.0f} files/s "
            f"(goal {r['goal_files_per_s']:.0f}) {r['mb_per_s']:8.1f} MB/s"
        )
    if a.json:
        print(json.dumps(results))
    return 0
