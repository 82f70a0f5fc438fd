"""`python -m tools.bench staging`: hpcdl-stage vs `cp -r` vs shutil.copytree, and threads sweep.

All of them copy the same generated tree (JPEGs, so it is also an image folder), read through
the slow read-only FUSE file system of tools.bench.slowfs (--latency-ms per open, --mbps shared;
NOTE [how the slow file system behaves]) in the same run: every reader pays the same costs, and
the stager runs its production copy path with its thread count. `python -m hpcdl.stage --data D
--stage-dir S` with default flags is timed too, as a new user runs it (listing, plan and copy).
CPU seconds come from the rusage of the child processes (the FUSE server's time is not
included). The sweep runs hpcdl-stage with more and more threads against the same mount: the
goal is >= 0.8 x threads / latency files/s until the bandwidth cap (or the FUSE server's own
CPU) binds. The issue's goal for stage-only (issue 29: with default flags): >= 5x faster than
`cp -r`.
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

from hpcdl.bench import synthetic
from hpcdl.data.sampler import SamplerSpec
from hpcdl.helpformat import HelpFormatter
from hpcdl.staging.binary import find_stager_binary
from hpcdl.staging.layout import StageDir
from hpcdl.staging.ownership import data_key
from hpcdl.staging.plan import FileTreeDataset, plan_for_node, write_plan
from hpcdl.staging.status import ProgressFile
from tools.bench.slowfs import SlowFSOptions, mounted

CLI_ROW = "python -m hpcdl.stage (defaults)"


def make_tree(root: Path, files: int, size: int, per_dir: int = 1000) -> None:
    """root/dirNNNN/imgNNNNNNN.jpg: `files` JPEGs of `size` bytes (a small image, padded after
    its end marker with different bytes per file), so that image-folder readers accept them."""
    rng = np.random.default_rng(0)
    jpeg = synthetic.encode(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "jpg", quality=75)
    head = jpeg[: max(0, size)]
    blob = head + rng.integers(0, 256, max(0, size - len(head)) + files, dtype=np.uint8).tobytes()
    for i in range(files):
        d = root / f"dir{i // per_dir:04d}"
        if i % per_dir == 0:
            d.mkdir(parents=True)
        (d / f"img{i:07d}.jpg").write_bytes(head + blob[len(head) + i : i + size])


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
    """Write a session's plan and progress in dst for every file of src; return the command.

    The copies land in dst/<data key>/ as in training; dst is removed by the caller."""
    ds = FileTreeDataset(src)
    sampler = SamplerSpec(num_samples=len(ds), world_size=1, seed=0, shuffle="none")
    plan = plan_for_node(ds, sampler, batch_size=1, epochs=(0, 1))
    files = StageDir(dst).session("bench")
    files.path.mkdir(parents=True, mode=0o700)
    write_plan(files.plan, plan, ds, dest_prefix=data_key(src))
    ProgressFile.create(files.progress, 1)
    return [
        str(find_stager_binary()),
        "--stage-dir",
        str(dst),
        "--session",
        "bench",
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench staging",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--files", type=int, default=6000, help="files in the synthetic data set")
    p.add_argument("--size", type=int, default=20000, help="bytes per file")
    p.add_argument("--threads", type=int, default=8, help="hpcdl-stage copy threads")
    p.add_argument(
        "--latency-ms", type=float, default=5.0, help="slow file system: milliseconds per open"
    )
    p.add_argument("--mbps", type=float, default=200.0, help="slow file system: shared MB/s")
    p.add_argument("--sweep-files", type=int, default=1000, help="files per sweep point")
    p.add_argument(
        "--sweep-threads", default="1,2,4,8,16,32", help="copy thread counts of the sweep"
    )
    p.add_argument("--skip-copytree", action="store_true", help="only cp -r and hpcdl-stage")
    p.add_argument("--dir", help="scratch directory (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.dir is not None and not Path(a.dir).is_dir():
        why = "does not exist" if not Path(a.dir).exists() else "is not a directory"
        print(f"tools.bench staging: --dir {a.dir} {why}; give an existing directory for the "
              "scratch trees, or leave --dir out for a temporary one", file=sys.stderr)  # fmt: skip
        return 2
    options = SlowFSOptions(a.latency_ms, a.mbps)
    results: dict = {"files": a.files, "size": a.size, "slow_fs": vars(options), "copy": []}
    results["sweep"] = []
    env = {k: v for k, v in os.environ.items() if k != "HPCDL_STAGE_EMULATE_PFS"}
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="hpcdl-bench-staging-") as tmp:
        base = Path(tmp)
        make_tree(base / "src", a.files, a.size)
        (base / "pfs").mkdir()
        with mounted(base / "src", base / "pfs", options):
            results["copy"] = copies(a, base, base / "pfs", env)
        make_tree(base / "sweep", a.sweep_files, a.size)
        with mounted(base / "sweep", base / "pfs", options):
            results["sweep"] = sweep(a, base, base / "pfs", env)
    print_results(a, results)
    if a.json:
        print(json.dumps(results))
    return 0


def copies(a: argparse.Namespace, base: Path, src: Path, env: dict) -> list[dict]:
    """cp -r, shutil.copytree and hpcdl-stage from the mounted tree, one after another."""
    nbytes = a.files * a.size
    rows = []
    wall, cpu = timed(stager_command(src, base / "stage", a.threads), env)
    rows.append(row(f"hpcdl-stage ({a.threads} threads)", a.files, nbytes, wall, cpu))
    # As a new user stages: the command line with default flags, its index (a fresh cache)
    # and plan included; the tree's JPEGs make it an image folder.
    cli = [sys.executable, "-m", "hpcdl.stage", "--data", str(src), "--stage-dir"]
    cli += [str(base / "cli"), "--quiet"]
    wall, cpu = timed(cli, dict(env, XDG_CACHE_HOME=str(base / "xdg-cache")))
    rows.append(row(CLI_ROW, a.files, nbytes, wall, cpu))
    wall, cpu = timed(["cp", "-r", str(src), str(base / "cp")])
    rows.append(row("cp -r", a.files, nbytes, wall, cpu))
    if not a.skip_copytree:
        code = f"import shutil; shutil.copytree({str(src)!r}, {str(base / 'py')!r})"
        wall, cpu = timed([sys.executable, "-c", code])
        rows.append(row("shutil.copytree", a.files, nbytes, wall, cpu))
    for tree in ("cp", "py", "stage", "cli", "xdg-cache"):
        shutil.rmtree(base / tree, ignore_errors=True)
    return rows


def sweep(a: argparse.Namespace, base: Path, src: Path, env: dict) -> list[dict]:
    """hpcdl-stage files/s against threads, and the goal min(0.8 x threads / latency, 0.8 x
    the bandwidth cap in files/s)."""
    bound = a.mbps * 1e6 / a.size if a.mbps > 0 else float("inf")
    rows = []
    for threads in [int(t) for t in a.sweep_threads.split(",")]:
        dst = base / f"sweep-{threads}"
        wall, _ = timed(stager_command(src, dst, threads), env)
        goal = min(0.8 * threads / max(a.latency_ms / 1000, 1e-9), 0.8 * bound)
        rows.append(
            dict(
                threads=threads,
                files_per_s=round(a.sweep_files / wall, 1),
                goal_files_per_s=round(goal, 1),
                mb_per_s=round(a.sweep_files * a.size / 1e6 / wall, 1),
            )
        )
        shutil.rmtree(dst)
    return rows


def print_results(a: argparse.Namespace, results: dict) -> None:
    fs = f"{a.latency_ms:g} ms per open, {a.mbps:g} MB/s"
    print(f"copy of {a.files} files x {a.size} B from the slow file system ({fs}):")
    for r in results["copy"]:
        print(
            f"  {r['tool']:<26} {r['seconds']:8.2f} s {r['files_per_s']:10.0f} files/s "
            f"{r['mb_per_s']:8.1f} MB/s {r['cpu_s_per_1000_files']:8.3f} CPU s/1000 files"
        )
    by_tool = {r["tool"]: r["seconds"] for r in results["copy"]}
    stage = by_tool[f"hpcdl-stage ({a.threads} threads)"]
    results["cp_over_stage"] = round(by_tool["cp -r"] / stage, 2)
    results["cp_over_stage_cli"] = round(by_tool["cp -r"] / by_tool[CLI_ROW], 2)
    print(f"  cp -r time / hpcdl-stage time: {results['cp_over_stage']:.1f}x (goal >= 5)")
    print(
        f"  cp -r time / python -m hpcdl.stage time: {results['cp_over_stage_cli']:.1f}x "
        "(goal >= 5)"
    )
    print(f"hpcdl-stage from the slow file system ({fs}), {a.sweep_files} files:")
    for r in results["sweep"]:
        print(
            f"  {r['threads']:3d} threads {r['files_per_s']:9.0f} files/s "
            f"(goal {r['goal_files_per_s']:.0f}) {r['mb_per_s']:8.1f} MB/s"
        )
